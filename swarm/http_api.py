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
import html
import json
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from swarm.engine import GenerationEngine, SamplingParams
from swarm.metrics import SwarmMetrics
from swarm.orchestrator import NoChainsError, Orchestrator, QueueTimeout, UnknownLeaseError
from swarm.routing import Lease, NoRouteError
from swarm.schemas import (
    CompletionRequest, CompletionResponse, LeaseRequest, LeaseResponse, RerouteRequest, RerouteResponse,
)


logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5  # how often a non-streaming completion checks that its client is still there


class ClientDisconnected(Exception):
    """Raised in a session thread to stop generating for a client that has gone away."""


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class _LoopProvider:
    """Lets a session thread ask the orchestrator (on the event loop) for a replacement route."""

    def __init__(self, orchestrator: Orchestrator, loop: asyncio.AbstractEventLoop):
        self.orchestrator, self.loop = orchestrator, loop

    def acquire(self, *, max_length: int) -> Lease:  # proxied sessions always start with a lease
        raise NoRouteError("proxied sessions are granted before they start")

    def reroute(self, lease: Lease, start: int, end: int, failed_peers) -> tuple:
        async def ask():
            return self.orchestrator.reroute(lease.chain_id, start, end, failed_peers)
        return asyncio.run_coroutine_threadsafe(ask(), self.loop).result(timeout=30)

    def release(self, lease: Lease, *, processed_tokens: int) -> None:
        pass  # the completion handler finishes the request itself


def create_app(orchestrator: Orchestrator, engine: GenerationEngine | None, *, initial_peers: list[str],
               model_name: str, api_keys: dict[str, str] | None = None) -> FastAPI:
    """Build the API around a started orchestrator (and its generation engine, if it proxies sessions)."""
    app = FastAPI(title="Chainswarm orchestrator", version="0.1.0",
                  description="Planned chains, JFFC dispatch and per-client fairness over a petals swarm.")
    metrics = SwarmMetrics(orchestrator)
    keys = dict(api_keys or {})

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

    async def admit(client: str, input_tokens: int, max_new_tokens: int, timeout: float | None = None,
                    page_hashes=()):
        try:
            return await orchestrator.acquire(client, input_tokens, max_new_tokens, timeout=timeout,
                                              page_hashes=page_hashes)
        except ValueError as exc:  # too long for the swarm's sessions
            raise ApiError(400, "invalid_request", str(exc)) from None
        except (NoChainsError, QueueTimeout) as exc:
            raise ApiError(503, "unavailable", str(exc)) from None

    # -- completions -----------------------------------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={400: {}, 401: {}, 422: {}, 503: {}})
    async def completions(body: CompletionRequest, request: Request, response: Response,
                          authorization: str | None = Header(None), x_client_id: str | None = Header(None)):
        eng = require_engine()
        client = client_of(authorization, x_client_id or body.user)
        input_ids = eng.encode(body.prompt)
        # prefix pages are hashed here, from the token ids this orchestrator tokenized, in its secret
        # namespace: what a client sends can never name a cached page (swarm.prefix)
        page_hashes = orchestrator.prompt_hashes(input_ids)
        submitted = time.monotonic()
        grant = await admit(client, len(input_ids), body.max_tokens, page_hashes=page_hashes)
        started = time.monotonic()
        chain = orchestrator.chain(grant.chain_id)
        lease = Lease(grant.request_id, grant.chain_id, chain.route, orchestrator.config.expect.max_length)
        params = SamplingParams(body.max_tokens, body.temperature, body.top_p)
        loop = asyncio.get_running_loop()
        provider = _LoopProvider(orchestrator, loop)
        tokens: asyncio.Queue = asyncio.Queue()
        disconnected = threading.Event()

        def on_token(token: int) -> None:  # session thread -> event loop
            if disconnected.is_set():  # the client is gone: stop generating at the next token
                raise ClientDisconnected("the client disconnected")
            loop.call_soon_threadsafe(tokens.put_nowait, token)

        def charge(token: int) -> None:
            orchestrator.tokens(grant.request_id, 1)
            metrics.tokens.labels(client).inc()

        # token callbacks are queued on the loop before the executor future resolves, so once the task is
        # done every token is already in the queue
        prefix: dict[str, Any] = {"expected": grant.matched_tokens}

        def on_prefix(reused: int) -> None:  # session thread, after the probe and before the prefill
            prefix["reused"] = reused
            loop.call_soon_threadsafe(orchestrator.prefilled, grant.request_id, reused, len(input_ids),
                                      grant.matched_tokens)

        def generate():
            return eng.generate(lease, provider, input_ids, params, on_token,
                                page_hashes=page_hashes or None, on_prefix=on_prefix if page_hashes else None)

        task = asyncio.ensure_future(loop.run_in_executor(eng.executor, generate))
        meta = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_name}

        def finished(result) -> None:
            orchestrator.finish(grant.request_id, len(result.token_ids))
            metrics.observe(client, "ok", started - submitted, time.monotonic() - started)

        def failed(exc: BaseException) -> ApiError:
            orchestrator.abort(grant.request_id)
            metrics.observe(client, "error", started - submitted, time.monotonic() - started)
            return ApiError(503, "swarm_failure", f"the session failed on the swarm: {exc!r}")

        def gone() -> Response:
            """The client disconnected mid-generation: stop the session at its next token and give the chain
            slot back once the session has let go of its servers (no traceback, nothing leaks)."""
            disconnected.set()

            def release(done: asyncio.Future) -> None:
                if not done.cancelled():
                    done.exception()  # retrieved: ClientDisconnected is the expected outcome
                orchestrator.abort(grant.request_id)

            task.add_done_callback(release)
            metrics.observe(client, "disconnected", started - submitted, time.monotonic() - started)
            logger.info("client %s disconnected from request %s", client, grant.request_id)
            return Response(status_code=499)

        if not body.stream:
            produced: list[int] = []
            try:
                checked = time.monotonic()
                while not task.done() or not tokens.empty():
                    getter = asyncio.ensure_future(tokens.get())
                    done, _ = await asyncio.wait({getter, task}, timeout=DISCONNECT_POLL_S,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if getter in done:
                        token = getter.result()
                        produced.append(token)
                        charge(token)
                    else:
                        getter.cancel()
                    if time.monotonic() - checked >= DISCONNECT_POLL_S and not task.done():
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            return gone()
                result = task.result()
            except asyncio.CancelledError:  # the server is shutting down
                return gone()
            except Exception as exc:
                raise failed(exc) from None
            finished(result)
            response.headers["x-chainswarm-prefix"] = (
                f"expected={prefix['expected']};reused={result.reused_tokens};prefill={result.prefill_tokens};"
                f"restarts={result.restarts}")
            return CompletionResponse(
                **meta, choices=[{"text": eng.decode(result.token_ids), "finish_reason": result.finish_reason}],
                usage={"prompt_tokens": len(input_ids), "completion_tokens": len(result.token_ids),
                       "total_tokens": len(input_ids) + len(result.token_ids)},
                chainswarm={"chain_id": grant.chain_id, "servers": list(chain.servers), "route": list(chain.route),
                            "waiting_s": started - submitted, "service_s": time.monotonic() - started},
            )

        async def events() -> AsyncIterator[bytes]:
            produced: list[int] = []
            sent = ""
            try:
                while not task.done() or not tokens.empty():
                    getter = asyncio.ensure_future(tokens.get())
                    done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if getter not in done:
                        getter.cancel()
                        continue
                    token = getter.result()
                    produced.append(token)
                    charge(token)
                    text = eng.decode(produced)
                    if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
                        continue
                    delta, sent = text[len(sent):], text
                    chunk = {**meta, "object": "text_completion",
                             "choices": [{"index": 0, "text": delta, "finish_reason": None, "logprobs": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                result = task.result()
            except (asyncio.CancelledError, GeneratorExit):
                gone()
                raise
            except Exception as exc:
                err = failed(exc)
                yield f"data: {json.dumps({'error': {'type': err.kind, 'message': err.message}})}\n\n".encode()
                return
            finished(result)
            tail = eng.decode(result.token_ids)[len(sent):]
            last = {**meta, "object": "text_completion",
                    "choices": [{"index": 0, "text": tail, "finish_reason": result.finish_reason, "logprobs": None}],
                    "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(result.token_ids),
                              "total_tokens": len(input_ids) + len(result.token_ids)}}
            yield f"data: {json.dumps(last)}\n\n".encode()
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
