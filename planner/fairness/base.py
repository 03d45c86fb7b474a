"""The central-queue scheduler interface shared by the orchestrator and the simulator.

Every policy (FCFS, RPM, LPM, VTC/LCF, DLPM, the swarm policy, BF-IO mode) is a subclass of
``CentralQueueScheduler``.  The caller owns the clock and the chains; the scheduler owns the central queue, the
per-chain occupancy n_k, the fairness counters and the accounting of actual service (§1.2: w_e * extend tokens +
w_q * output tokens).

Driving loop (orchestrator or simulator): ``submit(...)`` when a request arrives (False only under an RPM
limit); ``dispatch(now)`` after every event — a dispatch round (§14.4) that fills every free chain slot it can
and returns the ``Grant`` list to start (``pick_for_chain``/``choose_chain`` for the two single-slot questions);
``on_prefill`` (actual reused prefix), ``on_tokens``, ``on_finish``/``on_failure``/``cancel`` as sessions progress.

A dispatch round (``rounds.py``) = (1) the policy picks, one at a time, which waiting requests get the free slots
(fairness, with a provisional charge against the best prefix match among free chains), (2) the chain selector
(``selectors.py``: JFFC, MostFree, EstimatedTime, LongestPrefixMatch, BFIO) places them on the free slots,
optionally penalised by per-client per-chain stickiness quanta (DoubleQ's Q^w), (3) the charges are settled to
the chosen chain's extend (``_start``).
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence

from .counters import StickinessQuanta
from .rounds import DispatchRounds
from .selectors import CHAIN_MODES, JFFC, ChainSelector, selector_class  # CHAIN_MODES: re-exported
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


class CentralQueueScheduler(DispatchRounds):
    """Base class: queue, chain table, events and accounting; dispatch rounds from
    ``DispatchRounds``, chain selection delegated to ``self.selector``.

    Parameters
    ----------
    weights: cost weights (w_e, w_q), default (1, 2).
    chain_mode: how picked requests are placed on free chains: a
        ``ChainSelector`` object, or the name of one (``CHAIN_MODES``: ``jffc``,
        ``most_free``, ``est_time`` = min-sum matching of T_k(r), ``lpm`` =
        matching on -m_k(r), ``bfio`` = greedy on J_k(r), §14.7), looked up once
        here; default the policy's ``default_selector``.  ``chain_mode`` then
        reports the selector's name and ``selector`` holds it.
    prefix_match: ``f(request, chain_id) -> tokens`` of the request's prompt the
        chain holds (m_k(r) before the len - 1 cap); None = no prefix reuse.
    window_per_client: only the oldest N queued requests of each client are
        candidates in a round (§15 Q17); None = all.
    chain_quantum: Q^w of the per-client per-chain stickiness counters; None
        disables them.
    bfio_horizon: H for ``bfio`` (default 16); server_kv_time: t_s per server.
    default_output_estimate: ô when a request has no max_new_tokens and its
        client has no finished sample yet (§15 Q18).
    joint_assignment: ``est_time``/``lpm`` place a round's requests jointly
        (min-sum matching, §14.4; default); False = greedy in pick order.
        These three configure a selector chosen by name; give a selector
        object its own settings instead.
    on_service: optional hook ``(time, client, amount)`` called for every unit of
        actual service charged (metrics / property tests).
    """

    policy_name = "base"
    default_selector: type[ChainSelector] = JFFC

    def __init__(
        self,
        *,
        weights: CostWeights | None = None,
        chain_mode: str | ChainSelector | None = None,
        prefix_match: PrefixMatchFn | None = None,
        window_per_client: int | None = 16,
        chain_quantum: float | None = None,
        bfio_horizon: int | None = None,
        server_kv_time: Mapping[Hashable, float] | None = None,
        default_output_estimate: float = 256.0,
        joint_assignment: bool | None = None,
        on_service: ServiceHook | None = None,
    ) -> None:
        self.weights = weights or CostWeights()
        options = {"bfio_horizon": bfio_horizon, "server_kv_time": server_kv_time, "joint_assignment": joint_assignment}
        options = {k: v for k, v in options.items() if v is not None}
        if isinstance(chain_mode, ChainSelector):
            if options:
                raise ValueError(f"{sorted(options)} configure a selector chosen by name; set them on {chain_mode!r}")
            self.selector = chain_mode
        else:
            cls = selector_class(chain_mode) if chain_mode else self.default_selector
            self.selector = cls.from_options(**options)
        self.prefix_match = prefix_match
        if window_per_client is not None and window_per_client < 1:
            raise ValueError("window_per_client must be >= 1 or None")
        self.window_per_client = window_per_client
        self.quanta = StickinessQuanta(chain_quantum) if chain_quantum is not None else None
        self.default_output_estimate = float(default_output_estimate)
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

    @property
    def chain_mode(self) -> str:
        """Name of the chain selector (``CHAIN_MODES``)."""
        return self.selector.name

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
                state.held_tokens = old.held_tokens
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

    def kv_tokens(self) -> dict[Hashable, tuple[int, int]]:
        """(held, budget) KV tokens per block of every chain with a KV budget (token admission)."""
        return {cid: (c.held_tokens, c.spec.kv_tokens) for cid, c in self._chains.items()
                if c.spec.kv_tokens is not None}

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
        if max_new_tokens is not None and max_new_tokens < 0:  # 0: a prompt scored, nothing generated
            raise InvalidEventError(f"request {request_id!r}: max_new_tokens must be >= 0, got {max_new_tokens}")
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

    def stickiness_available(self, client_id: Hashable) -> set | None:
        """avail_i = {k : d[i][k] > 0} over all current chains, after DoubleQ's Q^w
        refill when empty (§14.4 step 1); None when quanta are disabled."""
        if self.quanta is None:
            return None
        return set(self.quanta.available(client_id, list(self._chains)))

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

    def grow(self, request_id: Hashable, more_tokens: int) -> bool:
        """Extend a running request's output cap by ``more_tokens`` when its chain's KV
        budget has room for the larger need (and the chain's max length allows it);
        False leaves it unchanged.  A request without an explicit cap reserves its
        output this way, a part at a time, instead of the rest of ``max_length``."""
        req = self._get(request_id, "grow")
        if req.state != "running" or more_tokens < 1:
            raise InvalidEventError(f"grow for request {request_id!r}: not running, or nothing to add")
        chain = self._chains.get(req.chain_id)
        wanted = (req.max_new_tokens or 0) + int(more_tokens)
        if chain is None or not chain.healthy or not chain.spec.fits(req.input_tokens, wanted):
            return False
        need = chain.spec.kv_need(req.input_tokens, wanted)
        if chain.free_tokens is not None and need - req.kv_tokens > chain.free_tokens:
            return False
        chain.held_tokens += need - req.kv_tokens
        req.kv_tokens, req.max_new_tokens = need, wanted
        return True

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
            chain.held_tokens -= req.kv_tokens
        req.kv_tokens = 0

    def _record_service(self, now: float, client: Hashable, amount: float, client_view: float = 0.0) -> None:
        self._service[client] = self._service.get(client, 0.0) + amount
        if client_view:
            self._client_view_service[client] = self._client_view_service.get(client, 0.0) + client_view
        if self.on_service is not None and amount:
            self.on_service(now, client, amount)

    # ------------------------------------------------------------ grant
    def _start(self, r: RequestState, chain: ChainState, matched: int, best_match: int, now: float) -> Grant:
        del self._queues[r.client_id][r.request_id]
        r.state = "running"
        r.chain_id = chain.spec.chain_id
        r.matched_tokens = matched
        r.grant_time = now
        chain.active += 1
        chain.running.add(r.request_id)
        r.kv_tokens = chain.spec.kv_need(r.input_tokens, r.max_new_tokens)
        chain.held_tokens += r.kv_tokens
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

    # ------------------------------------------------------------ snapshots
    def export_state(self) -> dict:
        """Per-client fairness state as a JSON-safe document (``snapshot.py``; restart persistence)."""
        from .snapshot import export_state

        return export_state(self)

    def import_state(self, doc: dict, now: float) -> None:
        """Restore :meth:`export_state`'s document into this idle scheduler (ValueError when it does not fit)."""
        from .snapshot import import_state

        import_state(self, doc, now)

    # ------------------------------------------------------- policy hooks
    def _export_counters(self) -> dict:
        """The policy's own counters, JSON-safe (client ids as values, mappings as pairs)."""
        return {}

    def _check_counters(self, counters: dict, clients: list) -> None:
        """Raise (KeyError/TypeError/ValueError) when ``counters`` cannot be imported."""

    def _import_counters(self, counters: dict) -> None:
        """Restore :meth:`_export_counters`'s output (after the clients are registered)."""

    def _register_client(self, client: Hashable) -> None:
        """A client is seen for the first time."""

    def _forget_client(self, client: Hashable) -> None:
        """A client was garbage-collected."""

    def _accept(self, client: Hashable, now: float) -> bool:
        return True

    def _before_enqueue(self, req: RequestState, now: float) -> None:
        """Called on arrival before the request joins the queue (VTC lift)."""

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
