"""The score of ``placement="auto"``: predicted mean response time of JFFC over a set of chains.

One pure function, :func:`predict`, maps GCA's chains (rates μ_k, capacities c_k) and the planning λ to
a :class:`Prediction` (seconds), choosing the cheapest method that is accurate enough:

1. λ ≥ ν: ``unstable``, +inf.
2. Π(c_k + 1) ≤ ``exact_states``: the **exact** CTMC occupancy of §8.6 (E[N]/λ).
3. Theorem 3.7's bounds within ``tight`` of each other (relative): their midpoint, ``bounds``.
4. Otherwise a short **simulation** of the same CTMC model (Poisson(λ) arrivals, Exp service at rate μ_k,
   JFFC with a central FIFO queue) with a fixed seed, clamped to the bounds. All candidates use the
   same seed (common random numbers), so comparisons between them see the same arrivals and job sizes.

Everything is deterministic for a given input.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from planner.bounds import exact_mean_response_time, response_time_bounds

EXACT_STATES = 300
"""Largest CTMC (Π(c_k + 1) states) solved exactly."""
TIGHT = 0.005
"""Bounds closer than this (relative) are used as they are (midpoint)."""
SIM_JOBS = 8000
"""Jobs of the fallback simulation (the first 10% are warm-up)."""
SIM_SEED = 20240
"""Fixed seed of the fallback simulation (common random numbers across candidates)."""


@dataclass(frozen=True)
class Prediction:
    value: float
    """Predicted mean response time (s); +inf when λ ≥ ν or there is no chain."""
    method: str
    """"exact", "bounds", "simulation" or "unstable"."""
    lower: float
    upper: float

    def to_dict(self) -> dict:
        fin = lambda v: v if math.isfinite(v) else None  # noqa: E731
        return {"value": fin(self.value), "method": self.method, "lower": fin(self.lower), "upper": fin(self.upper)}


def predict(
    rates: Sequence[float],
    capacities: Sequence[int],
    arrival_rate: float,
    *,
    exact_states: int = EXACT_STATES,
    tight: float = TIGHT,
    sim_jobs: int = SIM_JOBS,
    seed: int = SIM_SEED,
) -> Prediction:
    """Predicted mean response time under JFFC (see the module docstring for the method order)."""
    bounds = response_time_bounds(rates, capacities, arrival_rate)
    if bounds is None:
        return Prediction(math.inf, "unstable", math.inf, math.inf)
    lo, up = bounds.lower, bounds.upper
    if arrival_rate <= 0:
        return Prediction(lo, "exact", lo, up)
    states = 1
    for c in capacities:
        states *= int(c) + 1
        if states > exact_states:
            break
    if states <= exact_states:
        value = exact_mean_response_time(rates, capacities, arrival_rate, max_states=exact_states)
        return Prediction(value, "exact", lo, up)
    if up - lo <= tight * lo:
        return Prediction(0.5 * (lo + up), "bounds", lo, up)
    value = simulate_jffc(rates, capacities, arrival_rate, num_jobs=sim_jobs, seed=seed)
    return Prediction(min(max(value, lo), up), "simulation", lo, up)


def simulate_jffc(
    rates: Sequence[float], capacities: Sequence[int], arrival_rate: float, *, num_jobs: int, seed: int,
    warmup: float = 0.1,
) -> float:
    """Mean response time of ``num_jobs`` Poisson(λ) jobs with Exp(1) sizes under JFFC (central FIFO
    queue served at completions; a job of size r takes r/μ_k on chain k), the first ``warmup`` share
    left out. Chains are taken fastest first (stable sort by rate)."""
    order = sorted(range(len(rates)), key=lambda k: -rates[k])
    mu = [float(rates[k]) for k in order]
    free = [int(capacities[k]) for k in order]
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / arrival_rate, num_jobs)).tolist()
    sizes = rng.exponential(1.0, num_jobs).tolist()
    open_chains = [k for k, f in enumerate(free) if f > 0]  # min-heap of chains with a free slot
    heapq.heapify(open_chains)
    running: list[tuple[float, int]] = []  # (completion time, chain)
    queue: deque[int] = deque()
    skip = int(warmup * num_jobs)
    total = 0.0
    i = 0
    while i < num_jobs or running:
        if i < num_jobs and (not running or arrivals[i] < running[0][0]):
            if open_chains:
                k = open_chains[0]
                free[k] -= 1
                if free[k] == 0:
                    heapq.heappop(open_chains)
                finish = arrivals[i] + sizes[i] / mu[k]
                heapq.heappush(running, (finish, k))
                if i >= skip:
                    total += finish - arrivals[i]
            else:
                queue.append(i)
            i += 1
            continue
        now, k = heapq.heappop(running)
        if queue:
            job = queue.popleft()
            finish = now + sizes[job] / mu[k]
            heapq.heappush(running, (finish, k))
            if job >= skip:
                total += finish - arrivals[job]
        else:
            if free[k] == 0:
                heapq.heappush(open_chains, k)
            free[k] += 1
    return total / max(1, num_jobs - skip)
