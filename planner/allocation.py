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
suffix of an optimal path is optimal). Servers that end at the same boundary share the rest of the path,
so among them the choice is by their own cost rounded to 40 significant bits (relative ~1e-12), then id;
all this differs from the textbook only for times within float noise of each other.

Cost: one O(Σ_j m_j log) setup, then per round O(path length + boundaries touched × distinct ends).

Batching servers (:mod:`planner.service_model`): paths and capacities are chosen exactly as above (by the
time of a job alone, T_k(1), and by memory); then each chain's service time becomes T_k(n^cap), its time
when every chain through its servers is full (n_j = Σ_{k∋j} c_k; T_k(1) is kept as ``Chain.solo_time``), and
the chains are re-sorted by it (stable), so ν and JFFC's fastest-first order use that conservative rate (the
bounds use state-dependent rates: :mod:`planner.batch_bounds`). Without batching servers nothing changes.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

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
from planner.service_model import capacity_occupancy, has_batching, path_service

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
    id_rank = {sid: r for r, sid in enumerate(sorted(s.id for s in servers))}
    placed = [(j, span[0], span[1]) for j, span in enumerate(placement.spans) if span is not None]
    return allocate(
        model.num_blocks,
        [s.id for s in servers],
        placed,
        budget,
        [s.comm_time_s for s in servers],
        [s.compute_time_s for s in servers],
        [id_rank[s.id] for s in servers],
        servers=servers,
    )


def allocate(
    num_blocks: int,
    ids: Sequence[str],
    placed: Sequence[tuple[int, int, int]],
    budget: Sequence[int],
    comm: Sequence[float],
    compute: Sequence[float],
    ranks: Sequence[int],
    *,
    servers: Sequence[Server] | None = None,
) -> Allocation:
    """GCA over pre-validated inputs (the tuner's hot path): ``placed`` lists (server, start, end);
    ``budget``, ``comm``, ``compute`` and ``ranks`` (id order) are indexed by server. With ``servers`` (the
    same swarm as planner Servers) batching servers' chains get T_k(n^cap) (see the module doc)."""
    paths = _gca_paths(num_blocks, placed, budget, comm, compute, ranks)
    chains = []
    allocated = [0] * len(ids)
    for path, capacity in paths:
        time = 0.0
        for j, (start, end) in path:
            time += comm[j] + compute[j] * (end - start)
            allocated[j] += capacity * (end - start)
        chains.append(
            Chain(
                servers=tuple(ids[j] for j, _ in path),
                spans=tuple(span for _, span in path),
                capacity=capacity,
                service_time=time,
            )
        )
    if servers is not None and has_batching(servers):
        chains = _at_capacity_occupancy(chains, paths, servers)
    return Allocation(tuple(chains), tuple(budget), tuple(allocated))


def _at_capacity_occupancy(chains: list[Chain], paths, servers: Sequence[Server]) -> list[Chain]:
    """The chains with T_k(n^cap) as service time and T_k(1) as solo time, re-sorted by T_k(n^cap)."""
    hops = [[j for j, _ in path] for path, _ in paths]
    held = capacity_occupancy(hops, [cap for _, cap in paths], len(servers))
    out = []
    for chain, path in zip(chains, hops):
        service = path_service(servers, path, chain.slots_needed, chain.service_time)
        out.append(Chain(chain.servers, chain.spans, chain.capacity, service.time(held), chain.service_time))
    out.sort(key=lambda ch: ch.service_time)  # stable: ties keep GCA's order
    return out


def _build_groups(num_blocks, placed, comm, compute, ranks):
    """groups[e] = [[end, need, members, costs, pointer], ...] for every boundary e (see _gca_paths)."""
    groups: list[list[list]] = [[] for _ in range(num_blocks)]
    if not placed:
        return groups
    arr = np.asarray(placed, dtype=np.int64)
    server, start, end = arr[:, 0], arr[:, 1], arr[:, 2]
    width = end - start
    total = int(width.sum())
    offsets = np.repeat(np.cumsum(width) - width, width)
    rep_server = np.repeat(server, width)
    rep_end = np.repeat(end, width)
    boundary = np.repeat(start, width) + (np.arange(total) - offsets)
    need = rep_end - boundary
    comm_a = np.asarray(comm, dtype=np.float64)[rep_server]
    compute_a = np.asarray(compute, dtype=np.float64)[rep_server]
    own = comm_a + compute_a * need
    mant, expo = np.frexp(own)
    key = np.ldexp(np.round(mant * 2.0**40), expo - 40)
    rank = np.asarray(ranks, dtype=np.int64)[rep_server]
    order = np.lexsort((rank, key, rep_end, boundary))
    boundary, rep_end, need = boundary[order], rep_end[order], need[order]
    members_all = rep_server[order].tolist()
    costs_all = own[order].tolist()
    cut = np.flatnonzero((np.diff(boundary) != 0) | (np.diff(rep_end) != 0)) + 1
    lows = [0] + cut.tolist()
    highs = cut.tolist() + [total]
    b_list, e_list, n_list = boundary.tolist(), rep_end.tolist(), need.tolist()
    for lo, hi in zip(lows, highs):
        groups[b_list[lo]].append([e_list[lo], n_list[lo], members_all[lo:hi], costs_all[lo:hi], 0])
    return groups


def _gca_paths(
    num_blocks: int,
    placed: Sequence[tuple[int, int, int]],
    budget: Sequence[int],
    comm: Sequence[float],
    compute: Sequence[float],
    ranks: Sequence[int],
) -> list[tuple[list[tuple[int, tuple[int, int]]], int]]:
    """Core of GCA: returns [(path as [(server, processed span)], capacity)] in order."""
    L = num_blocks
    residual = {j: int(budget[j]) for j, _, _ in placed}
    ends = {j: end for j, _, end in placed}
    # groups[e]: the servers that may process the block after boundary e (start ≤ e < end), grouped by
    # their end. Inside a group every server has the same tail F(end) and hop count, so its order is fixed
    # by its own cost τc_j + τp_j·(end − e) (rounded to 40 significant bits, then id rank); slots only
    # shrink, so the group's best usable server is found by advancing a pointer (amortized O(1)).
    groups = _build_groups(L, placed, comm, compute, ranks)

    value = [_INF] * (L + 1)  # F(e): fastest time from boundary e to jE
    hops = [0] * (L + 1)  # servers on that fastest path
    best = [-1] * (L + 1)  # server chosen at boundary e
    value[L] = 0.0
    users_of_server: dict[int, set[int]] = {j: set() for j in residual}  # boundaries whose best is j
    users_of_boundary: list[set[int]] = [set() for _ in range(L + 1)]  # boundaries whose best ends here

    def recompute(e: int) -> bool:
        """Recompute F(e); return True if (F, hops) changed."""
        bv, bh, br, bj = _INF, 0, 0, -1
        for group in groups[e]:
            end, need, members, costs, ptr = group
            n = len(members)
            while ptr < n and residual[members[ptr]] < need:
                ptr += 1
            group[4] = ptr
            if ptr == n:
                continue
            tail = value[end]
            if tail == _INF:
                continue
            j = members[ptr]
            v = costs[ptr] + tail
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
