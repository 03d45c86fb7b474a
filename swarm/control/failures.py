"""Who may take a server out of the chains: failure claims and their confirmation.

A session that sees a server fail asks for a reroute and names the peer. When the session is the orchestrator's
own (a proxied completion), that is evidence enough: the server is excluded at once. When it is a lease
holder's, it is only a claim — a client could name every server to trigger re-plans — so :class:`FailureClaims`
(the policy) excludes the server only when the claim is confirmed: by claims of ``quorum`` distinct clients
within ``window_s``, or by the orchestrator's own probe (:class:`DhtPing`, the mechanism) failing to reach it.
The claiming client's own session is rerouted around the peer either way.
"""
from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger(__name__)


class FailureClaims:
    def __init__(self, quorum: int = 2, window_s: float = 60.0, max_tracked: int = 1024):
        self.quorum, self.window_s, self.max_tracked = quorum, window_s, max_tracked
        self._claims: dict[str, dict[str, float]] = {}  # node -> {client: time of its latest claim}

    def claim(self, node: str, client: str, now: float) -> bool:
        """Record ``client``'s claim that ``node`` failed; True when distinct clients confirm it."""
        recent = {c: t for c, t in self._claims.get(node, {}).items() if now - t <= self.window_s}
        recent[client] = now
        self._claims[node] = recent
        if len(self._claims) > self.max_tracked:  # bounded: drop the node claimed longest ago
            oldest = min(self._claims, key=lambda n: max(self._claims[n].values(), default=0.0))
            self._claims.pop(oldest, None)
        return len(recent) >= self.quorum

    def forget(self, node: str) -> None:
        self._claims.pop(node, None)

    def pending(self) -> int:
        return len(self._claims)


class DhtPing:
    """The orchestrator's probe: a DHT ping of the server's peer (petals' own ``ping``); blocking, run it in a
    thread. ``dht`` is a running ``hivemind.DHT``; anything else cannot probe (the claim stays unconfirmed)."""

    def __init__(self, dht: Any, timeout_s: float = 5.0):
        self.dht, self.timeout_s = dht, timeout_s

    def reachable(self, peer_id: str) -> bool:
        if not hasattr(self.dht, "run_coroutine"):
            return True
        from functools import partial

        from hivemind import PeerID

        from swarm.model.compat import petals  # noqa: F401 (the shim before any petals import)
        from petals.utils.ping import ping

        try:
            rtt = self.dht.run_coroutine(partial(ping, PeerID.from_base58(peer_id), wait_timeout=self.timeout_s))
        except Exception as exc:  # a malformed id or a DHT that is shutting down: not evidence of a failure
            logger.warning("could not probe %s: %s", peer_id, exc)
            return True
        return math.isfinite(rtt)
