"""Structured outputs and tool calls without a swarm: the grammar + sampler layer on SmolLM2's real
vocabulary (49,152 tokens), and the HTTP handlers in-process over the local model (tests/local_api.py) with
the official ``openai`` client.

* Hypothesis-generated JSON schemas (within the bounds of swarm.api.structured) decoded from random logits
  with seeded sampling: every finished output parses and validates (jsonschema_rs).
* The sampling extensions (ignore_eos, min_tokens, top_k, min_p, repetition_penalty) with vLLM's meaning.
* ``chat.completions.parse`` with a pydantic model; tool calls (call -> tool result -> answer), streamed and
  not; invalid schemas and tool definitions get 400s that name them; bounds are refused with the bound.
* 1 and 16 sessions of one step, each along its grammar (the cost per token: tests/bench_grammar.py).
"""
from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from swarm.api.schemas import MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH
from swarm.engine.grammar import GrammarMatcher, compile_grammar, json_schema_grammar, lark_grammar
from swarm.engine.sampling import SamplingParams, StopMatcher, TokenChooser
from helpers import HTTP

VOCAB = 49_152


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from swarm.model.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


def decode_with(chooser: TokenChooser, tokenizer, steps: int, seed: int, scale: float = 4.0) -> tuple[list[int], bool]:
    """Choose up to ``steps`` tokens from random logits; (tokens without the end token, ended)."""
    rng = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(steps):
        TokenChooser.prepare([chooser])
        logits = torch.randn(1, VOCAB, generator=rng) * scale
        token = int(chooser(torch.tensor([[0]]), logits)[0].argmax())
        if token == tokenizer.eos_token_id:
            return ids, True
        ids.append(token)
    return ids, False


# -- hypothesis: generated schemas, random logits, always valid ------------------------------------------
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


def schemas(depth: int = 3):
    leaves = st.one_of(
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.integers(-1000, 1000).flatmap(lambda lo: st.integers(lo, lo + 10**6).map(
            lambda hi: {"type": "integer", "minimum": lo, "maximum": hi})),
        st.integers(0, 4).flatmap(lambda lo: st.integers(lo, lo + 12).map(
            lambda hi: {"type": "string", "minLength": lo, "maxLength": hi})),
        st.lists(st.text(alphabet="abc xyz-", min_size=1, max_size=6), min_size=1, max_size=4, unique=True)
        .map(lambda values: {"enum": values}),
        st.sampled_from([{"const": "fixed"}, {"type": "string", "pattern": "^[a-z]{1,5}$"},
                         {"type": "string", "format": "date"}, {"type": ["integer", "null"], "maximum": 99,
                                                                "minimum": 0}]),
    )
    if depth == 0:
        return leaves
    inner = schemas(depth - 1)
    # closed objects: random logits would write extra keys forever (valid, but never finished)
    objects = st.dictionaries(NAMES, inner, min_size=0, max_size=4).flatmap(lambda props: st.tuples(
        st.just(props), st.lists(st.sampled_from(sorted(props)) if props else st.nothing(), unique=True))).map(
        lambda t: {"type": "object", "properties": t[0], "required": t[1], "additionalProperties": False})
    arrays = st.tuples(inner, st.integers(0, 2), st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    unions = st.lists(inner, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
    return st.one_of(leaves, objects, arrays, unions)


@settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(schema=schemas(), seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]))
def test_generated_schemas_always_validate(tokenizer, schema, seed, temperature):
    grammar = compile_grammar(json_schema_grammar(schema), tokenizer)
    chooser = TokenChooser(SamplingParams(400, temperature=temperature, seed=seed, top_p=0.95,
                                          grammar=grammar), VOCAB)
    ids, ended = decode_with(chooser, tokenizer, 400, seed)
    assert ended, ("no end in 400 tokens", schema, tokenizer.decode(ids))
    text = tokenizer.decode(ids, skip_special_tokens=True)
    document = json.loads(text)
    assert jsonschema_rs.validator_for(schema).is_valid(document), (schema, text)


# -- the sampler inside the mask ---------------------------------------------------------------------------
def test_penalties_bias_and_sampling_apply_inside_the_mask(tokenizer):
    grammar = compile_grammar(lark_grammar('start: "yes" | "no"'), tokenizer)
    yes, no = tokenizer("yes").input_ids[0], tokenizer("no").input_ids[0]
    logits = torch.zeros(1, VOCAB)
    logits[0, 42] = 50.0  # the model's favourite is outside the grammar
    logits[0, yes], logits[0, no] = 2.0, 1.0
    greedy = TokenChooser(SamplingParams(4, temperature=0, grammar=grammar), VOCAB)
    assert int(greedy(torch.tensor([[0]]), logits.clone())[0].argmax()) == yes
    biased = TokenChooser(SamplingParams(4, temperature=0, grammar=grammar, logit_bias=((no, 5.0), (42, 100.0))),
                          VOCAB)
    assert int(biased(torch.tensor([[0]]), logits.clone())[0].argmax()) == no  # bias cannot leave the grammar
    repeated = TokenChooser(SamplingParams(4, temperature=0, grammar=grammar, repetition_penalty=4.0), VOCAB)
    assert int(repeated(torch.tensor([[yes]]), logits.clone())[0].argmax()) == no  # "yes" is in the prompt
    for seed in range(20):  # sampling only ever picks grammar tokens
        sampled = TokenChooser(SamplingParams(4, temperature=1.5, seed=seed, top_k=50, min_p=0.0,
                                              grammar=grammar), VOCAB)
        piece = tokenizer.decode([int(sampled(torch.tensor([[0]]), logits.clone())[0].argmax())])
        assert piece and ("yes".startswith(piece) or "no".startswith(piece))
    after = TokenChooser(SamplingParams(4, temperature=0, grammar=grammar), VOCAB)
    after(torch.tensor([[0]]), logits.clone())
    assert int(after(torch.tensor([[0]]), logits.clone())[0].argmax()) == tokenizer.eos_token_id  # complete


def test_restart_rollback_and_speculative_drafts(tokenizer):
    grammar = compile_grammar(json_schema_grammar({"type": "object", "properties": {"a": {
        "type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"], "additionalProperties": False}), tokenizer)
    chooser = TokenChooser(SamplingParams(20, temperature=0.8, seed=3, grammar=grammar), VOCAB)
    ids, _ = decode_with(chooser, tokenizer, 3, seed=1)
    chooser.truncate(1)  # a restarted session re-chooses the last two tokens
    assert chooser.grammar.consumed == 1 and chooser.generated == ids[:1]
    rest, ended = decode_with(chooser, tokenizer, 50, seed=2)
    assert ended and json.loads(tokenizer.decode(ids[:1] + rest))["a"] is not None
    # a continuation on another chain (swarm.engine.completion): a new chooser replayed to the delivered tokens
    # goes on inside the grammar, with the same state and the same seeded choices for the same failure point
    replayed = [TokenChooser(SamplingParams(20, temperature=0.8, seed=3, grammar=grammar), VOCAB) for _ in "ab"]
    for other in replayed:
        other.replay(ids[:2], chooser.logprobs[:2])
        assert other.grammar.consumed == 2 and other.generated == ids[:2]
    tails = [decode_with(other, tokenizer, 50, seed=5) for other in replayed]
    assert tails[0] == tails[1] and tails[0][1]
    assert json.loads(tokenizer.decode(ids[:2] + tails[0][0]))["a"] is not None
    fresh = GrammarMatcher(grammar)
    good, bad = tokenizer('{"a": 12}').input_ids, tokenizer('{"b": 1}').input_ids
    assert fresh.accepted_prefix(good) == len(good) and fresh.accepted_prefix(bad) < len(bad)
    assert fresh.consumed == 0  # checking a draft consumes nothing


def test_sampling_extensions_have_vllms_meaning():
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 1.5]])
    chooser = TokenChooser(SamplingParams(8, temperature=0, min_tokens=2, eos_token_ids=(eos,)), 5)
    picks = [int(chooser(torch.tensor([[0]]), logits.clone())[0].argmax()) for _ in range(3)]
    assert picks == [2, 2, eos]  # the end token is blocked for the first two tokens only
    assert not SamplingParams(8, ignore_eos=True).stops_at_eos and SamplingParams(8).stops_at_eos
    for seed in range(30):
        top1 = TokenChooser(SamplingParams(8, temperature=1.0, top_k=1, seed=seed), 5)
        assert int(top1(torch.tensor([[0]]), logits.clone())[0].argmax()) == 3
        minp = TokenChooser(SamplingParams(8, temperature=1.0, min_p=0.5, seed=seed), 5)
        assert int(minp(torch.tensor([[0]]), logits.clone())[0].argmax()) == 3  # the rest < 0.5 x p(3)
    rep = TokenChooser(SamplingParams(8, temperature=0, repetition_penalty=10.0), 5)
    assert int(rep(torch.tensor([[3]]), logits.clone())[0].argmax()) == 2  # 9 / 10 < 2
    # min_tokens: a stop string inside the first tokens' text does not count
    assert StopMatcher((".",)).final("a. b. c", after=3) == "a. b"


# -- the HTTP surface, in-process over the local model -------------------------------------------------------
@pytest.fixture(scope="module")
def api(smollm2_dir):
    from local_api import make_app, serve

    with serve(make_app(smollm2_dir)) as url:
        yield url


@pytest.fixture
def client(api):
    return openai.OpenAI(base_url=f"{api}/v1", api_key="local", max_retries=0, timeout=300)


class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0, le=100_000_000)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time now"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_parse_with_a_pydantic_model(client):
    reply = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "Describe Paris."}],
                                          response_format=City, temperature=0, max_tokens=80)
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and city.name and reply.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                           response_format={"type": "json_object"}, max_tokens=120, seed=1)
    if plain.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(plain.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(client, stream):
    def ask(messages, **extra):
        if not stream:
            return client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, CLOCK],
                                                  temperature=0, max_tokens=60, **extra).choices[0]
        with client.chat.completions.stream(model="smollm2", messages=messages, tools=[WEATHER, CLOCK],
                                            temperature=0, max_tokens=60, **extra) as events:
            return events.get_final_completion().choices[0]

    call = ask(ASK, tool_choice="required", parallel_tool_calls=False)
    assert call.finish_reason == "tool_calls" and call.message.content in (None, "")
    [tool_call] = call.message.tool_calls
    assert tool_call.function.name in ("get_weather", "clock") and tool_call.id.startswith("call_")
    arguments = json.loads(tool_call.function.arguments)
    if tool_call.function.name == "get_weather":
        assert jsonschema_rs.validator_for(WEATHER["function"]["parameters"]).is_valid(arguments)
    result = {"role": "tool", "tool_call_id": tool_call.id, "content": "Sunny, 21 degrees celsius."}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]}, result]
    answer = ask(history, tool_choice="none")
    assert answer.message.content and not answer.message.tool_calls
    assert not answer.message.content.startswith("<tool_call>")


def test_named_tool_choice_and_streamed_argument_deltas(api):
    body = {"messages": ASK, "tools": [WEATHER, CLOCK], "temperature": 0, "max_tokens": 60, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with HTTP.stream("POST", f"{api}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert len(calls) > 2  # the arguments arrive in pieces
    arguments = "".join(c["function"].get("arguments", "") for c in calls)
    assert json.loads(arguments)["unit"] in ("celsius", "fahrenheit")
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(d.get("content") for d in deltas)


def test_sampling_extensions_over_http(api):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "ignore_eos": True, "top_k": 20,
            "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4, "seed": 5}
    reply = HTTP.post(f"{api}/v1/chat/completions", json=body, timeout=300).json()
    assert reply["usage"]["completion_tokens"] == 24 and reply["choices"][0]["finish_reason"] == "length"
    bad = HTTP.post(f"{api}/v1/chat/completions", json={**body, "min_tokens": 30}, timeout=30)
    assert bad.status_code == 400 and "min_tokens" in bad.json()["error"]["message"]
    typo = HTTP.post(f"{api}/v1/completions", json={"prompt": "a", "ignore_eoss": True}, timeout=30)
    assert typo.status_code == 400 and "ignore_eoss" in typo.json()["error"]["message"]


def deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("extra, status, needle, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                          "if": {}}}}},
     400, "response_format.json_schema.schema: unsupported or invalid schema", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     400, "Invalid type: nope", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep(MAX_SCHEMA_DEPTH)}}},
     400, f"deeper than {MAX_SCHEMA_DEPTH}", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                         for i in range(MAX_SCHEMA_CHARS // 100)}}}}},
     400, f"at most {MAX_SCHEMA_CHARS}", None),
    ({"response_format": {"type": "json_schema"}}, 400, "needs its json_schema", "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "dependentSchemas": {}}}}]},
     400, "tools[f].function.parameters", "tools[f].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, 400, "unique", "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "nope", "tool_choice"),
    ({"tool_choice": "required"}, 400, "needs tools", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools[0].function.name", "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, 400, "tools[0]", "tools[0].type"),
    ({"functions": [{"name": "f"}]}, 400, "functions", "functions"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "tool_call_id", "messages[0]"),
    ({"top_logprobs": 3}, 400, "top_logprobs needs logprobs: true", "top_logprobs"),  # was answered without any logprobs
    ({"logit_bias": {"49152": 5}}, 400, "logit_bias: token id 49152 is not in the model's vocabulary of 49152",
     "logit_bias"),
])
def test_invalid_schemas_and_tools_get_clear_errors(api, extra, status, needle, param):
    """A clear message, and OpenAI's ``param``: the field at fault, which the SDKs surface as ``error.param``."""
    response = HTTP.post(f"{api}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra}, timeout=60)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == param, response.text


def test_fallback_and_template_tool_rendering(tokenizer):
    from swarm.api.schemas import ChatCompletionRequest
    from swarm.api.tools import fallback_messages, has_tool_section, render_template, template_messages, tool_list

    body = ChatCompletionRequest.model_validate({"messages": [
        *ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER]})
    assert not has_tool_section(tokenizer.chat_template)
    messages = fallback_messages(body.messages, body.tools)
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                      '</tool_call>')
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    template = ("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}:"
                "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{% else %}{{ m.content }}"
                "{% endif %}\n{% endfor %}")
    assert has_tool_section(template)
    text = render_template(template, template_messages(body.messages), tool_list(body.tools), {})
    assert text.startswith('TOOLS:[{"type": "function"') and 'assistant:{"city": "Paris"}' in text
    assert "tool:sunny" in text


# -- the grammar's cost per token --------------------------------------------------------------------------
def test_every_session_of_a_step_follows_its_grammar_on_the_real_vocabulary(tokenizer):
    """1 and 16 sessions in one step (their masks computed together, as the orchestrator's step does), each steered
    along the same valid JSON text: every session's mask admits the text's token, and the sampler takes it. The
    grammar's cost per token is measured by ``tests/bench_grammar.py`` (a benchmark, not a timed test)."""
    schema = City.model_json_schema()
    grammar = compile_grammar(json_schema_grammar(schema), tokenizer)
    head = torch.randn(VOCAB, 576) / 24
    text_ids = tokenizer(json.dumps({"name": "Paris", "country": "France", "population": 2102650},
                                    separators=(", ", ": "))).input_ids
    for sessions in (1, 16):
        choosers = [TokenChooser(SamplingParams(100, temperature=0.7, seed=i, grammar=grammar), VOCAB)
                    for i in range(sessions)]
        hidden = torch.randn(sessions, 576)
        for token in text_ids:
            TokenChooser.prepare(choosers)
            logits = hidden @ head.T
            logits[:, token] += 50.0  # the sampler picks the text's token (the model's favourite) if the mask allows
            for row, chooser in enumerate(choosers):
                chooser(torch.tensor([[0]]), logits[row: row + 1])
                assert chooser.generated[-1] == token


def test_response_ids_have_openais_forms(api):
    """cmpl-…, chatcmpl-… and resp_… (the Responses API's ids were resp-…)."""
    ids = [HTTP.post(f"{api}/v1/{path}", json=body, timeout=60).json()["id"] for path, body in [
        ("completions", {"prompt": "Hi", "max_tokens": 1}),
        ("chat/completions", {"messages": ASK, "max_tokens": 1}),
        ("responses", {"input": "Hi", "max_output_tokens": 1})]]
    assert [i[:i.index(sep) + 1] for i, sep in zip(ids, "--_")] == ["cmpl-", "chatcmpl-", "resp_"], ids
    assert all(len(i) > 20 for i in ids), ids
