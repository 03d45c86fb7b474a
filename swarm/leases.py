"""Leases: chain slots handed to clients that drive petals themselves (``client.DirectSwarmModel``).

:class:`LeaseBook` keeps the granted leases: grant (a lease id, the granted chain's route and the session
length), lookup, release and expiry after ``timeout_s``. Pure bookkeeping: the orchestrator queues the request
before a grant and finishes it when its lease is released or expires.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from swarm.planning import RoutableChain
from swarm.routing import Lease


class UnknownLeaseError(KeyError):
    pass


@dataclass
class LeaseRecord:
    lease: Lease
    request_id: str
    client_id: str
    granted_at: float
    expires_at: float


class LeaseBook:
    def __init__(self, timeout_s: float, max_length: int):
        self.timeout_s, self.max_length = timeout_s, max_length
        self._leases: dict[str, LeaseRecord] = {}

    def grant(self, request_id: str, client_id: str, chain: RoutableChain, now: float) -> LeaseRecord:
        """A lease on ``chain`` for the granted request ``request_id``."""
        lease = Lease(uuid.uuid4().hex, chain.chain_id, chain.route, self.max_length)
        record = LeaseRecord(lease, request_id, client_id, now, now + self.timeout_s)
        self._leases[lease.lease_id] = record
        return record

    def get(self, lease_id: str) -> LeaseRecord:
        try:
            return self._leases[lease_id]
        except KeyError:
            raise UnknownLeaseError(lease_id) from None

    def release(self, lease_id: str) -> LeaseRecord:
        """Forget the lease; its request is the caller's to finish."""
        record = self._leases.pop(lease_id, None)
        if record is None:
            raise UnknownLeaseError(lease_id)
        return record

    def expired(self, now: float) -> list[str]:
        """Ids of the leases past their expiry (still held: release them)."""
        return [lease_id for lease_id, record in self._leases.items() if record.expires_at < now]

    def __len__(self) -> int:
        return len(self._leases)
