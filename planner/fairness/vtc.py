"""VTC: virtual token counter (§5), LCF (§5.5) and weighted VTC (§5.7)."""

from __future__ import annotations

from typing import Hashable, Mapping

from .base import CentralQueueScheduler
from .types import UnknownClientError

LIFT_RULES = ("recommended", "artifact", "none")


class VTCScheduler(CentralQueueScheduler):
    """Virtual token counter scheduling.

    Counters c[i] (``virtual_counter``) count weighted service: w_p * len(r) at
    admission (full input, per [VTC]) and w_q per generated token, each divided
    by the client's weight omega_i (weighted VTC).  The next slot goes to the
    queued client with the smallest counter (ties: seq of its head request, then
    first-seen order, §15 Q2); its oldest fitting request is admitted.

    Counter lift (§5.2) when a client with nothing queued sends a request:

    * ``recommended`` (§15 Q1, = the paper): lift to max(c_u, min over queued
      clients), or to c[last_left] when nothing is queued;
    * ``artifact``: lift to the min over queued clients only; no lift when the
      queue is empty ([VTC-code]);
    * ``none``: LCF — no lift (exploitable, E2).

    Deviation: a client whose head fits no free chain is skipped rather than
    stopping the round (§15 Q7), so the scheduler stays work-conserving.
    """

    policy_name = "vtc"

    def __init__(self, *, lift: str = "recommended", client_weights: Mapping[Hashable, float] | None = None, **kwargs):
        super().__init__(**kwargs)
        if lift not in LIFT_RULES:
            raise ValueError(f"unknown lift rule {lift!r}; expected one of {LIFT_RULES}")
        self.lift = lift
        self._weights = dict(client_weights or {})
        for w in self._weights.values():
            if not w > 0:
                raise ValueError("client weights must be > 0")
        self.virtual_counter: dict[Hashable, float] = {}
        self.last_left: Hashable | None = None

    def client_weight(self, client) -> float:
        return self._weights.get(client, 1.0)

    def set_client_weight(self, client, weight: float) -> None:
        if not weight > 0:
            raise ValueError("client weight must be > 0")
        self._weights[client] = float(weight)

    def counter(self, client) -> float:
        try:
            return self.virtual_counter[client]
        except KeyError:
            raise UnknownClientError(client, "counter") from None

    def set_counter(self, client, value: float) -> None:
        """Restore a persisted counter (or set up a test state); registers the client."""
        if client not in self._clients:
            self._clients[client] = len(self._clients)
            self._queues.setdefault(client, {})
            self._service.setdefault(client, 0.0)
            self._client_view_service.setdefault(client, 0.0)
        self.virtual_counter[client] = float(value)

    def _register_client(self, client):
        self.virtual_counter.setdefault(client, 0.0)

    def _export_counters(self):
        return {"virtual_counter": [[c, v] for c, v in self.virtual_counter.items()], "last_left": self.last_left}

    def _check_counters(self, counters, clients):
        [(c, float(v)) for c, v in counters["virtual_counter"]]
        counters["last_left"]

    def _import_counters(self, counters):
        from .snapshot import _key

        for client, value in counters["virtual_counter"]:
            self.virtual_counter[_key(client)] = float(value)
        last = counters["last_left"]
        self.last_left = None if last is None else _key(last)

    def _forget_client(self, client):
        self.virtual_counter.pop(client, None)

    def _before_enqueue(self, req, now):
        u = req.client_id
        if self._queues.get(u):
            return  # already queued: no lift
        if self.lift == "none":
            return
        queued = [c for c, q in self._queues.items() if q and c != u]
        if queued:
            target = min(self.virtual_counter[c] for c in queued)
        elif self.lift == "recommended" and self.last_left is not None and self.last_left in self.virtual_counter:
            target = self.virtual_counter[self.last_left]
        else:
            return
        self.virtual_counter[u] = max(self.virtual_counter[u], target)

    def _select_next(self, candidates, best, now):
        heads = {}
        for r in candidates:  # candidates are in seq order
            heads.setdefault(r.client_id, r)
        return min(
            heads.values(),
            key=lambda r: (self.virtual_counter[r.client_id], r.seq, self._clients[r.client_id]),
        )

    def _charge_pick(self, req, best_match, now):
        if req.recompute_free:
            return 0.0
        amount = self.weights.extend * req.input_tokens / self.client_weight(req.client_id)
        self.virtual_counter[req.client_id] += amount
        return amount

    def _refund_pick(self, req, amount):
        self.virtual_counter[req.client_id] -= amount

    def _charge_output(self, req, count):
        self.virtual_counter[req.client_id] += self.weights.output * count / self.client_weight(req.client_id)

    def _after_grant(self, req, now):
        if not self._queues[req.client_id]:
            self.last_left = req.client_id


class LCFScheduler(VTCScheduler):
    """Least counter first: VTC without the counter lift (§5.5)."""

    policy_name = "lcf"

    def __init__(self, **kwargs):
        kwargs.setdefault("lift", "none")
        super().__init__(**kwargs)
