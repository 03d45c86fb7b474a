"""Online load balancing over composed chains: JFFC (spec §7, Alg. 3) and the baselines of §12.4.

All dispatchers share one event-driven interface, used by the orchestrator and by the simulator:

* ``arrive(job) -> int | None``: a job arrives; returns the chain index it **starts on now**, or None if it
  waits (in the central queue, or in a chain's dedicated queue for JSQ/SA-JSQ/SED/JIQ).
* ``complete(chain) -> Started | None``: a job on ``chain`` finished; returns the waiting job that starts
  now (always on that same chain) or None.
* ``state() -> DispatchState``: occupancy snapshot.

Chains are indexed 0..K−1 **fastest first** (GCA's order; the spec's chain 1 is index 0). Dispatchers use
only occupancy counts, never job sizes. Each job is held on its chain from start to completion (no
migration); every queue is FIFO.

JFFC keeps a min-heap of the indices of chains with a free slot, so ``arrive`` and ``complete`` cost
O(log K). The baselines scan all chains, O(K) per arrival.
"""
from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Sequence

POLICIES = ("jffc", "jsq", "sa-jsq", "sed", "jiq", "random")


@dataclass(frozen=True)
class Started:
    """A queued job that starts now on ``chain``."""

    job: Hashable
    chain: int


@dataclass(frozen=True)
class DispatchState:
    """Snapshot: jobs running per chain, jobs waiting per chain (dedicated queues) and centrally."""

    running: tuple[int, ...]
    """Z_k without queue: jobs in service on chain k (≤ c_k)."""
    chain_queues: tuple[int, ...]
    """Jobs waiting in chain k's dedicated queue (always 0 for central-queue policies)."""
    central_queue: int
    """Jobs waiting in the central FIFO queue (always 0 for dedicated-queue policies)."""

    @property
    def in_system(self) -> int:
        return sum(self.running) + sum(self.chain_queues) + self.central_queue


class Dispatcher:
    """Common state and checks; subclasses implement ``arrive``."""

    name = "base"

    def __init__(self, rates: Sequence[float], capacities: Sequence[int]):
        if len(rates) != len(capacities):
            raise ValueError("rates and capacities differ in length")
        for k, (mu, cap) in enumerate(zip(rates, capacities)):
            if not mu > 0:
                raise ValueError(f"chain {k}: rate must be > 0")
            if int(cap) != cap or cap < 0:
                raise ValueError(f"chain {k}: capacity must be an integer >= 0")
        for k in range(1, len(rates)):
            if rates[k] > rates[k - 1]:
                raise ValueError("chains must be ordered fastest first (nonincreasing rates)")
        self.rates = tuple(float(r) for r in rates)
        self.capacities = tuple(int(c) for c in capacities)
        self._running = [0] * len(self.rates)

    @classmethod
    def from_chains(cls, chains, **kwargs):
        """Build from planner chains (anything with ``.rate`` and ``.capacity``), already fastest first."""
        return cls([ch.rate for ch in chains], [ch.capacity for ch in chains], **kwargs)

    def arrive(self, job: Hashable) -> int | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def complete(self, chain: int) -> Started | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def state(self) -> DispatchState:  # pragma: no cover - abstract
        raise NotImplementedError


class JFFC(Dispatcher):
    """Join-the-Fastest-Free-Chain with a central FIFO queue (Alg. 3).

    Arrival: start on the smallest index k with Z_k < c_k (= the fastest free chain; equal rates → lowest
    index), else append to the queue. Completion on k: the queue head starts on k, else Z_k −= 1.
    Invariant: the queue is non-empty only when every chain is full.
    """

    name = "jffc"

    def __init__(self, rates: Sequence[float], capacities: Sequence[int]):
        super().__init__(rates, capacities)
        self._free = [k for k, cap in enumerate(self.capacities) if cap > 0]  # sorted ⇒ already a heap
        self._queue: deque = deque()

    def arrive(self, job: Hashable) -> int | None:
        free = self._free
        if free:
            k = free[0]
            self._running[k] += 1
            if self._running[k] == self.capacities[k]:
                heapq.heappop(free)
            return k
        self._queue.append(job)
        return None

    def complete(self, chain: int) -> Started | None:
        running = self._running
        if running[chain] <= 0:
            raise ValueError(f"chain {chain} has no running job")
        if self._queue:
            return Started(self._queue.popleft(), chain)
        if running[chain] == self.capacities[chain]:
            heapq.heappush(self._free, chain)
        running[chain] -= 1
        return None

    def state(self) -> DispatchState:
        return DispatchState(tuple(self._running), tuple(0 for _ in self._running), len(self._queue))


class RandomFree(Dispatcher):
    """Uniformly random chain with a free slot; if all are full, the central FIFO queue (§12.4 "Random")."""

    name = "random"

    def __init__(self, rates: Sequence[float], capacities: Sequence[int], *, seed: int = 0):
        super().__init__(rates, capacities)
        self._rng = random.Random(seed)
        self._queue: deque = deque()

    def arrive(self, job: Hashable) -> int | None:
        free = [k for k, z in enumerate(self._running) if z < self.capacities[k]]
        if free:
            k = free[self._rng.randrange(len(free))]
            self._running[k] += 1
            return k
        self._queue.append(job)
        return None

    def complete(self, chain: int) -> Started | None:
        if self._running[chain] <= 0:
            raise ValueError(f"chain {chain} has no running job")
        if self._queue:
            return Started(self._queue.popleft(), chain)
        self._running[chain] -= 1
        return None

    def state(self) -> DispatchState:
        return DispatchState(tuple(self._running), tuple(0 for _ in self._running), len(self._queue))


class _DedicatedQueues(Dispatcher):
    """Policies that commit each job to one chain; a job assigned to a full chain waits in its FIFO."""

    def __init__(self, rates: Sequence[float], capacities: Sequence[int], *, seed: int = 0):
        super().__init__(rates, capacities)
        if not any(c > 0 for c in self.capacities):
            raise ValueError("at least one chain needs capacity > 0")
        self._rng = random.Random(seed)
        self._queues: list[deque] = [deque() for _ in self.rates]

    def occupancy(self, k: int) -> int:
        """Z_k: jobs at chain k, running plus queued there."""
        return self._running[k] + len(self._queues[k])

    def choose(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def arrive(self, job: Hashable) -> int | None:
        k = self.choose()
        if self._running[k] < self.capacities[k]:
            self._running[k] += 1
            return k
        self._queues[k].append(job)
        return None

    def complete(self, chain: int) -> Started | None:
        if self._running[chain] <= 0:
            raise ValueError(f"chain {chain} has no running job")
        if self._queues[chain]:
            return Started(self._queues[chain].popleft(), chain)
        self._running[chain] -= 1
        return None

    def state(self) -> DispatchState:
        return DispatchState(tuple(self._running), tuple(len(q) for q in self._queues), 0)

    def _jsq_metric(self, k: int) -> float:
        """(Z_k − c_k + 1)+ / c_k; chains with c_k = 0 are never chosen."""
        cap = self.capacities[k]
        if cap == 0:
            return float("inf")
        return max(self.occupancy(k) - cap + 1, 0) / cap


class JSQ(_DedicatedQueues):
    """Join-the-shortest-queue: argmin (Z_k − c_k + 1)+/c_k, ties uniformly at random (speed-blind)."""

    name = "jsq"

    def choose(self) -> int:
        metrics = [self._jsq_metric(k) for k in range(len(self.rates))]
        low = min(metrics)
        ties = [k for k, v in enumerate(metrics) if v == low]
        return ties[self._rng.randrange(len(ties))] if len(ties) > 1 else ties[0]


class SAJSQ(_DedicatedQueues):
    """Speed-aware JSQ (JFSQ): the JSQ metric, ties to the largest μ_k (then the lowest index)."""

    name = "sa-jsq"

    def choose(self) -> int:
        return min(range(len(self.rates)), key=lambda k: (self._jsq_metric(k), -self.rates[k], k))


class SED(_DedicatedQueues):
    """Smallest expected delay: argmin 1/μ_k + (Z_k − c_k + 1)+/(μ_k·c_k), ties to the lowest index."""

    name = "sed"

    def choose(self) -> int:
        def delay(k: int) -> float:
            cap = self.capacities[k]
            if cap == 0:
                return float("inf")
            mu = self.rates[k]
            return 1.0 / mu + max(self.occupancy(k) - cap + 1, 0) / (mu * cap)

        return min(range(len(self.rates)), key=lambda k: (delay(k), k))


class JIQ(_DedicatedQueues):
    """Join-idle-queue: a uniformly random chain with a free slot; if none, a uniformly random chain."""

    name = "jiq"

    def choose(self) -> int:
        free = [k for k, z in enumerate(self._running) if z < self.capacities[k]]
        pool = free or [k for k, c in enumerate(self.capacities) if c > 0]
        return pool[self._rng.randrange(len(pool))]


_CLASSES = {"jffc": JFFC, "jsq": JSQ, "sa-jsq": SAJSQ, "sed": SED, "jiq": JIQ, "random": RandomFree}


def make_dispatcher(
    policy: str, rates: Sequence[float], capacities: Sequence[int], *, seed: int = 0
) -> Dispatcher:
    """Build a dispatcher by name (one of ``POLICIES``); ``seed`` drives the randomized policies."""
    try:
        cls = _CLASSES[policy]
    except KeyError:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}") from None
    if cls is JFFC:
        return JFFC(rates, capacities)
    return cls(rates, capacities, seed=seed)
