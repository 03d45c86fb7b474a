"""A short rolling history of the service each client received: the dashboard's fairness chart.

The orchestrator calls :meth:`ServiceHistory.sample` on every refresh with the fairness scheduler's
cumulative service per client; one sample is kept per ``period_s`` at most, holding the service each client
received since the previous sample (only clients that received some). Memory is bounded: at most
``samples`` samples of at most ``clients_per_sample`` clients each (the largest shares; the rest are summed
under ``other``).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping

OTHER = "other"


class ServiceHistory:
    def __init__(self, period_s: float = 2.0, samples: int = 150, clients_per_sample: int = 8):
        if period_s <= 0 or samples < 1 or clients_per_sample < 1:
            raise ValueError("period_s must be > 0, samples and clients_per_sample >= 1")
        self.period_s = period_s
        self.clients_per_sample = clients_per_sample
        self._samples: deque[tuple[float, dict[str, float]]] = deque(maxlen=samples)
        self._last: dict[str, float] = {}
        self._last_time: float | None = None

    def sample(self, now: float, service: Mapping[str, float]) -> bool:
        """Record the service received since the last sample (``service`` is cumulative per client).
        Returns whether a sample was taken (at most one per ``period_s``)."""
        if self._last_time is not None and now - self._last_time < self.period_s:
            return False
        deltas = {}
        for client, total in service.items():
            delta = float(total) - self._last.get(client, 0.0)
            if math.isfinite(delta) and delta > 0:
                deltas[str(client)] = delta
        self._last = {str(c): float(v) for c, v in service.items()}
        if self._last_time is not None:  # the first call only sets the baseline
            top = sorted(deltas.items(), key=lambda kv: -kv[1])
            kept = dict(top[:self.clients_per_sample])
            rest = sum(v for _, v in top[self.clients_per_sample:])
            if rest > 0:
                kept[OTHER] = kept.get(OTHER, 0.0) + rest
            self._samples.append((now, kept))
        self._last_time = now
        return True

    def to_dict(self) -> dict[str, Any]:
        """``{"period_s", "samples": [{"time", "service": {client: service in that period}}]}``, oldest first
        (``time`` is when the period ended, in the clock the caller samples with)."""
        return {"period_s": self.period_s,
                "samples": [{"time": t, "service": dict(s)} for t, s in self._samples]}
