"""BF-IO: balance the short future with integer optimisation (§8, §14.7).

Two forms:

* ``bfio_place`` — the paper's data-parallel decision (§8.3): place a given set
  of waiting requests on G workers with free slots so that the predicted
  barrier idle J = sum_{h=0..H} Imbalance(k+h) is minimal, where
  Imbalance = G * max_g L_g - sum_g L_g.  Which requests are placed is fixed by
  the fairness policy (§14), BF-IO only decides where.  Small instances are
  solved exactly by enumeration (the ILP of §8.3 has the same optimum; at this
  size enumeration is simpler and dependency free), larger ones greedily.
* ``server_load_profile`` / ``swarm_bfio_cost`` — the swarm form of §14.7:
  servers are the workers; a chain adds its candidate's KV read load to every
  server on it; J_k(r) is computed over all servers of the swarm.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence


@dataclass(frozen=True)
class BfioSession:
    """An active request: current workload ``size`` (w at this step; for decode the
    context length) and ``remaining_steps`` it is predicted to stay alive
    (alive at horizon step h iff h < remaining_steps); None = beyond the horizon."""

    size: float
    remaining_steps: int | None = None

    def alive(self, h: int) -> bool:
        return self.remaining_steps is None or h < self.remaining_steps


@dataclass(frozen=True)
class BfioWorker:
    sessions: tuple = ()
    free_slots: int = 1


@dataclass(frozen=True)
class BfioPlacement:
    assignment: tuple  # worker index per request, in the input order
    objective: float  # J over h = 0..H
    max_load_now: float  # max_g L_g at h = 0 (first tie-break)
    exact: bool


def _base_loads(workers: Sequence[BfioWorker], horizon: int, drift: float) -> list[list[float]]:
    loads = []
    for w in workers:
        row = []
        for h in range(horizon + 1):
            row.append(sum(s.size + drift * h for s in w.sessions if s.alive(h)))
        loads.append(row)
    return loads


def _objective(loads: list[list[float]], horizon: int) -> tuple[float, float]:
    g = len(loads)
    total = 0.0
    for h in range(horizon + 1):
        column = [row[h] for row in loads]
        total += g * max(column) - sum(column)
    return total, max(row[0] for row in loads)


def _add(loads, worker, size, remaining, horizon, drift, sign=1.0):
    row = loads[worker]
    for h in range(horizon + 1):
        if remaining is None or h < remaining:
            row[h] += sign * (size + drift * h)


def bfio_objective(
    workers: Sequence[BfioWorker],
    assignment: Sequence[int],
    request_sizes: Sequence[float],
    horizon: int = 0,
    *,
    drift: float = 1.0,
    request_remaining: Sequence[int | None] | None = None,
) -> tuple[float, float]:
    """(J, max load at h = 0) of one allocation: request i goes to worker assignment[i]."""
    remaining = list(request_remaining) if request_remaining is not None else [None] * len(request_sizes)
    loads = _base_loads(workers, horizon, drift)
    for i, w in enumerate(assignment):
        _add(loads, w, request_sizes[i], remaining[i], horizon, drift)
    return _objective(loads, horizon)


def bfio_place(
    workers: Sequence[BfioWorker],
    request_sizes: Sequence[float],
    horizon: int = 0,
    *,
    drift: float = 1.0,
    request_remaining: Sequence[int | None] | None = None,
    exact_limit: int = 20000,
) -> BfioPlacement:
    """Place every request (len(request_sizes) <= total free slots) minimising J.

    Tie-breaks (§8.3): smaller J, then smaller max load at h = 0, then the
    lexicographically smallest assignment (earlier requests on lower-index
    workers).  Exact when the number of candidate allocations is at most
    ``exact_limit``; otherwise greedy in decreasing size, each request to the
    feasible worker with the smallest incremental J.
    """
    n = len(request_sizes)
    if n > sum(w.free_slots for w in workers):
        raise ValueError("more requests than free slots: the fairness policy must choose which to place")
    remaining = list(request_remaining) if request_remaining is not None else [None] * n
    base = _base_loads(workers, horizon, drift)
    g = len(workers)
    if n == 0:
        j, mx = _objective(base, horizon)
        return BfioPlacement((), j, mx, True)
    if g ** n <= exact_limit:
        best = None
        for assignment in itertools.product(range(g), repeat=n):
            counts = [0] * g
            for w in assignment:
                counts[w] += 1
            if any(counts[w] > workers[w].free_slots for w in range(g)):
                continue
            loads = [row[:] for row in base]
            for i, w in enumerate(assignment):
                _add(loads, w, request_sizes[i], remaining[i], horizon, drift)
            j, mx = _objective(loads, horizon)
            key = (j, mx, assignment)
            if best is None or key < best:
                best = key
        return BfioPlacement(best[2], best[0], best[1], True)
    # greedy
    loads = [row[:] for row in base]
    free = [w.free_slots for w in workers]
    assignment = [None] * n
    for i in sorted(range(n), key=lambda i: (-request_sizes[i], i)):
        choice = None
        for w in range(g):
            if free[w] <= 0:
                continue
            _add(loads, w, request_sizes[i], remaining[i], horizon, drift)
            key = (*_objective(loads, horizon), w)
            _add(loads, w, request_sizes[i], remaining[i], horizon, drift, sign=-1.0)
            if choice is None or key < choice:
                choice = key
        w = choice[2]
        _add(loads, w, request_sizes[i], remaining[i], horizon, drift)
        free[w] -= 1
        assignment[i] = w
    j, mx = _objective(loads, horizon)
    return BfioPlacement(tuple(assignment), j, mx, False)


# --- swarm form (§14.7) -------------------------------------------------------


def server_load_profile(
    sessions: Iterable[tuple[Sequence[Hashable], float, int | None]],
    servers: Iterable[Hashable],
    kv_time: Mapping[Hashable, float],
    horizon: int,
) -> dict[Hashable, list[float]]:
    """ell_s(h) = t_s * sum over sessions j on s alive at h of (ctx_j + h).

    ``sessions`` yields (servers of the session's chain, current context length,
    remaining steps or None).  Servers missing from ``kv_time`` count t_s = 1.
    """
    profile = {s: [0.0] * (horizon + 1) for s in servers}
    for chain_servers, ctx, remaining in sessions:
        add_session_load(profile, chain_servers, ctx, remaining, kv_time, horizon)
    return profile


def add_session_load(
    profile: dict[Hashable, list[float]],
    chain_servers: Sequence[Hashable],
    ctx: float,
    remaining: int | None,
    kv_time: Mapping[Hashable, float],
    horizon: int,
) -> None:
    """Add one session's KV read load t_s * (ctx + h), h < remaining, to every server of its chain."""
    for s in chain_servers:
        row = profile.setdefault(s, [0.0] * (horizon + 1))
        t = kv_time.get(s, 1.0)
        for h in range(horizon + 1):
            if remaining is None or h < remaining:
                row[h] += t * (ctx + h)


def swarm_bfio_cost(
    profile: Mapping[Hashable, list[float]],
    chain_servers: Sequence[Hashable],
    add_tokens: float,
    kv_time: Mapping[Hashable, float],
    horizon: int,
    remaining: int | None = None,
) -> float:
    """J_k(r) = sum_h (|S| * max_s ell_s(h) - sum_s ell_s(h)) with r's load (len(r) + h)
    added to every server of chain k (the full context is read; reuse saves only prefill)."""
    on_chain = set(chain_servers)
    servers = list(profile)
    for s in chain_servers:
        if s not in profile:
            servers.append(s)
    total = 0.0
    for h in range(horizon + 1):
        column = []
        for s in servers:
            load = profile[s][h] if s in profile else 0.0
            if s in on_chain and (remaining is None or h < remaining):
                load += kv_time.get(s, 1.0) * (add_tokens + h)
            column.append(load)
        if column:
            total += len(column) * max(column) - sum(column)
    return total
