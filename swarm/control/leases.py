"""Leases: chain slots handed to clients that drive petals themselves (``client.DirectSwarmModel``).

:class:`LeaseBook` keeps the granted leases: grant (a lease id, the granted chain's route and the session
length), lookup, renewal, release and expiry. A lease lives only while its holder uses it: it expires ``ttl_s``
after its grant or its last renewal (the holder renews it with a heartbeat, and every reroute renews it), so a
client that takes slots and vanishes holds them for at most one TTL. A lease may report failures only of the
peers on its own route, at most ``max_reroutes`` times. Pure bookkeeping: the orchestrator queues the request
before a grant and finishes it when its lease is released or expires.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Sequence

from swarm.control.planning import RoutableChain
from swarm.engine.routing import Lease, RouteSpan

MAX_REROUTES = 4  # failovers one lease may ask for (a session fails over once per failed server, rarely more)


class UnknownLeaseError(KeyError):
    pass


class LeaseMisuse(ValueError):
    """A lease asked for something it may not (another chain's peers, too many reroutes)."""


@dataclass
class LeaseRecord:
    lease: Lease
    request_id: str
    client_id: str
    granted_at: float
    expires_at: float
    peers: set[str] = field(default_factory=set)  # every peer the lease was routed through (grant and reroutes)
    reroutes: int = 0


class LeaseBook:
    def __init__(self, ttl_s: float, max_length: int, max_reroutes: int = MAX_REROUTES):
        if ttl_s <= 0:
            raise ValueError("the lease TTL must be positive")
        self.ttl_s, self.max_length, self.max_reroutes = ttl_s, max_length, max_reroutes
        self._leases: dict[str, LeaseRecord] = {}

    def grant(self, request_id: str, client_id: str, chain: RoutableChain, now: float) -> LeaseRecord:
        """A lease on ``chain`` for the granted request ``request_id``."""
        lease = Lease(uuid.uuid4().hex, chain.chain_id, chain.route, self.max_length)
        record = LeaseRecord(lease, request_id, client_id, now, now + self.ttl_s, {p for p, _, _ in chain.route})
        self._leases[lease.lease_id] = record
        return record

    def get(self, lease_id: str) -> LeaseRecord:
        try:
            return self._leases[lease_id]
        except KeyError:
            raise UnknownLeaseError(lease_id) from None

    def renew(self, lease_id: str, now: float) -> LeaseRecord:
        """The holder is still using the lease: it lives another TTL."""
        record = self.get(lease_id)
        record.expires_at = now + self.ttl_s
        return record

    def check_reroute(self, lease_id: str, failed_peers: Sequence[str]) -> LeaseRecord:
        """Validate a reroute request: only peers this lease was routed through, at most ``max_reroutes`` times."""
        record = self.get(lease_id)
        strangers = sorted(set(failed_peers) - record.peers)
        if strangers:
            raise LeaseMisuse(f"failed_peers must be peers of this lease's route; not on it: {strangers[:3]}")
        if record.reroutes >= self.max_reroutes:
            raise LeaseMisuse(f"this lease has been rerouted {record.reroutes} times (the bound); release it and "
                              "ask for a new one")
        return record

    def rerouted(self, lease_id: str, route: Sequence[RouteSpan], now: float) -> None:
        record = self.renew(lease_id, now)
        record.reroutes += 1
        record.peers.update(p for p, _, _ in route)

    def release(self, lease_id: str) -> LeaseRecord:
        """Forget the lease; its request is the caller's to finish."""
        record = self._leases.pop(lease_id, None)
        if record is None:
            raise UnknownLeaseError(lease_id)
        return record

    def expired(self, now: float) -> list[str]:
        """Ids of the leases past their expiry (still held: release them)."""
        return [lease_id for lease_id, record in self._leases.items() if record.expires_at < now]

    def held_by(self) -> dict[str, int]:
        """Leases held per client."""
        out: dict[str, int] = {}
        for record in self._leases.values():
            out[record.client_id] = out.get(record.client_id, 0) + 1
        return out

    def __len__(self) -> int:
        return len(self._leases)
