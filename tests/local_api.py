"""The OpenAI-compatible handlers over a local model, in-process: no DHT, no servers, no orchestrator.

:class:`LocalRunner` has :class:`swarm.engine.completion.CompletionRunner`'s contract (``run`` yields token ids,
then a ``Finished``) but computes every token in local transformers, choosing it with the engine's own
:class:`~swarm.engine.sampling.TokenChooser` — the same grammar masks, sampling and stop handling as the
swarm's batched path, for fast tests of the API surface (structured outputs, tools) on the real SmolLM2.
:func:`serve` runs the routes on a loopback port (uvicorn in a thread) for the official ``openai`` client;
:func:`kept_reference` is an ``openai`` client of those routes whose answers are kept in the user cache (ground truth
that several runs read: each answer is computed once per checkpoint, library versions and code).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import socket
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from swarm.api.errors import ApiError, validation_error
from swarm.api.openai_routes import add_openai_routes
from swarm.engine.completion import Finished
from swarm.engine.sampling import StopMatcher, TokenChooser
from swarm.model.tokenizer import text_decoder

from real_model import decoding_digest, kept_entry, reference_dir


class LocalEngine:
    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        self.eos_token_id = self.tokenizer.eos_token_id
        self._decode = text_decoder(self.tokenizer)  # as the swarm's engine decodes

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self._decode(token_ids)


class LocalRunner:
    def __init__(self, engine: LocalEngine):
        self.engine = engine
        self.lock = threading.Lock()

    def _generate(self, input_ids, params, emit):
        engine = self.engine
        chooser = TokenChooser(params, engine.model.config.vocab_size)
        produced, past, feed = [], None, list(input_ids)
        matcher = StopMatcher(params.stop) if params.stop else None
        finish = "length"
        with self.lock, torch.inference_mode():
            for _ in range(params.max_new_tokens):
                TokenChooser.prepare([chooser])  # the batched path's mask hook
                out = engine.model(torch.tensor([feed]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                forced = chooser(torch.tensor([list(input_ids) + produced]), out.logits[:, -1].float())
                token = int(forced[0].argmax())
                produced.append(token)
                emit(token)
                feed = [token]
                if params.stops_at_eos and token == engine.eos_token_id:
                    finish = "stop"
                    break
                if matcher is not None and len(produced) >= params.min_tokens:
                    after = len(engine.decode(produced[:params.min_tokens - 1])) if params.min_tokens > 1 else 0
                    if matcher.check(engine.decode(produced), after)[1]:
                        finish = "stop"
                        break
        return Finished(produced, finish, "local", ["local"], [], 0.0, 0.0, {}, logprobs=chooser.logprobs)

    async def run(self, client, input_ids, params, is_disconnected, *, dual=False):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        task = loop.run_in_executor(None, self._generate, input_ids, params,
                                    lambda t: loop.call_soon_threadsafe(queue.put_nowait, t))
        while not task.done() or not queue.empty():
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield getter.result()
            else:
                getter.cancel()
        yield task.result()


def make_app(model_dir, max_length: int = 2048, model_name: str = "smollm2") -> FastAPI:
    engine = LocalEngine(model_dir)
    app = FastAPI(title="local")

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        headers = {} if exc.retry_after_s is None else {"Retry-After": str(math.ceil(exc.retry_after_s))}
        return JSONResponse(exc.body(), status_code=exc.status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        error = validation_error(exc.errors(), request.headers.get("content-type"))
        return JSONResponse(error.body(), status_code=error.status)

    add_openai_routes(app, runner=LocalRunner(engine), engine=engine, model_name=model_name,
                      max_length=max_length, client_of=lambda authorization, fallback: fallback or "local")
    app.state.engine = engine
    return app


@contextmanager
def serve(app: FastAPI):
    """The app on a loopback port for the length of the block; yields its base URL."""
    import uvicorn

    sock = socket.socket()  # bound here and handed to uvicorn: no window in which another bind could take it
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the local API did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


# -- answers kept across runs ----------------------------------------------------------------------------------
_CODE = Path(__file__).resolve().parent.parent / "swarm"


def code_digest() -> str:
    """sha256 over the code that decides a local answer: every module of ``swarm/`` (handlers, wire formats,
    grammar, sampling, tokenizer and chat templates) and this file. A change anywhere there computes the answers
    anew; an unchanged tree reads the kept ones."""
    digest = hashlib.sha256()
    for path in sorted([*_CODE.rglob("*.py"), Path(__file__).resolve()]):
        digest.update(f"{path.relative_to(_CODE.parent)}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


_CALL_IDS = ("id", "tool_call_id", "call_id")


def without_call_ids(body: bytes) -> bytes:
    """The request body with the tool-call and item ids inside ``messages``/``input`` numbered by first appearance
    (``id0``, ``id1``, ...; equal ids stay equal): the key of a question whose ids cannot reach the prompt, because
    the chat template has no tool section and the fallback rendering drops them (``swarm.api.tools``). The swarm
    answers with new random ids each run, and a conversation that sends them back is the same question."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    numbers: dict[str, str] = {}

    def walk(node):
        if isinstance(node, list):
            return [walk(item) for item in node]
        if isinstance(node, dict):
            return {key: (numbers.setdefault(value, f"id{len(numbers)}") if key in _CALL_IDS and isinstance(value, str)
                          else walk(value)) for key, value in node.items()}
        return node

    if not isinstance(doc, dict):
        return body
    for field in ("messages", "input"):
        if field in doc:
            doc[field] = walk(doc[field])
    return json.dumps(doc, sort_keys=True).encode()


class KeptAnswers(httpx.BaseTransport):
    """An ``httpx`` transport that answers a request from the kept responses when it has one and otherwise sends it
    to the local API (started on the first miss) and keeps its response: status, content type and body bytes
    (a stream's whole event stream, which the ``openai`` client then reads as it would the live one). The key is
    a digest of the method, path and body with the checkpoint's decoding digest (weights, tokenizer, library
    versions: ``real_model.decoding_digest``) and :func:`code_digest`; only 200s are kept. With ``ids_in_prompt``
    false the key leaves out the tool-call ids (:func:`without_call_ids`). Entries are written under a file lock,
    so xdist workers asking the same question compute it once (``real_model.kept_entry``)."""

    def __init__(self, directory: Path, salt: str, start, *, ids_in_prompt: bool = True):
        self.directory, self.salt, self._start = directory, salt, start
        self.ids_in_prompt = ids_in_prompt
        self._live: httpx.HTTPTransport | None = None
        self._base = ""
        self.misses = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        question = body if self.ids_in_prompt else without_call_ids(body)
        key = hashlib.sha256(b"\0".join([self.salt.encode(), request.method.encode(),
                                          request.url.path.encode(), question])).hexdigest()[:40]
        kept = kept_entry(self.directory / f"{key}.json", lambda entry: entry is not None,
                          lambda: self._ask(request, body), keep=lambda entry: entry["status"] == 200)
        return httpx.Response(kept["status"], headers={"content-type": kept["content_type"]},
                              content=kept["body"].encode(), request=request)

    def _ask(self, request: httpx.Request, body: bytes) -> dict:
        self.misses += 1
        if self._live is None:
            self._base = self._start()
            self._live = httpx.HTTPTransport()
        url = httpx.URL(self._base).join(request.url.raw_path.decode())
        live = httpx.Request(request.method, url, headers=request.headers, content=body)
        response = self._live.handle_request(live)
        try:
            content = response.read()
        finally:
            response.close()
        return {"status": response.status_code, "content_type": response.headers.get("content-type", ""),
                "body": content.decode()}

    def close(self) -> None:
        if self._live is not None:
            self._live.close()


@contextmanager
def kept_reference(model_dir, *, max_length: int = 2048, model_name: str = "smollm2", timeout: float = 300):
    """An ``openai.OpenAI`` client of the local API whose answers are kept (:class:`KeptAnswers`, in the greedy
    references' directory: ``real_model.reference_dir``, so ``CHAINSWARM_FRESH_REFERENCES=1`` computes them anew
    too). The local model is loaded only when an answer is not kept yet; ``client.transport.misses`` counts them."""
    import openai

    from swarm.api.tools import has_tool_section
    from swarm.model.tokenizer import load_tokenizer

    directory = reference_dir(model_dir) / "api"
    directory.mkdir(exist_ok=True)
    salt = f"{decoding_digest(model_dir)}\0{code_digest()}\0{max_length}\0{model_name}"
    template = getattr(load_tokenizer(model_dir), "chat_template", None)
    with ExitStack() as stack:
        transport = KeptAnswers(directory, salt,
                                lambda: stack.enter_context(serve(make_app(model_dir, max_length, model_name))),
                                ids_in_prompt=has_tool_section(template))
        stack.callback(transport.close)
        client = openai.OpenAI(base_url="http://local-reference/v1", api_key="local", max_retries=0,
                               timeout=timeout, http_client=httpx.Client(transport=transport, timeout=timeout))
        client.transport = transport
        yield client
