"""Theorem 3.7-style bounds for batching servers: death rates at the occupancy each state implies.

Spec §8's bounds replace JFFC's occupancy process by a birth–death process whose death rate with n jobs is the
rate of the n fastest (ν⁺_n, eq. 28) or slowest (ν⁻_n, eq. 29) job servers. When servers batch, a chain's rate
depends on how many sessions its servers hold (:mod:`planner.service_model`), so here the n jobs are placed
slot by slot in the chains' dispatch order (fastest first: JFFC's fill) or in the reverse order, each server's
occupancy n_j is counted from that placement, and

    ν±_n = Σ_k z_k / T_k(n(z)),   z = the placement of n jobs,

with ν_C = Σ_k c_k/T_k(n^cap) = ν, the rate GCA gives the swarm at saturation. E[N] and the mean response time
then follow from eqs. (30)–(32) as before (:func:`planner.bounds.birth_death_mean`). With g ≡ 1 these are exactly
eqs. (28)–(29). With batching they are the two fill orders' estimates, not proven bounds (a state with n jobs
spread differently can depart faster or slower): what they add over rating every chain at capacity occupancy is
that a light load is predicted at the light-load rates, so extra capacity is only charged when it is used.

:func:`allocation_bounds` is what the planner calls (:func:`planner.plan.plan`, the c tuner): the batched
bounds when a server batches, :func:`planner.bounds.response_time_bounds` otherwise (the paper's, unchanged).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from planner.bounds import ResponseTimeBounds, birth_death_mean, response_time_bounds
from planner.service_model import chain_services, has_batching


def fill_death_rates(chains: Sequence, servers: Sequence, *, fastest_first: bool) -> np.ndarray:
    """ν_n for n = 1..C when the n jobs fill the chains' slots in dispatch order (or its reverse)."""
    services = chain_services(chains, servers)
    order = list(range(len(chains))) if fastest_first else list(range(len(chains)))[::-1]
    held = [0] * len(servers)
    factor = [1.0] * len(servers)  # g_j(held_j), updated as servers fill
    curve = {j: g for s in services for j, g in zip(s.servers, s.curves)}  # (each curve memoizes its g(n))
    z = [0] * len(chains)
    share = [0.0] * len(chains)  # z_k / T_k(n) of every chain with jobs
    through: dict[int, list[int]] = {}
    for k, s in enumerate(services):
        for j in s.servers:
            through.setdefault(j, []).append(k)
    total, out = 0.0, []
    for k in order:
        service = services[k]
        touched = sorted({k} | {i for j in service.servers for i in through[j]})
        for _ in range(int(chains[k].capacity)):
            z[k] += 1
            for j in service.servers:
                held[j] += 1
                factor[j] = curve[j](held[j])
            for i in touched:
                if z[i]:
                    s_i = services[i]
                    extra = 0.0
                    for j, w in zip(s_i.servers, s_i.weights):
                        extra += w * (factor[j] - 1.0)
                    new = z[i] / (s_i.solo + extra)
                    total += new - share[i]
                    share[i] = new
            out.append(total)
    return np.asarray(out, dtype=np.float64)


def batched_response_time_bounds(chains: Sequence, servers: Sequence, arrival_rate: float
                                 ) -> ResponseTimeBounds | None:
    """The two fill orders' mean response times (see the module doc); None when λ ≥ ν or no chain."""
    if arrival_rate < 0 or not math.isfinite(arrival_rate):
        raise ValueError("arrival_rate must be finite and >= 0")
    chains = [ch for ch in chains if ch.capacity > 0]
    if not chains:
        return None
    fast = fill_death_rates(chains, servers, fastest_first=True)
    slow = fill_death_rates(chains, servers, fastest_first=False)
    if arrival_rate >= fast[-1]:
        return None
    if arrival_rate == 0:
        return ResponseTimeBounds(0.0, 0.0, 1.0 / fast[0], 1.0 / slow[0])
    lo, up = birth_death_mean(arrival_rate, fast), birth_death_mean(arrival_rate, slow)
    lo, up = min(lo, up), max(lo, up)
    return ResponseTimeBounds(lo, up, lo / arrival_rate, up / arrival_rate)


def allocation_bounds(chains: Sequence, servers: Sequence, arrival_rate: float) -> ResponseTimeBounds | None:
    """The planner's bounds for GCA's ``chains`` over ``servers``: batched when some server batches."""
    if has_batching(servers):
        return batched_response_time_bounds(chains, servers, arrival_rate)
    return response_time_bounds([ch.rate for ch in chains], [ch.capacity for ch in chains], arrival_rate)
