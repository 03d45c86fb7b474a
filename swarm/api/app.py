"""The orchestrator's HTTP API (FastAPI): completions, leases, swarm status, Prometheus metrics.

* ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` — OpenAI-compatible
  (:mod:`swarm.api.openai_routes`); the orchestrator runs each session on its granted chain (the paper's proxying
  orchestrator); ``stream: true`` answers with server-sent events.
* ``POST /v1/leases`` / ``POST /v1/leases/{id}/reroute`` / ``DELETE /v1/leases/{id}`` — for clients that
  drive the chain themselves (``client.DirectSwarmModel``).
* ``GET /v1/swarm`` — plan, servers, chains with capacity and active sessions, queue, service and deficit per
  client, a short per-client service history, recent events (joins, leaves, plans, failures, refusals).
* ``GET /metrics`` — Prometheus; ``GET /health``, ``GET /ready``; ``GET /`` — the dashboard, ``GET /chat`` —
  a chat page (:mod:`swarm.api.web_pages`);
  ``GET /docs`` — the OpenAPI UI. Every response carries ``X-Request-Id``.

Errors are JSON ``{"error": {"type", "message"}}`` with a 4xx status for bad input (400 too long or an
unsupported OpenAI field, 401 bad key, 404 unknown lease or model, 422 malformed/unknown fields), 429 with
``Retry-After`` when the queue is at its bound, and 503 (with ``Retry-After`` after a queue timeout) when the
swarm cannot serve.
"""
from __future__ import annotations

import base64

import hmac
import logging
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from swarm.api import web_pages
from swarm.api.errors import REFUSALS, ApiError, refusal
from swarm.engine.completion import CompletionRunner
from swarm.engine.generation import GenerationEngine
from swarm.api.metrics import SwarmMetrics
from swarm.api.openai_routes import add_openai_routes
from swarm.control.orchestrator import LeaseMisuse, Orchestrator, UnknownLeaseError
from swarm.engine.routing import NoRouteError
from swarm.api.schemas import LeaseRequest, LeaseResponse, RenewResponse, RerouteRequest, RerouteResponse


logger = logging.getLogger(__name__)
MAX_CLIENT_ID = 64  # X-Client-Id / client_id / user: a client naming itself (no API keys)


def match_api_key(token: str, keys: dict[str, str]) -> str | None:
    """The client an API key belongs to, or None. Every configured key is compared in constant time
    (``hmac.compare_digest``) and all of them are tried, so the answer time tells nothing about the keys."""
    supplied, found = token.encode(), None
    for key, client in keys.items():
        if hmac.compare_digest(supplied, key.encode()):
            found = client
    return found


class RequestIdMiddleware:
    """Every response carries X-Request-Id: the client's own when it sent one, else a new one.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide ``http.disconnect`` from the endpoints,
    and the completion runner needs it to take a departed client's request out of the queue."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or ()).get(b"x-request-id", b"")[:128]
        request_id = sent.decode("latin-1") if sent else uuid.uuid4().hex

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(orchestrator: Orchestrator, engine: GenerationEngine | None, *, initial_peers: list[str],
               model_name: str, api_keys: dict[str, str] | None = None,
               stall_timeout_s: float | None = None) -> FastAPI:
    """Build the API around a started orchestrator (and its generation engine, if it proxies sessions)."""
    app = FastAPI(title="Chainswarm orchestrator", version="0.1.0",
                  description="Planned chains, JFFC dispatch and per-client fairness over a petals swarm.")
    metrics = SwarmMetrics(orchestrator, engine)
    keys = dict(api_keys or {})
    runner = CompletionRunner(orchestrator, engine, metrics, stall_timeout_s=stall_timeout_s) if engine else None

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        headers = {} if exc.retry_after_s is None else {"Retry-After": str(math.ceil(exc.retry_after_s))}
        return JSONResponse({"error": {"type": exc.kind, "message": exc.message}}, status_code=exc.status,
                            headers=headers)

    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{where or 'body'}: {err.get('msg')}")
        return JSONResponse({"error": {"type": "invalid_request", "message": "; ".join(parts)}}, status_code=422)

    def client_of(authorization: str | None, fallback: str | None) -> str:
        if keys:
            token = (authorization or "").removeprefix("Bearer ").strip()
            if not token:
                raise ApiError(401, "unauthorized", "missing API key (send 'Authorization: Bearer <key>')")
            client = match_api_key(token, keys)
            if client is None:
                raise ApiError(401, "unauthorized", "unknown API key")
            return client
        if fallback is not None and not 0 < len(fallback) <= MAX_CLIENT_ID:
            raise ApiError(400, "invalid_request", f"a client id is 1 to {MAX_CLIENT_ID} characters")
        return fallback or "anonymous"


    add_openai_routes(app, runner=runner, engine=engine, model_name=model_name,
                      max_length=orchestrator.config.expect.max_length, client_of=client_of)

    # -- operations ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Alive: the process answers (says nothing about the swarm)."""
        return {"status": "alive", "uptime_s": time.monotonic() - orchestrator.started_at}

    @app.get("/ready", responses={503: {}})
    async def ready():
        """Ready: a current plan with at least one chain whose every server serves its assignment."""
        view = orchestrator.view
        chains = sum(1 for c in view.chains if c.ready)
        doc = {"ready": view.plan is not None and chains > 0, "plan_id": view.plan_id, "ready_chains": chains,
               "plan_error": view.plan_error}
        return JSONResponse(doc, status_code=200 if doc["ready"] else 503)

    # -- leases ----------------------------------------------------------------------------------------
    def lease_response(record) -> LeaseResponse:
        lease = record.lease
        return LeaseResponse(
            lease_id=lease.lease_id, chain_id=lease.chain_id,
            route=[{"peer_id": p, "start": s, "end": e} for p, s, e in lease.route],
            max_length=orchestrator.config.expect.max_length, dht_prefix=orchestrator.config.dht_prefix,
            initial_peers=initial_peers, expires_in_s=record.expires_at - time.monotonic(),
            ttl_s=orchestrator.leases.ttl_s,
            ticket=None if lease.ticket is None else base64.b64encode(lease.ticket).decode(),
        )

    @app.post("/v1/leases", response_model=LeaseResponse, responses={400: {}, 401: {}, 422: {}, 429: {}, 503: {}})
    async def create_lease(body: LeaseRequest, authorization: str | None = Header(None),
                           x_client_id: str | None = Header(None)):
        client = client_of(authorization, x_client_id or body.client_id)
        try:
            record = await orchestrator.grant_lease(client, body.input_tokens, body.max_new_tokens,
                                                    timeout=body.timeout_s)
        except REFUSALS as exc:
            raise refusal(exc) from None
        return lease_response(record)

    def owned_lease(lease_id: str, authorization: str | None, x_client_id: str | None):
        try:
            record = orchestrator.lease(lease_id)
        except UnknownLeaseError:
            raise ApiError(404, "not_found", f"unknown lease {lease_id!r} (released or expired)") from None
        if keys and client_of(authorization, None) != record.client_id:
            raise ApiError(404, "not_found", f"unknown lease {lease_id!r} (released or expired)")
        return record

    @app.post("/v1/leases/{lease_id}/reroute", response_model=RerouteResponse,
              responses={403: {}, 404: {}, 503: {}})
    async def reroute(lease_id: str, body: RerouteRequest, authorization: str | None = Header(None),
                      x_client_id: str | None = Header(None)):
        record = owned_lease(lease_id, authorization, x_client_id)
        if body.end <= body.start or body.end > orchestrator.config.num_blocks:
            raise ApiError(400, "invalid_request", f"bad block range [{body.start}, {body.end})")
        try:
            route = await orchestrator.reroute_lease(record.lease.lease_id, body.start, body.end, body.failed_peers)
        except LeaseMisuse as exc:
            raise ApiError(403, "forbidden", str(exc)) from None
        except NoRouteError as exc:
            raise ApiError(503, "unavailable", str(exc)) from None
        ticket = orchestrator.rerouted_lease_ticket(record, route)
        return RerouteResponse(route=[{"peer_id": p, "start": s, "end": e} for p, s, e in route],
                               ticket=base64.b64encode(ticket).decode())

    @app.post("/v1/leases/{lease_id}/renew", response_model=RenewResponse, responses={404: {}})
    async def renew(lease_id: str, authorization: str | None = Header(None), x_client_id: str | None = Header(None)):
        """The holder still uses the lease: it lives another TTL (``ttl_s`` of the grant)."""
        record = orchestrator.renew_lease(owned_lease(lease_id, authorization, x_client_id).lease.lease_id)
        return RenewResponse(lease_id=lease_id, expires_in_s=record.expires_at - time.monotonic())

    @app.delete("/v1/leases/{lease_id}", responses={404: {}})
    async def release(lease_id: str, output_tokens: int | None = None, authorization: str | None = Header(None),
                      x_client_id: str | None = Header(None)):
        owned_lease(lease_id, authorization, x_client_id)
        if output_tokens is not None and output_tokens < 0:
            raise ApiError(400, "invalid_request", "output_tokens must be >= 0")
        orchestrator.release_lease(lease_id, output_tokens)
        return {"released": lease_id}

    # -- status ----------------------------------------------------------------------------------------
    admins = set(orchestrator.config.admin_clients)

    def operator(authorization: str | None) -> bool:
        """Operator detail: for an admin client's key; for everyone when no API keys are configured (a lab)."""
        if not keys:
            return True
        token = (authorization or "").removeprefix("Bearer ").strip()
        return bool(token) and match_api_key(token, keys) in admins

    @app.get("/v1/swarm")
    async def swarm_status(authorization: str | None = Header(None)) -> dict[str, Any]:
        """Plan, servers, chains and prefix reuse; with an admin client's key (or without API keys) also the
        per-client queue and service and the recent events."""
        return {"initial_peers": initial_peers, "model": model_name,
                **orchestrator.status(detail=operator(authorization))}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(web_pages.router)  # GET / (dashboard), GET /chat, GET /static/...

    return app

