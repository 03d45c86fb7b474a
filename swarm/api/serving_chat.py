"""``POST /v1/chat/completions``: :class:`OpenAIServingChat`."""
from __future__ import annotations

from functools import partial

from fastapi import Header, Request, Response
from fastapi.responses import StreamingResponse

from swarm.api.errors import ApiError
from swarm.api.schemas import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest
from swarm.api.serving_base import OpenAIServing, swarm_info, usage
from swarm.engine.sampling import TokenLogprob


class OpenAIServingChat(OpenAIServing):
    """Chat completions: the messages rendered with the model's chat template, ``logprobs`` as ``content``
    entries with ``bytes``; a stream opens every choice with an ``assistant`` role delta."""

    id_prefix = "chatcmpl"

    # The route's operation (summary "Chat Completions"; its docstring would become the OpenAPI description).
    async def chat_completions(self, body: ChatCompletionRequest, request: Request,
                               authorization: str | None = Header(None), x_client_id: str | None = Header(None)):
        self.check(body, UNSUPPORTED_CHAT_FIELDS, sum(len(m.content) for m in body.messages))
        client = self.client_of(authorization, x_client_id or body.user)
        input_ids = self.engine.encode(self.render(body))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        stop, meta, items = self.begin(body, client, input_ids, body.max_completion_tokens or body.max_tokens,
                                       logprobs, request)
        if not body.stream:
            done = await self.collect(items, body.n)
            if done is None:
                return Response(status_code=499)
            out = []
            for index, d in enumerate(done):
                text = self.text_of(d, stop)
                out.append({"index": index, "message": {"role": "assistant", "content": text},
                            "finish_reason": d.finish_reason,
                            "logprobs": self.chat_logprobs(self.kept_logprobs(d, text)) if body.logprobs else None})
            return {**meta, "object": "chat.completion", "choices": out, "usage": usage(len(input_ids), done),
                    "chainswarm": swarm_info(done[0])}

        first = await self.first_or_refuse(items)
        if first is None:
            return Response(status_code=499)
        chunk_meta = {**meta, "object": "chat.completion.chunk"}
        include = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(self.stream(items, first, body.n, stop, len(input_ids),
                                             partial(self.chunk, body, chunk_meta), partial(self.head, chunk_meta),
                                             include, chunk_meta), media_type="text/event-stream")

    def render(self, body: ChatCompletionRequest) -> str:
        """The prompt: the conversation through the model's chat template (400 when there is none or it
        rejects the conversation)."""
        template = getattr(self.engine.tokenizer, "chat_template", None)
        if not template:
            raise ApiError(400, "invalid_request", f"{self.model_name} has no chat template; use /v1/completions")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            return self.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template rejected the conversation (e.g. roles out of order)
            raise ApiError(400, "invalid_request", f"the chat template cannot render these messages: {exc}")

    @staticmethod
    def head(chunk_meta: dict, index: int) -> dict:
        """The first chunk of choice ``index``: the assistant's role."""
        return {**chunk_meta, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None, "logprobs": None}]}

    def chunk(self, body: ChatCompletionRequest, chunk_meta: dict, index: int, text: str, finish: str | None,
              records: list[TokenLogprob] | None) -> dict:
        """One stream chunk of choice ``index``."""
        delta = {"content": text} if text or finish is None else {}
        logprobs = self.chat_logprobs(records) if records is not None and body.logprobs else None
        return {**chunk_meta, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                           "logprobs": logprobs}]}

    def chat_logprobs(self, records: list[TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.engine.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                            for r in records]}
