"""Deficit and stickiness counters (DLPM §6, DoubleQ/D2LPM §7.2, swarm §14.3).

Two small state objects, shared by the central-queue schedulers and by the
paper-form DoubleQ router:

* ``DeficitCounters`` — one deficit q[i] per client with quantum Q^u, refilled
  in rounds (DRR style) only when no eligible client has credit left; the loop
  form recommended in §15 Q6.
* ``StickinessQuanta`` — one counter d[i][k] per (client, chain/worker) with
  quantum Q^w; when a client has no chain with d > 0, every chain is refilled.
"""

from __future__ import annotations

import math
from typing import Hashable, Iterable, Mapping

from .types import UnknownClientError


class DeficitCounters:
    """Per-client deficits q[i] with quantum Q^u and refill counts K[i].

    Invariants (Thm A.1): q[i] <= quantum * weight(i) always, because only
    clients with q <= 0 are refilled; q[i] > -U when admissions require q > 0.
    The client list only grows (§15 Q5, [DLPM] Alg. 1) — idle clients with
    q <= 0 keep being refilled up to the quantum, so banking is bounded by Q^u.
    Call ``forget`` to garbage-collect clients idle for a long time.
    """

    def __init__(self, quantum: float, client_weights: Mapping[Hashable, float] | None = None) -> None:
        if not quantum > 0:
            raise ValueError(f"deficit quantum must be > 0, got {quantum!r}")
        self.quantum = float(quantum)
        self._weights = dict(client_weights or {})
        self.deficit: dict[Hashable, float] = {}
        self.refills: dict[Hashable, int] = {}
        self.refill_rounds = 0

    def register(self, client: Hashable) -> None:
        if client not in self.deficit:
            self.deficit[client] = 0.0
            self.refills[client] = 0

    def forget(self, client: Hashable) -> None:
        self.deficit.pop(client, None)
        self.refills.pop(client, None)

    def weight(self, client: Hashable) -> float:
        return self._weights.get(client, 1.0)

    def set_weight(self, client: Hashable, weight: float) -> None:
        if not weight > 0:
            raise ValueError("client weight must be > 0")
        self._weights[client] = float(weight)

    def __getitem__(self, client: Hashable) -> float:
        try:
            return self.deficit[client]
        except KeyError:
            raise UnknownClientError(client, "deficit lookup") from None

    def set(self, client: Hashable, value: float) -> None:
        """Restore a persisted deficit (or set up a test state)."""
        self.register(client)
        self.deficit[client] = float(value)

    def charge(self, client: Hashable, amount: float) -> None:
        if client not in self.deficit:
            raise UnknownClientError(client, "deficit charge")
        self.deficit[client] -= amount

    def has_credit(self, client: Hashable) -> bool:
        return self.deficit[client] > 0

    def refill_until_credit(self, eligible: Iterable[Hashable]) -> int:
        """CHECKREFILL in loop form: while no eligible client has q > 0, add the
        quantum to every known client with q <= 0.  Returns the rounds run."""
        eligible = list(eligible)
        if not eligible:
            return 0
        rounds = 0
        while not any(self.deficit[c] > 0 for c in eligible):
            if math.isinf(self.quantum):
                for c in self.deficit:
                    if self.deficit[c] <= 0:
                        self.deficit[c] = math.inf
                        self.refills[c] += 1
            else:
                for c, value in self.deficit.items():
                    if value <= 0:
                        self.deficit[c] = value + self.quantum * self.weight(c)
                        self.refills[c] += 1
            rounds += 1
        self.refill_rounds += rounds
        return rounds


class StickinessQuanta:
    """Per-(client, chain) stickiness counters d[i][k] with quantum Q^w.

    DoubleQ's SelectWorker refill: when the client has no chain with d > 0,
    Q^w is added to d[i][k] for every chain, repeatedly, until one is positive.
    Charges (§15 Q12): full input at grant (w_e * len), w_q * o at finish.
    Q^w never enters a fairness bound; it only bounds how many consecutive
    requests of one client stick to a locality chain (E6).
    """

    def __init__(self, quantum: float) -> None:
        if not quantum > 0:
            raise ValueError(f"stickiness quantum must be > 0, got {quantum!r}")
        self.quantum = float(quantum)
        self._d: dict[Hashable, dict[Hashable, float]] = {}

    def value(self, client: Hashable, chain: Hashable) -> float:
        return self._d.get(client, {}).get(chain, 0.0)

    def set(self, client: Hashable, chain: Hashable, value: float) -> None:
        self._d.setdefault(client, {})[chain] = float(value)

    def charge(self, client: Hashable, chain: Hashable, amount: float) -> None:
        row = self._d.setdefault(client, {})
        row[chain] = row.get(chain, 0.0) - amount

    def available(self, client: Hashable, chains: Iterable[Hashable]) -> list:
        """Chains with d[client][k] > 0, refilling every chain first if there are none."""
        chains = list(chains)
        if not chains:
            return []
        row = self._d.setdefault(client, {})
        avail = [k for k in chains if row.get(k, 0.0) > 0]
        while not avail:
            for k in chains:
                row[k] = row.get(k, 0.0) + self.quantum
            avail = [k for k in chains if row[k] > 0]
        return avail

    def retain_chains(self, chains: Iterable[Hashable]) -> None:
        """After a re-plan keep d only for persisting chains (§15 Q19); new chains start at 0."""
        keep = set(chains)
        for row in self._d.values():
            for k in [k for k in row if k not in keep]:
                del row[k]

    def forget(self, client: Hashable) -> None:
        self._d.pop(client, None)
