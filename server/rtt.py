"""The server's round-trip time to its orchestrator (the profile's *communication* part, :mod:`server.profiling`).

The orchestrator's peer is found through its signed DHT record (:func:`swarm.trust.records.fetch_orchestrator`) and
pinged over the swarm; :class:`RttMonitor` keeps the figure current while the server runs, and says so when it finds
no orchestrator at all.
"""
from __future__ import annotations

import contextlib
import logging
import math
import statistics
import threading
import time
from functools import partial
from typing import Optional

logger = logging.getLogger(__name__)


def measure_rtt(dht, peer_id: str, *, pings: int = 3, timeout: float = 2.0) -> Optional[float]:
    """Median round-trip time (s) of ``pings`` DHT pings to ``peer_id`` (base58) over the swarm, or None
    when the peer does not answer."""
    from swarm.model.compat import petals  # noqa: F401
    from hivemind.p2p import PeerID
    from petals.utils.ping import ping

    try:
        target = PeerID.from_base58(peer_id)
    except Exception:
        logger.warning("orchestrator peer id %r is not a valid base58 peer id", peer_id)
        return None
    samples = []
    for _ in range(max(1, pings)):
        with contextlib.suppress(Exception):
            rtt = dht.run_coroutine(partial(ping, target, wait_timeout=timeout))
            if rtt is not None and math.isfinite(rtt):
                samples.append(float(rtt))
    return statistics.median(samples) if samples else None


def _orchestrator(dht, dht_prefix: str, orchestrator_key: Optional[bytes]):
    from swarm.trust.records import fetch_orchestrator

    try:  # a copy a few seconds old does here: the record only names the peer to ping
        return fetch_orchestrator(dht, dht_prefix, orchestrator_key, latest=False)
    except Exception as exc:
        logger.debug("could not read the orchestrator record: %s", exc)
        return None


def _rtt_to(dht, peer_id: str, **options) -> Optional[float]:
    if peer_id == dht.peer_id.to_base58():
        return 0.0
    return measure_rtt(dht, peer_id, **options)


class RttMonitor(threading.Thread):
    """Keeps ``rtt_s``, the RTT to the orchestrator, up to date.

    The orchestrator record is read every ``check_period`` s, and every ``search_period`` s while no
    orchestrator is known (a server has no RTT and cannot be planned until it finds one, so it looks more
    often then); the orchestrator is pinged when it first appears, when its peer changes and every ``period``
    s. A failed ping keeps the last value (a lost packet must not make the server look unplannable);
    ``rtt_s`` returns to None only after the record has been missing ``forget_after`` times in a row. No orchestrator
    for ``warn_after`` s (another checkpoint's DHT prefix, say) is logged, again every ``warn_every`` s.
    """

    def __init__(self, dht, dht_prefix: str, *, period: float = 30.0, check_period: float = 2.0,
                 search_period: float = 0.5, forget_after: int = 3, on_change=None, orchestrator_key=lambda: None,
                 warn_after: float = 30.0, warn_every: float = 300.0, **ping_options):
        super().__init__(name="orchestrator-rtt", daemon=True)
        self.orchestrator_key = orchestrator_key  # () -> the key the orchestrator record must be signed by
        self.dht, self.dht_prefix = dht, dht_prefix
        self.period, self.check_period, self.forget_after = period, check_period, forget_after
        self.search_period = min(search_period, check_period)
        self.on_change, self.ping_options = on_change, ping_options
        self.warn_after, self.warn_every = warn_after, warn_every
        self.rtt_s: Optional[float] = None
        self.orchestrator_peer: Optional[str] = None
        self.stop_event = threading.Event()

    def _set(self, rtt: Optional[float]) -> None:
        changed, self.rtt_s = rtt != self.rtt_s, rtt
        if changed and self.on_change is not None:
            self.on_change(rtt)

    def _warn_missing(self, missing_s: float) -> None:
        pinned = " signed by the pinned orchestrator key" if self.orchestrator_key() is not None else ""
        logger.warning("no orchestrator%s found under DHT prefix %r for %.0f s, still waiting: an orchestrator plans "
                       "only servers of its own checkpoint (the prefix is the model folder's name) reachable through "
                       "--initial-peers", pinned, self.dht_prefix, missing_s)

    def run(self) -> None:
        misses, measured_at = 0, -math.inf
        missing_since, next_warning = time.monotonic(), self.warn_after  # (s missing at the next warning)
        while not self.stop_event.is_set():
            info = _orchestrator(self.dht, self.dht_prefix, self.orchestrator_key())
            if info is None:
                misses += 1
                if misses >= self.forget_after and self.rtt_s is not None:
                    self.orchestrator_peer = None
                    self._set(None)
                missing_s = time.monotonic() - missing_since
                if self.orchestrator_peer is None and missing_s >= next_warning:
                    self._warn_missing(missing_s)
                    next_warning = missing_s + self.warn_every
            else:
                misses, missing_since, next_warning = 0, time.monotonic(), self.warn_after
                if info.peer_id != self.orchestrator_peer or time.monotonic() - measured_at >= self.period:
                    rtt = _rtt_to(self.dht, info.peer_id, **self.ping_options)
                    if rtt is not None:
                        self.orchestrator_peer, measured_at = info.peer_id, time.monotonic()
                        self._set(rtt)
            self.stop_event.wait(self.check_period if self.orchestrator_peer is not None else self.search_period)

    def stop(self) -> None:
        self.stop_event.set()
