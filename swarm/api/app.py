"""The orchestrator's HTTP API (FastAPI): completions, leases, swarm status, Prometheus metrics.

* ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` — OpenAI-compatible
  (:mod:`swarm.api.openai_routes`; the handlers are ``swarm.api.serving_*`` objects); the orchestrator runs
  each session on its granted chain (the paper's proxying orchestrator); ``stream: true`` answers with
  server-sent events.
* ``POST /v1/leases`` / ``POST /v1/leases/{id}/reroute`` / ``DELETE /v1/leases/{id}`` — for clients that
  drive the chain themselves (``client.DirectSwarmModel``; :mod:`swarm.api.serving_leases`). API keys and
  self-declared client ids: :mod:`swarm.api.auth`.
* ``GET /v1/swarm`` — plan, servers, chains with capacity and active sessions, queue, service and deficit per
  client, a short per-client service history, recent events (joins, leaves, plans, failures, refusals).
* ``GET /metrics`` — Prometheus; ``GET /health``, ``GET /ready``; ``GET /`` — the dashboard, ``GET /chat`` —
  a chat page (:mod:`swarm.api.web_pages`);
  ``GET /docs`` — the OpenAPI UI. Every response carries ``X-Request-Id``.

Errors are OpenAI's error object ``{"error": {"message", "type", "param", "code"}}`` (:mod:`swarm.api.errors`)
with a 4xx status for bad input (400 malformed, unknown or unsupported fields and too long a prompt, as OpenAI's;
401 bad key, 404 unknown lease or model), 429 with
``Retry-After`` when the queue is at its bound, and 503 (with ``Retry-After`` after a queue timeout) when the
swarm cannot serve.
"""
from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from swarm.api import web_pages
from swarm.api.auth import MAX_CLIENT_ID, ClientAuth, match_api_key
from swarm.api.errors import ApiError, error_body, validation_error
from swarm.api.metrics import SwarmMetrics
from swarm.api.openai_routes import add_openai_routes
from swarm.api.serving_leases import LeaseHandlers, add_lease_routes
from swarm.control.orchestrator import Orchestrator
from swarm.engine.completion import CompletionRunner
from swarm.engine.generation import GenerationEngine

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 * 2**20  # a request body past it is refused (413) before it is parsed
HTTP_ERROR_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
TOO_LARGE = f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB"
__all__ = ["create_app", "RequestIdMiddleware", "match_api_key", "MAX_CLIENT_ID"]  # the last two: re-exported


class RequestIdMiddleware:
    """Every response carries X-Request-Id: the client's own when it sent one, else a new one; a request body
    larger than :data:`MAX_BODY_BYTES` is refused (413) without being kept in memory.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide ``http.disconnect`` from the endpoints,
    and the completion runner needs it to take a departed client's request out of the queue."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        sent = headers.get(b"x-request-id", b"")[:128]
        request_id = sent.decode("latin-1") if sent else uuid.uuid4().hex
        too_large = JSONResponse(error_body(413, "request_too_large", TOO_LARGE), status_code=413,
                                 headers={"x-request-id": request_id})
        length = headers.get(b"content-length", b"")
        chunked = not length and b"chunked" in headers.get(b"transfer-encoding", b"")
        if (length.isdigit() and int(length) > MAX_BODY_BYTES) or chunked:
            # past the bound: read and dropped, then refused (a client still sending would see its connection reset);
            # without a length: read here, bounded, and handed on
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return
                size, more = size + len(message.get("body", b"")), message.get("more_body", False)
                if size <= MAX_BODY_BYTES and chunked:
                    chunks.append(message.get("body", b""))
            if size > MAX_BODY_BYTES:
                return await too_large(scope, receive, send)
            receive = _replay(b"".join(chunks), receive)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that hands out ``body`` (already read) first, then what ``receive`` gives."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replay


def _openapi_says_400(app: FastAPI) -> None:
    """The OpenAPI schema without FastAPI's automatic 422 "Validation Error" responses: a request the schemas refuse
    is a 400 with OpenAI's error object (:func:`~swarm.api.errors.validation_error`)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.get("responses", {}) if isinstance(operation, dict) else {}
                    if responses.pop("422", None) is not None:
                        responses.setdefault("400", {"description": "Bad Request"})
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi


def create_app(orchestrator: Orchestrator, engine: GenerationEngine | None, *, initial_peers: list[str],
               model_name: str, api_keys: dict[str, str] | None = None,
               stall_timeout_s: float | None = None, route_wait_s: float = 120.0,
               grow_tokens: int = 256) -> FastAPI:
    """Build the API around a started orchestrator (and its generation engine, if it proxies sessions)."""
    app = FastAPI(title="Chainswarm orchestrator", version="0.1.0",
                  description="Planned chains, JFFC dispatch and per-client fairness over a petals swarm.")
    metrics = SwarmMetrics(orchestrator, engine)
    auth = ClientAuth(api_keys, orchestrator.config.admin_clients)
    runner = (CompletionRunner(orchestrator, engine, metrics, stall_timeout_s=stall_timeout_s,
                               route_wait_s=route_wait_s, grow_tokens=grow_tokens) if engine else None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        headers = {} if exc.retry_after_s is None else {"Retry-After": str(math.ceil(exc.retry_after_s))}
        return JSONResponse(exc.body(), status_code=exc.status,
                            headers=headers)

    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):  # unknown paths and methods
        kind = HTTP_ERROR_KINDS.get(exc.status_code, "invalid_request")
        message = TOO_LARGE if exc.status_code == 413 else str(exc.detail)
        return JSONResponse(error_body(exc.status_code, kind, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        if auth.keys and request.method in ("POST", "DELETE"):  # every such route serves a key's client: who
            try:  # asks is checked before what is asked, so an unknown caller learns nothing of the API from it
                auth.client_of(request.headers.get("authorization"), None)
            except ApiError as refused:
                return await _api_error(request, refused)
        return await _api_error(request, validation_error(exc.errors(), request.headers.get("content-type")))

    _openapi_says_400(app)
    add_openai_routes(app, runner=runner, engine=engine, model_name=model_name,
                      max_length=orchestrator.config.expect.max_length, client_of=auth.client_of)

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
    add_lease_routes(app, LeaseHandlers(orchestrator, auth, initial_peers))

    # -- status ----------------------------------------------------------------------------------------
    @app.get("/v1/swarm")
    async def swarm_status(authorization: str | None = Header(None)) -> dict[str, Any]:
        """Plan, servers, chains and prefix reuse; with an admin client's key (or without API keys) also the
        per-client queue and service and the recent events."""
        return {"initial_peers": initial_peers, "model": model_name,
                **orchestrator.status(detail=auth.operator(authorization))}

    @app.get("/v1/swarm/requests/{request_id}", responses={404: {}})
    async def request_verdict(request_id: str):
        """What the spot checks know of a finished request: ``verified`` is ``pending``, ``true`` or ``false``
        (:mod:`swarm.trust.verification`); 404 for an id the orchestrator does not remember."""
        verdict = orchestrator.ledger.verdict(request_id)
        if verdict is None:
            raise ApiError(404, "not_found", f"no finished request {request_id!r} is remembered")
        return {"request_id": request_id, "verified": verdict}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(web_pages.router)  # GET / (dashboard), GET /chat, GET /static/...

    return app

