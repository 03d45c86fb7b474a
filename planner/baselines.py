"""Placement baselines (spec §12): PETALS' block selection, BPRR's CG-BP, whole-model-per-server, random.

Each returns a :class:`~planner.model.Placement` (plus baseline-specific data) that GCA and JFFC can run
over, so every method is compared with the same chain composition and dispatch machinery.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from planner.allocation import gca
from planner.model import ModelSpec, Placement, Server, Span, free_slots, validate_servers
from planner.placement import DEFAULT_TARGET_LOAD, GbpCrResult, SwarmArrays, gbp_cr

# ----------------------------------------------------------------------------------------------
# PETALS (§12.1)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PetalsPlacement:
    """What petals 2.2 servers choose on their own (no rebalancing)."""

    placement: Placement
    slot_pool: tuple[int, ...]
    """Each server's fixed KV pool in slots of s_c: num_blocks × ``cache_slots_per_block``."""
    throughputs: tuple[float, ...]
    """Each server's announced throughput (0 for servers that host nothing)."""
    join_order: tuple[int, ...]


def petals_throughput(server: Server, num_blocks: int) -> float:
    """petals' ``get_server_throughput`` in the planner's terms [R mapping].

    ``min(forward_rps / ((num_blocks + 1)/2), network_rps)`` with forward_rps = 1/τp_j (jobs per second
    through one block) and network_rps = 1/τc_j; no relay penalty (all servers are reachable).
    """
    forward = math.inf if server.compute_time_s == 0 else 1.0 / server.compute_time_s
    network = math.inf if server.comm_time_s == 0 else 1.0 / server.comm_time_s
    return min(forward / ((num_blocks + 1) / 2.0), network)


def petals_num_blocks(
    server: Server,
    model: ModelSpec,
    *,
    cache_slots_per_block: int = 2,
    autograd_gb: float = 0.0,
    block_overhead: float = 1.01,
) -> int:
    """petals' ``_choose_num_blocks``: min(⌊(M − autograd)/(1.01·s_m + cache_per_block)⌋, L).

    ``cache_slots_per_block`` is petals' per-block attention cache in units of s_c: petals sizes it for
    ``attn_cache_tokens`` = 4096 tokens while s_c is sized for the 2048-token maximum, hence 2 by default.
    """
    per_block = int(round(model.block_bytes * block_overhead)) + cache_slots_per_block * model.slot_bytes
    usable = server.memory_bytes - int(round(autograd_gb * 1e9))
    return max(0, min(usable // per_block, model.num_blocks))


def _best_start(totals: list[float], num_blocks: int) -> int:
    """petals' ``choose_best_blocks``: the start whose sorted window of per-block throughputs is
    lexicographically smallest (weakest block first), ties to the smallest start."""
    best_key, best_start = None, 0
    for start in range(len(totals) - num_blocks + 1):
        key = sorted(totals[start : start + num_blocks])
        if best_key is None or key < best_key:
            best_key, best_start = key, start
    return best_start


def petals_placement(
    model: ModelSpec,
    servers: Sequence[Server],
    *,
    seed: int | None = None,
    cache_slots_per_block: int = 2,
    autograd_gb: float = 0.0,
) -> PetalsPlacement:
    """Servers join one at a time (input order, or a ``seed``-ed random order) and each takes the span
    covering the least-served blocks given the servers already up. petals' periodic rebalancing is not
    applied (the authors skipped it too, §12.1)."""
    servers = validate_servers(servers)
    order = list(range(len(servers)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    L = model.num_blocks
    totals = [0.0] * L
    spans: list[Span | None] = [None] * len(servers)
    pool = [0] * len(servers)
    thr = [0.0] * len(servers)
    for j in order:
        m = petals_num_blocks(
            servers[j], model, cache_slots_per_block=cache_slots_per_block, autograd_gb=autograd_gb
        )
        if m == 0:
            continue
        start = _best_start(totals, m)
        spans[j] = (start, start + m)
        thr[j] = petals_throughput(servers[j], m)
        pool[j] = m * cache_slots_per_block
        for b in range(start, start + m):
            totals[b] += thr[j]
    return PetalsPlacement(Placement(tuple(spans)), tuple(pool), tuple(thr), tuple(order))


# ----------------------------------------------------------------------------------------------
# BPRR: Conservative Greedy Block Placement (§12.2)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BprrPlacement:
    placement: Placement
    reservation: int
    """R, the target number of concurrent requests every server reserves cache for."""
    feasible: bool
    """Every block reached capacity C_b ≥ R."""
    block_capacity: tuple[int, ...]
    """C_b per block at the end."""


def cg_bp(model: ModelSpec, servers: Sequence[Server], reservation: int, *, virtual_margin_s: float = 1.0
          ) -> BprrPlacement:
    """CG-BP with reservation R (§12.2).

    m_j = min(⌊M_j/(s_m + s_c·R)⌋, L); servers in ascending t̃_j = (τc_j + τp_j·m_j)/m_j (ties by id; the
    per-job times are the per-token times scaled by l̄_O, which changes neither the order nor the choices
    below except through the virtual margin, ``virtual_margin_s`` = the "+1" of T_v, here in seconds).
    T_v = max t̃ + margin; C_b = 0, T_b = R·T_v; s_j = ⌊(M_j − s_m·m_j)/(s_c·m_j)⌋. Each server takes, while
    some C_b < R, the window containing such a block with the largest Σ T_b (first on ties), else the window
    whose sorted C vector is lexicographically smallest (first on ties); then
    T_b −= (T_v − t̃_j)·min((R − C_b)+, s_j) and C_b += s_j on its window.
    """
    if reservation < 1:
        raise ValueError("reservation R must be >= 1")
    arrays = SwarmArrays(model, servers)
    L = model.num_blocks
    m = arrays.max_blocks(reservation)
    order = [int(j) for j in arrays.gbp_cr_order(m)]
    spans: list[Span | None] = [None] * len(arrays)
    if not order:
        return BprrPlacement(Placement(tuple(spans)), reservation, False, tuple([0] * L))
    ttilde = {j: (arrays.comm[j] + arrays.compute[j] * m[j]) / m[j] for j in order}
    t_virtual = max(ttilde.values()) + virtual_margin_s
    cap = [0] * L
    weight = [reservation * t_virtual] * L
    for j in order:
        mj = int(m[j])
        sessions = free_slots(arrays.servers[j], model, mj) // mj
        windows = range(L - mj + 1)
        if any(cb < reservation for cb in cap):
            best, best_a = None, None
            for a in windows:
                if not any(cap[b] < reservation for b in range(a, a + mj)):
                    continue
                total = sum(weight[a : a + mj])
                if best is None or total > best:
                    best, best_a = total, a
            a = best_a
        else:
            a = min(windows, key=lambda a: (sorted(cap[a : a + mj]), a))
        spans[j] = (a, a + mj)
        for b in range(a, a + mj):
            weight[b] -= (t_virtual - ttilde[j]) * min(max(reservation - cap[b], 0), sessions)
            cap[b] += sessions
    feasible = all(cb >= reservation for cb in cap)
    return BprrPlacement(Placement(tuple(spans)), reservation, feasible, tuple(cap))


def bprr_reservation(model: ModelSpec, servers: Sequence[Server], arrival_rate: float) -> int:
    """R = max(1, ⌈min(R̂ + √max(R̂, 1), R_max)⌉) with R̂ = λ·T̂ (§12.2).

    T̂, the estimated fastest path time, is the service time of GCA's fastest chain on CG-BP(R = 1) [R];
    R_max = ⌊(Σ M_j − s_m(L + J))/(s_c(L + J))⌋.
    """
    servers = validate_servers(servers)
    L, J = model.num_blocks, len(servers)
    r_max = (sum(s.memory_bytes for s in servers) - model.block_bytes * (L + J)) // (model.slot_bytes * (L + J))
    base = cg_bp(model, servers, 1)
    chains = gca(model, servers, base.placement).chains if base.feasible else ()
    if not chains:
        return 1
    r_hat = arrival_rate * chains[0].service_time
    return max(1, math.ceil(min(r_hat + math.sqrt(max(r_hat, 1.0)), r_max)))


@dataclass(frozen=True)
class Route:
    """A WS-RR route: the chain to use now and how long the request must wait before it can start."""

    servers: tuple[str, ...]
    spans: tuple[Span, ...]
    """Blocks each server processes (first-host rule), 0-based half-open."""
    start_delay: float
    """The largest wait on the path: the request starts this long after it arrives."""
    service_time: float
    """Σ τc_j + τp_j·m_ij over the path (eq. 2)."""


def ws_rr_route(
    model: ModelSpec,
    servers: Sequence[Server],
    placement: Placement,
    wait_s: Callable[[int, int], float],
) -> Route | None:
    """WS-RR (§12.2, fast time scale): the path minimizing Σ over links of (tW_ij − t) + τc_j + τp_j·m_ij.

    ``wait_s(j, slots)`` is how long from now until server j (index into ``servers``) has ``slots`` free
    cache slots (0 if it has them now, ``math.inf`` if never); the simulator computes it from the active
    requests' (estimated or true) completion times. The request then starts after the largest wait on its
    path. Same DAG programme and tie-breaks as GCA. Returns None if no path has a finite cost.
    """
    L = model.num_blocks
    value = [math.inf] * (L + 1)
    hops = [0] * (L + 1)
    choice: list[tuple[int, float] | None] = [None] * (L + 1)
    value[L] = 0.0
    covering: list[list[int]] = [[] for _ in range(L)]
    for j, span in sorted(enumerate(placement.spans), key=lambda js: servers[js[0]].id):
        if span is not None:
            for e in range(span[0], span[1]):
                covering[e].append(j)
    for e in range(L - 1, -1, -1):
        for j in covering[e]:
            end = placement.spans[j][1]
            need = end - e
            if value[end] == math.inf:
                continue
            wait = max(0.0, float(wait_s(j, need)))
            if wait == math.inf:
                continue
            v = wait + servers[j].comm_time_s + servers[j].compute_time_s * need + value[end]
            h = hops[end] + 1
            if choice[e] is None or v < value[e] - 1e-9 * value[e] or (
                v <= value[e] + 1e-9 * value[e] and h < hops[e]
            ):
                value[e], hops[e], choice[e] = v, h, (j, wait)
    if choice[0] is None:
        return None
    path, e, delay, service = [], 0, 0.0, 0.0
    while e < L:
        j, wait = choice[e]
        end = placement.spans[j][1]
        path.append((j, (e, end)))
        delay = max(delay, wait)
        service += servers[j].comm_time_s + servers[j].compute_time_s * (end - e)
        e = end
    return Route(
        servers=tuple(servers[j].id for j, _ in path),
        spans=tuple(span for _, span in path),
        start_delay=delay,
        service_time=service,
    )


# ----------------------------------------------------------------------------------------------
# Whole model per server ("JFFC only", §12.3) and random placement (§12.5)
# ----------------------------------------------------------------------------------------------


def whole_model_placement(model: ModelSpec, servers: Sequence[Server]) -> Placement:
    """Every server that can hold all L blocks hosts [0, L); the others host nothing.

    GCA over it yields one single-server chain per server with capacity ⌊(M_j − L·s_m)/(L·s_c)⌋ and
    T_j = τc_j + L·τp_j (servers whose capacity is 0 get no chain).
    """
    servers = validate_servers(servers)
    L = model.num_blocks
    return Placement(tuple((0, L) if free_slots(s, model, L) >= 0 else None for s in servers))


def random_order(seed: int):
    """An ``order`` function for GBP-CR's loop: one fixed random permutation of all servers (servers with
    m_j(c) = 0 skipped), the same for every c."""

    def order(arrays: SwarmArrays, m: np.ndarray) -> list[int]:
        perm = list(range(len(arrays)))
        random.Random(seed).shuffle(perm)
        return [j for j in perm if m[j] > 0]

    return order


def random_placement(
    model: ModelSpec,
    servers: Sequence[Server],
    c: int,
    arrival_rate: float,
    target_load: float = DEFAULT_TARGET_LOAD,
    *,
    seed: int = 0,
) -> GbpCrResult:
    """GBP-CR's chain-forming loop fed a random permutation instead of the t̃ order (§12.5; Fig. 3 draws
    100 of these with seeds 0..99)."""
    return gbp_cr(model, servers, c, arrival_rate, target_load, order=random_order(seed))
