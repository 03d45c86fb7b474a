"""``POST /v1/chat/completions``: :class:`OpenAIServingChat`."""
from __future__ import annotations

from functools import partial

from fastapi import Header, Request, Response
from fastapi.responses import StreamingResponse

from swarm.api.errors import ApiError
from swarm.api.schemas import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest
from swarm.api.serving_base import OpenAIServing, swarm_info, usage
from swarm.api.structured import OutputPlan, compile_plan, plan_output
from swarm.api.tools import (
    CallStream, fallback_messages, has_tool_section, parse_calls, render_template, template_messages, tool_calls_json,
    tool_list,
)
from swarm.engine.sampling import TokenLogprob


class OpenAIServingChat(OpenAIServing):
    """Chat completions: the messages rendered with the model's chat template, ``logprobs`` as ``content``
    entries with ``bytes``; a stream opens every choice with an ``assistant`` role delta. ``response_format``
    and ``tools`` constrain the answer by grammar (:mod:`swarm.api.structured`, :mod:`swarm.api.tools`): tool
    calls come back as ``message.tool_calls`` with ``finish_reason: "tool_calls"``, streamed as argument
    deltas."""

    id_prefix = "chatcmpl-"
    prompt_param = "messages"

    # The route's operation (summary "Chat Completions"; its docstring would become the OpenAPI description).
    async def chat_completions(self, body: ChatCompletionRequest, request: Request,
                               authorization: str | None = Header(None), x_client_id: str | None = Header(None)):
        client = self.client_of(authorization, x_client_id or body.user)  # who asks, before what is asked
        self.validate(body)
        plan, input_ids = await self.prompt(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        stop, meta, items = self.begin(body, client, [input_ids], body.max_completion_tokens or body.max_tokens,
                                       logprobs, request, plan.grammar)
        if not body.stream:
            done = await self.collect(items, body.n)
            if done is None:
                return Response(status_code=499)
            out = []
            for index, d in enumerate(done):
                text = self.text_of(d, stop, body.min_tokens)
                message, finish = self.message(plan, text, d.finish_reason)
                out.append({"index": index, "message": message, "finish_reason": finish,
                            "logprobs": self.chat_logprobs(self.kept_logprobs(d, text)) if body.logprobs else None})
            return {**meta, "object": "chat.completion", "choices": out, "usage": usage(len(input_ids), done),
                    "chainswarm": swarm_info(done[0])}

        first = await self.first_or_refuse(items)
        if first is None:
            return Response(status_code=499)
        chunk_meta = {**meta, "object": "chat.completion.chunk"}
        include = bool(body.stream_options and body.stream_options.include_usage)
        calls = [CallStream() for _ in range(body.n)] if plan.calls_possible else None
        return StreamingResponse(self.stream(items, first, body.n, stop, len(input_ids),
                                             partial(self.chunk, body, chunk_meta, calls),
                                             partial(self.head, chunk_meta), include, chunk_meta, body.min_tokens),
                                 media_type="text/event-stream")

    def validate(self, body: ChatCompletionRequest) -> None:
        """What is refused before the client is even named: unsupported fields, the wrong model, a conversation
        longer than a session can be, a malformed conversation."""
        self.check(body, UNSUPPORTED_CHAT_FIELDS, sum(len(m.text()) for m in body.messages)
                   + sum(len(c.function.arguments) for m in body.messages for c in m.tool_calls or ()))
        self.check_messages(body)
        if body.top_logprobs and not body.logprobs:  # asked for, and it would have been answered without them
            raise ApiError(400, "invalid_request", "top_logprobs needs logprobs: true", param="top_logprobs")

    async def prompt(self, body: ChatCompletionRequest) -> tuple[OutputPlan, list[int]]:
        """The answer's compiled output plan and the prompt's token ids (the conversation rendered)."""
        plan = await compile_plan(plan_output(body), self.engine.tokenizer)
        return plan, self.engine.encode(self.render(body, plan))

    @staticmethod
    def check_messages(body: ChatCompletionRequest) -> None:
        """The conversation's shape (400 naming the message): content where it is needed, tool results that
        name their call, calls only from the assistant."""
        for i, m in enumerate(body.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise ApiError(400, "invalid_request", f"messages[{i}]: a tool message needs its tool_call_id",
                               param=f"messages[{i}]")
            if m.tool_calls and m.role != "assistant":
                raise ApiError(400, "invalid_request", f"messages[{i}]: only assistant messages have tool_calls",
                               param=f"messages[{i}]")
            if m.tool_call_id is not None and m.role != "tool":
                raise ApiError(400, "invalid_request", f"messages[{i}]: only tool messages have a tool_call_id",
                               param=f"messages[{i}]")
            for name in ("audio", "function_call"):
                if getattr(m, name) is not None:
                    raise ApiError(400, "unsupported_parameter", f"messages[{i}].{name}: not supported by Chainswarm",
                                   param=f"messages[{i}].{name}")
            if m.content is None and not (m.role == "assistant" and (m.tool_calls or m.refusal)):
                raise ApiError(400, "invalid_request", f"messages[{i}]: content is required",
                               param=f"messages[{i}]")

    def render(self, body: ChatCompletionRequest, plan: OutputPlan | None = None) -> str:
        """The prompt: the conversation through the model's chat template (400 when there is none or it
        rejects the conversation). Tools and tool messages go through the template's tool section when it
        has one, else through the documented fallback (:mod:`swarm.api.tools`)."""
        tokenizer = self.engine.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ApiError(400, "invalid_request", f"{self.model_name} has no chat template; use /v1/completions")
        toolish = bool(body.tools) or any(m.role == "tool" or m.tool_calls for m in body.messages)
        try:
            if toolish and has_tool_section(template):
                return render_template(template, template_messages(body.messages), tool_list(body.tools),
                                       dict(getattr(tokenizer, "special_tokens_map", {}) or {}))
            if toolish:
                messages = fallback_messages(body.messages, body.tools)
            else:
                messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                            for m in body.messages]
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template rejected the conversation (e.g. roles out of order)
            raise ApiError(400, "invalid_request", f"the chat template cannot render these messages: {exc}")

    @staticmethod
    def message(plan: OutputPlan, text: str, finish: str) -> tuple[dict, str]:
        """The assistant message of a finished choice and its finish reason (``tool_calls`` for calls)."""
        calls = parse_calls(text, truncated=finish == "length") if plan.calls_possible else None
        if calls:
            return {"role": "assistant", "content": None, "tool_calls": tool_calls_json(calls)}, (
                "tool_calls" if finish == "stop" else finish)
        return {"role": "assistant", "content": text}, finish

    @staticmethod
    def head(chunk_meta: dict, index: int) -> dict:
        """The first chunk of choice ``index``: the assistant's role."""
        return {**chunk_meta, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None, "logprobs": None}]}

    def chunk(self, body: ChatCompletionRequest, chunk_meta: dict, calls: list[CallStream] | None, index: int,
              text: str, finish: str | None, records: list[TokenLogprob] | None) -> dict | None:
        """One stream chunk of choice ``index`` (None: nothing to send yet — a tool call's text held back)."""
        if calls is not None:
            stream = calls[index]
            delta = stream.feed(text, final=finish is not None) or {}
            if finish == "stop" and stream.mode == "calls" and stream.calls:
                finish = "tool_calls"
            if not delta and finish is None:
                return None
        else:
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
