"""petals' block announcer, whose last announcement cannot hang a stopping server.

A stopping petals 2.2 server announces its blocks OFFLINE and then joins the announcer thread, which makes that
announcement through the server's DHT process and waits for it without a bound. When the DHT process is already
gone, the wait never ends: a volunteer's Ctrl-C reaches every process of the terminal's process group, DHT
included, and so does systemd's default stop (SIGTERM to every process of the unit), so ``chainswarm server``
hung for good on its way out, its port and GPU held. :class:`BoundedAnnouncer` announces OFFLINE while the DHT
process lives and waits at most :data:`OFFLINE_WAIT_S` for it; without one it says so and goes on (the blocks'
records expire by themselves, and the orchestrator sees the server's profile record vanish).
"""
from __future__ import annotations

import logging
import time

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from petals.data_structures import ServerState
from petals.server.server import ModuleAnnouncerThread

logger = logging.getLogger(__name__)

OFFLINE_WAIT_S = 10.0  # one DHT store, normally milliseconds; past it the server stops without it
POLL_S = 0.05  # how often the wait looks whether the DHT process is still there


class BoundedAnnouncer(ModuleAnnouncerThread):
    """petals' announcer (a daemon thread) whose OFFLINE :meth:`announce` waits at most :data:`OFFLINE_WAIT_S`."""

    def announce(self, state: ServerState) -> None:
        if state != ServerState.OFFLINE:
            return super().announce(state)
        self.server_info.state = state
        self.trigger.set()
        deadline = time.monotonic() + OFFLINE_WAIT_S
        while self.is_alive() and time.monotonic() < deadline:
            if not _alive(self.dht):  # (a SIGTERM to the whole group reaches it as this waits)
                logger.warning("the DHT process has stopped: blocks %d:%d are not announced offline (their "
                               "records expire by themselves)", self.server_info.start_block,
                               self.server_info.end_block)
                return
            self.join(POLL_S)
        if self.is_alive():
            logger.warning("blocks %d:%d could not be announced offline within %.0f s (their records expire by "
                           "themselves)", self.server_info.start_block, self.server_info.end_block, OFFLINE_WAIT_S)


def _alive(process) -> bool:
    try:
        return process.is_alive()
    except AssertionError:  # not this process's child: it cannot tell, so it waits as petals does (bounded)
        return True


def install() -> None:
    """Make petals' ``ModuleContainer`` build a :class:`BoundedAnnouncer` (in the server process, before
    ``Server.run()``)."""
    import petals.server.server as server_module

    server_module.ModuleAnnouncerThread = BoundedAnnouncer
