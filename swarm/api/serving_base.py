"""What the OpenAI-compatible generation handlers share (:class:`OpenAIServing`).

Both generation endpoints turn a request into :class:`~swarm.engine.sampling.SamplingParams`, start ``n`` runs of
:class:`swarm.engine.completion.CompletionRunner` (each a session through the fair queue, charged to the client) and
shape what the runs yield into OpenAI's response or stream format. The token pump, liveness and retries live
in the runner; the handlers only speak the wire format:

* text is decoded from the generated token ids; ``stop`` strings are cut with
  :class:`~swarm.engine.sampling.StopMatcher` (a streamed delta never contains a stop string or its beginning);
* ``logprobs`` come from the LM head's real distribution (each endpoint family shapes them its own way);
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
from dataclasses import replace
from typing import AsyncIterator, Callable

from fastapi import Request

from swarm.api.errors import REFUSALS, ApiError, refusal
from swarm.api.schemas import MAX_PROMPT_CHARS
from swarm.engine.completion import ClientGone, Finished
from swarm.engine.sampling import SamplingParams, StopMatcher, TokenLogprob

ChunkFn = Callable[[int, str, "str | None", "list[TokenLogprob] | None"], dict]
"""``chunk(choice index, text delta, finish_reason or None, kept logprobs or None)``: one stream chunk."""


def prompt_char_limit(tokenizer, max_length: int) -> int:
    """The most characters a text of ``max_length`` tokens can have: ``max_length`` times the longest vocabulary
    entry (no token stands for more characters than its entry has: byte-level BPE spells one byte per
    character, sentencepiece a space as one ``▁``). A tokenizer without a vocabulary: the schema's bound."""
    try:
        longest = max(len(token) for token in tokenizer.get_vocab())
    except Exception:
        return MAX_PROMPT_CHARS
    return min(MAX_PROMPT_CHARS, max_length * max(1, longest))


def sse(doc: dict) -> bytes:
    """One server-sent event carrying ``doc`` as JSON."""
    return f"data: {json.dumps(doc)}\n\n".encode()


def stream_end(meta: dict, use: dict, include_usage: bool) -> list[bytes]:
    """A stream's last events: the usage chunk (``stream_options.include_usage``), then ``[DONE]``."""
    return ([sse({**meta, "choices": [], "usage": use})] if include_usage else []) + [b"data: [DONE]\n\n"]


def usage(prompt_tokens: int, done: list[Finished]) -> dict:
    completion = sum(len(d.token_ids) for d in done)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def swarm_info(done: Finished) -> dict:
    """The ``chainswarm`` field: how the swarm served the request."""
    info = {"chain_id": done.chain_id, "servers": done.servers, "route": done.route,
            "waiting_s": done.waiting_s, "service_s": done.service_s, "request_id": done.request_id}
    if done.verified is not None:
        info["verified"] = done.verified
    return info


class OpenAIServing:
    """The handles every generation handler needs and the steps they share: admission checks, the ``n`` runs
    through the fair queue, refusal-to-HTTP mapping, decoding with stop strings, and the SSE stream.

    ``runner`` is the :class:`~swarm.engine.completion.CompletionRunner` (None without an engine), ``engine`` the
    :class:`~swarm.engine.generation.GenerationEngine` (None: this orchestrator does not proxy completions),
    ``client_of(authorization, fallback)`` names the client (API key or self-declared id)."""

    id_prefix = "cmpl-"  # the response ids' prefix (OpenAI's: cmpl-, chatcmpl-, resp_)
    prompt_param = "prompt"  # the request's field of the prompt: a too-long context's error names it

    def __init__(self, *, runner, engine, model_name: str, max_length: int,
                 client_of: Callable[[str | None, str | None], str]):
        self.runner, self.engine, self.model_name, self.max_length = runner, engine, model_name, max_length
        self.client_of = client_of
        self._char_limit: int | None = None  # characters a prompt of max_length tokens can have (computed once)

    @property
    def dual_clients(self) -> set[str]:
        """Clients whose every request runs with dual execution (``--dual-execution-clients``)."""
        config = getattr(getattr(self.runner, "orchestrator", None), "config", None)
        return set(getattr(config, "dual_execution_clients", None) or ())

    # -- admission -------------------------------------------------------------------------------------
    def check(self, body, unsupported, chars: int) -> None:
        """Refuse what cannot be served before any work (``chars``: the prompt's or the messages' length)."""
        if self.engine is None:
            raise ApiError(503, "unavailable", "this orchestrator does not proxy completions (no engine)")
        used = [name for name in unsupported if getattr(body, name) is not None]
        if used:
            raise ApiError(400, "unsupported_parameter", f"not supported by Chainswarm: {', '.join(used)}",
                           param=used[0])
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, "model_not_found", f"this swarm serves {self.model_name!r}, not {body.model!r}",
                           param="model")
        if getattr(body, "logit_bias", None):  # keys past the vocabulary were accepted and biased nothing
            self.check_vocabulary([int(k) for k in body.logit_bias], "logit_bias")
        if self._char_limit is None:
            self._char_limit = prompt_char_limit(self.engine.tokenizer, self.max_length)
        if chars > self._char_limit:  # tokenizing it (on the event loop) would be work for nothing
            raise ApiError(400, "context_length_exceeded", f"the prompt ({chars} characters) is longer than "
                           f"{self.max_length} tokens can be, the swarm's maximum session length",
                           param=self.prompt_param)

    def check_vocabulary(self, token_ids, param: str) -> None:
        """400 for the first of ``token_ids`` (sent as ``param``) that is not in the model's vocabulary."""
        vocabulary = len(self.engine.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < vocabulary), None)
        if bad is not None:
            where = "" if param == "prompt" else f"{param}: "
            raise ApiError(400, "invalid_request", f"{where}token id {bad} is not in the model's vocabulary of "
                           f"{vocabulary}", param=param)

    def sampling(self, body, input_ids: list[int], max_tokens: int | None,
                 logprobs: int | None, grammar=None) -> list[SamplingParams]:
        room = self.max_length - len(input_ids)
        grows = max_tokens is None  # to the end of the session length, reserved as it grows
        if max_tokens is None:
            if room < 1:
                raise ApiError(400, "context_length_exceeded", f"the prompt ({len(input_ids)} tokens) leaves no "
                               f"room in the swarm's maximum session length of {self.max_length} tokens",
                               param=self.prompt_param)
            max_tokens = room
        if body.min_tokens > max_tokens:
            raise ApiError(400, "invalid_request", f"min_tokens ({body.min_tokens}) is more than max_tokens "
                           f"({max_tokens})", param="min_tokens")
        eos = getattr(self.engine, "eos_token_id", None)
        return [SamplingParams(max_tokens, body.temperature, body.top_p,
                               None if body.seed is None else body.seed + i, body.presence_penalty,
                               body.frequency_penalty, body.bias_pairs(), logprobs, body.stop_strings(),
                               ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, top_k=body.top_k,
                               min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                               eos_token_ids=(eos,) if isinstance(eos, int) else (), grammar=grammar,
                               speculative=getattr(body, "speculative", True), grows=grows)
                for i in range(body.n)]

    # -- the n runs ------------------------------------------------------------------------------------
    async def choices(self, client: str, runs: list[tuple[list[int], SamplingParams]],
                      request: Request, dual: bool = False) -> AsyncIterator[tuple[int, int | Finished]]:
        """Items of all runs (``(prompt ids, params)`` each: a prompt's ``n``, or a batch's ``n`` per prompt) as
        ``(choice index, token or Finished)``, the index a run's place in ``runs``; the first failure ends them
        all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def drain(index: int, run) -> None:
            try:
                async with contextlib.aclosing(run):
                    async for item in run:
                        await queue.put((index, item))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((index, exc))

        tasks = [asyncio.ensure_future(drain(i, self.runner.run(client, input_ids, p, request.is_disconnected,
                                                                dual=dual)))
                 for i, (input_ids, p) in enumerate(runs)]
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

    def response_meta(self) -> dict:
        """A response's ``id``, ``created`` and ``model``."""
        return {"id": f"{self.id_prefix}{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": self.model_name}

    def begin(self, body, client: str, prompts: list[list[int]], max_tokens: int | None,
              logprobs: int | None, request: Request, grammar=None, prompt_logprobs: int | None = None):
        """Start the request's ``n`` runs per prompt (``prompts``' token ids; one for chat, a completions batch
        for more), prompt after prompt: its stop strings, the response's id/created/model, the items (with
        ``prompt_logprobs``, each prompt's first run scores the prompt too: :mod:`swarm.engine.scoring`)."""
        meta = self.response_meta()
        runs = []
        for ids in prompts:
            params = self.sampling(body, ids, max_tokens, logprobs, grammar)
            params[0] = replace(params[0], prompt_logprobs=prompt_logprobs)
            runs += [(ids, p) for p in params]
        dual = getattr(body, "dual_execution", False) or client in self.dual_clients
        return body.stop_strings(), meta, self.choices(client, runs, request, dual)

    async def first_or_refuse(self, items: AsyncIterator):
        """Wait for the first token (or the whole answer) here, so that a refusal is still an HTTP status."""
        try:
            return await items.__anext__()
        except ClientGone:
            return None
        except REFUSALS as exc:
            raise refusal(exc, self.prompt_param) from None

    async def collect(self, items: AsyncIterator, n: int) -> list[Finished] | None:
        """Every choice's :class:`Finished` (None: the client left); a refusal becomes its HTTP error."""
        done: list[Finished | None] = [None] * n
        try:
            async with contextlib.aclosing(items):
                async for index, item in items:
                    if isinstance(item, Finished):
                        done[index] = item
        except ClientGone:
            return None
        except REFUSALS as exc:
            raise refusal(exc, self.prompt_param) from None
        return done  # type: ignore[return-value]

    # -- text ------------------------------------------------------------------------------------------
    def text_of(self, done: Finished, stop: tuple[str, ...], min_tokens: int = 0) -> str:
        return StopMatcher(stop).final(self.engine.decode(done.token_ids),
                                       self.stop_after(done.token_ids, stop, min_tokens))

    def stop_after(self, token_ids: list[int], stop: tuple[str, ...], min_tokens: int) -> int:
        """The characters no stop string may end within: the text of the first ``min_tokens`` − 1 tokens (a
        stop string counts from the ``min_tokens``-th token on, as in vLLM)."""
        if not stop or min_tokens <= 1:
            return 0
        return len(self.engine.decode(token_ids[:min_tokens - 1]))

    def kept_logprobs(self, done: Finished, text: str) -> list[TokenLogprob]:
        """The logprobs of the tokens that the returned text holds (a stop string's tokens are cut)."""
        kept, length = [], 0
        for record in done.logprobs:
            if length >= len(text):
                break
            kept.append(record)
            length += len(self.engine.decode([record.token_id]))
        return kept

    # -- streaming -------------------------------------------------------------------------------------
    async def stream(self, items: AsyncIterator, first, n: int, stop: tuple[str, ...], prompt_tokens: int,
                     chunk: ChunkFn, head: Callable[[int], dict] | None, include_usage: bool,
                     meta: dict, min_tokens: int = 0) -> AsyncIterator[bytes]:
        """The SSE body: ``head(i)`` per choice (if any), text deltas, each choice's last chunk (with its
        logprobs and the ``chainswarm`` field), the usage chunk when ``include_usage``, ``[DONE]``. A refusal
        after the first token is an ``error`` event (the status was already sent). ``chunk`` may answer None
        for a delta it holds back (a tool call's text); its choice's last chunk is never None."""
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
                        text = self.text_of(value, stop, min_tokens)
                        # token events carry ids only: every kept token's logprobs travel with the last chunk
                        records = self.kept_logprobs(value, text) if value.logprobs else None
                        last = chunk(index, text[len(sent[index]):], value.finish_reason, records)
                        yield sse({**last, "chainswarm": swarm_info(value)})  # each choice's last chunk
                    else:
                        produced[index].append(value)
                        text = self.engine.decode(produced[index])
                        after = self.stop_after(produced[index], stop, min_tokens)
                        safe, _ = matcher.check(text, after) if stop else (text, False)
                        if safe and not safe.endswith("\ufffd") and len(safe) > len(sent[index]):
                            doc = chunk(index, safe[len(sent[index]):], None, None)
                            sent[index] = safe
                            if doc is not None:
                                yield sse(doc)
                    item = await items.__anext__() if len(done) < n else None
            except (ClientGone, StopAsyncIteration):
                return
            except REFUSALS as exc:
                err = refusal(exc, self.prompt_param)
                yield sse(err.body())
                return
        for event in stream_end(meta, usage(prompt_tokens, done), include_usage):
            yield event
