"""Request-level simulations of the two state-of-the-art baselines of Fig. 8 (spec §12.1, §12.2).

Neither baseline has pre-composed chains or a central queue: every request is routed on arrival over the
servers' current cache state, holds ``m_ij`` KV slots on each server of its path from start to completion
(static allocation, §2.7), and runs ``r·T_path`` seconds (eq. 2 over the path, r ~ Exp(1) as for the
proposed method, so the three methods see the same workload).

* **PETALS** (§12.1, "faithful version"): servers join in a seeded random order and choose blocks with
  petals' own rule (:func:`planner.baselines.petals_placement`); each server's KV pool is fixed at
  ``num_blocks × 2`` slots (4096-token cache, independent of demand). The client routes with petals'
  ``min_latency`` graph: ``rtt/2 + 18 ms`` per hop (+10 s if the server lacks cache for its whole span),
  ``τp_j/l̄_O`` per block, ``rtt/2`` back to the client. If a server on the path cannot allocate the
  session's slots, the request retries after petals' backoff 1, 2, 4, … s (capped at 60 s) and is
  re-routed then.
* **BPRR** (§12.2): CG-BP placement with R from :func:`planner.baselines.bprr_reservation`, and WS-RR
  routing (:func:`planner.baselines.ws_rr_route`) per request with waits computed from the servers'
  believed schedule. By default (the authors' simulation, ``oracle=False``) a running request is believed
  to end at start + mean service time; when it actually runs longer, the request planned behind it finds
  the slots still held ("surprise waiting"), fails, and retries with the same backoff schedule.

On batching servers (servers with a ``batch`` curve, :mod:`planner.service_model`) a request's service
progresses at the rate its path's occupancy allows (:class:`experiments.sim.batch_sim.RequestClock`); otherwise it
takes exactly ``r·T_path``.

Simplifications, stated in the report: petals' temporary peer ban and the immediate first retry are not
modelled (a retry at the same instant would see the same state); WS-RR's planned start is exact (no
rounding to retry instants) as in a model-driven simulation.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from planner.baselines import bprr_reservation, cg_bp, petals_placement, ws_rr_route
from planner.model import ModelSpec, Placement, Server, free_slots
from experiments.sim.batch_sim import RequestClock
from experiments.sim.simulator import Jobs, SimResult

PETALS_HOP_OVERHEAD_S = 0.018
PETALS_NO_CACHE_PENALTY_S = 10.0
PETALS_MAX_HALF_RTT_S = 5.0
BACKOFF_CAP_S = 60.0


class Unstable(ValueError):
    """The simulated swarm cannot keep up with the arrivals."""


def backoff_delay(attempt: int) -> float:
    """Delay before retry number ``attempt`` ≥ 1: min(2^(attempt−1), 60) s (petals' schedule)."""
    return min(2.0 ** min(attempt - 1, 16), BACKOFF_CAP_S)


@dataclass(frozen=True)
class Path:
    servers: tuple[int, ...]
    """Server indices in order."""
    need: tuple[int, ...]
    """Slots (= blocks processed, m_ij) held on each."""
    service_time: float
    """T_path of eq. (2)."""


def _path_time(servers: Sequence[Server], hops: Sequence[int], need: Sequence[int]) -> float:
    return sum(servers[j].comm_time_s + servers[j].compute_time_s * m for j, m in zip(hops, need))


# ------------------------------------------------------------------------------------------------
# PETALS
# ------------------------------------------------------------------------------------------------


class PetalsRouter:
    """petals' ``min_latency`` routing over a fixed placement, memoized by which servers have cache."""

    def __init__(self, model: ModelSpec, servers: Sequence[Server], placement: Placement,
                 rtt_ms: Sequence[Sequence[float]], mean_output: float):
        self.servers = list(servers)
        self.L = model.num_blocks
        self.spans = placement.spans
        self.placed = [j for j, s in enumerate(self.spans) if s is not None]
        self.hosted = [0 if s is None else s[1] - s[0] for s in self.spans]
        half = lambda a, b: min(rtt_ms[a][b] / 2000.0, PETALS_MAX_HALF_RTT_S)  # noqa: E731  (ms → s, /2)
        self.client_half = [half(0, j + 1) for j in range(len(servers))]
        self.pair_half = [[half(i + 1, j + 1) for j in range(len(servers))] for i in range(len(servers))]
        self.per_block = [s.compute_time_s / mean_output for s in servers]
        self._memo: dict[tuple[bool, ...], Path | None] = {}
        # servers by end boundary, in decreasing end (DP order) and those that can follow boundary b
        self.order = sorted(self.placed, key=lambda j: -self.spans[j][1])
        self.covering = {b: [j for j in self.placed if self.spans[j][0] <= b < self.spans[j][1]]
                         for b in range(self.L)}

    def route(self, has_cache: tuple[bool, ...]) -> Path | None:
        path = self._memo.get(has_cache)
        if path is None and has_cache not in self._memo:
            path = self._route(has_cache)
            self._memo[has_cache] = path
        return path

    def _route(self, has_cache: tuple[bool, ...]) -> Path | None:
        L, spans = self.L, self.spans
        pen = [0.0 if h else PETALS_NO_CACHE_PENALTY_S for h in has_cache]
        best: dict[int, float] = {}
        nxt: dict[int, int | None] = {}
        for j in self.order:  # F(j): cost from the end of j's span to the client
            end = spans[j][1]
            if end == L:
                best[j], nxt[j] = self.client_half[j], None
                continue
            value, choice = math.inf, None
            for k in self.covering[end]:
                if k not in best:
                    continue
                v = (self.pair_half[j][k] + PETALS_HOP_OVERHEAD_S + pen[k]
                     + (spans[k][1] - end) * self.per_block[k] + best[k])
                if v < value:
                    value, choice = v, k
            if choice is not None:
                best[j], nxt[j] = value, choice
        value, first = math.inf, None
        for j in self.covering.get(0, ()):
            if j not in best:
                continue
            v = self.client_half[j] + PETALS_HOP_OVERHEAD_S + pen[j] + spans[j][1] * self.per_block[j] + best[j]
            if v < value:
                value, first = v, j
        if first is None:
            return None
        hops, need, b, j = [], [], 0, first
        while j is not None:
            hops.append(j)
            need.append(spans[j][1] - b)
            b = spans[j][1]
            j = nxt[j]
        return Path(tuple(hops), tuple(need), _path_time(self.servers, hops, need))


def simulate_petals(model: ModelSpec, servers: Sequence[Server], rtt_ms: Sequence[Sequence[float]],
                    jobs: Jobs, *, join_seed: int = 0, mean_output: float = 20.0,
                    cache_slots_per_block: int = 2, max_retries_per_job: int | None = None
                    ) -> tuple[SimResult, dict]:
    """Simulate PETALS (placement + routing + retries) on ``jobs``. Returns (result, info).

    With ``max_retries_per_job`` set, a request that fails that many times raises :class:`Unstable`
    (the swarm cannot keep up with the arrivals; the run's mean would only measure its length).
    """
    pp = petals_placement(model, servers, seed=join_seed, cache_slots_per_block=cache_slots_per_block)
    clock = RequestClock.for_servers(servers)
    router = PetalsRouter(model, servers, pp.placement, rtt_ms, mean_output)
    free = list(pp.slot_pool)
    hosted = router.hosted
    placed = router.placed
    J = len(servers)
    if router.route(tuple(True for _ in range(J))) is None:
        raise ValueError("the PETALS placement does not cover all blocks")
    n = len(jobs)
    arrivals = jobs.arrivals.tolist()
    sizes = jobs.sizes.tolist()
    start, finish = [0.0] * n, [0.0] * n
    attempts = [0] * n
    held: list[Path | None] = [None] * n
    heap: list = []  # (time, kind, job): kind 0 = completion, 1 = retry
    push, pop = heapq.heappush, heapq.heappop
    retries = 0
    i, inf = 0, math.inf
    next_arrival = arrivals[0] if n else inf

    def try_start(job: int, t: float) -> None:
        nonlocal retries
        mask = tuple(free[j] >= hosted[j] for j in range(J))
        path = router.route(mask)
        if path is not None and all(free[j] >= m for j, m in zip(path.servers, path.need)):
            for j, m in zip(path.servers, path.need):
                free[j] -= m
            held[job] = path
            start[job] = t
            if clock is None:
                push(heap, (t + sizes[job] * path.service_time, 0, job))
            else:
                clock.begin(heap, job, t, sizes[job] * path.service_time, path)
        else:
            attempts[job] += 1
            retries += 1
            if max_retries_per_job is not None and attempts[job] > max_retries_per_job:
                raise Unstable(f"a request failed {attempts[job] - 1} times to get cache (job {job} of {n})")
            push(heap, (t + backoff_delay(attempts[job]), 1, job))

    while heap or i < n:
        if heap and heap[0][0] <= next_arrival:
            t, kind, job = pop(heap)
            if kind == 0:
                if clock is not None and not clock.ends(heap, job, t):
                    continue  # a stale completion: the request was projected again
                finish[job] = t
                path = held[job]
                for j, m in zip(path.servers, path.need):
                    free[j] += m
            else:
                try_start(job, t)
        else:
            try_start(i, next_arrival)
            i += 1
            next_arrival = arrivals[i] if i < n else inf
    info = {"placement": [list(s) if s is not None else None for s in pp.placement.spans],
            "slot_pool": list(pp.slot_pool), "servers_used": len(placed), "retries": retries,
            "fastest_path_time": router.route(tuple(True for _ in range(J))).service_time}
    return SimResult(jobs.arrivals.copy(), np.asarray(start), np.asarray(finish), np.full(n, -1)), info


# ------------------------------------------------------------------------------------------------
# BPRR
# ------------------------------------------------------------------------------------------------


class BeliefLedger:
    """One server's WS-RR ledger: the slots each planned or running request is believed to hold, and until
    when (its believed end). ``wait(need, t)`` is how long until ``need`` slots are believed free at time t:
    the entries ending after t hold slots; they free them in order of believed end.

    Entries are kept sorted by end with a cumulative sum of their slots (rebuilt after a change, once per
    routing decision), and the entries ending at or before the last query time are counted apart, so a
    query is a binary search instead of a sort of all k entries: under overload (BPRR's queues in the
    Azure cells of Fig. 9) a ledger holds thousands of planned requests. Query times never decrease in
    the simulation; an earlier one recomputes from the start. Results are identical to the sort."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.total = 0
        """Σ slots of every entry (an upper bound on the slots believed held at any time)."""
        self._entries: dict[int, tuple[int, float]] = {}
        self._sorted: list[tuple[float, int, int]] = []  # (end, slots, job)
        self._cum: list[int] | None = None  # cumulative slots along _sorted (None: stale)
        self._past, self._past_slots, self._now = 0, 0, -math.inf  # _sorted[:_past] end at or before _now

    def add(self, job: int, slots: int, end: float) -> None:
        item = (end, slots, job)
        pos = bisect.bisect_right(self._sorted, item)
        self._sorted.insert(pos, item)
        self._entries[job] = (slots, end)
        self.total += slots
        self._cum = None
        if pos < self._past:
            self._past += 1
            self._past_slots += slots

    def remove(self, job: int) -> None:
        slots, end = self._entries.pop(job)
        pos = bisect.bisect_left(self._sorted, (end, slots, job))
        del self._sorted[pos]
        self.total -= slots
        self._cum = None
        if pos < self._past:
            self._past -= 1
            self._past_slots -= slots

    def held(self, t: float) -> int:
        """Slots believed held at time t (entries that end after t)."""
        if t < self._now:
            self._past, self._past_slots = 0, 0
        self._now = t
        items = self._sorted
        while self._past < len(items) and items[self._past][0] <= t:
            self._past_slots += items[self._past][1]
            self._past += 1
        return self.total - self._past_slots

    def wait(self, need: int, t: float) -> float:
        if need > self.capacity:
            return math.inf
        short = need - (self.capacity - self.held(t))  # slots that must be freed first
        if short <= 0:
            return 0.0
        if self._cum is None:
            self._cum = list(itertools.accumulate(map(operator.itemgetter(1), self._sorted)))
        # the first entry k ≥ _past whose release brings the freed slots to ``short``
        k = bisect.bisect_left(self._cum, self._past_slots + short)
        return self._sorted[k][0] - t if k < len(self._sorted) else math.inf  # inf not reached: need ≤ capacity


def simulate_bprr(model: ModelSpec, servers: Sequence[Server], jobs: Jobs, arrival_rate: float, *,
                  reservation: int | None = None, oracle: bool = False) -> tuple[SimResult, dict]:
    """Simulate BPRR (CG-BP + WS-RR) on ``jobs``. Returns (result, info)."""
    servers = list(servers)
    R = reservation if reservation is not None else bprr_reservation(model, servers, arrival_rate)
    clock = RequestClock.for_servers(servers)
    bp = cg_bp(model, servers, R)
    placement = bp.placement
    J = len(servers)
    capacity = [0] * J
    hosted = [0] * J
    for j, span in enumerate(placement.spans):
        if span is not None:
            hosted[j] = span[1] - span[0]
            capacity[j] = free_slots(servers[j], model, hosted[j])
    index = {s.id: j for j, s in enumerate(servers)}
    static = ws_rr_route(model, servers, placement, lambda j, need: 0.0 if need <= capacity[j] else math.inf)
    if static is None:
        raise ValueError(f"the CG-BP placement (R={R}) forms no path")

    def to_path(route) -> Path:
        hops = tuple(index[s] for s in route.servers)
        return Path(hops, tuple(e - s for s, e in route.spans), route.service_time)

    static_path = to_path(static)
    used = [0] * J  # physically held slots
    ledger = [BeliefLedger(capacity[j]) for j in range(J)]  # job -> (slots, believed end), per server
    n = len(jobs)
    arrivals = jobs.arrivals.tolist()
    sizes = jobs.sizes.tolist()
    start, finish = [0.0] * n, [0.0] * n
    attempts = [0] * n
    plan: list[Path | None] = [None] * n
    heap: list = []  # (time, kind, job): 0 completion, 1 planned start, 2 retry (re-route)
    push, pop = heapq.heappush, heapq.heappop
    stats = {"surprise_failures": 0, "planned_waits": 0}
    placed = [j for j in range(J) if hosted[j] > 0]

    def route_and_plan(job: int, t: float) -> None:
        if all(capacity[j] - ledger[j].total >= hosted[j] for j in placed) or all(
            capacity[j] - ledger[j].held(t) >= hosted[j] for j in placed
        ):
            path, delay = static_path, 0.0
        else:
            cache: dict[tuple[int, int], float] = {}

            def wait(j: int, need: int) -> float:
                key = (j, need)
                if key not in cache:
                    cache[key] = ledger[j].wait(need, t)
                return cache[key]

            route = ws_rr_route(model, servers, placement, wait)
            path, delay = to_path(route), route.start_delay
        planned = t + delay
        believed = planned + (sizes[job] if oracle else 1.0) * path.service_time
        for j, m in zip(path.servers, path.need):
            ledger[j].add(job, m, believed)
        plan[job] = path
        if delay > 0:
            stats["planned_waits"] += 1
            push(heap, (planned, 1, job))
        else:
            attempt_start(job, t)

    def attempt_start(job: int, t: float) -> None:
        path = plan[job]
        if all(used[j] + m <= capacity[j] for j, m in zip(path.servers, path.need)):
            for j, m in zip(path.servers, path.need):
                used[j] += m
            start[job] = t
            if clock is None:
                push(heap, (t + sizes[job] * path.service_time, 0, job))
            else:
                clock.begin(heap, job, t, sizes[job] * path.service_time, path)
        else:  # the slots are still held by a request that outlived its estimate
            stats["surprise_failures"] += 1
            for j in path.servers:
                ledger[j].remove(job)
            attempts[job] += 1
            push(heap, (t + backoff_delay(attempts[job]), 2, job))

    i, inf = 0, math.inf
    next_arrival = arrivals[0] if n else inf
    while heap or i < n:
        if heap and heap[0][0] <= next_arrival:
            t, kind, job = pop(heap)
            if kind == 0:
                if clock is not None and not clock.ends(heap, job, t):
                    continue  # a stale completion: the request was projected again
                finish[job] = t
                path = plan[job]
                for j, m in zip(path.servers, path.need):
                    used[j] -= m
                    ledger[j].remove(job)
            elif kind == 1:
                attempt_start(job, t)
            else:
                route_and_plan(job, t)
        else:
            route_and_plan(i, next_arrival)
            i += 1
            next_arrival = arrivals[i] if i < n else inf
    info = {"reservation": R, "feasible": bp.feasible,
            "placement": [list(s) if s is not None else None for s in placement.spans],
            "servers_used": len(placed), "fastest_path_time": static_path.service_time, **stats}
    return SimResult(jobs.arrivals.copy(), np.asarray(start), np.asarray(finish), np.full(n, -1)), info
