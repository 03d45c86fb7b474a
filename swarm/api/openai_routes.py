"""The OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Both generation endpoints turn a request into :class:`~swarm.engine.sampling.SamplingParams`, start ``n`` runs of
:class:`swarm.engine.completion.CompletionRunner` (each a session through the fair queue, charged to the client) and
shape what the runs yield into OpenAI's response or stream format. The token pump, liveness and retries live
in the runner; this module only speaks the wire format:

* text is decoded from the generated token ids; ``stop`` strings are cut with
  :class:`~swarm.engine.sampling.StopMatcher` (a streamed delta never contains a stop string or its beginning);
* ``logprobs`` (completions: the legacy ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``; chat:
  ``content`` entries with ``bytes``) come from the LM head's real distribution;
* a stream answers with an HTTP status until its first token exists (so a refusal is still a 4xx/5xx), then
  sends SSE chunks, a final chunk with ``finish_reason`` per choice, the usage chunk when
  ``stream_options.include_usage`` is set, and ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Header, Request, Response
from fastapi.responses import StreamingResponse

from swarm.api.errors import REFUSALS, ApiError, refusal
from swarm.engine.completion import ClientGone, Finished
from swarm.engine.sampling import SamplingParams, StopMatcher, TokenLogprob
from swarm.api.schemas import (
    UNSUPPORTED_CHAT_FIELDS, UNSUPPORTED_COMPLETION_FIELDS, ChatCompletionRequest, CompletionRequest,
    CompletionResponse,
)

def prompt_char_limit(tokenizer, max_length: int) -> int:
    """The most characters a text of ``max_length`` tokens can have: ``max_length`` times the longest vocabulary
    entry (no token stands for more characters than its entry has: byte-level BPE spells one byte per
    character, sentencepiece a space as one ``▁``). A tokenizer without a vocabulary: the schema's bound."""
    from swarm.api.schemas import MAX_PROMPT_CHARS

    try:
        longest = max(len(token) for token in tokenizer.get_vocab())
    except Exception:
        return MAX_PROMPT_CHARS
    return min(MAX_PROMPT_CHARS, max_length * max(1, longest))


def add_openai_routes(app: FastAPI, *, runner, engine, model_name: str, max_length: int,
                      client_of: Callable[[str | None, str | None], str]) -> None:
    """Register the OpenAI-compatible routes on ``app``. ``client_of(authorization, fallback)`` names the
    client (API key or self-declared id)."""

    limit: list[int] = []  # characters a prompt of max_length tokens can have (computed once)

    def check(body, unsupported, chars: int) -> None:
        """Refuse what cannot be served before any work (``chars``: the prompt's or the messages' length)."""
        if engine is None:
            raise ApiError(503, "unavailable", "this orchestrator does not proxy completions (no engine)")
        used = [name for name in unsupported if getattr(body, name) is not None]
        if used:
            raise ApiError(400, "unsupported_parameter", f"not supported by Chainswarm: {', '.join(used)}")
        if body.model is not None and body.model != model_name:
            raise ApiError(404, "model_not_found", f"this swarm serves {model_name!r}, not {body.model!r}")
        if not limit:
            limit.append(prompt_char_limit(engine.tokenizer, max_length))
        if chars > limit[0]:  # tokenizing it (on the event loop) would be work for nothing
            raise ApiError(400, "invalid_request", f"the prompt ({chars} characters) is longer than "
                           f"{max_length} tokens can be, the swarm's maximum session length")

    def sampling(body, input_ids: list[int], max_tokens: int | None, logprobs: int | None) -> list[SamplingParams]:
        room = max_length - len(input_ids)
        if max_tokens is None:
            if room < 1:
                raise ApiError(400, "invalid_request", f"the prompt ({len(input_ids)} tokens) leaves no room in "
                                f"the swarm's maximum session length of {max_length} tokens")
            max_tokens = room
        return [SamplingParams(max_tokens, body.temperature, body.top_p,
                               None if body.seed is None else body.seed + i, body.presence_penalty,
                               body.frequency_penalty, body.bias_pairs(), logprobs, body.stop_strings())
                for i in range(body.n)]

    async def choices(client: str, input_ids: list[int], params: list[SamplingParams],
                      request: Request) -> AsyncIterator[tuple[int, int | Finished]]:
        """Items of all ``n`` runs as ``(choice index, token or Finished)``; the first failure ends them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def drain(index: int, run) -> None:
            try:
                async with contextlib.aclosing(run):
                    async for item in run:
                        await queue.put((index, item))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((index, exc))

        tasks = [asyncio.ensure_future(drain(i, runner.run(client, input_ids, p, request.is_disconnected)))
                 for i, p in enumerate(params)]
        try:
            finished = 0
            while finished < len(tasks):
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished += isinstance(item, Finished)
                yield index, item
        finally:
            for task in tasks:
                task.cancel()

    def begin(body, client: str, input_ids: list[int], max_tokens: int | None, logprobs: int | None,
              request: Request, id_prefix: str):
        """Start the request's ``n`` runs: its stop strings, the response's id/created/model, the items."""
        meta = {"id": f"{id_prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_name}
        params = sampling(body, input_ids, max_tokens, logprobs)
        return body.stop_strings(), meta, choices(client, input_ids, params, request)

    async def first_or_refuse(items: AsyncIterator):
        """Wait for the first token (or the whole answer) here, so that a refusal is still an HTTP status."""
        try:
            return await items.__anext__()
        except ClientGone:
            return None
        except REFUSALS as exc:
            raise refusal(exc) from None

    async def collect(items: AsyncIterator, n: int) -> list[Finished] | None:
        done: list[Finished | None] = [None] * n
        try:
            async with contextlib.aclosing(items):
                async for index, item in items:
                    if isinstance(item, Finished):
                        done[index] = item
        except ClientGone:
            return None
        except REFUSALS as exc:
            raise refusal(exc) from None
        return done  # type: ignore[return-value]

    def text_of(done: Finished, stop: tuple[str, ...]) -> str:
        return StopMatcher(stop).final(engine.decode(done.token_ids))

    def kept_logprobs(done: Finished, text: str) -> list[TokenLogprob]:
        """The logprobs of the tokens that the returned text holds (a stop string's tokens are cut)."""
        kept, length = [], 0
        for record in done.logprobs:
            if length >= len(text):
                break
            kept.append(record)
            length += len(engine.decode([record.token_id]))
        return kept

    def legacy_logprobs(records: list[TokenLogprob]) -> dict:
        tokens = [engine.decode([r.token_id]) for r in records]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [{engine.decode([t]): lp for t, lp in r.top} for r in records],
                "text_offset": offsets}

    def chat_logprobs(records: list[TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = engine.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                            for r in records]}

    def usage(prompt_tokens: int, done: list[Finished]) -> dict:
        completion = sum(len(d.token_ids) for d in done)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def swarm_info(done: Finished) -> dict:
        return {"chain_id": done.chain_id, "servers": done.servers, "route": done.route,
                "waiting_s": done.waiting_s, "service_s": done.service_s}

    def sse(doc: dict) -> bytes:
        return f"data: {json.dumps(doc)}\n\n".encode()

    async def stream(items: AsyncIterator, first, n: int, stop: tuple[str, ...], prompt_tokens: int,
                     chunk: Callable[[int, str, str | None, list[TokenLogprob] | None], dict],
                     head: Callable[[int], dict] | None, include_usage: bool, meta: dict) -> AsyncIterator[bytes]:
        produced: list[list[int]] = [[] for _ in range(n)]
        sent = [""] * n
        done: list[Finished] = []
        matcher = StopMatcher(stop)
        async with contextlib.aclosing(items):
            if head is not None:
                for index in range(n):
                    yield sse(head(index))
            try:
                item = first
                while item is not None:
                    index, value = item
                    if isinstance(value, Finished):
                        done.append(value)
                        text = text_of(value, stop)
                        # token events carry ids only: every kept token's logprobs travel with the last chunk
                        records = kept_logprobs(value, text) if value.logprobs else None
                        last = chunk(index, text[len(sent[index]):], value.finish_reason, records)
                        yield sse({**last, "chainswarm": swarm_info(value)})  # each choice's last chunk
                    else:
                        produced[index].append(value)
                        text = engine.decode(produced[index])
                        safe, _ = matcher.check(text) if stop else (text, False)
                        if safe and not safe.endswith("\ufffd") and len(safe) > len(sent[index]):
                            yield sse(chunk(index, safe[len(sent[index]):], None, None))
                            sent[index] = safe
                    item = await items.__anext__() if len(done) < n else None
            except (ClientGone, StopAsyncIteration):
                return
            except REFUSALS as exc:
                err = refusal(exc)
                yield sse({"error": {"type": err.kind, "message": err.message}})
                return
        if include_usage:
            yield sse({**meta, "choices": [], "usage": usage(prompt_tokens, done)})
        yield b"data: [DONE]\n\n"

    # -- completions -----------------------------------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse, response_model_exclude_none=True,
              responses={400: {}, 401: {}, 404: {}, 422: {}, 429: {}, 503: {}})
    async def completions(body: CompletionRequest, request: Request, response: Response,
                          authorization: str | None = Header(None), x_client_id: str | None = Header(None)):
        check(body, UNSUPPORTED_COMPLETION_FIELDS, len(body.prompt))
        client = client_of(authorization, x_client_id or body.user)
        input_ids = engine.encode(body.prompt)
        stop, meta, items = begin(body, client, input_ids, body.max_tokens, body.logprobs, request, "cmpl")
        if not body.stream:
            done = await collect(items, body.n)
            if done is None:
                return Response(status_code=499)
            prefix = done[0].prefix
            response.headers["x-chainswarm-prefix"] = (
                f"expected={prefix.get('expected', 0)};reused={prefix.get('reused', 0)};"
                f"prefill={prefix.get('prefill', 0)};restarts={prefix.get('restarts', 0)}")
            out = []
            for index, d in enumerate(done):
                text = text_of(d, stop)
                out.append({"index": index, "text": text, "finish_reason": d.finish_reason,
                            "logprobs": legacy_logprobs(kept_logprobs(d, text)) if body.logprobs is not None else None})
            return {**meta, "object": "text_completion", "choices": out, "usage": usage(len(input_ids), done),
                    "chainswarm": swarm_info(done[0])}

        first = await first_or_refuse(items)
        if first is None:
            return Response(status_code=499)

        def chunk(index, text, finish, records):
            logprobs = legacy_logprobs(records) if records is not None and body.logprobs is not None else None
            return {**meta, "object": "text_completion",
                    "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(items, first, body.n, stop, len(input_ids), chunk, None, include,
                                        {**meta, "object": "text_completion"}), media_type="text/event-stream")

    # -- chat ------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", responses={400: {}, 401: {}, 404: {}, 422: {}, 429: {}, 503: {}})
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               authorization: str | None = Header(None), x_client_id: str | None = Header(None)):
        check(body, UNSUPPORTED_CHAT_FIELDS, sum(len(m.content) for m in body.messages))
        client = client_of(authorization, x_client_id or body.user)
        template = getattr(engine.tokenizer, "chat_template", None)
        if not template:
            raise ApiError(400, "invalid_request", f"{model_name} has no chat template; use /v1/completions")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template rejected the conversation (e.g. roles out of order)
            raise ApiError(400, "invalid_request", f"the chat template cannot render these messages: {exc}")
        input_ids = engine.encode(prompt)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        stop, meta, items = begin(body, client, input_ids, body.max_completion_tokens or body.max_tokens, logprobs,
                                  request, "chatcmpl")
        if not body.stream:
            done = await collect(items, body.n)
            if done is None:
                return Response(status_code=499)
            out = []
            for index, d in enumerate(done):
                text = text_of(d, stop)
                out.append({"index": index, "message": {"role": "assistant", "content": text},
                            "finish_reason": d.finish_reason,
                            "logprobs": chat_logprobs(kept_logprobs(d, text)) if body.logprobs else None})
            return {**meta, "object": "chat.completion", "choices": out, "usage": usage(len(input_ids), done),
                    "chainswarm": swarm_info(done[0])}

        first = await first_or_refuse(items)
        if first is None:
            return Response(status_code=499)
        chunk_meta = {**meta, "object": "chat.completion.chunk"}

        def head(index):
            return {**chunk_meta, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                               "finish_reason": None, "logprobs": None}]}

        def chunk(index, text, finish, records):
            delta = {"content": text} if text or finish is None else {}
            logprobs = chat_logprobs(records) if records is not None and body.logprobs else None
            return {**chunk_meta, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                               "logprobs": logprobs}]}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(items, first, body.n, stop, len(input_ids), chunk, head, include,
                                        chunk_meta), media_type="text/event-stream")

    # -- models ----------------------------------------------------------------------------------------
    started = int(time.time())

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "chainswarm"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}", responses={404: {}})
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise ApiError(404, "model_not_found", f"this swarm serves {model_name!r}, not {model_id!r}")
        return model_card()
