"""FCFS (§2) and the RPM admission limit (§3)."""

from __future__ import annotations

from collections import deque
from typing import Hashable

from .base import CentralQueueScheduler


class FCFSScheduler(CentralQueueScheduler):
    """First come, first served: the oldest waiting request (global seq) gets the next
    slot.  With the default ``jffc`` chain mode this is the JFFC dispatcher of
    chain-composition.md §7; ``most_free`` gives [BFIO]'s multi-worker FCFS (§2.2).
    A request that fits no free chain is skipped, not waited for (§15 Q7)."""

    policy_name = "fcfs"

    def _select_next(self, candidates, best, now):
        return min(candidates, key=lambda r: r.seq)


class RPMLimitScheduler(FCFSScheduler):
    """Requests-per-minute limit, then FCFS (§3, §15 Q3).

    ``submit`` returns False (answer HTTP 429) when the client already had
    ``limit_rpm`` accepted requests with ``now - t <= window`` (rolling window,
    inclusive).  Rejected requests are not recorded.  ``fixed_window=True``
    counts within aligned windows [n*window, (n+1)*window) instead.
    Not work-conserving: requests over the limit are dropped even on idle chains.
    """

    policy_name = "rpm"

    def __init__(self, limit_rpm: int, *, window: float = 60.0, fixed_window: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        if limit_rpm < 1:
            raise ValueError("limit_rpm must be >= 1")
        self.limit_rpm = int(limit_rpm)
        self.window = float(window)
        self.fixed_window = fixed_window
        self._accepted: dict[Hashable, deque] = {}
        self.rejected: dict[Hashable, int] = {}

    def _accept(self, client, now):
        stamps = self._accepted.setdefault(client, deque())
        if self.fixed_window:
            start = (now // self.window) * self.window
            while stamps and stamps[0] < start:
                stamps.popleft()
        else:
            while stamps and now - stamps[0] > self.window:
                stamps.popleft()
        if len(stamps) >= self.limit_rpm:
            self.rejected[client] = self.rejected.get(client, 0) + 1
            return False
        stamps.append(now)
        return True
