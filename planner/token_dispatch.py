"""JFFC admitting by KV tokens: the orchestrator's grant rule, for the simulators.

The orchestrator (``--kv-admission tokens``, the default) gives chain k, besides its c_k session slots, a budget
B_k = c_k · slot_tokens of KV tokens per block, and a request needs n = its prompt + output cap in whole pages
(:meth:`planner.fairness.types.ChainSpec.kv_need`). A chain *admits* a request when it has a free slot and at least
n free tokens (``ChainState.admits``), and JFFC grants the fastest chain that admits it.

:class:`TokenJFFC` is that rule behind :mod:`planner.dispatch`'s event interface, with each job's need passed in:

* ``arrive(job, need)``: start on the fastest chain that admits it, else wait in the central FIFO queue;
* ``complete(chain, need)``: the job on ``chain`` ended and gave back its slot and tokens; the waiting jobs are
  offered the room in arrival order, each to the fastest chain that admits it, and the ones that start are
  returned — a job that fits nowhere yet does not hold back smaller ones behind it, as in the orchestrator's
  scheduler, which places each picked request on a chain that admits it and leaves the others queued.

With every need equal to the slot size (the papers' fixed-length sessions, B_k = c_k · need) it is exactly
:class:`planner.dispatch.JFFC`. Pure bookkeeping, no I/O.
"""
from __future__ import annotations

from collections import deque
from typing import Hashable, Sequence

from planner.dispatch import DispatchState, Started


class TokenJFFC:
    """JFFC over chains with slots and KV token budgets (see the module doc)."""

    name = "jffc-tokens"

    def __init__(self, rates: Sequence[float], capacities: Sequence[int], budgets: Sequence[int]):
        if not len(rates) == len(capacities) == len(budgets):
            raise ValueError("rates, capacities and budgets differ in length")
        if any(rates[k] > rates[k - 1] for k in range(1, len(rates))):
            raise ValueError("chains must be ordered fastest first (nonincreasing rates)")
        if any(int(c) != c or c < 0 for c in capacities) or any(b < 0 for b in budgets):
            raise ValueError("capacities and budgets must be >= 0 (capacities integers)")
        self.rates = tuple(float(r) for r in rates)
        self.capacities = tuple(int(c) for c in capacities)
        self.budgets = tuple(int(b) for b in budgets)
        self._running = [0] * len(self.rates)
        self._held = [0] * len(self.rates)
        self._queue: deque = deque()  # (job, need), arrival order

    def fits(self, need: int) -> bool:
        """Whether some chain could ever run a job of this need."""
        return any(c > 0 and need <= b for c, b in zip(self.capacities, self.budgets))

    def _admitting(self, need: int) -> int | None:
        for k, (cap, budget) in enumerate(zip(self.capacities, self.budgets)):
            if self._running[k] < cap and self._held[k] + need <= budget:
                return k
        return None

    def _start(self, k: int, need: int) -> int:
        self._running[k] += 1
        self._held[k] += need
        return k

    def arrive(self, job: Hashable, need: int) -> int | None:
        """The chain ``job`` starts on now, or None (it waits); ``ValueError`` when no chain could ever hold it."""
        if not self.fits(need):
            raise ValueError(f"a job needing {need} KV tokens fits no chain (budgets {self.budgets})")
        k = self._admitting(need)  # (no waiting job fits anywhere now: room only grows at completions)
        if k is None:
            self._queue.append((job, need))
            return None
        return self._start(k, need)

    def complete(self, chain: int, need: int) -> list[Started]:
        """The job on ``chain`` (needing ``need``) ended; returns the waiting jobs that start now."""
        if self._running[chain] <= 0 or self._held[chain] < need:
            raise ValueError(f"chain {chain} has no running job of {need} tokens")
        self._running[chain] -= 1
        self._held[chain] -= need
        started, waiting = [], deque()
        while self._queue:
            job, job_need = self._queue.popleft()
            k = self._admitting(job_need)
            if k is None:
                waiting.append((job, job_need))
            else:
                started.append(Started(job, self._start(k, job_need)))
        self._queue = waiting
        return started

    def state(self) -> DispatchState:
        return DispatchState(tuple(self._running), tuple(0 for _ in self._running), len(self._queue))

    def held(self) -> tuple[int, ...]:
        """KV tokens per block held on each chain now."""
        return tuple(self._held)
