"""The lease endpoints, for clients that drive a chain themselves (``client.DirectSwarmModel``):
``POST /v1/leases``, ``POST /v1/leases/{id}/reroute``, ``POST /v1/leases/{id}/renew``, ``DELETE /v1/leases/{id}``."""
from __future__ import annotations

import base64
import time

from fastapi import FastAPI, Header

from swarm.api.auth import ClientAuth
from swarm.api.errors import REFUSALS, ApiError, refusal
from swarm.api.schemas import LeaseRequest, LeaseResponse, RenewResponse, RerouteRequest, RerouteResponse
from swarm.control.orchestrator import LeaseMisuse, UnknownLeaseError
from swarm.engine.routing import NoRouteError


class LeaseHandlers:
    """Grant, reroute, renew and release leases. With API keys a lease is only visible to the client that
    holds it (anyone else gets the same 404 as for an unknown lease). The route operations have no docstring
    where the OpenAPI description is empty."""

    def __init__(self, orchestrator, auth: ClientAuth, initial_peers: list[str]):
        self.orchestrator, self.auth, self.initial_peers = orchestrator, auth, initial_peers

    def lease_response(self, record) -> LeaseResponse:
        lease, config = record.lease, self.orchestrator.config
        return LeaseResponse(
            lease_id=lease.lease_id, chain_id=lease.chain_id,
            route=[{"peer_id": p, "start": s, "end": e} for p, s, e in lease.route],
            max_length=config.expect.max_length, dht_prefix=config.dht_prefix,
            initial_peers=self.initial_peers, expires_in_s=record.expires_at - time.monotonic(),
            ttl_s=self.orchestrator.leases.ttl_s,
            ticket=None if lease.ticket is None else base64.b64encode(lease.ticket).decode(),
        )

    def owned_lease(self, lease_id: str, authorization: str | None, x_client_id: str | None):
        client = self.auth.client_of(authorization, None) if self.auth.keys else None  # 401 before any lookup
        try:
            record = self.orchestrator.lease(lease_id)
        except UnknownLeaseError:
            raise ApiError(404, "not_found", f"unknown lease {lease_id!r} (released or expired)") from None
        if client is not None and client != record.client_id:
            raise ApiError(404, "not_found", f"unknown lease {lease_id!r} (released or expired)")
        return record

    async def create_lease(self, body: LeaseRequest, authorization: str | None = Header(None),
                           x_client_id: str | None = Header(None)):
        client = self.auth.client_of(authorization, x_client_id or body.client_id)
        try:
            record = await self.orchestrator.grant_lease(client, body.input_tokens, body.max_new_tokens,
                                                         timeout=body.timeout_s)
        except REFUSALS as exc:
            raise refusal(exc) from None
        return self.lease_response(record)

    async def reroute(self, lease_id: str, body: RerouteRequest, authorization: str | None = Header(None),
                      x_client_id: str | None = Header(None)):
        record = self.owned_lease(lease_id, authorization, x_client_id)
        if body.end <= body.start or body.end > self.orchestrator.config.num_blocks:
            raise ApiError(400, "invalid_request", f"bad block range [{body.start}, {body.end})")
        try:
            route = await self.orchestrator.reroute_lease(record.lease.lease_id, body.start, body.end,
                                                          body.failed_peers)
        except LeaseMisuse as exc:
            raise ApiError(403, "forbidden", str(exc)) from None
        except NoRouteError as exc:
            raise ApiError(503, "unavailable", str(exc)) from None
        ticket = self.orchestrator.rerouted_lease_ticket(record, route)
        return RerouteResponse(route=[{"peer_id": p, "start": s, "end": e} for p, s, e in route],
                               ticket=base64.b64encode(ticket).decode())

    async def renew(self, lease_id: str, authorization: str | None = Header(None),
                    x_client_id: str | None = Header(None)):
        """The holder still uses the lease: it lives another TTL (``ttl_s`` of the grant)."""
        record = self.orchestrator.renew_lease(self.owned_lease(lease_id, authorization, x_client_id).lease.lease_id)
        return RenewResponse(lease_id=lease_id, expires_in_s=record.expires_at - time.monotonic())

    async def release(self, lease_id: str, output_tokens: int | None = None, authorization: str | None = Header(None),
                      x_client_id: str | None = Header(None)):
        self.owned_lease(lease_id, authorization, x_client_id)
        if output_tokens is not None and output_tokens < 0:
            raise ApiError(400, "invalid_request", "output_tokens must be >= 0")
        self.orchestrator.release_lease(lease_id, output_tokens)
        return {"released": lease_id}


def add_lease_routes(app: FastAPI, handlers: LeaseHandlers) -> None:
    """Bind the lease operations to their paths (route names are the operations' names)."""
    app.add_api_route("/v1/leases", handlers.create_lease, methods=["POST"], name="create_lease",
                      response_model=LeaseResponse, responses={400: {}, 401: {}, 429: {}, 503: {}})
    app.add_api_route("/v1/leases/{lease_id}/reroute", handlers.reroute, methods=["POST"], name="reroute",
                      response_model=RerouteResponse, responses={403: {}, 404: {}, 503: {}})
    app.add_api_route("/v1/leases/{lease_id}/renew", handlers.renew, methods=["POST"], name="renew",
                      response_model=RenewResponse, responses={404: {}})
    app.add_api_route("/v1/leases/{lease_id}", handlers.release, methods=["DELETE"], name="release",
                      responses={404: {}})
