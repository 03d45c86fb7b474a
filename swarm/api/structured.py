"""What a request asks the grammar engine for: ``response_format`` and ``tools``/``tool_choice`` as one grammar.

* ``response_format: {"type": "json_object"}`` — any JSON object; ``{"type": "json_schema", "json_schema":
  {"schema": ...}}`` — JSON that validates against the schema (``strict`` or not: the output always does).
* ``tools`` with ``tool_choice``: ``required`` — one call (several with ``parallel_tool_calls``, the default)
  of the declared functions; a named function — exactly one call of it; ``auto`` (the default) — either an
  answer (text, or the ``response_format``'s JSON) that does not start with ``<tool_call>``, or calls;
  ``none`` — an answer only. The call syntax is :mod:`swarm.api.tools`'.

Bounds, checked before anything is compiled (a 400 that states them): the compact JSON of the response
schema plus every tool definition is at most :data:`~swarm.api.schemas.MAX_SCHEMA_CHARS` characters, and no
schema document nests more than :data:`~swarm.api.schemas.MAX_SCHEMA_DEPTH` objects/arrays deep; at most
:data:`~swarm.api.schemas.MAX_TOOLS` tools. A schema feature the grammar engine does not implement (or an
invalid schema) is a 400 naming it, with llguidance's message (e.g. ``Unimplemented keys: ["if"]``).
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from swarm.api.errors import ApiError
from swarm.api.schemas import MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH, MAX_TOOLS
from swarm.api.tools import CALL_CLOSE, CALL_OPEN, CALL_SEPARATOR, NAME_END
from swarm.engine.grammar import Grammar, GrammarError, compile_grammar, inline_json, lark_grammar

NO_CALL_TEXT = "/(?s:.*)/ & ~/<tool_call>(?s:.*)/"
"""Any text that does not start with ``<tool_call>`` (llguidance regex: ``&`` and, ``~`` not)."""

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class OutputPlan:
    """What the answer must be: its grammar (None: free text), whether it may hold tool calls."""

    grammar_source: str | None = None
    json: bool = False  # the answer (when not calls) is JSON
    tools: list = field(default_factory=list)  # the request's tools, when calls are possible
    tool_choice: str | None = None  # "auto", "required", "named", "none" (None: no tools)
    grammar: Grammar | None = None  # compiled for the engine's tokenizer
    owners: dict[int, str] = field(default_factory=dict)  # grammar line -> the request field it comes from

    @property
    def calls_possible(self) -> bool:
        return self.tool_choice in ("auto", "required", "named")


def depth(doc) -> int:
    """How many JSON containers nest in ``doc`` at most (iterative: a hostile document cannot recurse)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if level > MAX_SCHEMA_DEPTH:
            return level
        stack.extend((child, level + 1) for child in children)
    return deepest


def _check_schema(what: str, schema) -> None:
    if depth(schema) > MAX_SCHEMA_DEPTH:
        raise ApiError(400, "invalid_request", f"{what} nests deeper than {MAX_SCHEMA_DEPTH} JSON objects/arrays "
                       "(the bound of structured outputs)", param=what)


def _lark_literal(text: str) -> str:
    return json.dumps(text)


def plan_output(body) -> OutputPlan:
    """The request's :class:`OutputPlan` (400 for what cannot be served; nothing compiled yet)."""
    fmt = getattr(body, "response_format", None)
    tools = list(getattr(body, "tools", None) or [])
    choice = getattr(body, "tool_choice", None)
    size = 0
    answer = None  # the Lark item of an answer that is not a call (None: free text)
    plan = OutputPlan()
    if fmt is not None and fmt.type == "json_object":
        answer, plan.json = inline_json({"type": "object"}), True
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(400, "invalid_request", "response_format of type json_schema needs its json_schema",
                           param="response_format")
        schema = fmt.json_schema.schema_
        schema = {"type": "object"} if schema is None else schema
        _check_schema("response_format.json_schema.schema", schema)
        size += len(json.dumps(schema, separators=(",", ":")))
        answer, plan.json = _inline(schema, "response_format.json_schema.schema"), True
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, "invalid_request", f"at most {MAX_TOOLS} tools", param="tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "invalid_request", "tools: function names must be unique", param="tools")
    if isinstance(choice, str) or choice is None:
        mode = choice or ("auto" if tools else None)
    else:
        mode = "named"
        if choice.function.name not in names:
            raise ApiError(400, "invalid_request", f"tool_choice names {choice.function.name!r}, which is not one "
                           "of the tools", param="tool_choice")
    if mode in ("required", "named") and not tools:
        raise ApiError(400, "invalid_request", f"tool_choice {mode!r} needs tools", param="tool_choice")
    if not tools:
        mode = None
    for t in tools:
        params = t.function.parameters
        _check_schema(f"tools[{t.function.name}].function.parameters", params if params is not None else {})
        size += len(json.dumps(t.model_dump(exclude_none=True), separators=(",", ":")))
    if size > MAX_SCHEMA_CHARS:
        raise ApiError(400, "invalid_request", f"the response schema and tool definitions come to {size} characters "
                       f"of JSON; structured outputs take at most {MAX_SCHEMA_CHARS}")
    plan.tool_choice, plan.tools = mode, tools
    if mode is None:
        if answer is not None:
            plan.grammar_source = _grammar_lark(f"start: {answer}", "response_format")
            plan.owners = {1: "response_format.json_schema.schema"}
        return plan
    chosen = [t for t in tools if mode != "named" or t.function.name == choice.function.name]
    parallel = mode != "named" and getattr(body, "parallel_tool_calls", None) is not False
    rules = []
    for i, t in enumerate(chosen):
        params = t.function.parameters
        params = NO_ARGUMENTS if params is None else params
        item = _inline(params, f"tools[{t.function.name}].function.parameters")
        rules.append(f"call_{i}: {_lark_literal(CALL_OPEN + t.function.name + NAME_END)} {item} "
                     f"{_lark_literal(CALL_CLOSE)}")
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))
    calls = f"calls: call ({_lark_literal(CALL_SEPARATOR)} call)*" if parallel else "calls: call"
    text = answer if answer is not None else "NO_CALL"
    if mode in ("required", "named"):
        start = "start: calls"
    elif mode == "auto":
        start = f"start: {text} | calls"
    else:  # none: an answer, never a call
        start = f"start: {text}"
    lines = [start, calls, call, *rules, f"NO_CALL: {NO_CALL_TEXT}"]
    plan.owners = {1: "response_format.json_schema.schema"}
    plan.owners.update((4 + i, f"tools[{t.function.name}].function.parameters") for i, t in enumerate(chosen))
    plan.grammar_source = _grammar_lark("\n".join(lines), "tools")
    return plan


def _inline(schema, what: str) -> str:
    try:
        return inline_json(schema)
    except GrammarError as exc:
        raise ApiError(400, "invalid_request", f"{what}: {exc}", param=what) from None


def _grammar_lark(text: str, what: str) -> str:
    try:
        return lark_grammar(text)
    except Exception as exc:  # noqa: BLE001 - never for a valid Lark text; reported, not a 500
        raise ApiError(400, "invalid_request", f"{what}: {exc}") from None


_compiled: "OrderedDict[tuple, Grammar]" = OrderedDict()
_compiled_lock = threading.Lock()
COMPILED_CACHE = 64  # checked grammars kept (the same schema, request after request, is checked once)


def _compile(source: str, tokenizer) -> Grammar:
    key = (id(tokenizer), source)
    with _compiled_lock:
        if key in _compiled:
            _compiled.move_to_end(key)
            return _compiled[key]
    grammar = compile_grammar(source, tokenizer)
    with _compiled_lock:
        _compiled[key] = grammar
        while len(_compiled) > COMPILED_CACHE:
            _compiled.popitem(last=False)
    return grammar


async def compile_plan(plan: OutputPlan, tokenizer) -> OutputPlan:
    """Compile the plan's grammar for the tokenizer (off the event loop); 400 naming what is unsupported."""
    if plan.grammar_source is None:
        return plan
    try:
        plan.grammar = await asyncio.to_thread(_compile, plan.grammar_source, tokenizer)
    except GrammarError as exc:
        what, message = _explain(plan, str(exc))
        raise ApiError(400, "invalid_request", message, param=what) from None
    return plan


def _explain(plan: OutputPlan, error: str) -> tuple[str, str]:
    """The request field whose schema llguidance's message is about, and the message attributed to it."""
    first = error.strip().splitlines()[0] if error.strip() else "invalid grammar"
    found = re.match(r"at (\d+)\(\d+\): (.*)", first)
    what = "tools" if plan.tool_choice else "response_format"
    if found:
        what, first = plan.owners.get(int(found.group(1)), what), found.group(2)
    return what, f"{what}: unsupported or invalid schema: {first}"


__all__ = ["OutputPlan", "plan_output", "compile_plan", "depth"]
