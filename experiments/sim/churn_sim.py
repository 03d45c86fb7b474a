"""JFFC over a chain set that changes while jobs run (issue 20, item 5: servers join, leave and reload).

experiments/sim/simulator.py keeps one chain set for a whole run; under churn the chains change whenever a
server leaves, finishes loading or starts reloading. Here the run is split into **epochs**: epoch i starts
at ``times[i]`` and serves with ``chains[i]`` (each chain: a hashable key — its servers and spans —, its
service time T_k and capacity c_k), until the next epoch starts.

At an epoch change, a running job whose chain (same key) is still there keeps running on it; if the
chain's capacity shrank below the jobs on it, the ones that started last are interrupted. A job whose
chain is gone is interrupted too (a server on it left or started loading other blocks). An interrupted
job loses its work and goes back to the head of the central queue (FIFO by arrival), to restart from
scratch. Dispatch is JFFC: an arriving job takes the fastest chain with a free slot, else waits in the
central queue, which is served at completions and at epoch changes. Deterministic.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np


@dataclass(frozen=True)
class EpochChain:
    key: Hashable
    """Identity across epochs (servers and processed spans)."""
    service_time: float
    capacity: int


@dataclass(frozen=True)
class ChurnRun:
    arrival: np.ndarray
    finish: np.ndarray
    restarts: np.ndarray
    """Times each job was interrupted and restarted."""

    @property
    def response(self) -> np.ndarray:
        return self.finish - self.arrival


def simulate_epochs(arrivals: Sequence[float], sizes: Sequence[float], times: Sequence[float],
                    chains: Sequence[Sequence[EpochChain]]) -> ChurnRun:
    """Serve the jobs (arrival times, sizes: a job of size r takes r·T_k on chain k) over the epochs.
    ``times[0]`` must be ≤ the first arrival. Jobs still unfinished after the last epoch's chains are
    gone (no chain) never finish: their finish time is inf."""
    n = len(arrivals)
    arrivals = np.asarray(arrivals, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64)
    finish = np.full(n, np.inf)
    restarts = np.zeros(n, dtype=np.int64)
    stamp = [0] * n  # invalidates a job's completion event when it is interrupted
    events: list[tuple[float, int, int]] = []  # (completion time, job, stamp)
    queue: list[int] = []  # heap of waiting jobs by index (= arrival order)
    running: dict[Hashable, list[tuple[float, int]]] = {}  # chain key -> [(start, job)]
    where: dict[int, Hashable] = {}
    current: list[EpochChain] = []

    def start(job: int, ch: EpochChain, now: float) -> None:
        running.setdefault(ch.key, []).append((now, job))
        where[job] = ch.key
        heapq.heappush(events, (now + sizes[job] * ch.service_time, job, stamp[job]))

    def free_chain() -> EpochChain | None:
        for ch in current:  # fastest first
            if len(running.get(ch.key, ())) < ch.capacity:
                return ch
        return None

    def drain(now: float) -> None:
        while queue:
            ch = free_chain()
            if ch is None:
                return
            start(heapq.heappop(queue), ch, now)

    def interrupt(job: int) -> None:
        stamp[job] += 1
        restarts[job] += 1
        del where[job]
        heapq.heappush(queue, job)

    def new_epoch(i: int) -> None:
        nonlocal current
        current = sorted(chains[i], key=lambda c: c.service_time)
        keep = {c.key: c.capacity for c in current}
        for key in list(running):
            jobs = sorted(running[key])
            cap = keep.get(key, 0)
            for _, job in jobs[cap:]:
                interrupt(job)
            if cap == 0 or not jobs[:cap]:
                del running[key]
            else:
                running[key] = jobs[:cap]
        drain(times[i])

    epoch, i = 0, 0
    new_epoch(0)
    while i < n or events or (queue and epoch + 1 < len(times)):
        t_arr = arrivals[i] if i < n else np.inf
        t_done = events[0][0] if events else np.inf
        t_epoch = times[epoch + 1] if epoch + 1 < len(times) else np.inf
        now = min(t_arr, t_done, t_epoch)
        if now == np.inf:
            break
        if t_done == now:  # completions first: a freed slot is visible to what happens at the same instant
            _, job, st = heapq.heappop(events)
            if st != stamp[job]:
                continue
            finish[job] = now
            key = where.pop(job)
            running[key] = [(s, j) for s, j in running[key] if j != job]
            drain(now)
        elif t_epoch == now:
            epoch += 1
            new_epoch(epoch)
        else:
            heapq.heappush(queue, i)
            drain(now)
            i += 1
    return ChurnRun(arrivals, finish, restarts)
