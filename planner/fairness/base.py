"""The central-queue scheduler interface shared by the orchestrator and the simulator.

Every policy (FCFS, RPM, LPM, VTC/LCF, DLPM, the swarm policy, BF-IO mode) is a
subclass of ``CentralQueueScheduler``.  The caller owns the clock and the
chains; the scheduler owns the central queue, the per-chain occupancy n_k, the
fairness counters and the accounting of actual service (§1.2: w_e * extend
tokens + w_q * output tokens).

Driving loop (orchestrator or simulator):

* ``submit(...)`` when a request arrives (returns False only under an RPM limit),
* ``dispatch(now)`` after every event — a dispatch round (§14.4) that fills
  every free chain slot it can and returns the ``Grant`` list to start,
* ``pick_for_chain(chain, now)`` / ``choose_chain(request, now)`` for the two
  single-slot questions,
* ``on_prefill`` (actual reused prefix), ``on_tokens`` (generated tokens),
  ``on_finish`` / ``on_failure`` / ``cancel`` as sessions progress.

A dispatch round = (1) the policy picks, one at a time, which waiting requests
get the free slots (fairness, with a provisional charge against the best
prefix match among free chains), (2) a chain selector places the picked
requests on the free slots (``jffc`` / ``most_free`` / ``est_time`` / ``lpm``
/ ``bfio``), optionally filtered by per-client per-chain stickiness quanta
(DoubleQ's Q^w), (3) the charges are settled to the chosen chain's extend.
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence

from .bfio import server_load_profile, swarm_bfio_cost
from .counters import StickinessQuanta
from .types import (
    ChainSpec,
    ChainState,
    CostWeights,
    DuplicateRequestError,
    Grant,
    InvalidEventError,
    RequestState,
    UnknownChainError,
    UnknownClientError,
    UnknownRequestError,
)

PrefixMatchFn = Callable[[RequestState, Hashable], int]
ServiceHook = Callable[[float, Hashable, float], None]

CHAIN_MODES = ("jffc", "most_free", "est_time", "lpm", "bfio")
QUANTUM_PENALTY = 1e6  # §14.4: pairs outside a client's stickiness quantum cost +1e6 (never excluded)
_TIE_EPS = 1e-7


class CentralQueueScheduler:
    """Base class: queue, chain table, events, accounting and chain selection.

    Parameters
    ----------
    weights: cost weights (w_e, w_q), default (1, 2).
    chain_mode: how picked requests are placed on free chains: ``jffc``
        (fastest free chain: smallest tdec, then list order), ``most_free``
        (BF-IO paper's FCFS baseline, §2.2), ``est_time`` (min-sum matching of
        T_k(r) = tfix + tpre * extend_k(r) + tdec * ô(r)), ``lpm`` (matching on
        -m_k(r)), ``bfio`` (§14.7, greedy in pick order on J_k(r)).
    prefix_match: ``f(request, chain_id) -> tokens`` of the request's prompt the
        chain holds (m_k(r) before the len - 1 cap); None = no prefix reuse.
    window_per_client: only the oldest N queued requests of each client are
        candidates in a round (§15 Q17); None = all.
    chain_quantum: Q^w of the per-client per-chain stickiness counters; None
        disables them.
    bfio_horizon: H for ``bfio`` mode; server_kv_time: t_s per server.
    default_output_estimate: ô when a request has no max_new_tokens and its
        client has no finished sample yet (§15 Q18).
    joint_assignment: ``est_time``/``lpm`` place a round's requests jointly
        (min-sum matching, §14.4); False = greedy per request in pick order.
    on_service: optional hook ``(time, client, amount)`` called for every unit of
        actual service charged (metrics / property tests).
    """

    policy_name = "base"
    default_chain_mode = "jffc"

    def __init__(
        self,
        *,
        weights: CostWeights | None = None,
        chain_mode: str | None = None,
        prefix_match: PrefixMatchFn | None = None,
        window_per_client: int | None = 16,
        chain_quantum: float | None = None,
        bfio_horizon: int = 16,
        server_kv_time: Mapping[Hashable, float] | None = None,
        default_output_estimate: float = 256.0,
        joint_assignment: bool = True,
        on_service: ServiceHook | None = None,
    ) -> None:
        self.weights = weights or CostWeights()
        mode = chain_mode or self.default_chain_mode
        if mode not in CHAIN_MODES:
            raise ValueError(f"unknown chain_mode {mode!r}; expected one of {CHAIN_MODES}")
        self.chain_mode = mode
        self.prefix_match = prefix_match
        if window_per_client is not None and window_per_client < 1:
            raise ValueError("window_per_client must be >= 1 or None")
        self.window_per_client = window_per_client
        self.quanta = StickinessQuanta(chain_quantum) if chain_quantum is not None else None
        self.bfio_horizon = int(bfio_horizon)
        self.server_kv_time = dict(server_kv_time or {})
        self.default_output_estimate = float(default_output_estimate)
        self.joint_assignment = joint_assignment
        self.on_service = on_service

        self._chains: dict[Hashable, ChainState] = {}
        self._requests: dict[Hashable, RequestState] = {}
        self._queues: dict[Hashable, dict[Hashable, RequestState]] = {}  # client -> rid -> request, seq order
        self._clients: dict[Hashable, int] = {}  # client -> first-seen index
        self._client_last_seen: dict[Hashable, float] = {}
        self._output_estimate: dict[Hashable, float] = {}
        self._service: dict[Hashable, float] = {}
        self._client_view_service: dict[Hashable, float] = {}
        self._seq = 0

    # ------------------------------------------------------------------ chains
    def set_chains(self, chains: Sequence[ChainSpec]) -> None:
        """Replace the chain table (list order = JFFC order, fastest first).

        Chains whose id persists keep their occupancy and stickiness counters
        (§15 Q19); new chains start empty.  Requests still running on a removed
        chain stay known until their finish/failure event.
        """
        new: dict[Hashable, ChainState] = {}
        for order, spec in enumerate(chains):
            if spec.chain_id in new:
                raise ValueError(f"duplicate chain id {spec.chain_id!r}")
            old = self._chains.get(spec.chain_id)
            state = ChainState(spec=spec, order=order)
            if old is not None:
                state.active, state.running, state.healthy = old.active, old.running, old.healthy
            new[spec.chain_id] = state
        self._chains = new
        if self.quanta is not None:
            self.quanta.retain_chains(new)

    def set_chain_health(self, chain_id: Hashable, healthy: bool) -> None:
        self._chain(chain_id, "set_chain_health").healthy = bool(healthy)

    def chains(self) -> list[ChainSpec]:
        return [c.spec for c in self._chains.values()]

    def free_slots(self) -> dict[Hashable, int]:
        return {cid: c.free for cid, c in self._chains.items()}

    def active_sessions(self) -> dict[Hashable, int]:
        return {cid: c.active for cid, c in self._chains.items()}

    def _chain(self, chain_id: Hashable, action: str) -> ChainState:
        try:
            return self._chains[chain_id]
        except KeyError:
            raise UnknownChainError(chain_id, action) from None

    # ---------------------------------------------------------------- requests
    def submit(
        self,
        request_id: Hashable,
        client_id: Hashable,
        input_tokens: int,
        now: float,
        *,
        max_new_tokens: int | None = None,
        page_hashes: Sequence = (),
    ) -> bool:
        """A request arrives.  Returns False when admission control rejects it
        (RPM limit: answer HTTP 429); every other policy accepts it."""
        if request_id in self._requests:
            raise DuplicateRequestError(f"request {request_id!r} is already queued or running")
        if input_tokens < 1:
            raise InvalidEventError(f"request {request_id!r}: input_tokens must be >= 1, got {input_tokens}")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise InvalidEventError(f"request {request_id!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if client_id not in self._clients:
            self._clients[client_id] = len(self._clients)
            self._service.setdefault(client_id, 0.0)
            self._client_view_service.setdefault(client_id, 0.0)
            self._queues.setdefault(client_id, {})
            self._register_client(client_id)
        self._client_last_seen[client_id] = now
        if not self._accept(client_id, now):
            return False
        self._seq += 1
        req = RequestState(
            request_id=request_id,
            client_id=client_id,
            input_tokens=int(input_tokens),
            arrival_time=now,
            seq=self._seq,
            max_new_tokens=max_new_tokens,
            page_hashes=tuple(page_hashes),
        )
        self._before_enqueue(req, now)
        self._requests[request_id] = req
        self._queues[client_id][request_id] = req
        return True

    def request(self, request_id: Hashable) -> RequestState:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(request_id, "request lookup") from None

    def _get(self, request_id: Hashable, action: str) -> RequestState:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(request_id, action) from None

    def waiting(self, client_id: Hashable | None = None) -> list[RequestState]:
        """Queued requests (one client's, or all in seq order)."""
        if client_id is not None:
            if client_id not in self._clients:
                raise UnknownClientError(client_id, "waiting")
            return list(self._queues[client_id].values())
        out = [r for q in self._queues.values() for r in q.values()]
        out.sort(key=lambda r: r.seq)
        return out

    def queue_lengths(self) -> dict[Hashable, int]:
        return {c: len(q) for c, q in self._queues.items()}

    def is_backlogged(self, client_id: Hashable) -> bool:
        """§1.4 test definition: the client has at least one queued (not admitted) request."""
        if client_id not in self._clients:
            raise UnknownClientError(client_id, "is_backlogged")
        return bool(self._queues[client_id])

    def running(self) -> list[RequestState]:
        return [r for r in self._requests.values() if r.state == "running"]

    def clients(self) -> list[Hashable]:
        return list(self._clients)

    def service(self, client_id: Hashable) -> float:
        """Actual service charged so far: w_e * extend + w_q * output (system view, §1.2)."""
        try:
            return self._service[client_id]
        except KeyError:
            raise UnknownClientError(client_id, "service") from None

    def client_view_service(self, client_id: Hashable) -> float:
        """Client-view service: w_e * full input + w_q * output (§9.1)."""
        try:
            return self._client_view_service[client_id]
        except KeyError:
            raise UnknownClientError(client_id, "client_view_service") from None

    def output_estimate(self, request: RequestState) -> float:
        """ô(r) (§15 Q18): client's moving average of output length (window 5)
        capped by max_new_tokens; max_new_tokens until a sample exists."""
        est = self._output_estimate.get(request.client_id)
        cap = request.max_new_tokens
        if est is None:
            return float(cap) if cap is not None else self.default_output_estimate
        return float(min(est, cap)) if cap is not None else est

    def forget_idle_clients(self, now: float, idle_for: float = 3600.0) -> list:
        """Garbage-collect clients with nothing queued or running and no arrival in
        ``idle_for`` seconds (§15 Q5).  They start afresh if they return."""
        busy = {r.client_id for r in self._requests.values()}
        gone = [
            c
            for c in self._clients
            if c not in busy and now - self._client_last_seen.get(c, now) > idle_for
        ]
        for c in gone:
            del self._clients[c]
            self._queues.pop(c, None)
            self._output_estimate.pop(c, None)
            self._client_last_seen.pop(c, None)
            if self.quanta is not None:
                self.quanta.forget(c)
            self._forget_client(c)
        return gone

    # ------------------------------------------------------------------ events
    def on_prefill(self, request_id: Hashable, reused_tokens: int, now: float) -> None:
        """The chain reports the prefix it actually reused; the deficit is reconciled
        by w_e * ((len - hit) - extend assumed at grant) (§14.5)."""
        req = self._get(request_id, "on_prefill")
        if req.state != "running":
            raise InvalidEventError(f"on_prefill for request {request_id!r} which is not running")
        hit = max(0, min(int(reused_tokens), req.input_tokens - 1))
        delta_extend = req.matched_tokens - hit
        req.matched_tokens = hit
        if delta_extend and not req.recompute_free:
            amount = self.weights.extend * delta_extend
            req.charged_extend += amount
            self._charge_reconcile(req, amount)
            self._record_service(now, req.client_id, amount)

    def on_tokens(self, request_id: Hashable, count: int, now: float) -> None:
        """``count`` output tokens were generated (streamed) for a running request."""
        req = self._get(request_id, "on_tokens")
        if req.state != "running":
            raise InvalidEventError(f"on_tokens for request {request_id!r} which is not running")
        if count < 0:
            raise InvalidEventError("token count must be >= 0")
        if count == 0:
            return
        req.output_tokens += count
        amount = self.weights.output * count
        self._charge_output(req, count)
        self._record_service(now, req.client_id, amount, client_view=amount)

    def on_finish(self, request_id: Hashable, now: float, output_tokens: int | None = None) -> None:
        """The session ended normally.  ``output_tokens`` (e.g. reported by a lease
        holder) charges any tokens not yet reported through ``on_tokens``."""
        req = self._get(request_id, "on_finish")
        if req.state != "running":
            raise InvalidEventError(f"on_finish for request {request_id!r} which is not running")
        if output_tokens is not None and output_tokens > req.output_tokens:
            self.on_tokens(request_id, output_tokens - req.output_tokens, now)
        self._release_slot(req)
        o = req.output_tokens
        prev = self._output_estimate.get(req.client_id)
        self._output_estimate[req.client_id] = float(o) if prev is None else (4 * prev + o) / 5
        if self.quanta is not None and req.chain_id is not None:
            self.quanta.charge(req.client_id, req.chain_id, self.weights.output * o)
        self._on_done(req)
        del self._requests[request_id]

    def on_failure(
        self,
        request_id: Hashable,
        now: float,
        *,
        requeue: bool = True,
        input_tokens: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """The chain failed mid-session.  With ``requeue`` the continuation (prompt plus
        tokens so far: pass its ``input_tokens``) goes back to the head of its
        client's queue with its original seq; recomputation is not charged
        (§15 Q16); tokens already generated stay charged."""
        req = self._get(request_id, "on_failure")
        if req.state != "running":
            raise InvalidEventError(f"on_failure for request {request_id!r} which is not running")
        self._release_slot(req)
        if not requeue:
            self._on_done(req)
            del self._requests[request_id]
            return
        req.state = "queued"
        req.chain_id = None
        req.matched_tokens = 0
        req.recompute_free = True
        req.provisional = 0.0
        if input_tokens is not None:
            req.input_tokens = int(input_tokens)
        if max_new_tokens is not None:
            req.max_new_tokens = max_new_tokens
        self._on_done(req)
        queue = self._queues.setdefault(req.client_id, {})
        items = list(queue.values()) + [req]
        items.sort(key=lambda r: r.seq)
        queue.clear()
        queue.update((r.request_id, r) for r in items)

    def cancel(self, request_id: Hashable, now: float) -> None:
        """Abort: a queued request leaves with no charge; a running one ends, keeping
        the charges made so far."""
        req = self._get(request_id, "cancel")
        if req.state == "queued":
            del self._queues[req.client_id][request_id]
            del self._requests[request_id]
            self._on_dequeue_without_grant(req)
            return
        self._release_slot(req)
        self._on_done(req)
        del self._requests[request_id]

    def _release_slot(self, req: RequestState) -> None:
        chain = self._chains.get(req.chain_id)
        if chain is not None and req.request_id in chain.running:
            chain.running.discard(req.request_id)
            chain.active -= 1

    def _record_service(self, now: float, client: Hashable, amount: float, client_view: float = 0.0) -> None:
        self._service[client] = self._service.get(client, 0.0) + amount
        if client_view:
            self._client_view_service[client] = self._client_view_service.get(client, 0.0) + client_view
        if self.on_service is not None and amount:
            self.on_service(now, client, amount)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, now: float) -> list[Grant]:
        """One dispatch round (§14.4): fill every free slot a waiting request fits."""
        grants: list[Grant] = []
        while True:
            got = self._round(now, only_chain=None, only_request=None, max_grants=None)
            grants.extend(got)
            if not got:
                return grants

    def pick_for_chain(self, chain_id: Hashable, now: float) -> Grant | None:
        """A slot freed on ``chain_id``: which waiting request goes there (at most one)?"""
        chain = self._chain(chain_id, "pick_for_chain")
        if chain.free <= 0:
            return None
        got = self._round(now, only_chain=chain_id, only_request=None, max_grants=1)
        return got[0] if got else None

    def choose_chain(self, request_id: Hashable, now: float) -> Grant | None:
        """Place this waiting request on the best free chain now (None if none fits).
        The request is charged as usual; fairness ordering is bypassed, so use it
        when the request is the only one waiting (the arrival-with-free-slot case)."""
        req = self._get(request_id, "choose_chain")
        if req.state != "queued":
            raise InvalidEventError(f"choose_chain for request {request_id!r} which is not queued")
        got = self._round(now, only_chain=None, only_request=req, max_grants=1)
        return got[0] if got else None

    def rank_chains(self, request_id: Hashable, now: float) -> list[Hashable]:
        """All fitting healthy chains (free or not) ranked for this request by the
        current chain mode's single-request cost (e.g. for failover hints)."""
        req = self._get(request_id, "rank_chains")
        chains = [c for c in self._chains.values() if c.healthy and c.spec.fits(req.input_tokens, req.max_new_tokens)]
        matches = {req.request_id: {c.spec.chain_id: self._match(req, c.spec.chain_id) for c in chains}}
        return [c.spec.chain_id for c in sorted(chains, key=lambda c: self._single_key(req, c, matches, None))]

    def work_conserving(self) -> bool:
        """P3: no healthy chain has a free slot while a queued request fits it."""
        for chain in self._chains.values():
            if chain.free <= 0:
                continue
            for q in self._queues.values():
                for r in q.values():
                    if chain.spec.fits(r.input_tokens, r.max_new_tokens):
                        return False
        return True

    def _match(self, req: RequestState, chain_id: Hashable) -> int:
        if self.prefix_match is None:
            return 0
        m = int(self.prefix_match(req, chain_id))
        return max(0, min(m, req.input_tokens - 1))

    def _window(self, free: list[ChainState]) -> list[RequestState]:
        out = []
        for q in self._queues.values():
            taken = 0
            for r in q.values():
                if self.window_per_client is not None and taken >= self.window_per_client:
                    break
                taken += 1
                if any(c.spec.fits(r.input_tokens, r.max_new_tokens) for c in free):
                    out.append(r)
        out.sort(key=lambda r: r.seq)
        return out

    def _round(self, now, only_chain, only_request, max_grants) -> list[Grant]:
        if only_chain is not None:
            free = [self._chains[only_chain]] if self._chains[only_chain].free > 0 else []
        else:
            free = [c for c in self._chains.values() if c.free > 0]
        if not free:
            return []
        slots = sum(c.free for c in free)
        if only_chain is not None:
            slots = 1
        if max_grants is not None:
            slots = min(slots, max_grants)
        if only_request is not None:
            candidates = [only_request] if any(
                c.spec.fits(only_request.input_tokens, only_request.max_new_tokens) for c in free
            ) else []
        else:
            candidates = self._window(free)
        if not candidates:
            return []
        matches: dict[Hashable, dict[Hashable, int]] = {}
        best: dict[Hashable, int] = {}
        for r in candidates:
            row = {
                c.spec.chain_id: self._match(r, c.spec.chain_id)
                for c in free
                if c.spec.fits(r.input_tokens, r.max_new_tokens)
            }
            matches[r.request_id] = row
            best[r.request_id] = max(row.values()) if row else 0
        self._begin_round(matches)
        picked: list[RequestState] = []
        remaining = list(candidates)
        while len(picked) < slots and remaining:
            if only_request is not None:
                r = only_request
            else:
                r = self._select_next(remaining, best, now)
                if r is None:
                    break
            r.provisional = self._charge_pick(r, best[r.request_id], now)
            picked.append(r)
            remaining = [x for x in remaining if x is not r]
        if not picked:
            return []
        assignment = self._assign(picked, free, matches, now)
        placed = {id(r) for r, _ in assignment}
        for r in picked:
            if id(r) not in placed:
                self._refund_pick(r, r.provisional)
                r.provisional = 0.0
        grants = []
        for r, chain in assignment:
            grants.append(self._start(r, chain, matches[r.request_id][chain.spec.chain_id], best[r.request_id], now))
        return grants

    def _start(self, r: RequestState, chain: ChainState, matched: int, best_match: int, now: float) -> Grant:
        del self._queues[r.client_id][r.request_id]
        r.state = "running"
        r.chain_id = chain.spec.chain_id
        r.matched_tokens = matched
        r.grant_time = now
        chain.active += 1
        chain.running.add(r.request_id)
        extend = r.input_tokens - matched
        self._settle(r, chain.spec.chain_id, matched, best_match, now)
        r.provisional = 0.0
        if not r.recompute_free:
            amount = self.weights.extend * extend
            r.charged_extend = amount
            self._record_service(now, r.client_id, amount, client_view=self.weights.extend * r.input_tokens)
        if self.quanta is not None and not r.recompute_free:
            self.quanta.charge(r.client_id, chain.spec.chain_id, self.weights.extend * r.input_tokens)
        self._after_grant(r, now)
        return Grant(r.request_id, r.client_id, chain.spec.chain_id, matched, extend, now)

    # ------------------------------------------------------- chain selection
    def _jffc_key(self, chain: ChainState, free_left: int):
        return (chain.spec.decode_time, -free_left, chain.order)

    def _pair_cost(self, r: RequestState, chain: ChainState, matches) -> float:
        m = matches[r.request_id].get(chain.spec.chain_id, 0)
        if self.chain_mode == "lpm":
            return -float(m)
        spec = chain.spec
        extend = r.input_tokens - m
        return spec.fixed_time + spec.prefill_time * extend + spec.decode_time * self.output_estimate(r)

    def _avail(self, r: RequestState) -> set | None:
        if self.quanta is None or self.chain_mode in ("jffc", "most_free"):
            return None
        return set(self.quanta.available(r.client_id, list(self._chains)))

    def _single_key(self, r, chain, matches, avail, free_left=None):
        free_left = chain.free if free_left is None else free_left
        penalty = 0.0 if avail is None or chain.spec.chain_id in avail else QUANTUM_PENALTY
        if self.chain_mode in ("est_time", "lpm", "bfio"):
            primary = self._pair_cost(r, chain, matches) if self.chain_mode != "bfio" else 0.0
            return (primary + penalty, *self._jffc_key(chain, free_left))
        if self.chain_mode == "most_free":
            return (-free_left, chain.order)
        return self._jffc_key(chain, free_left)

    def _assign(self, picked, free, matches, now) -> list[tuple[RequestState, ChainState]]:
        left = {c.spec.chain_id: c.free for c in free}
        by_id = {c.spec.chain_id: c for c in free}
        if len(picked) > 1 and self.joint_assignment and self.chain_mode in ("est_time", "lpm"):
            return self._assign_matching(picked, free, matches)
        if self.chain_mode == "bfio":
            return self._assign_bfio(picked, free, matches)
        out = []
        for r in picked:
            avail = self._avail(r)
            options = [by_id[k] for k, n in left.items() if n > 0 and k in matches[r.request_id]]
            if not options:
                continue
            chain = min(options, key=lambda c: self._single_key(r, c, matches, avail, left[c.spec.chain_id]))
            left[chain.spec.chain_id] -= 1
            out.append((r, chain))
        return out

    def _assign_matching(self, picked, free, matches):
        from scipy.optimize import linear_sum_assignment  # lazy: only joint rounds need it

        columns: list[ChainState] = []
        ranked = sorted(free, key=lambda c: self._jffc_key(c, c.free))
        rank = {c.spec.chain_id: i for i, c in enumerate(ranked)}
        for c in free:
            columns.extend([c] * c.free)
        big = 1e12
        cost = []
        for r in picked:
            avail = self._avail(r)
            row = []
            for c in columns:
                k = c.spec.chain_id
                if k not in matches[r.request_id]:
                    row.append(big)
                    continue
                penalty = 0.0 if avail is None or k in avail else QUANTUM_PENALTY
                tie = _TIE_EPS * rank[k] / (len(ranked) + 1)
                row.append(self._pair_cost(r, c, matches) + penalty + tie)
            cost.append(row)
        rows, cols = linear_sum_assignment(cost)
        out = []
        for i, j in sorted(zip(rows, cols)):
            if cost[i][j] >= big:
                continue
            out.append((picked[i], columns[j]))
        return out

    def _assign_bfio(self, picked, free, matches):
        servers = set(self.server_kv_time)
        for c in self._chains.values():
            servers.update(c.spec.servers)
        sessions = []
        for r in self.running():
            chain = self._chains.get(r.chain_id)
            if chain is None:
                continue
            remaining = None
            if r.max_new_tokens is not None:
                remaining = max(0, r.max_new_tokens - r.output_tokens)
            sessions.append((chain.spec.servers, r.input_tokens + r.output_tokens, remaining))
        H = self.bfio_horizon
        profile = server_load_profile(sessions, servers, self.server_kv_time, H)
        left = {c.spec.chain_id: c.free for c in free}
        by_id = {c.spec.chain_id: c for c in free}
        out = []
        for r in picked:
            avail = self._avail(r)
            options = [by_id[k] for k, n in left.items() if n > 0 and k in matches[r.request_id]]
            if not options:
                continue

            def key(c):
                j = swarm_bfio_cost(profile, c.spec.servers, r.input_tokens, self.server_kv_time, H, r.max_new_tokens)
                penalty = 0.0 if avail is None or c.spec.chain_id in avail else QUANTUM_PENALTY
                extend = r.input_tokens - matches[r.request_id][c.spec.chain_id]
                return (j + penalty, extend, *self._jffc_key(c, left[c.spec.chain_id]))

            chain = min(options, key=key)
            left[chain.spec.chain_id] -= 1
            for s in chain.spec.servers:
                row = profile.setdefault(s, [0.0] * (H + 1))
                t = self.server_kv_time.get(s, 1.0)
                for h in range(H + 1):
                    if r.max_new_tokens is None or h < r.max_new_tokens:
                        row[h] += t * (r.input_tokens + h)
            out.append((r, chain))
        return out

    # ------------------------------------------------------- policy hooks
    def _register_client(self, client: Hashable) -> None:
        """A client is seen for the first time."""

    def _forget_client(self, client: Hashable) -> None:
        """A client was garbage-collected."""

    def _accept(self, client: Hashable, now: float) -> bool:
        return True

    def _before_enqueue(self, req: RequestState, now: float) -> None:
        """Called on arrival before the request joins the queue (VTC lift)."""

    def _begin_round(self, matches: dict) -> None:
        """A dispatch round starts; ``matches[rid][chain]`` = m_k(r) over fitting free chains."""

    def _select_next(self, candidates: list[RequestState], best: dict, now: float) -> RequestState | None:
        raise NotImplementedError

    def _charge_pick(self, req: RequestState, best_match: int, now: float) -> float:
        """Provisional fairness charge at pick time; returns the amount for a refund."""
        return 0.0

    def _refund_pick(self, req: RequestState, amount: float) -> None:
        """The picked request could not be placed this round."""

    def _settle(self, req: RequestState, chain_id, matched: int, best_match: int, now: float) -> None:
        """Adjust the provisional charge to the chosen chain's extend."""

    def _charge_output(self, req: RequestState, count: int) -> None:
        """Per-token charge of the policy's counters."""

    def _charge_reconcile(self, req: RequestState, amount: float) -> None:
        """Extend reconciliation on the prefill report."""

    def _after_grant(self, req: RequestState, now: float) -> None:
        """The request left the queue by admission."""

    def _on_done(self, req: RequestState) -> None:
        """The request finished, failed or was cancelled while running."""

    def _on_dequeue_without_grant(self, req: RequestState) -> None:
        """A queued request was cancelled."""
