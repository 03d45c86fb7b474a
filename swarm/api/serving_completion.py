"""``POST /v1/completions`` (OpenAI's legacy text completions): :class:`OpenAIServingCompletion`."""
from __future__ import annotations

from dataclasses import dataclass, replace

from fastapi import Header, Request, Response
from fastapi.responses import StreamingResponse

from swarm.api.errors import ApiError
from swarm.api.schemas import MAX_PROMPT_CHARS, UNSUPPORTED_COMPLETION_FIELDS, CompletionRequest
from swarm.api.serving_base import OpenAIServing, sse, stream_end, swarm_info, usage
from swarm.api.structured import compile_plan, plan_output
from swarm.engine.completion import Finished
from swarm.engine.sampling import TokenLogprob


class OpenAIServingCompletion(OpenAIServing):
    """Text completions: the prompt as it is, ``logprobs`` in the legacy ``tokens``/``token_logprobs``/
    ``top_logprobs``/``text_offset`` form, the prefix-cache outcome in ``x-chainswarm-prefix``."""

    id_prefix = "cmpl-"

    # The route's operation (summary "Completions"; its docstring would become the OpenAPI description).
    async def completions(self, body: CompletionRequest, request: Request, response: Response,
                          authorization: str | None = Header(None), x_client_id: str | None = Header(None)):
        client = self.client_of(authorization, x_client_id or body.user)  # who asks, before what is asked
        prompts = body.prompts()
        self.check(body, UNSUPPORTED_COMPLETION_FIELDS, max((len(p) for p in prompts if isinstance(p, str)), default=0))
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "invalid_request", "max_tokens 0 generates nothing: it is allowed only with echo "
                           "(the prompt returned, with logprobs scored)", param="max_tokens")
        if sum(len(p) for p in prompts if isinstance(p, str)) > MAX_PROMPT_CHARS:  # tokenized on the event loop
            raise ApiError(400, "invalid_request", f"a batch's prompts have more than {MAX_PROMPT_CHARS:,} characters "
                           "together (send fewer at a time)", param="prompt")
        if body.echo and body.logprobs is not None and (body.dual_execution or client in self.dual_clients):
            raise ApiError(400, "invalid_request", "echo with logprobs cannot run with dual execution: a prompt's "
                           "scores are not re-executed", param="echo")
        inputs = [self.tokens_of(p) for p in prompts]
        plan = await compile_plan(plan_output(body), self.engine.tokenizer)  # response_format (vLLM's extension)
        return await self.complete(body, client, inputs, plan, request, response)

    def tokens_of(self, prompt: str | list[int]) -> tuple[list[int], str]:
        """A prompt's token ids and text (a prompt given as token ids is checked against the vocabulary)."""
        if isinstance(prompt, str):
            return self.engine.encode(prompt), prompt
        self.check_vocabulary(prompt, "prompt")
        return list(prompt), self.engine.decode(list(prompt))

    async def complete(self, body: CompletionRequest, client: str, inputs: list[tuple[list[int], str]], plan,
                       request: Request, response: Response):
        """The prompts' ``n`` choices each (a batch: choice ``p·n + i`` is prompt ``p``'s ``i``-th, all runs at
        once through the fair queue): the response document, a stream, or a 499 (the client left)."""
        prompts = [ids for ids, _ in inputs]
        n, prompt_tokens = body.n, sum(map(len, prompts))
        echoes, scored = [None] * len(inputs), [None] * len(inputs)
        # echo with logprobs: each prompt is scored (swarm.engine.scoring) in its answer's own run where it has one
        # answer, not streamed (lm-evaluation-harness's request); else in a run of its own through the fair queue
        together = body.echo and body.logprobs is not None and body.max_tokens != 0 and n == 1 and not body.stream
        if body.echo:
            if body.logprobs is not None and not together:
                scored = await self.score_all(body, client, prompts, request)
                if scored is None:
                    return Response(status_code=499)
            echoes = [Echo(text, ids, s.prompt_logprobs if s is not None else None)
                      for (ids, text), s in zip(inputs, scored)]
            if body.max_tokens == 0:
                if scored[0] is not None:
                    prefix_header(response, scored[0].prefix)
                return self.echo_only(body, echoes, scored)
        stop, meta, items = self.begin(body, client, prompts, body.max_tokens, body.logprobs, request, plan.grammar,
                                       body.logprobs if together else None)
        if not body.stream:
            done = await self.collect(items, n * len(inputs))
            if done is None:
                return Response(status_code=499)
            if together:
                for p, echo in enumerate(echoes):
                    echo.scores = done[p * n].prompt_logprobs
            prefix_header(response, done[0].prefix)
            out = []
            for index, d in enumerate(done):
                echo, text = echoes[index // n], self.text_of(d, stop, body.min_tokens)
                logprobs = (self.legacy_logprobs(self.kept_logprobs(d, text), echo) if body.logprobs is not None
                            else None)
                text = text if echo is None else echo.text + text
                out.append({"index": index, "text": text, "finish_reason": d.finish_reason, "logprobs": logprobs})
            return {**meta, "object": "text_completion", "choices": out, "usage": usage(prompt_tokens, done),
                    "chainswarm": swarm_info(done[0])}

        first = await self.first_or_refuse(items)
        if first is None:
            return Response(status_code=499)
        include = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(index: int, text: str, finish: str | None, records: list[TokenLogprob] | None) -> dict:
            return self.chunk(body, meta, echoes[index // n], index, text, finish, records)

        def head(index: int) -> dict:  # each choice starts with its echoed prompt
            return self.chunk(body, meta, None, index, echoes[index // n].text, None, None)

        return StreamingResponse(self.stream(items, first, n * len(inputs), stop, prompt_tokens, chunk,
                                             head if body.echo else None, include,
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

    async def score_all(self, body: CompletionRequest, client: str, prompts: list[list[int]],
                        request: Request) -> list[Finished] | None:
        """Each prompt scored (``prompt_logprobs``, ``body.logprobs`` alternatives) by a run of max_tokens 0 of its
        own, queued and charged as any request, all at once; None: the client left. The first refusal is the
        request's, and ends the others."""
        one = body.model_copy(update={"n": 1})

        def params(ids: list[int]):
            return replace(self.sampling(one, ids, 0, None)[0], prompt_logprobs=body.logprobs)

        return await self.collect(self.choices(client, [(ids, params(ids)) for ids in prompts], request),
                                  len(prompts))

    def echo_only(self, body: CompletionRequest, echoes: list[Echo], scored: list[Finished | None]):
        """max_tokens 0: every choice is its prompt (scored by ``scored``'s runs, if logprobs were asked)."""
        for echo in echoes:
            if len(echo.input_ids) > self.max_length:
                raise ApiError(400, "context_length_exceeded", f"the prompt ({len(echo.input_ids)} tokens) exceeds "
                               f"the swarm's maximum session length of {self.max_length} tokens", param="prompt")
        meta = self.response_meta()
        choices = [{"index": p * body.n + i, "text": echo.text, "finish_reason": "length",
                    "logprobs": self.legacy_logprobs([], echo) if body.logprobs is not None else None}
                   for p, echo in enumerate(echoes) for i in range(body.n)]
        info = {"chainswarm": swarm_info(scored[0])} if scored[0] is not None else {}
        use = usage(sum(len(echo.input_ids) for echo in echoes), [])
        if not body.stream:
            return {**meta, "object": "text_completion", "choices": choices, "usage": use, **info}

        events = [sse({**meta, "object": "text_completion", "choices": [choice], **info}) for choice in choices]
        include = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(iter(events + stream_end({**meta, "object": "text_completion"}, use, include)),
                                 media_type="text/event-stream")

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


def prefix_header(response: Response, prefix: dict) -> None:
    """``x-chainswarm-prefix``: the first run's prefix-cache outcome (pages expected, tokens reused and computed)."""
    response.headers["x-chainswarm-prefix"] = (
        f"expected={prefix.get('expected', 0)};reused={prefix.get('reused', 0)};"
        f"prefill={prefix.get('prefill', 0)};restarts={prefix.get('restarts', 0)}")


@dataclass
class Echo:
    """``echo``: the prompt as the text starts with it, its token ids, and (with logprobs) the scores of every
    token after the first (:mod:`swarm.engine.scoring`)."""

    text: str
    input_ids: list[int]
    scores: list[TokenLogprob] | None
