"""Tool calls on the wire: how tools and tool messages reach the model, and how its calls come back.

**The call syntax.** A model calls tools by answering with one block per call (the Hermes / Qwen / SmolLM3
convention, which most chat templates with a tool section use)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several blocks separated by a newline when ``parallel_tool_calls`` allows it. The grammar
(:func:`calls_lark`) makes the blocks exact — a declared function's name, arguments that validate against
its ``parameters`` schema — so :func:`parse_calls` never meets a malformed call.

**Rendering.** A checkpoint whose chat template has a tool section (it uses a ``tools`` variable) renders
the conversation itself: the tools are passed to it as OpenAI's ``tools`` list, the assistant's calls as
``tool_calls`` (arguments as objects), the results as ``role: tool`` messages. A template without one gets
the documented fallback (:func:`fallback_messages`): the tools are described in the system message
(:data:`FALLBACK_TOOLS_PROMPT`; appended to the first system/developer message, or a system message of its
own in front), an assistant's calls become ``<tool_call>`` blocks in its content, and each run of tool
results becomes one user message of ``<tool_response>`` blocks.

**Streaming** (:class:`CallStream`): while the answer could still be the start of ``<tool_call>`` nothing is
sent; then it is either content (text deltas) or calls, streamed as OpenAI streams them — per call, a first
delta with its ``id``, ``type`` and ``function.name``, then ``function.arguments`` deltas whose
concatenation is the arguments' JSON text.
"""
from __future__ import annotations

import json
import re
import uuid
from datetime import datetime
from typing import Any

CALL_TAG = "<tool_call>"
CALL_OPEN = CALL_TAG + "\n{\"name\": \""
NAME_END = "\", \"arguments\": "
CALL_CLOSE = "}\n</tool_call>"
CALL_SEPARATOR = "\n"

FALLBACK_TOOLS_PROMPT = """# Tools

You may call one or more of these functions to answer. Each is described by a JSON signature on its own \
line inside <tools></tools>:
<tools>
{signatures}
</tools>

To call functions, answer only with one <tool_call></tool_call> block per call, each holding a JSON object \
with the function's name and its arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{"<parameter>": <value>}}}}
</tool_call>"""
"""The system text that describes the tools to a chat template without a tool section."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- rendering -------------------------------------------------------------------------------------------
def has_tool_section(template: str | None) -> bool:
    """The chat template renders tools itself (it reads a ``tools`` variable)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def _arguments_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def tool_list(tools) -> list[dict]:
    """OpenAI's ``tools`` as plain dicts (what templates with a tool section read)."""
    return [t.model_dump(exclude_none=True) for t in tools or ()]


def template_messages(messages) -> list[dict]:
    """The conversation for a template with a tool section: tool calls' arguments as objects."""
    out = []
    for m in messages:
        doc: dict = {"role": m.role, "content": m.text()}
        if m.name is not None:
            doc["name"] = m.name
        if m.tool_calls:
            doc["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _arguments_object(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            doc["tool_call_id"] = m.tool_call_id
        out.append(doc)
    return out


def call_block(name: str, arguments: str) -> str:
    """One call as the model writes it (the arguments' JSON text as given)."""
    return f"{CALL_OPEN}{name}{NAME_END}{arguments}{CALL_CLOSE}"


def fallback_messages(messages, tools) -> list[dict]:
    """The conversation for a template without a tool section (see the module doc): plain roles and text."""
    out: list[dict] = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        text = m.text()
        if m.tool_calls:
            calls = CALL_SEPARATOR.join(call_block(c.function.name, _compact(c.function.arguments))
                                        for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        doc = {"role": m.role, "content": text}
        if m.name is not None:
            doc["name"] = m.name
        out.append(doc)
    for doc in out:
        doc.pop("_tool", None)
    if tools:
        signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_list(tools))
        prompt = FALLBACK_TOOLS_PROMPT.format(signatures=signatures)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _compact(arguments: str) -> str:
    """Arguments JSON spelled as the grammar spells it (", " and ": "), or the text as given if not JSON."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return arguments


def render_template(template: str, messages: list[dict], tools: list[dict] | None, special_tokens: dict) -> str:
    """Render a chat template with ``tools`` (transformers 4.34's ``apply_chat_template`` passes no extra
    variables): the same sandboxed Jinja environment and helpers as current transformers."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, tools=tools or None, add_generation_prompt=True,
                                            **special_tokens)


# -- the answer ------------------------------------------------------------------------------------------
def parse_calls(text: str, truncated: bool = False) -> list[tuple[str, str]] | None:
    """``[(name, arguments JSON text)]`` of an answer made of complete call blocks; None if it is not one.
    ``truncated`` (the answer hit max_tokens): the complete calls before the cut one."""
    if not text.startswith(CALL_TAG):
        return None
    calls, pos = [], 0
    while pos < len(text):
        if not text.startswith(CALL_OPEN, pos):
            return (calls or None) if truncated and CALL_OPEN.startswith(text[pos:]) else None
        start = pos + len(CALL_OPEN)
        name_end = text.find(NAME_END, start)
        end = text.find(CALL_CLOSE, name_end + len(NAME_END)) if name_end >= 0 else -1
        if end < 0:
            return (calls or None) if truncated else None
        calls.append((text[start:name_end], text[name_end + len(NAME_END):end]))
        pos = end + len(CALL_CLOSE)
        if text.startswith(CALL_SEPARATOR, pos) and pos + len(CALL_SEPARATOR) < len(text):
            pos += len(CALL_SEPARATOR)
        elif pos < len(text):
            return None
    return calls or None


def tool_calls_json(calls: list[tuple[str, str]]) -> list[dict]:
    return [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls]


class CallStream:
    """One streamed choice of a request with tools: text in, OpenAI chat deltas out (see the module doc)."""

    def __init__(self):
        self.text = ""
        self.mode: str | None = None  # None: undecided; "content"; "calls"
        self.sent_content = 0
        self.calls: list[dict] = []  # per call: id, name, sent (argument characters sent)

    def feed(self, delta: str, final: bool = False) -> dict | None:
        """The delta (``content`` or ``tool_calls``) for ``delta`` more text; None when nothing can be sent yet."""
        self.text += delta
        if self.mode is None:
            if self.text.startswith(CALL_TAG):
                self.mode = "calls"
            elif final or not CALL_TAG.startswith(self.text):
                self.mode = "content"
            else:
                return None
        if self.mode == "content":
            out, self.sent_content = self.text[self.sent_content:], len(self.text)
            return {"content": out} if out else None
        return self._calls(final)

    def _calls(self, final: bool) -> dict | None:
        entries, pos, index = [], 0, 0
        text = self.text
        while True:
            if not text.startswith(CALL_OPEN, pos):
                break
            start = pos + len(CALL_OPEN)
            name_end = text.find(NAME_END, start)
            if name_end < 0:
                break
            if index == len(self.calls):
                self.calls.append({"id": new_call_id(), "name": text[start:name_end], "sent": 0})
                entries.append({"index": index, "id": self.calls[index]["id"], "type": "function",
                                "function": {"name": self.calls[index]["name"], "arguments": ""}})
            args_start = name_end + len(NAME_END)
            end = text.find(CALL_CLOSE, args_start)
            if end >= 0:
                arguments = text[args_start:end]
            else:
                arguments = text[args_start:]
                for k in range(min(len(CALL_CLOSE), len(arguments)), 0, -1):  # may be the start of the close
                    if arguments.endswith(CALL_CLOSE[:k]):
                        arguments = arguments[:-k]
                        break
            call = self.calls[index]
            if len(arguments) > call["sent"]:
                piece, call["sent"] = arguments[call["sent"]:], len(arguments)
                if entries and entries[-1]["index"] == index:
                    entries[-1]["function"]["arguments"] += piece
                else:
                    entries.append({"index": index, "function": {"arguments": piece}})
            if end < 0:
                break
            pos, index = end + len(CALL_CLOSE) + len(CALL_SEPARATOR), index + 1
        return {"tool_calls": entries} if entries else None
