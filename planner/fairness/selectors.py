"""Chain selection: where the requests picked in a dispatch round go (§14.4 step 2).

The fairness policy decides *which* waiting requests get the free slots; a
``ChainSelector`` decides *where* each goes.  The scheduler holds one selector,
chosen once at construction (the policy's ``default_selector``, a selector
object, or a name from ``CHAIN_MODES``), and hands it the round's free chains
and m_k(r) table; the selector asks the scheduler only for state (ô(r),
stickiness quanta, running sessions, the chain table).

* ``JFFC`` — fastest free chain (smallest tdec_k, then more free slots, then
  list order); locality and quanta are ignored (chain-composition.md §7).
* ``MostFree`` — the chain with the most free slots ([BFIO]'s FCFS baseline, §2.2).
* ``EstimatedTime`` — min-sum matching of T_k(r) = tfix_k + tpre_k * extend_k(r)
  + tdec_k * ô(r) (§14.4, the swarm default); greedy in pick order when not joint.
* ``LongestPrefixMatch`` — the same matching on -m_k(r).
* ``BFIO`` — greedy in pick order on J_k(r) over the servers' KV read load (§14.7).

Stickiness (DoubleQ's Q^w, §14.4 step 1): for the selectors that honour it, a
pair (r, k) with k outside avail_i = {k : d[i][k] > 0} costs +``QUANTUM_PENALTY``
(never excluded, so every slot can still be filled).
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Mapping, Protocol, Sequence

from .bfio import add_session_load, server_load_profile, swarm_bfio_cost
from .types import ChainState, RequestState


class SchedulerView(Protocol):
    """What a selector reads of its scheduler (:class:`planner.fairness.base.CentralQueueScheduler`)."""

    def stickiness_available(self, client_id: Hashable) -> set | None: ...

    def output_estimate(self, r: RequestState) -> float: ...

    def chains(self) -> Iterable: ...

    def running(self) -> Iterable: ...


QUANTUM_PENALTY = 1e6  # §14.4: pairs outside a client's stickiness quantum cost +1e6 (never excluded)
_TIE_EPS = 1e-7
_INFEASIBLE = 1e12

Matches = Mapping[Hashable, Mapping[Hashable, int]]  # request id -> chain id -> m_k(r) over fitting free chains
Assignment = list  # [(RequestState, ChainState)] in placement order


def jffc_key(chain: ChainState, free_left: int) -> tuple:
    """JFFC order: smaller tdec_k, then more free slots, then list position."""
    return (chain.spec.decode_time, -free_left, chain.order)


def quantum_penalty(chain: ChainState, avail: set | None) -> float:
    """+QUANTUM_PENALTY when the client has used its quantum Q^w on this chain."""
    return 0.0 if avail is None or chain.spec.chain_id in avail else QUANTUM_PENALTY


class ChainSelector:
    """Places a round's picked requests on free chain slots.

    Subclasses state ``name`` (the ``chain_mode`` string), whether stickiness
    quanta apply (``uses_quanta``), the single-slot key of a (request, chain)
    pair and, when placement is not greedy in pick order, ``assign``.
    ``OPTIONS`` maps the scheduler keywords that configure a selector built by
    name (``joint_assignment``, ``bfio_horizon``, ``server_kv_time``) to
    constructor arguments.
    """

    name = ""
    uses_quanta = True
    OPTIONS: Mapping[str, str] = {}

    @classmethod
    def from_options(cls, **options) -> ChainSelector:
        """Build from scheduler keywords; those this selector does not use are ignored."""
        return cls(**{arg: options[kw] for kw, arg in cls.OPTIONS.items() if kw in options})

    def avail(self, sched: SchedulerView, r: RequestState) -> set | None:
        """avail_i for r's client (refilling Q^w as DoubleQ does), or None when quanta do not apply."""
        return sched.stickiness_available(r.client_id) if self.uses_quanta else None

    def single_key(self, sched, r: RequestState, chain: ChainState, matches: Matches, avail, free_left: int) -> tuple:
        """Sort key of chain for r (smallest wins) with ``free_left`` slots left on it."""
        raise NotImplementedError

    def assign(self, sched, picked: Sequence[RequestState], free: Sequence[ChainState], matches: Matches) -> Assignment:
        """Place ``picked`` (in pick order) on the free slots; unplaced requests are left out."""

        def key(r, c, avail, free_left):
            return self.single_key(sched, r, c, matches, avail, free_left)

        return self._greedy(sched, picked, free, matches, key)

    def _greedy(self, sched, picked, free, matches, key: Callable, placed: Callable | None = None) -> Assignment:
        """Each request in pick order to the fitting free chain of smallest ``key(r, chain, avail, free_left)``."""
        left = {c.spec.chain_id: c.free for c in free}
        tokens = {c.spec.chain_id: c.free_tokens for c in free}  # KV room left this round (None: no budget)
        by_id = {c.spec.chain_id: c for c in free}
        out = []
        for r in picked:
            avail = self.avail(sched, r)
            options = [by_id[k] for k, n in left.items()
                       if n > 0 and k in matches[r.request_id] and by_id[k].admits(r, tokens[k])]
            if not options:
                continue
            chain = min(options, key=lambda c: key(r, c, avail, left[c.spec.chain_id]))
            left[chain.spec.chain_id] -= 1
            if tokens[chain.spec.chain_id] is not None:
                tokens[chain.spec.chain_id] -= chain.spec.kv_need(r.input_tokens, r.max_new_tokens)
            if placed is not None:
                placed(r, chain)
            out.append((r, chain))
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class JFFC(ChainSelector):
    """Join the fastest free chain: pure JFFC, no locality, no quanta (a min-sum
    matching would be useless: every full assignment has the same total tdec)."""

    name = "jffc"
    uses_quanta = False

    def single_key(self, sched, r, chain, matches, avail, free_left):
        return jffc_key(chain, free_left)


class MostFree(ChainSelector):
    """The chain with the most free slots, then list order ([BFIO] §2.2 FCFS)."""

    name = "most_free"
    uses_quanta = False

    def single_key(self, sched, r, chain, matches, avail, free_left):
        return (-free_left, chain.order)


class _CostMatching(ChainSelector):
    """A per-pair cost, penalised outside the quantum, JFFC tie-break; a round of
    several requests is placed jointly by min-sum matching (|S| x slots, a chain
    with several free slots appears once per slot) unless ``joint`` is False."""

    OPTIONS = {"joint_assignment": "joint"}

    def __init__(self, joint: bool = True) -> None:
        self.joint = joint

    def pair_cost(self, sched, r: RequestState, chain: ChainState, matches: Matches) -> float:
        raise NotImplementedError

    def single_key(self, sched, r, chain, matches, avail, free_left):
        return (self.pair_cost(sched, r, chain, matches) + quantum_penalty(chain, avail), *jffc_key(chain, free_left))

    def assign(self, sched, picked, free, matches):
        if len(picked) > 1 and self.joint and all(c.spec.kv_tokens is None for c in free):
            return self._matching(sched, picked, free, matches)
        return super().assign(sched, picked, free, matches)  # KV budgets: greedy, which tracks the tokens

    def _matching(self, sched, picked, free, matches):
        from scipy.optimize import linear_sum_assignment  # lazy: only joint rounds need it

        columns: list[ChainState] = []
        ranked = sorted(free, key=lambda c: jffc_key(c, c.free))
        rank = {c.spec.chain_id: i for i, c in enumerate(ranked)}
        for c in free:
            columns.extend([c] * c.free)
        cost = []
        for r in picked:
            avail = self.avail(sched, r)
            row = []
            for c in columns:
                k = c.spec.chain_id
                if k not in matches[r.request_id]:
                    row.append(_INFEASIBLE)
                    continue
                tie = _TIE_EPS * rank[k] / (len(ranked) + 1)
                row.append(self.pair_cost(sched, r, c, matches) + quantum_penalty(c, avail) + tie)
            cost.append(row)
        rows, cols = linear_sum_assignment(cost)
        return [(picked[i], columns[j]) for i, j in sorted(zip(rows, cols)) if cost[i][j] < _INFEASIBLE]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(joint={self.joint})"


class EstimatedTime(_CostMatching):
    """Expected time T_k(r) = tfix_k + tpre_k * extend_k(r) + tdec_k * ô(r) (§14.4 default)."""

    name = "est_time"

    def pair_cost(self, sched, r, chain, matches):
        spec = chain.spec
        extend = r.input_tokens - matches[r.request_id].get(spec.chain_id, 0)
        return spec.fixed_time + spec.prefill_time * extend + spec.decode_time * sched.output_estimate(r)


class LongestPrefixMatch(_CostMatching):
    """Longest prefix match: cost -m_k(r), JFFC tie-break."""

    name = "lpm"

    def pair_cost(self, sched, r, chain, matches):
        return -float(matches[r.request_id].get(chain.spec.chain_id, 0))


class BFIO(ChainSelector):
    """BF-IO over the swarm's servers (§14.7): greedy in pick order, each request to
    the chain of smallest J_k(r) (+ quantum penalty), ties by smaller extend_k(r),
    then JFFC; a placed request's load joins the profile for the next one.

    ``horizon`` is H; ``kv_time`` maps a server to t_s (missing servers: 1).
    Outside a round (``rank_chains``) there is no profile, so chains rank by JFFC.
    """

    name = "bfio"
    OPTIONS = {"bfio_horizon": "horizon", "server_kv_time": "kv_time"}

    def __init__(self, horizon: int = 16, kv_time: Mapping[Hashable, float] | None = None) -> None:
        self.horizon = int(horizon)
        self.kv_time = dict(kv_time or {})

    def single_key(self, sched, r, chain, matches, avail, free_left):
        return (quantum_penalty(chain, avail), *jffc_key(chain, free_left))

    def assign(self, sched, picked, free, matches):
        H, kv_time = self.horizon, self.kv_time
        specs = {spec.chain_id: spec for spec in sched.chains()}
        servers = set(kv_time)
        for spec in specs.values():
            servers.update(spec.servers)
        sessions = []
        for run in sched.running():
            spec = specs.get(run.chain_id)
            if spec is None:
                continue
            remaining = None if run.max_new_tokens is None else max(0, run.max_new_tokens - run.output_tokens)
            sessions.append((spec.servers, run.input_tokens + run.output_tokens, remaining))
        profile = server_load_profile(sessions, servers, kv_time, H)

        def key(r, c, avail, free_left):
            j = swarm_bfio_cost(profile, c.spec.servers, r.input_tokens, kv_time, H, r.max_new_tokens)
            extend = r.input_tokens - matches[r.request_id][c.spec.chain_id]
            return (j + quantum_penalty(c, avail), extend, *jffc_key(c, free_left))

        def placed(r, c):
            add_session_load(profile, c.spec.servers, r.input_tokens, r.max_new_tokens, kv_time, H)

        return self._greedy(sched, picked, free, matches, key, placed)

    def __repr__(self) -> str:
        return f"BFIO(horizon={self.horizon}, kv_time={self.kv_time!r})"


SELECTORS: dict[str, type[ChainSelector]] = {
    cls.name: cls for cls in (JFFC, MostFree, EstimatedTime, LongestPrefixMatch, BFIO)
}
CHAIN_MODES = tuple(SELECTORS)


def selector_class(name: str) -> type[ChainSelector]:
    """The selector class of a ``chain_mode`` name."""
    try:
        return SELECTORS[name]
    except KeyError:
        raise ValueError(f"unknown chain_mode {name!r}; expected one of {CHAIN_MODES}") from None
