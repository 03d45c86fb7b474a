"""``POST /v1/responses``: :class:`OpenAIServingResponses`, OpenAI's Responses API over the chat machinery.

Why this surface (issue 32 asked for it or Anthropic's Messages API): it is OpenAI's recommended API for new
applications and the default of its Agents SDK, and the official ``openai`` client Chainswarm is already tested
with speaks it, so the same applications reach the swarm through either OpenAI surface.

A request is translated into a chat request — ``instructions`` a system message first, ``input`` items into
messages (``function_call`` items into an assistant message's ``tool_calls``, ``function_call_output`` into
``tool`` messages), ``tools`` and ``tool_choice`` into their chat forms, ``text.format`` into ``response_format`` —
and runs exactly as a chat completion does: rendered through the checkpoint's chat template (or the tools'
documented fallback), constrained by the same grammar, one session through the fair queue with the same queue
bounds, ``Retry-After`` and tickets. Stateless: ``previous_response_id`` and ``conversation`` are refused (400)
— the client sends its whole conversation, as it may with OpenAI (``store`` is accepted and nothing is stored).

The answer is a ``response`` object whose ``output`` is one assistant ``message`` (``output_text``) or the
``function_call`` items the model made; ``status`` is ``incomplete`` (``max_output_tokens``) when the answer was
cut. Streamed (``stream: true``) as OpenAI streams it: ``response.created``, ``response.in_progress``, per output
item ``response.output_item.added``, text as ``response.output_text.delta`` (within ``content_part`` events) or
arguments as ``response.function_call_arguments.delta``, their ``.done`` events, and ``response.completed`` with
the whole object; a failure after the first event is an ``error`` event.
"""
from __future__ import annotations

import contextlib
import json
import uuid
from typing import AsyncIterator

from fastapi import Header, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from swarm.api.errors import REFUSALS, ApiError, refusal
from swarm.api.schemas import (
    UNSUPPORTED_RESPONSE_FIELDS, ChatCompletionRequest, ChatMessage, InputFunctionCall, InputFunctionCallOutput,
    ResponsesRequest,
)
from swarm.api.serving_base import swarm_info
from swarm.api.serving_chat import OpenAIServingChat
from swarm.api.structured import OutputPlan
from swarm.api.tools import CallStream, parse_calls
from swarm.engine.completion import ClientGone, Finished


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex[:24]}"


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request stands for (see the module doc)."""
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [body.input] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, str):
            messages.append({"role": "user", "content": item})
        elif isinstance(item, InputFunctionCall):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                         "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # consecutive calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, InputFunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            messages.append({"role": item.role, "content": item.text()})
    if not messages:
        raise ApiError(400, "invalid_request", "input: at least one item is needed", param="input")
    doc: dict = {"messages": [ChatMessage(**m) for m in messages], "model": body.model, "stream": body.stream,
                 "temperature": body.temperature, "top_p": body.top_p, "max_tokens": body.max_output_tokens,
                 "user": body.user, "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        doc["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                        for t in body.tools]
    if body.tool_choice is not None:
        doc["tool_choice"] = body.tool_choice if isinstance(body.tool_choice, str) else {
            "type": "function", "function": {"name": body.tool_choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.name is None:
            raise ApiError(400, "invalid_request", "text.format of type json_schema needs its name",
                           param="text.format.name")
        schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
        doc["response_format"] = {"type": "json_schema",
                                  "json_schema": {k: v for k, v in schema.items() if v is not None}}
    elif fmt is not None:
        doc["response_format"] = {"type": fmt.type}
    try:
        return ChatCompletionRequest(**doc)
    except ValidationError as exc:  # e.g. more messages than a chat request may have
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ApiError(400, "invalid_request", f"input: as a conversation, {where}: {first['msg']}",
                       param="input") from None


class OpenAIServingResponses(OpenAIServingChat):
    """The Responses API (module doc): a chat completion underneath, OpenAI's ``response`` shape on the wire."""

    id_prefix = "resp_"
    prompt_param = "input"

    # The route's operation (summary "Responses").
    async def responses(self, body: ResponsesRequest, request: Request, authorization: str | None = Header(None),
                        x_client_id: str | None = Header(None)):
        client = self.client_of(authorization, x_client_id or body.user)
        used = [name for name in UNSUPPORTED_RESPONSE_FIELDS if getattr(body, name) is not None]
        if used:
            raise ApiError(400, "unsupported_parameter", f"not supported by Chainswarm: {', '.join(used)} (the "
                           "swarm keeps no conversation state: send the whole conversation in input)", param=used[0])
        chat = chat_request(body)
        self.validate(chat)
        plan, input_ids = await self.prompt(chat)
        stop, meta, items = self.begin(chat, client, [input_ids], chat.max_tokens, None, request, plan.grammar)
        if not body.stream:
            done = await self.collect(items, 1)
            if done is None:
                return Response(status_code=499)
            text = self.text_of(done[0], stop)
            return self.response(body, meta, self.output(plan, text, done[0].finish_reason), done[0],
                                 len(input_ids))
        first = await self.first_or_refuse(items)
        if first is None:
            return Response(status_code=499)
        return StreamingResponse(self.events(body, meta, plan, items, first, len(input_ids)),
                                 media_type="text/event-stream")

    # -- the response object ---------------------------------------------------------------------------
    @staticmethod
    def output(plan: OutputPlan, text: str, finish: str) -> list[dict]:
        """The output items of a finished answer: its function calls, or one assistant message."""
        calls = parse_calls(text, truncated=finish == "length") if plan.calls_possible else None
        if calls:
            return [{"type": "function_call", "id": _item_id("fc"), "call_id": _item_id("call"), "name": name,
                     "arguments": arguments, "status": "completed"} for name, arguments in calls]
        return [{"type": "message", "id": _item_id("msg"), "role": "assistant",
                 "status": "incomplete" if finish == "length" else "completed",
                 "content": [{"type": "output_text", "text": text, "annotations": []}]}]

    def response(self, body: ResponsesRequest, meta: dict, output: list[dict], done: Finished | None,
                 prompt_tokens: int) -> dict:
        """The ``response`` object (``done`` None: still in progress, for ``response.created``)."""
        doc = {"id": meta["id"], "object": "response", "created_at": meta["created"], "model": meta["model"],
               "status": "in_progress", "output": output, "error": None, "incomplete_details": None,
               "instructions": body.instructions, "metadata": body.metadata or {},
               "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
               "parallel_tool_calls": body.parallel_tool_calls is not False,
               "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
                               else body.tool_choice.model_dump()) or "auto",
               "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
               "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                   if body.text is not None and body.text.format is not None else {"type": "text"})},
               "usage": None}
        if done is not None:
            cut = done.finish_reason == "length"
            doc.update(status="incomplete" if cut else "completed",
                       incomplete_details={"reason": "max_output_tokens"} if cut else None,
                       usage={"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens": len(done.token_ids),
                              "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": prompt_tokens + len(done.token_ids)},
                       chainswarm=swarm_info(done))
        return doc

    # -- streaming -------------------------------------------------------------------------------------
    async def events(self, body: ResponsesRequest, meta: dict, plan: OutputPlan, items: AsyncIterator, first,
                     prompt_tokens: int) -> AsyncIterator[bytes]:
        seq = 0

        def event(kind: str, **fields) -> bytes:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n" \
                .encode()

        yield event("response.created", response=self.response(body, meta, [], None, prompt_tokens))
        yield event("response.in_progress", response=self.response(body, meta, [], None, prompt_tokens))
        writer = _OutputWriter(event, CallStream() if plan.calls_possible else None)
        produced: list[int] = []
        sent = ""
        async with contextlib.aclosing(items):
            try:
                item = first
                while True:
                    _, value = item
                    if isinstance(value, Finished):
                        text = self.text_of(value, ())
                        for chunk in writer.feed(text[len(sent):], final=True):
                            yield chunk
                        output = writer.finish(value.finish_reason)
                        for chunk in writer.done_events:
                            yield chunk
                        yield event("response.completed", response=self.response(body, meta, output, value,
                                                                                 prompt_tokens))
                        return
                    produced.append(value)
                    text = self.engine.decode(produced)
                    if text and not text.endswith("\ufffd") and len(text) > len(sent):
                        for chunk in writer.feed(text[len(sent):]):
                            yield chunk
                        sent = text
                    item = await items.__anext__()
            except (ClientGone, StopAsyncIteration):
                return
            except REFUSALS as exc:
                err = refusal(exc, self.prompt_param)
                yield event("error", code=err.code, message=err.message, param=err.param)


class _OutputWriter:
    """A streamed answer's output items and their events: text into one message item, or tool-call text (through
    :class:`~swarm.api.tools.CallStream`, the chat stream's parser) into function-call items."""

    def __init__(self, event, calls: CallStream | None):
        self.event, self.calls = event, calls
        self.message: dict | None = None
        self.text = ""
        self.items: list[dict] = []  # function-call items, in order
        self.done_events: list[bytes] = []

    def feed(self, delta: str, final: bool = False) -> list[bytes]:
        if self.calls is None:
            return self._text(delta) if delta else []
        chat_delta = self.calls.feed(delta, final=final) or {}
        if "content" in chat_delta:
            return self._text(chat_delta["content"])
        out = []
        for entry in chat_delta.get("tool_calls", ()):
            if entry["index"] == len(self.items):
                item = {"type": "function_call", "id": _item_id("fc"), "call_id": entry["id"],
                        "name": entry["function"]["name"], "arguments": "", "status": "in_progress"}
                self.items.append(item)
                out.append(self.event("response.output_item.added", output_index=entry["index"], item=dict(item)))
            item = self.items[entry["index"]]
            piece = entry["function"]["arguments"]
            if piece:
                item["arguments"] += piece
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=entry["index"], delta=piece))
        return out

    def _text(self, delta: str) -> list[bytes]:
        out = []
        if self.message is None:
            self.message = {"type": "message", "id": _item_id("msg"), "role": "assistant", "status": "in_progress",
                            "content": []}
            out.append(self.event("response.output_item.added", output_index=0, item=dict(self.message)))
            out.append(self.event("response.content_part.added", item_id=self.message["id"], output_index=0,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.text += delta
        if delta:
            out.append(self.event("response.output_text.delta", item_id=self.message["id"], output_index=0,
                                  content_index=0, delta=delta, logprobs=[]))
        return out

    def finish(self, finish_reason: str) -> list[dict]:
        """The final output items (their ``.done`` events into ``done_events``)."""
        ev = self.event
        if self.items:
            for index, item in enumerate(self.items):
                item["status"] = "completed"
                self.done_events.append(ev("response.function_call_arguments.done", item_id=item["id"],
                                           output_index=index, arguments=item["arguments"]))
                self.done_events.append(ev("response.output_item.done", output_index=index, item=item))
            return self.items
        if self.message is None:  # an empty answer is still one (empty) message
            self.done_events.extend(self._text(""))
        part = {"type": "output_text", "text": self.text, "annotations": []}
        message = {**self.message, "status": "incomplete" if finish_reason == "length" else "completed",
                   "content": [part]}
        mid = message["id"]
        self.done_events += [ev("response.output_text.done", item_id=mid, output_index=0, content_index=0,
                                text=self.text, logprobs=[]),
                             ev("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part),
                             ev("response.output_item.done", output_index=0, item=message)]
        return [message]
