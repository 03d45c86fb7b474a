"""Event-driven simulator of chains with capacities under an online dispatch policy (spec §10.5).

The model (§2.6, §8.1): chain k has capacity c_k (that many jobs may run on it at once) and mean service
time T_k; a job of size r runs on chain k for r·T_k seconds (or an explicit per-job, per-chain time).
Jobs arrive by a Poisson process (sizes i.i.d. Exp(1)) or from a trace. A dispatcher from
:mod:`planner.dispatch` decides on every arrival and every completion; the central queue (JFFC, random)
or a chain's dedicated queue (JSQ, SA-JSQ, SED, JIQ) is served **at completion instants**, exactly
(not only at arrival instants, the authors' shortcut).

Events live in one heap of completions ``(time, job, chain)``; arrivals are pre-sorted and merged in.
At equal times a completion is processed before an arrival (a freed slot is visible to the newcomer),
and completions at equal times in job order. The same ``(jobs, policy, seed)`` always gives the same
result. No torch, no petals: this module imports in milliseconds.

Typical use::

    jobs = poisson_jobs(rate=0.2, num_jobs=20_000, seed=3)
    result = simulate_chains([ch.service_time for ch in plan.chains], [ch.capacity for ch in plan.chains],
                             jobs, policy="jffc")
    result.summary().response.mean
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Sequence

import numpy as np

from experiments.paths import DATA
from planner.dispatch import JFFC, make_dispatcher

DEFAULT_WARMUP = 0.1
"""Fraction of the first jobs (by arrival) left out of steady-state statistics (§10.5)."""

AZURE_CODE_TRACE = DATA / "azure_llm_inference_trace_code_2023-11-16.csv"


# ------------------------------------------------------------------------------------------------
# Workloads
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Jobs:
    """A workload: arrival times (s, nondecreasing) and sizes (mean-1 multipliers of T_k).

    ``input_tokens``/``output_tokens`` are set for trace workloads (used to build explicit per-chain
    service times, see :func:`experiments.sim.scenarios.service_matrix`).
    """

    arrivals: np.ndarray
    sizes: np.ndarray
    input_tokens: np.ndarray | None = None
    output_tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.arrivals.size)

    def head(self, n: int) -> "Jobs":
        cut = lambda a: None if a is None else a[:n]  # noqa: E731
        return Jobs(self.arrivals[:n], self.sizes[:n], cut(self.input_tokens), cut(self.output_tokens))


def poisson_jobs(rate: float, num_jobs: int, seed: int = 0) -> Jobs:
    """Poisson(λ) arrivals from t = 0 and i.i.d. Exp(1) sizes (§10.1), from ``numpy.random.default_rng(seed)``."""
    if not rate > 0:
        raise ValueError("arrival rate must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=num_jobs)
    sizes = rng.exponential(1.0, size=num_jobs)
    return Jobs(np.cumsum(gaps), sizes)


@dataclass(frozen=True)
class Trace:
    """The parsed Azure trace: seconds since the first request, input and output token counts."""

    offsets: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.offsets.size)


def load_trace(path: str | Path = AZURE_CODE_TRACE) -> Trace:
    """Read an Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``, §13.1).

    The 7-digit fractional seconds are truncated to 6 for ``datetime.fromisoformat``.
    """
    stamps, inputs, outputs = [], [], []
    with Path(path).open() as f:
        header = f.readline().strip().split(",")
        if header[:3] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ValueError(f"{path}: not an Azure LLM inference trace (header {header})")
        for line in f:
            line = line.strip()
            if not line:
                continue
            ts, ctx, gen = line.split(",")[:3]
            if "." in ts:
                head, frac = ts.split(".")
                ts = f"{head}.{frac[:6]}"
            stamps.append(datetime.fromisoformat(ts).timestamp())
            inputs.append(int(ctx))
            outputs.append(int(gen))
    t = np.asarray(stamps, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t = t[order]
    return Trace(t - t[0], np.asarray(inputs, dtype=np.int64)[order], np.asarray(outputs, dtype=np.int64)[order])


def trace_jobs(trace: Trace, *, rate_scale: float = 1.0, num_jobs: int | None = None,
               max_length: int | None = None, max_new_tokens: int | None = None) -> Jobs:
    """Replay a trace: job i arrives at (t_i − t_0)/``rate_scale`` (§13.1).

    Sizes are set to 1 (use explicit service times from the token counts, or ``size`` × T_k if you want
    the paper's mean-time model). ``max_length`` left-truncates prompts to ``max_length − max_new_tokens``
    (§15.9; default: no truncation).
    """
    n = len(trace) if num_jobs is None else min(num_jobs, len(trace))
    inputs = trace.input_tokens[:n].copy()
    if max_length is not None:
        budget = max_length - (max_new_tokens or 0)
        inputs = np.minimum(inputs, budget)
    return Jobs(trace.offsets[:n] / rate_scale, np.ones(n), inputs, trace.output_tokens[:n].copy())


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    mean: float
    median: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: np.ndarray) -> "Stats":
        if values.size == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, nan)
        q = np.percentile(values, [50, 95, 99])
        return cls(float(values.mean()), float(q[0]), float(q[1]), float(q[2]), float(values.max()))

    def to_dict(self) -> dict:
        return {"mean": self.mean, "median": self.median, "p95": self.p95, "p99": self.p99, "max": self.max}


@dataclass(frozen=True)
class Summary:
    """Response = completion − arrival, waiting = start − arrival, service = completion − start (§11.4)."""

    response: Stats
    waiting: Stats
    service: Stats
    jobs: int
    """Jobs counted (after warm-up)."""

    def to_dict(self) -> dict:
        return {"jobs": self.jobs, "response": self.response.to_dict(), "waiting": self.waiting.to_dict(),
                "service": self.service.to_dict()}


@dataclass(frozen=True)
class SimResult:
    """Per-job times of one run (arrays aligned with the workload's jobs)."""

    arrival: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    chain: np.ndarray
    """Chain index each job ran on (−1 for routing simulations without chains)."""

    @property
    def response(self) -> np.ndarray:
        return self.finish - self.arrival

    @property
    def waiting(self) -> np.ndarray:
        return self.start - self.arrival

    @property
    def service(self) -> np.ndarray:
        return self.finish - self.start

    def summary(self, warmup: float = DEFAULT_WARMUP) -> Summary:
        """Statistics over the jobs after the first ``warmup`` fraction (by arrival order)."""
        skip = int(len(self.arrival) * warmup)
        sl = slice(skip, None)
        resp = (self.finish - self.arrival)[sl]
        wait = (self.start - self.arrival)[sl]
        serv = (self.finish - self.start)[sl]
        return Summary(Stats.of(resp), Stats.of(wait), Stats.of(serv), int(resp.size))

    def mean_response(self, warmup: float = DEFAULT_WARMUP) -> float:
        skip = int(len(self.arrival) * warmup)
        return float((self.finish[skip:] - self.arrival[skip:]).mean())


# ------------------------------------------------------------------------------------------------
# The chain simulator
# ------------------------------------------------------------------------------------------------


def simulate_chains(
    service_times: Sequence[float],
    capacities: Sequence[int],
    jobs: Jobs,
    policy: str = "jffc",
    *,
    seed: int = 0,
    service_matrix: np.ndarray | None = None,
) -> SimResult:
    """Simulate ``jobs`` on chains (fastest first) with mean times T_k and capacities c_k under ``policy``.

    A job of size r runs r·T_k on chain k; with ``service_matrix`` (shape jobs × chains) job i runs
    ``service_matrix[i, k]`` instead. ``seed`` drives randomized policies (JSQ ties, JIQ, random).
    Every job is simulated to completion (there is no horizon), so an overloaded system shows growing
    waits rather than lost jobs.
    """
    T = [float(t) for t in service_times]
    caps = [int(c) for c in capacities]
    if len(T) != len(caps) or not T:
        raise ValueError("need one capacity per chain and at least one chain")
    if sum(caps) == 0:
        raise ValueError("every chain has capacity 0")
    n = len(jobs)
    arrivals = jobs.arrivals.tolist()
    if service_matrix is not None:
        service_matrix = np.asarray(service_matrix, dtype=np.float64)
        if service_matrix.shape != (n, len(T)):
            raise ValueError(f"service_matrix must have shape {(n, len(T))}")
        durations = service_matrix.tolist()
    else:
        sizes = jobs.sizes.tolist()
        durations = None
    start = [0.0] * n
    finish = [0.0] * n
    chain_of = [-1] * n
    if policy == "jffc":
        _run_jffc(T, caps, arrivals, sizes if durations is None else None, durations, start, finish, chain_of)
    else:
        rates = [1.0 / t for t in T]
        disp = make_dispatcher(policy, rates, caps, seed=seed)
        _run_generic(disp, T, arrivals, sizes if durations is None else None, durations, start, finish, chain_of)
    return SimResult(jobs.arrivals.copy(), np.asarray(start), np.asarray(finish), np.asarray(chain_of))


def _run_generic(disp, T, arrivals, sizes, durations, start, finish, chain_of) -> None:
    """Any :mod:`planner.dispatch` policy through its ``arrive``/``complete`` interface."""
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop
    arrive, complete = disp.arrive, disp.complete
    n = len(arrivals)
    i = 0
    inf = float("inf")
    next_arrival = arrivals[0] if n else inf
    while heap or i < n:
        if heap and heap[0][0] <= next_arrival:
            t, job, k = pop(heap)
            finish[job] = t
            started = complete(k)
            if started is not None:
                j = started.job
                start[j] = t
                chain_of[j] = k
                push(heap, (t + (sizes[j] * T[k] if durations is None else durations[j][k]), j, k))
        else:
            t = next_arrival
            k = arrive(i)
            if k is not None:
                start[i] = t
                chain_of[i] = k
                push(heap, (t + (sizes[i] * T[k] if durations is None else durations[i][k]), i, k))
            i += 1
            next_arrival = arrivals[i] if i < n else inf


def _run_jffc(T, caps, arrivals, sizes, durations, start, finish, chain_of) -> None:
    """JFFC inlined (same rules as :class:`planner.dispatch.JFFC`, cross-checked in the tests): the
    fastest chain with a free slot on arrival, else the central FIFO queue; on a completion the queue
    head starts on the chain that just freed."""
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop
    free = [k for k, c in enumerate(caps) if c > 0]  # min-heap of chains with a free slot
    running = [0] * len(caps)
    queue: list = []  # central FIFO as a list + head index (no deque method lookups)
    qhead = 0
    n = len(arrivals)
    i = 0
    inf = float("inf")
    next_arrival = arrivals[0] if n else inf
    while heap or i < n:
        if heap and heap[0][0] <= next_arrival:
            t, job, k = pop(heap)
            finish[job] = t
            if qhead < len(queue):
                j = queue[qhead]
                qhead += 1
                start[j] = t
                chain_of[j] = k
                push(heap, (t + (sizes[j] * T[k] if durations is None else durations[j][k]), j, k))
            else:
                if running[k] == caps[k]:
                    push(free, k)
                running[k] -= 1
        else:
            t = next_arrival
            if free:
                k = free[0]
                running[k] += 1
                if running[k] == caps[k]:
                    pop(free)
                start[i] = t
                chain_of[i] = k
                push(heap, (t + (sizes[i] * T[k] if durations is None else durations[i][k]), i, k))
            else:
                queue.append(i)
            i += 1
            next_arrival = arrivals[i] if i < n else inf


def reference_jffc(service_times: Sequence[float], capacities: Sequence[int], jobs: Jobs) -> SimResult:
    """The same simulation driven through :class:`planner.dispatch.JFFC` (for cross-checking the inlined
    loop)."""
    T = [float(t) for t in service_times]
    n = len(jobs)
    start, finish, chain_of = [0.0] * n, [0.0] * n, [-1] * n
    disp = JFFC([1.0 / t for t in T], [int(c) for c in capacities])
    _run_generic(disp, T, jobs.arrivals.tolist(), jobs.sizes.tolist(), None, start, finish, chain_of)
    return SimResult(jobs.arrivals.copy(), np.asarray(start), np.asarray(finish), np.asarray(chain_of))


def monte_carlo(service_times: Sequence[float], capacities: Sequence[int], arrival_rate: float, *,
                runs: int, num_jobs: int, policy: str = "jffc", seed0: int = 0,
                warmup: float = DEFAULT_WARMUP) -> list[Summary]:
    """``runs`` independent Poisson/Exp runs (job seeds ``seed0 .. seed0 + runs − 1``)."""
    out = []
    for r in range(runs):
        jobs = poisson_jobs(arrival_rate, num_jobs, seed=seed0 + r)
        out.append(simulate_chains(service_times, capacities, jobs, policy, seed=seed0 + r).summary(warmup))
    return out
