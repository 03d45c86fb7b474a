"""Structured outputs and tool calls through a live swarm, with the official ``openai`` client.

One orchestrator and two nodes serving SmolLM2-135M-Instruct (as tests/test_openai_api.py); the sessions run
on the batched path (swarm.engine.batching.ChainGenerator), whose step computes the grammar masks of all its
constrained sessions together while the step travels through the chain. The constrained answers are the
ones the same handlers give over the local model in-process (tests/local_api.py: same grammar, same greedy
choice) — the batched path masks exactly as the reference does.
"""
import concurrent.futures as cf
import json
from pathlib import Path

import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

from server.local_swarm import LocalSwarm
from helpers import HTTP

pytestmark = pytest.mark.swarm

MAX_LENGTH = 512
DECLARED = {"prefill_s": 2e-4, "decode_s": 2e-3, "rtt_s": 0.002}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0, le=100_000_000)


@pytest.fixture(scope="module")
def swarm(smollm2_dir):
    with LocalSwarm(smollm2_dir) as swarm:
        swarm.add_orchestrator(expected_rate=0.5, max_length=MAX_LENGTH, expected_input_tokens=160,
                               expected_output_tokens=32, refresh_s=0.5, max_queue_per_client=16)
        nodes = [swarm.add_node(node_id=f"n{i}", memory_gb=0.24, wait=False, declared_profile=DECLARED)
                 for i in range(2)]
        for node in nodes:
            swarm.wait_profiled(node, timeout=180)
        swarm.wait_chains_ready(timeout=240)
        swarm.url = swarm.orchestrator.info["url"]
        yield swarm


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """The same handlers over the local model in-process (the ground truth of constrained greedy decoding), their
    answers kept across runs (tests/local_api.py, ``kept_reference``: computed once per checkpoint, library versions
    and code; the long tool prompts' prefills were 45 of this module's 65 in-process CPU-seconds)."""
    from local_api import kept_reference

    with kept_reference(smollm2_dir, max_length=MAX_LENGTH, model_name=Path(smollm2_dir).name) as api:
        api.model = Path(smollm2_dir).name
        yield api


@pytest.fixture(scope="module")
def expected(reference):
    """Greedy reference answers, each computed once for the module (the streamed and the plain variant of a test
    compare with the same answer: greedy decoding over the same grammar gives one text)."""
    answers = {}

    def answer(api: str, **options):
        key = (api, json.dumps(options, sort_keys=True))
        if key not in answers:
            options = dict(model=reference.model, temperature=0, **options)
            answers[key] = (reference.chat.completions.create(**options).choices[0].message if api == "chat"
                            else reference.responses.create(**options))
        return answers[key]

    return answer


@pytest.fixture
def client(swarm, smollm2_dir):
    api = openai.OpenAI(base_url=f"{swarm.url}/v1", api_key="none", max_retries=0, timeout=300)
    api.model = Path(smollm2_dir).name
    return api


def test_parse_with_a_pydantic_model_matches_the_reference(client, reference):
    messages = [{"role": "user", "content": "Describe Paris."}]
    options = dict(model=client.model, messages=messages, response_format=City, temperature=0, max_tokens=80)
    reply = client.chat.completions.parse(**options)
    expected = reference.chat.completions.parse(**options)
    assert isinstance(reply.choices[0].message.parsed, City)
    assert reply.choices[0].message.content == expected.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(client, expected, stream):
    def ask(api, messages, **extra):
        if not stream:
            return api.chat.completions.create(model=api.model, messages=messages, tools=[WEATHER], temperature=0,
                                               max_tokens=64, **extra).choices[0]
        with api.chat.completions.stream(model=api.model, messages=messages, tools=[WEATHER], temperature=0,
                                         max_tokens=64, **extra) as events:
            return events.get_final_completion().choices[0]

    call = ask(client, ASK, tool_choice="required", parallel_tool_calls=False)
    assert call.finish_reason == "tool_calls"
    [tool_call] = call.message.tool_calls
    assert tool_call.function.name == "get_weather"
    arguments = json.loads(tool_call.function.arguments)
    assert jsonschema_rs.validator_for(WEATHER["function"]["parameters"]).is_valid(arguments)
    assert tool_call.function.arguments == expected("chat", messages=ASK, tools=[WEATHER], max_tokens=64,
                                                    tool_choice="required", parallel_tool_calls=False
                                                    ).tool_calls[0].function.arguments
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": tool_call.id, "type": "function", "function": {"name": "get_weather",
                                                              "arguments": tool_call.function.arguments}}]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": "Sunny, 21 degrees celsius."}]
    answer = ask(client, history, tool_choice="none")
    assert answer.message.content and not answer.message.tool_calls
    assert answer.message.content == expected("chat", messages=history, tools=[WEATHER], max_tokens=64,
                                              tool_choice="none").content


def test_constrained_and_free_sessions_share_batched_steps(client, swarm):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    validator = jsonschema_rs.validator_for(schema)
    questions = ["Name a colour.", "Name a fruit.", "Name a planet.", "Name an animal."]

    def constrained(i):
        return client.chat.completions.create(
            model=client.model, messages=[{"role": "user", "content": questions[i % 4]}], temperature=0.8, seed=i,
            max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})

    def free(i):
        return client.completions.create(model=client.model, prompt="The three primary colours are", max_tokens=16,
                                         extra_body={"ignore_eos": True, "min_p": 0.05, "top_k": 40})

    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(constrained, range(6)))
        frees = list(pool.map(free, range(3)))
    for reply in answers:
        if reply.choices[0].finish_reason == "stop":
            assert validator.is_valid(json.loads(reply.choices[0].message.content)), reply.choices[0].message.content
    assert sum(r.choices[0].finish_reason == "stop" for r in answers) >= 4
    assert all(r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length" for r in frees)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api_function_call_round_trip(client, expected, stream):
    """``POST /v1/responses`` with the official client: a function call, then its output sent back with the
    earlier output items; the call and the answer equal the in-process reference's (the call: its chat API's)."""
    tool = {"type": "function", **WEATHER["function"]}

    def ask(api, items, **extra):
        options = dict(model=api.model, input=items, tools=[tool], temperature=0, max_output_tokens=64, **extra)
        if not stream:
            return api.responses.create(**options)
        with api.responses.stream(**options) as events:
            kinds = [event.type for event in events]
            final = events.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert any(k in ("response.output_text.delta", "response.function_call_arguments.delta") for k in kinds)
        return final

    first = ask(client, "What is the weather in Paris?", tool_choice="required", parallel_tool_calls=False)
    [call] = first.output
    assert first.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert jsonschema_rs.validator_for(WEATHER["function"]["parameters"]).is_valid(json.loads(call.arguments))
    # the same call as the chat API's (whose swarm answer test_tool_round_trip compares with this reference)
    assert call.arguments == expected("chat", messages=ASK, tools=[WEATHER], max_tokens=64, tool_choice="required",
                                      parallel_tool_calls=False).tool_calls[0].function.arguments
    conversation = [*ASK, *(item.model_dump(exclude_none=True) for item in first.output),
                    {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees celsius."}]
    answer = ask(client, conversation, tool_choice="none")
    assert answer.status == "completed" and answer.output_text and answer.output[0].type == "message"
    assert answer.output_text == expected("responses", input=conversation, tools=[tool], max_output_tokens=64,
                                          tool_choice="none").output_text
    assert answer.usage.output_tokens > 0 and answer.usage.input_tokens > 0


def test_responses_api_refuses_state_it_does_not_keep(swarm):
    reply = HTTP.post(f"{swarm.url}/v1/responses", json={"input": "Hi", "previous_response_id": "resp_1"},
                      timeout=30)
    assert reply.status_code == 400 and "previous_response_id" in reply.json()["error"]["message"]
    reply = HTTP.post(f"{swarm.url}/v1/responses", json={"input": []}, timeout=30)
    assert reply.status_code == 400 and "at least one item" in reply.json()["error"]["message"]
    reply = HTTP.post(f"{swarm.url}/v1/responses", json={"input": "Hi", "tmperature": 0}, timeout=30)
    assert reply.status_code == 400
