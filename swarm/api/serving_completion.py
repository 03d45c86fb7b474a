"""``POST /v1/completions`` (OpenAI's legacy text completions): :class:`OpenAIServingCompletion`."""
from __future__ import annotations

from functools import partial

from fastapi import Header, Request, Response
from fastapi.responses import StreamingResponse

from swarm.api.schemas import UNSUPPORTED_COMPLETION_FIELDS, CompletionRequest
from swarm.api.serving_base import OpenAIServing, swarm_info, usage
from swarm.api.structured import compile_plan, plan_output
from swarm.engine.sampling import TokenLogprob


class OpenAIServingCompletion(OpenAIServing):
    """Text completions: the prompt as it is, ``logprobs`` in the legacy ``tokens``/``token_logprobs``/
    ``top_logprobs``/``text_offset`` form, the prefix-cache outcome in ``x-chainswarm-prefix``."""

    id_prefix = "cmpl"

    # The route's operation (summary "Completions"; its docstring would become the OpenAPI description).
    async def completions(self, body: CompletionRequest, request: Request, response: Response,
                          authorization: str | None = Header(None), x_client_id: str | None = Header(None)):
        self.check(body, UNSUPPORTED_COMPLETION_FIELDS, len(body.prompt))
        client = self.client_of(authorization, x_client_id or body.user)
        plan = await compile_plan(plan_output(body), self.engine.tokenizer)  # response_format (vLLM's extension)
        input_ids = self.engine.encode(body.prompt)
        stop, meta, items = self.begin(body, client, input_ids, body.max_tokens, body.logprobs, request, plan.grammar)
        if not body.stream:
            done = await self.collect(items, body.n)
            if done is None:
                return Response(status_code=499)
            prefix = done[0].prefix
            response.headers["x-chainswarm-prefix"] = (
                f"expected={prefix.get('expected', 0)};reused={prefix.get('reused', 0)};"
                f"prefill={prefix.get('prefill', 0)};restarts={prefix.get('restarts', 0)}")
            out = []
            for index, d in enumerate(done):
                text = self.text_of(d, stop, body.min_tokens)
                logprobs = self.legacy_logprobs(self.kept_logprobs(d, text)) if body.logprobs is not None else None
                out.append({"index": index, "text": text, "finish_reason": d.finish_reason, "logprobs": logprobs})
            return {**meta, "object": "text_completion", "choices": out, "usage": usage(len(input_ids), done),
                    "chainswarm": swarm_info(done[0])}

        first = await self.first_or_refuse(items)
        if first is None:
            return Response(status_code=499)
        include = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(self.stream(items, first, body.n, stop, len(input_ids),
                                             partial(self.chunk, body, meta), None, include,
                                             {**meta, "object": "text_completion"}, body.min_tokens),
                                 media_type="text/event-stream")

    def chunk(self, body: CompletionRequest, meta: dict, index: int, text: str, finish: str | None,
              records: list[TokenLogprob] | None) -> dict:
        """One stream chunk of choice ``index``."""
        logprobs = self.legacy_logprobs(records) if records is not None and body.logprobs is not None else None
        return {**meta, "object": "text_completion",
                "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]}

    def legacy_logprobs(self, records: list[TokenLogprob]) -> dict:
        decode = self.engine.decode
        tokens = [decode([r.token_id]) for r in records]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [{decode([t]): lp for t, lp in r.top} for r in records],
                "text_offset": offsets}
