"""GCA: Greedy Cache Allocation (spec §6, Alg. 2).

Over any placement, GCA repeatedly takes the fastest j0→jE path of the routing topology whose every link
(i, j) is still usable (server j has at least m_ij free slots), gives it the largest capacity its servers
allow, ``c_k = min_j ⌊M_j/m_ij⌋``, charges ``c_k·m_ij`` slots to each server on it and repeats until no
path is left. The chains come out fastest first (nondecreasing T_k).

Implementation (same result as the textbook algorithm, much faster). The link rule makes the cost of
entering server j depend only on the *boundary* e = a_i + m_i − 1 (0-based: the previous server's end),
not on which server i ends there: j can follow any server ending at e iff ``start_j ≤ e < end_j``, it then
processes ``end_j − e`` blocks at cost ``τc_j + τp_j·(end_j − e)`` and needs that many free slots. So the
shortest path is a dynamic programme over the L + 1 boundaries, ``F(L) = 0`` and
``F(e) = min_j [τc_j + τp_j·(end_j − e) + F(end_j)]`` over usable j covering e. After each round only the
chosen servers lose slots, links only disappear, and F only grows; boundaries whose chosen server lost a
usable link are recomputed, and the change is propagated backwards in decreasing boundary order.

Tie-breaks (§6.3, §15.6): among paths whose times agree within a relative 1e-9, fewer servers first, then
the lexicographically smallest sequence of server ids (greedy from j0, which is exact because every
suffix of an optimal path is optimal).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from planner.model import (
    TIME_RTOL,
    Chain,
    ModelSpec,
    Placement,
    Server,
    free_slots,
    total_capacity,
    total_rate,
    validate_servers,
)

_INF = float("inf")


@dataclass(frozen=True)
class Allocation:
    """GCA's output: chains fastest first, with per-server slot accounting (§6.7)."""

    chains: tuple[Chain, ...]
    """Chains in nondecreasing service time; index 0 is the fastest (the spec's chain 1)."""
    slots_total: tuple[int, ...]
    """M̃_j (or the given slot budget) per server, aligned with the servers tuple."""
    slots_allocated: tuple[int, ...]
    """Σ over chains k through j of c_k·m_ij: the KV slots server j must configure."""

    @property
    def slots_free(self) -> tuple[int, ...]:
        """Slots left on each server after allocation (the residual M_j of the last round)."""
        return tuple(t - a for t, a in zip(self.slots_total, self.slots_allocated))

    @property
    def total_rate(self) -> float:
        """ν = Σ c_k·μ_k (eq. 4)."""
        return total_rate(self.chains)

    @property
    def total_capacity(self) -> int:
        """C = Σ c_k."""
        return total_capacity(self.chains)


def gca(
    model: ModelSpec,
    servers: Sequence[Server],
    placement: Placement,
    *,
    slot_budget: Sequence[int] | None = None,
) -> Allocation:
    """Run GCA (Alg. 2) on ``placement``.

    ``slot_budget[j]`` overrides M̃_j = ⌊(M_j − s_m·m_j)/s_c⌋ as the slots server j may hand out (used for
    the PETALS baseline, whose cache pool is fixed; §12.1). Raises ValueError if a placed server's blocks
    do not fit its memory.
    """
    servers = validate_servers(servers)
    placement.validate(model, servers)
    if slot_budget is None:
        budget = [free_slots(s, model, placement.num_blocks(i)) for i, s in enumerate(servers)]
    else:
        budget = [int(b) for b in slot_budget]
        if len(budget) != len(servers) or min(budget) < 0:
            raise ValueError("slot_budget must give a non-negative slot count per server")
    comm = [s.comm_time_s for s in servers]
    compute = [s.compute_time_s for s in servers]
    id_rank = {sid: r for r, sid in enumerate(sorted(s.id for s in servers))}
    ranks = [id_rank[s.id] for s in servers]
    paths = _gca_paths(model.num_blocks, placement.spans, budget, comm, compute, ranks)
    chains = []
    for path, capacity in paths:
        time = 0.0
        for j, (start, end) in path:
            time += comm[j] + compute[j] * (end - start)
        chains.append(
            Chain(
                servers=tuple(servers[j].id for j, _ in path),
                spans=tuple(span for _, span in path),
                capacity=capacity,
                service_time=time,
            )
        )
    allocated = [0] * len(servers)
    for path, capacity in paths:
        for j, (start, end) in path:
            allocated[j] += capacity * (end - start)
    return Allocation(tuple(chains), tuple(budget), tuple(allocated))


def _gca_paths(
    num_blocks: int,
    spans: Sequence[tuple[int, int] | None],
    budget: Sequence[int],
    comm: Sequence[float],
    compute: Sequence[float],
    ranks: Sequence[int],
) -> list[tuple[list[tuple[int, tuple[int, int]]], int]]:
    """Core of GCA over plain lists: returns [(path as [(server, processed span)], capacity)] in order."""
    L = num_blocks
    residual = list(budget)
    ends = [s[1] if s is not None else -1 for s in spans]
    # cover[e]: servers that may process the block after boundary e (start ≤ e < end), by id rank.
    cover: list[list[int]] = [[] for _ in range(L)]
    for j in sorted((j for j, s in enumerate(spans) if s is not None), key=lambda j: ranks[j]):
        start, end = spans[j]
        for e in range(start, end):
            cover[e].append(j)

    value = [_INF] * (L + 1)  # F(e): fastest time from boundary e to jE
    hops = [0] * (L + 1)  # servers on that fastest path
    best = [-1] * (L + 1)  # server chosen at boundary e
    value[L] = 0.0
    users_of_server: list[set[int]] = [set() for _ in spans]  # boundaries whose best is j
    users_of_boundary: list[set[int]] = [set() for _ in range(L + 1)]  # boundaries whose best ends here

    def recompute(e: int) -> bool:
        """Recompute F(e); return True if (F, hops) changed."""
        bv, bh, br, bj = _INF, 0, 0, -1
        for j in cover[e]:
            end = ends[j]
            need = end - e
            if residual[j] < need:
                continue
            tail = value[end]
            if tail == _INF:
                continue
            v = comm[j] + compute[j] * need + tail
            h = hops[end] + 1
            r = ranks[j]
            if bj < 0:
                take = True
            else:
                tol = TIME_RTOL * (v if v > bv else bv)
                if v < bv - tol:
                    take = True
                elif v > bv + tol:
                    take = False
                else:
                    take = h < bh or (h == bh and r < br)
            if take:
                bv, bh, br, bj = v, h, r, j
        old = best[e]
        if old != bj:
            if old >= 0:
                users_of_server[old].discard(e)
                users_of_boundary[ends[old]].discard(e)
            if bj >= 0:
                users_of_server[bj].add(e)
                users_of_boundary[ends[bj]].add(e)
            best[e] = bj
        changed = bv != value[e] or bh != hops[e]
        value[e], hops[e] = bv, bh
        return changed

    for e in range(L - 1, -1, -1):
        recompute(e)

    result = []
    while value[0] < _INF:
        path = []
        e = 0
        while e < L:
            j = best[e]
            path.append((j, (e, ends[j])))
            e = ends[j]
        capacity = min(residual[j] // (end - start) for j, (start, end) in path)
        dirty: list[int] = []
        queued: set[int] = set()
        for j, (start, end) in path:
            residual[j] -= capacity * (end - start)
            for user in users_of_server[j]:
                if end - user > residual[j] and user not in queued:
                    queued.add(user)
                    heapq.heappush(dirty, -user)
        while dirty:
            e = -heapq.heappop(dirty)
            queued.discard(e)
            if recompute(e):
                for user in users_of_boundary[e]:
                    if user not in queued:
                        queued.add(user)
                        heapq.heappush(dirty, -user)
        result.append((path, capacity))
    return result
