"""``DirectSwarmModel``: a petals distributed model routed by orchestrator leases.

The client drives the chain itself (activations go client → server → client, as in petals), but which
chain it uses is the orchestrator's decision: each inference session acquires a lease (a JFFC-granted
chain slot, queued fairly with every other client), runs on that chain, renews it from a background thread
every third of its TTL, and releases it when the session closes. If a server fails mid-session, the client reports it and asks for a replacement for the failed
blocks; petals replays the session's history there (with Chainswarm's failover fix).

>>> model = DirectSwarmModel.from_pretrained("models/tiny", orchestrator="http://127.0.0.1:8000")
>>> out = model.generate(input_ids, max_new_tokens=32)
>>> model.close()
"""
from __future__ import annotations

import base64
import logging
import threading
from typing import Sequence

from client.http import SwarmClient
from swarm.engine.routing import Lease, RouteSpan

logger = logging.getLogger(__name__)


class OrchestratorLeases:
    """A :class:`swarm.engine.routing.LeaseProvider` backed by the orchestrator's HTTP API."""

    def __init__(self, client: SwarmClient, *, max_new_tokens_hint: int = 1, timeout_s: float | None = None):
        self.client = client
        self.max_new_tokens_hint = max_new_tokens_hint
        self.timeout_s = timeout_s
        self.local = threading.local()  # prompt length of the session being opened in this thread
        self._held: dict[str, float] = {}  # lease id -> renewal period (a third of its TTL)
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._closed = False
        self._keeper: threading.Thread | None = None

    def acquire(self, *, max_length: int) -> Lease:
        input_tokens = getattr(self.local, "input_tokens", None) or 1
        new_tokens = max(1, max_length - input_tokens)
        doc = self.client.lease(input_tokens, new_tokens, timeout_s=self.timeout_s)
        route = tuple((r["peer_id"], r["start"], r["end"]) for r in doc["route"])
        ticket = base64.b64decode(doc["ticket"]) if doc.get("ticket") else None
        self._keep(doc["lease_id"], doc["ttl_s"] / 3)
        return Lease(doc["lease_id"], doc["chain_id"], route, doc["max_length"], ticket=ticket)

    def _keep(self, lease_id: str, period: float) -> None:
        with self._lock:
            self._held[lease_id] = max(0.05, period)
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._renew_loop, name="lease-renewal", daemon=True)
                self._keeper.start()
        self._changed.set()

    def _renew_loop(self) -> None:
        """Renew every held lease every third of its TTL, until :meth:`close`."""
        while not self._closed:
            with self._lock:
                period = min(self._held.values(), default=1.0)
            self._changed.wait(period)
            self._changed.clear()
            with self._lock:
                held = list(self._held)
            for lease_id in held:
                try:
                    self.client.renew(lease_id)
                except Exception as exc:  # expired or released meanwhile: nothing left to keep
                    logger.warning("lease %s could not be renewed: %s", lease_id, exc)
                    with self._lock:
                        self._held.pop(lease_id, None)

    def close(self) -> None:
        self._closed = True
        self._changed.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)

    def reroute(self, lease: Lease, start: int, end: int, failed_peers: Sequence[str]) -> tuple[RouteSpan, ...]:
        doc = self.client.reroute_lease(lease.lease_id, start, end, list(failed_peers))
        if doc.get("ticket"):  # the servers opened from now on need the fresh ticket
            lease.ticket = base64.b64decode(doc["ticket"])
        return tuple((r["peer_id"], r["start"], r["end"]) for r in doc["route"])

    def release(self, lease: Lease, *, processed_tokens: int) -> None:
        with self._lock:
            self._held.pop(lease.lease_id, None)
        input_tokens = getattr(self.local, "input_tokens", None) or 0
        self.client.release(lease.lease_id, max(0, processed_tokens - input_tokens))


class DirectSwarmModel:
    """Wraps a petals ``AutoDistributedModelForCausalLM`` whose routing comes from orchestrator leases."""

    def __init__(self, model, client: SwarmClient, leases: OrchestratorLeases):
        self.model, self.client, self.leases = model, client, leases

    @classmethod
    def from_pretrained(cls, model_dir: str, *, orchestrator: str, api_key: str | None = None,
                        client_id: str | None = None, max_retries: int = 3, **petals_kwargs) -> "DirectSwarmModel":
        from swarm.model.compat import petals
        from swarm.engine.routing import install

        client = SwarmClient(orchestrator, api_key, client_id=client_id)
        swarm = client.swarm()
        model = petals.AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=swarm["initial_peers"], dht_prefix=swarm["dht_prefix"],
            max_retries=max_retries, show_route=False, **petals_kwargs,
        )
        leases = OrchestratorLeases(client)
        install(model, leases)
        return cls(model, client, leases)

    def generate(self, input_ids, max_new_tokens: int = 32, **kwargs):
        """``transformers``-style generate; one lease (chain slot) for the whole call."""
        self.leases.local.input_tokens = int(input_ids.shape[1])
        try:
            return self.model.generate(input_ids, max_new_tokens=max_new_tokens, **kwargs)
        finally:
            self.leases.local.input_tokens = None

    def close(self) -> None:
        from swarm.engine.petals_client import close_distributed_model

        self.leases.close()
        close_distributed_model(self.model)
        self.client.close()

    def __enter__(self) -> "DirectSwarmModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
