"""Scoring ``placement="auto"`` candidates on a known arrival process instead of Poisson (issue 20).

planner/auto_score.py predicts the mean response time under Poisson(λ) arrivals. Real arrivals are burstier
(the Azure code trace's inter-arrival gaps have a coefficient of variation of 13): a placement with fewer,
faster job slots that wins under Poisson can lose badly when requests come in bursts. When the shape of the
arrival process is known — a sample of inter-arrival gaps — :class:`TraceScore` scores a chain set by the
mean response time of JFFC on that sample, rescaled to mean gap 1/λ, with Exp(1) job sizes from a fixed
seed (the same sample for every candidate: common random numbers), the first 10% left out.

A scorer is any callable ``(rates, capacities, λ) -> Prediction`` with a ``poisson`` attribute saying whether
Theorem 3.7's bounds (which assume Poisson arrivals) may prune candidates. :data:`POISSON` is the default.
Pure and deterministic.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from planner.auto_score import Prediction, predict
from planner.bounds import response_time_bounds


class Scorer(Protocol):
    poisson: bool

    def __call__(self, rates: Sequence[float], capacities: Sequence[int], arrival_rate: float) -> Prediction: ...


@dataclass(frozen=True)
class PoissonScore:
    """planner.auto_score.predict: exact CTMC, Theorem 3.7's bounds or a Poisson simulation."""

    poisson: bool = True

    def __call__(self, rates: Sequence[float], capacities: Sequence[int], arrival_rate: float) -> Prediction:
        return predict(rates, capacities, arrival_rate)


POISSON = PoissonScore()


@dataclass(frozen=True)
class TraceScore:
    """Mean JFFC response time on a fixed sample of the arrival process (see the module docstring)."""

    gaps: tuple[float, ...]
    """Inter-arrival gaps of the sample, any unit (rescaled to mean 1/λ)."""
    seed: int = 20240
    warmup: float = 0.1
    poisson: bool = False
    _sizes: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.gaps) < 10 or min(self.gaps) < 0 or sum(self.gaps) <= 0:
            raise ValueError("a trace score needs at least 10 non-negative gaps with a positive sum")
        sizes = np.random.default_rng(self.seed).exponential(1.0, len(self.gaps))
        object.__setattr__(self, "_sizes", tuple(sizes.tolist()))

    def __call__(self, rates: Sequence[float], capacities: Sequence[int], arrival_rate: float) -> Prediction:
        b = response_time_bounds(rates, capacities, arrival_rate)
        lo, up = (math.inf, math.inf) if b is None else (b.lower, b.upper)
        if not rates or sum(c for c in capacities) == 0 or arrival_rate <= 0:
            return Prediction(math.inf, "unstable", lo, up)
        scale = 1.0 / (arrival_rate * float(np.mean(self.gaps)))
        arrivals = np.cumsum(np.asarray(self.gaps) * scale).tolist()
        value = jffc_on_arrivals(rates, capacities, arrivals, self._sizes, self.warmup)
        return Prediction(value, "trace", lo, up)


def jffc_on_arrivals(rates: Sequence[float], capacities: Sequence[int], arrivals: Sequence[float],
                     sizes: Sequence[float], warmup: float) -> float:
    """Mean response time of JFFC (central FIFO queue, fastest free chain first) on the given arrival
    times and sizes (a job of size r takes r/μ_k on chain k), the first ``warmup`` share left out."""
    speed = sorted(((float(r), int(c)) for r, c in zip(rates, capacities) if c > 0), key=lambda rc: -rc[0])
    mu = [r for r, _ in speed]
    free = [c for _, c in speed]
    idle = list(range(len(mu)))  # heap of chains with a free slot: the fastest is idle[0]
    busy: list[tuple[float, int]] = []  # heap of (finish, chain)
    waiting: list[int] = []  # FIFO of jobs (a list read from ``head``)
    head = 0
    first = int(warmup * len(arrivals))
    total, n = 0.0, 0

    def run(job: int, k: int, now: float) -> None:
        nonlocal total, n
        finish = now + sizes[job] / mu[k]
        heapq.heappush(busy, (finish, k))
        if job >= first:
            total += finish - arrivals[job]
            n += 1

    def complete() -> None:
        """The next completion: its slot goes to the head of the queue, else back to the idle chains (when
        jobs wait, no other slot is free, so this chain is the fastest free one)."""
        nonlocal head
        now, k = heapq.heappop(busy)
        if head < len(waiting):
            run(waiting[head], k, now)
            head += 1
        else:
            free[k] += 1
            if free[k] == 1:
                heapq.heappush(idle, k)

    for job, t in enumerate(arrivals):
        while busy and busy[0][0] <= t:
            complete()
        if idle:
            k = idle[0]
            free[k] -= 1
            if free[k] == 0:
                heapq.heappop(idle)
            run(job, k, t)
        else:
            waiting.append(job)
    while head < len(waiting):
        complete()
    return total / max(1, n)
