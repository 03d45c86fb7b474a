"""Blocking calls off the event loop, each waited for a bounded time (the orchestrator's DHT reads and writes).

``asyncio.to_thread`` alone waits as long as the call takes: one DHT call that never returns stops the
orchestrator's control loop for good (no re-plan, no failover, the servers' assignments unrefreshed), while its
HTTP API goes on answering. :class:`BoundedCall` runs one call of a kind at a time in a thread and waits for it
at most ``timeout_s``; a call still running then raises :class:`CallTimeout` and is not started again — the next
wait picks up the same call — so a hung call costs one thread, not one per refresh.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional


class CallTimeout(RuntimeError):
    """The call did not return within the bound; it goes on in its thread."""


class BoundedCall:
    def __init__(self, what: str, timeout_s: float):
        self.what, self.timeout_s = what, float(timeout_s)
        self._running: Optional[asyncio.Future] = None
        self.timeouts = 0  # waits that ran out (the status and tests read it)

    @property
    def idle(self) -> bool:
        """No earlier call is still running: the next call runs the function it is given."""
        return self._running is None

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a thread (or the result of the one still running, which ``fn`` then does not
        replace), within ``timeout_s``."""
        if self._running is None:
            self._running = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        running = self._running
        try:
            return await asyncio.wait_for(asyncio.shield(running), self.timeout_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            raise CallTimeout(f"{self.what} has not returned after {self.timeout_s:.0f} s") from None
        finally:
            if running.done():
                self._running = None
