"""``POST /v1/completions`` (OpenAI's legacy text completions): :class:`OpenAIServingCompletion`."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from functools import partial

from fastapi import Header, Request, Response
from fastapi.responses import StreamingResponse

from swarm.api.errors import ApiError
from swarm.api.schemas import MAX_PROMPT_CHARS, UNSUPPORTED_COMPLETION_FIELDS, CompletionRequest
from swarm.api.serving_base import OpenAIServing, sse, swarm_info, usage
from swarm.api.structured import compile_plan, plan_output
from swarm.engine.completion import Finished
from swarm.engine.sampling import TokenLogprob


class OpenAIServingCompletion(OpenAIServing):
    """Text completions: the prompt as it is, ``logprobs`` in the legacy ``tokens``/``token_logprobs``/
    ``top_logprobs``/``text_offset`` form, the prefix-cache outcome in ``x-chainswarm-prefix``."""

    id_prefix = "cmpl"

    # The route's operation (summary "Completions"; its docstring would become the OpenAPI description).
    async def completions(self, body: CompletionRequest, request: Request, response: Response,
                          authorization: str | None = Header(None), x_client_id: str | None = Header(None)):
        prompts = body.prompts()
        self.check(body, UNSUPPORTED_COMPLETION_FIELDS, max((len(p) for p in prompts if isinstance(p, str)), default=0))
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "invalid_request", "max_tokens 0 generates nothing: it is allowed only with echo "
                           "(the prompt returned, with logprobs scored)")
        if sum(len(p) for p in prompts if isinstance(p, str)) > MAX_PROMPT_CHARS:  # tokenized on the event loop
            raise ApiError(400, "invalid_request", f"a batch's prompts have more than {MAX_PROMPT_CHARS:,} characters "
                           "together (send fewer at a time)")
        if body.stream and len(prompts) > 1:
            raise ApiError(400, "invalid_request", f"a stream answers one prompt; this request has {len(prompts)} "
                           "(send them without stream, or one request each)")
        client = self.client_of(authorization, x_client_id or body.user)
        if body.echo and body.logprobs is not None and (body.dual_execution or client in self.dual_clients):
            raise ApiError(400, "invalid_request", "echo with logprobs cannot run with dual execution: a prompt's "
                           "scores are not re-executed")
        inputs = [self.tokens_of(p) for p in prompts]
        plan = await compile_plan(plan_output(body), self.engine.tokenizer)  # response_format (vLLM's extension)
        if len(inputs) == 1:
            return await self.complete(body, client, *inputs[0], plan, request, response)
        # a batch of prompts (evaluation harnesses send them): every prompt's runs at once, choices in prompt order
        tasks = [asyncio.ensure_future(self.complete(body, client, ids, text, plan, request,
                                                     response if i == 0 else Response()))
                 for i, (ids, text) in enumerate(inputs)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            docs = [task.result() for task in tasks]  # the first refusal is the request's
        finally:
            for task in tasks:
                task.cancel()
        if any(isinstance(doc, Response) for doc in docs):
            return Response(status_code=499)  # the client left
        choices = [dict(c, index=i) for i, c in enumerate(c for doc in docs for c in doc["choices"])]
        total = {key: sum(doc["usage"][key] for doc in docs) for key in docs[0]["usage"]}
        return {**docs[0], "choices": choices, "usage": total}

    def tokens_of(self, prompt: str | list[int]) -> tuple[list[int], str]:
        """A prompt's token ids and text (a prompt given as token ids is checked against the vocabulary)."""
        if isinstance(prompt, str):
            return self.engine.encode(prompt), prompt
        vocabulary = len(self.engine.tokenizer)
        bad = next((t for t in prompt if not 0 <= t < vocabulary), None)
        if bad is not None:
            raise ApiError(400, "invalid_request", f"token id {bad} is not in the model's vocabulary of {vocabulary}")
        return list(prompt), self.engine.decode(list(prompt))

    async def complete(self, body: CompletionRequest, client: str, input_ids: list[int], prompt: str, plan,
                       request: Request, response: Response):
        """One prompt's ``n`` choices: the response document, a stream, or a 499 (the client left)."""
        echo, scored = None, None
        # echo with logprobs: the prompt is scored (swarm.engine.scoring) in the answer's own run where there is one
        # answer, not streamed (lm-evaluation-harness's request); else in a run of its own through the fair queue first
        together = body.echo and body.logprobs is not None and body.max_tokens != 0 and body.n == 1 and not body.stream
        if body.echo:
            if body.logprobs is not None and not together:
                scored = await self.score(body, client, input_ids, request)
                if scored is None:
                    return Response(status_code=499)
            echo = Echo(prompt, input_ids, scored.prompt_logprobs if scored is not None else None)
            if body.max_tokens == 0:
                return self.echo_only(body, echo, scored)
        stop, meta, items = self.begin(body, client, input_ids, body.max_tokens, body.logprobs, request, plan.grammar,
                                       body.logprobs if together else None)
        if not body.stream:
            done = await self.collect(items, body.n)
            if done is None:
                return Response(status_code=499)
            if together:
                echo.scores = done[0].prompt_logprobs
            prefix = done[0].prefix
            response.headers["x-chainswarm-prefix"] = (
                f"expected={prefix.get('expected', 0)};reused={prefix.get('reused', 0)};"
                f"prefill={prefix.get('prefill', 0)};restarts={prefix.get('restarts', 0)}")
            out = []
            for index, d in enumerate(done):
                text = self.text_of(d, stop, body.min_tokens)
                logprobs = (self.legacy_logprobs(self.kept_logprobs(d, text), echo) if body.logprobs is not None
                            else None)
                text = text if echo is None else echo.text + text
                out.append({"index": index, "text": text, "finish_reason": d.finish_reason, "logprobs": logprobs})
            return {**meta, "object": "text_completion", "choices": out, "usage": usage(len(input_ids), done),
                    "chainswarm": swarm_info(done[0])}

        first = await self.first_or_refuse(items)
        if first is None:
            return Response(status_code=499)
        include = bool(body.stream_options and body.stream_options.include_usage)
        head = None if echo is None else partial(self.chunk, body, meta, None, text=echo.text, finish=None,
                                                  records=None)  # each choice starts with the echoed prompt
        return StreamingResponse(self.stream(items, first, body.n, stop, len(input_ids),
                                             partial(self.chunk, body, meta, echo), head, include,
                                             {**meta, "object": "text_completion"}, body.min_tokens),
                                 media_type="text/event-stream")

    def chunk(self, body: CompletionRequest, meta: dict, echo: Echo | None, index: int, text: str,
              finish: str | None, records: list[TokenLogprob] | None) -> dict:
        """One stream chunk of choice ``index`` (its last one carries the logprobs: with ``echo``, the prompt's
        first)."""
        if records is None and finish is not None and echo is not None and echo.scores is not None:
            records = []  # a choice's last chunk carries the prompt's logprobs whatever it generated
        logprobs = (self.legacy_logprobs(records, echo) if records is not None and body.logprobs is not None
                    else None)
        return {**meta, "object": "text_completion",
                "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]}

    async def score(self, body: CompletionRequest, client: str, input_ids: list[int],
                    request: Request) -> Finished | None:
        """One run of max_tokens 0 that scores the prompt (``prompt_logprobs``, ``body.logprobs`` alternatives),
        queued and charged as any request; None: the client left."""
        params = replace(self.sampling(body.model_copy(update={"n": 1}), input_ids, 0, None)[0],
                         prompt_logprobs=body.logprobs)
        done = await self.collect(self.choices(client, input_ids, [params], request), 1)
        return None if done is None else done[0]

    def echo_only(self, body: CompletionRequest, echo: Echo, scored: Finished | None):
        """max_tokens 0: every choice is the prompt (scored by ``scored``'s run, if logprobs were asked)."""
        if len(echo.input_ids) > self.max_length:
            raise ApiError(400, "invalid_request", f"the prompt ({len(echo.input_ids)} tokens) exceeds the swarm's "
                           f"maximum session length of {self.max_length} tokens")
        meta = self.response_meta()
        logprobs = self.legacy_logprobs([], echo) if body.logprobs is not None else None
        choices = [{"index": i, "text": echo.text, "finish_reason": "length", "logprobs": logprobs}
                   for i in range(body.n)]
        info = {"chainswarm": swarm_info(scored)} if scored is not None else {}
        use = usage(len(echo.input_ids), [])
        if not body.stream:
            return {**meta, "object": "text_completion", "choices": choices, "usage": use, **info}

        def events():
            for choice in choices:
                yield sse({**meta, "object": "text_completion", "choices": [choice], **info})
            if body.stream_options and body.stream_options.include_usage:
                yield sse({**meta, "object": "text_completion", "choices": [], "usage": use})
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    def legacy_logprobs(self, records: list[TokenLogprob], echo: Echo | None = None) -> dict:
        """OpenAI's legacy form of ``records``; with ``echo`` the prompt's tokens come first, the very first with
        ``null`` logprob and alternatives (it follows nothing)."""
        decode = self.engine.decode
        ids, values, tops = [], [], []
        if echo is not None and echo.scores is not None:
            ids.append(echo.input_ids[0]), values.append(None), tops.append(None)
            records = [*echo.scores, *records]
        for r in records:
            ids.append(r.token_id), values.append(r.logprob), tops.append({decode([t]): lp for t, lp in r.top})
        tokens = [decode([i]) for i in ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


@dataclass
class Echo:
    """``echo``: the prompt as the text starts with it, its token ids, and (with logprobs) the scores of every
    token after the first (:mod:`swarm.engine.scoring`)."""

    text: str
    input_ids: list[int]
    scores: list[TokenLogprob] | None
