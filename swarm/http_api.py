"""The orchestrator's HTTP API (FastAPI): completions, leases, swarm status, Prometheus metrics.

* ``POST /v1/completions`` — OpenAI-compatible; the orchestrator runs the session on the granted chain
  (the paper's proxying orchestrator); ``stream: true`` answers with server-sent events.
* ``POST /v1/leases`` / ``POST /v1/leases/{id}/reroute`` / ``DELETE /v1/leases/{id}`` — for clients that
  drive the chain themselves (``client.DirectSwarmModel``).
* ``GET /v1/swarm`` — plan, servers, chains with capacity and active sessions, queue per client.
* ``GET /metrics`` — Prometheus; ``GET /`` — a small status page; ``GET /docs`` — the OpenAPI UI.

Errors are JSON ``{"error": {"type", "message"}}`` with a 4xx status for bad input (400 too long, 401 bad
key, 404 unknown lease, 422 malformed/unknown fields) and 503 when the swarm cannot serve.
"""
from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from swarm.completion import ClientGone, CompletionFailed, CompletionRunner, Finished
from swarm.engine import GenerationEngine, SamplingParams
from swarm.metrics import SwarmMetrics
from swarm.orchestrator import NoChainsError, Orchestrator, QueueTimeout, UnknownLeaseError
from swarm.routing import NoRouteError
from swarm.schemas import (
    CompletionRequest, CompletionResponse, LeaseRequest, LeaseResponse, RerouteRequest, RerouteResponse,
)


logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def create_app(orchestrator: Orchestrator, engine: GenerationEngine | None, *, initial_peers: list[str],
               model_name: str, api_keys: dict[str, str] | None = None,
               stall_timeout_s: float | None = None) -> FastAPI:
    """Build the API around a started orchestrator (and its generation engine, if it proxies sessions)."""
    app = FastAPI(title="Chainswarm orchestrator", version="0.1.0",
                  description="Planned chains, JFFC dispatch and per-client fairness over a petals swarm.")
    metrics = SwarmMetrics(orchestrator)
    keys = dict(api_keys or {})
    runner = CompletionRunner(orchestrator, engine, metrics, stall_timeout_s=stall_timeout_s) if engine else None

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return JSONResponse({"error": {"type": exc.kind, "message": exc.message}}, status_code=exc.status)

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
            if token not in keys:
                raise ApiError(401, "unauthorized", "unknown API key")
            return keys[token]
        return fallback or "anonymous"

    def require_engine() -> GenerationEngine:
        if engine is None:
            raise ApiError(503, "unavailable", "this orchestrator does not proxy completions (no engine)")
        return engine

    # -- completions -----------------------------------------------------------------------------------
    def refuse(exc: Exception) -> ApiError:
        if isinstance(exc, ValueError):  # too long for the swarm's sessions
            return ApiError(400, "invalid_request", str(exc))
        if isinstance(exc, CompletionFailed):
            return ApiError(503, "swarm_failure", str(exc))
        return ApiError(503, "unavailable", str(exc))  # NoChainsError, QueueTimeout

    refusals = (ValueError, NoChainsError, QueueTimeout, CompletionFailed)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={400: {}, 401: {}, 422: {}, 503: {}})
    async def completions(body: CompletionRequest, request: Request, response: Response,
                          authorization: str | None = Header(None), x_client_id: str | None = Header(None)):
        eng = require_engine()
        client = client_of(authorization, x_client_id or body.user)
        # prefix pages are hashed by the runner from the token ids this orchestrator tokenized, in its secret
        # namespace: what a client sends can never name a cached page (swarm.prefix)
        input_ids = eng.encode(body.prompt)
        params = SamplingParams(body.max_tokens, body.temperature, body.top_p)
        run = runner.run(client, input_ids, params, request.is_disconnected)
        meta = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_name}
        usage = lambda done: {"prompt_tokens": len(input_ids), "completion_tokens": len(done.token_ids),  # noqa: E731
                              "total_tokens": len(input_ids) + len(done.token_ids)}

        if not body.stream:
            try:
                async with contextlib.aclosing(run):
                    done = [item async for item in run if isinstance(item, Finished)][-1]
            except ClientGone:
                return Response(status_code=499)
            except refusals as exc:
                raise refuse(exc) from None
            prefix = done.prefix
            response.headers["x-chainswarm-prefix"] = (
                f"expected={prefix.get('expected', 0)};reused={prefix.get('reused', 0)};"
                f"prefill={prefix.get('prefill', 0)};restarts={prefix.get('restarts', 0)}")
            return CompletionResponse(
                **meta, choices=[{"text": eng.decode(done.token_ids), "finish_reason": done.finish_reason}],
                usage=usage(done),
                chainswarm={"chain_id": done.chain_id, "servers": done.servers, "route": done.route,
                            "waiting_s": done.waiting_s, "service_s": done.service_s},
            )

        # streamed: wait for the first token here, so that a refusal is still an HTTP status
        try:
            first = await run.__anext__()
        except ClientGone:
            return Response(status_code=499)
        except refusals as exc:
            raise refuse(exc) from None

        def chunk(text: str, finish_reason: str | None, **extra) -> bytes:
            doc = {**meta, "object": "text_completion", **extra,
                   "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}
            return f"data: {json.dumps(doc)}\n\n".encode()

        async def events() -> AsyncIterator[bytes]:
            produced: list[int] = []
            sent = ""
            async with contextlib.aclosing(run):
                try:
                    item = first
                    while not isinstance(item, Finished):
                        produced.append(item)
                        text = eng.decode(produced)
                        if not text.endswith("\ufffd"):  # else: an incomplete multi-byte character
                            delta, sent = text[len(sent):], text
                            yield chunk(delta, None)
                        item = await run.__anext__()
                except (ClientGone, asyncio.CancelledError, GeneratorExit):
                    raise
                except refusals as exc:
                    err = refuse(exc)
                    yield f"data: {json.dumps({'error': {'type': err.kind, 'message': err.message}})}\n\n".encode()
                    return
            yield chunk(eng.decode(item.token_ids)[len(sent):], item.finish_reason, usage=usage(item))
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- leases ----------------------------------------------------------------------------------------
    def lease_response(record) -> LeaseResponse:
        lease = record.lease
        return LeaseResponse(
            lease_id=lease.lease_id, chain_id=lease.chain_id,
            route=[{"peer_id": p, "start": s, "end": e} for p, s, e in lease.route],
            max_length=orchestrator.config.expect.max_length, dht_prefix=orchestrator.config.dht_prefix,
            initial_peers=initial_peers, expires_in_s=record.expires_at - time.monotonic(),
        )

    @app.post("/v1/leases", response_model=LeaseResponse, responses={400: {}, 401: {}, 422: {}, 503: {}})
    async def create_lease(body: LeaseRequest, authorization: str | None = Header(None),
                           x_client_id: str | None = Header(None)):
        client = client_of(authorization, x_client_id or body.client_id)
        try:
            record = await orchestrator.grant_lease(client, body.input_tokens, body.max_new_tokens,
                                                    timeout=body.timeout_s)
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        except (NoChainsError, QueueTimeout) as exc:
            raise ApiError(503, "unavailable", str(exc)) from None
        return lease_response(record)

    def owned_lease(lease_id: str, authorization: str | None, x_client_id: str | None):
        try:
            record = orchestrator.lease(lease_id)
        except UnknownLeaseError:
            raise ApiError(404, "not_found", f"unknown lease {lease_id!r} (released or expired)") from None
        if keys and client_of(authorization, None) != record.client_id:
            raise ApiError(404, "not_found", f"unknown lease {lease_id!r} (released or expired)")
        return record

    @app.post("/v1/leases/{lease_id}/reroute", response_model=RerouteResponse, responses={404: {}, 503: {}})
    async def reroute(lease_id: str, body: RerouteRequest, authorization: str | None = Header(None),
                      x_client_id: str | None = Header(None)):
        record = owned_lease(lease_id, authorization, x_client_id)
        if body.end <= body.start or body.end > orchestrator.config.num_blocks:
            raise ApiError(400, "invalid_request", f"bad block range [{body.start}, {body.end})")
        try:
            route = orchestrator.reroute(record.lease.chain_id, body.start, body.end, body.failed_peers)
        except NoRouteError as exc:
            raise ApiError(503, "unavailable", str(exc)) from None
        return RerouteResponse(route=[{"peer_id": p, "start": s, "end": e} for p, s, e in route])

    @app.delete("/v1/leases/{lease_id}", responses={404: {}})
    async def release(lease_id: str, output_tokens: int | None = None, authorization: str | None = Header(None),
                      x_client_id: str | None = Header(None)):
        owned_lease(lease_id, authorization, x_client_id)
        if output_tokens is not None and output_tokens < 0:
            raise ApiError(400, "invalid_request", "output_tokens must be >= 0")
        orchestrator.release_lease(lease_id, output_tokens)
        return {"released": lease_id}

    # -- status ----------------------------------------------------------------------------------------
    @app.get("/v1/swarm")
    async def swarm_status() -> dict[str, Any]:
        return {"initial_peers": initial_peers, "model": model_name, **orchestrator.status()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def status_page() -> str:
        return render_status_page({"initial_peers": initial_peers, "model": model_name, **orchestrator.status()})

    return app


def render_status_page(status: dict[str, Any]) -> str:
    esc = html.escape

    def table(headers, rows) -> str:
        head = "".join(f"<th>{esc(str(h))}</th>" for h in headers)
        body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    plan = status.get("plan") or {}
    servers = table(["node", "peer", "state", "blocks", "slots", "memory MB", "decode ms/block", "rtt ms"], [
        [s["node_id"], s["peer_id"][-8:], s["state"] + (" (suspect)" if s["suspect"] else ""),
         "-" if s["start"] is None else f"[{s['start']}, {s['end']})", s["cache_slots"],
         f"{s['memory_bytes'] / 1e6:.1f}", f"{s['decode_s'] * 1e3:.2f}",
         "-" if s["rtt_s"] is None else f"{s['rtt_s'] * 1e3:.1f}"] for s in status["servers"]])
    chains = table(["chain", "servers", "spans", "capacity", "active", "ready", "service time s"], [
        [c["id"], " → ".join(c["servers"]), " ".join(f"[{a},{b})" for a, b in c["spans"]), c["capacity"],
         c["active"], c["ready"], f"{c['service_time']:.3f}"] for c in status["chains"]])
    clients = table(["client", "waiting", "service (cost units)"],
                    [[c, v["waiting"], f"{v['service']:.0f}"] for c, v in status["clients"].items()])
    return f"""<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>Chainswarm</title><style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}</style></head><body>
<h1>Chainswarm orchestrator</h1>
<p>model <b>{esc(status['model'])}</b> · policy <b>{esc(status['policy'])}</b> · plan <b>{esc(str(plan.get('plan_id')))}</b>
(c = {esc(str(plan.get('c')))}, total capacity {esc(str(plan.get('total_capacity')))}) {esc(status.get('plan_error') or '')}</p>
<p>join with <code>--initial-peers {esc(' '.join(status['initial_peers']))}</code></p>
<h2>Servers</h2>{servers}<h2>Chains (fastest first)</h2>{chains}<h2>Clients</h2>{clients}
<p><a href="/v1/swarm">/v1/swarm</a> · <a href="/metrics">/metrics</a> · <a href="/docs">/docs</a></p></body></html>"""
