"""The tests' ground truth, ``real_model.greedy_reference``: local transformers' greedy text, decoded once and kept
in files (the user cache's ``references/``, or ``CHAINSWARM_REFERENCE_DIR``) under a digest of the checkpoint and
library versions — what a module reads from there is what transformers gives for that prompt and length, a shorter
length is the prefix of a longer decoding, and a changed checkpoint reads none of another's tokens."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import real_model
from real_model import greedy_reference


def _transformers(model_dir: str, prompt: str, count: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=count, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_a_shared_reference_is_transformers_own_at_every_length(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("CHAINSWARM_REFERENCE_DIR", str(tmp_path))
    prompt = "the quick brown fox"
    first = greedy_reference(tiny_model, horizon=12)
    assert first(prompt, 5) == _transformers(tiny_model, prompt, 5)  # decoded to 12, read back as 5
    assert len(list(tmp_path.rglob("*.json"))) == 1

    # another module or worker of the run: reads the file, never loads the model
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded although the reference was in the run's store")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_model)
    second = greedy_reference(tiny_model, horizon=12)
    assert second(prompt, 12) == first(prompt, 12)
    assert second(prompt, 3) == first(prompt, 3)
    # longer than what is stored (and the stored decoding did not end): decoded again, to the new length
    with pytest.raises(AssertionError, match="the model was loaded"):
        second(prompt, 20)
    monkeypatch.undo()
    monkeypatch.setenv("CHAINSWARM_REFERENCE_DIR", str(tmp_path))
    assert greedy_reference(tiny_model, horizon=12)(prompt, 20) == _transformers(tiny_model, prompt, 20)


def test_a_decoding_that_ended_answers_every_longer_length(tmp_path, monkeypatch, tiny_model):
    """A stored decoding that stopped at the end-of-sequence token is the answer for any length: nothing follows."""
    monkeypatch.setenv("CHAINSWARM_REFERENCE_DIR", str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    generate = greedy_reference(tiny_model, horizon=4)
    generate("hello", 4)
    [stored] = tmp_path.rglob("*.json")
    ended = [7, 9, tokenizer.eos_token_id]
    stored.write_text(real_model.json.dumps({"tokens": ended, "ended": True}))
    later = greedy_reference(tiny_model, horizon=4)
    assert later("hello", 50) == tokenizer.decode(ended, skip_special_tokens=True)


def test_a_changed_checkpoint_reads_none_of_the_old_ones_tokens(tiny_model, tmp_path, monkeypatch):
    import shutil

    store = tmp_path / "references"
    monkeypatch.setenv("CHAINSWARM_REFERENCE_DIR", str(store))
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    greedy_reference(str(copy), horizon=4)("hello", 4)
    [stored] = store.rglob("*.json")
    stored.write_text(real_model.json.dumps({"tokens": [5, 6, 7, 8], "ended": False}))  # what the old weights gave
    assert greedy_reference(str(copy), horizon=4)("hello", 4) == AutoTokenizer.from_pretrained(copy).decode([5, 6, 7, 8])
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert real_model.reference_dir(str(copy)) != stored.parent
    assert greedy_reference(str(copy), horizon=4)("hello", 4) == _transformers(str(copy), "hello", 4)


def test_the_kept_real_model_reference_is_what_transformers_gives_now(smollm2_dir):
    """The references kept from earlier runs: one, decoded anew in every run, equals what is kept."""
    prompt = real_model.PROMPTS[0]
    assert greedy_reference(smollm2_dir)(prompt, 32) == _transformers(smollm2_dir, prompt, 32)


def test_kept_api_answers_are_the_local_apis_own_and_read_back_without_the_model(tiny_model, tmp_path, monkeypatch):
    """``local_api.kept_reference``: the answers of the in-process handlers (plain and streamed) kept in the
    reference directory and read back by a later client without the model; a change of the code they depend on, or
    a refused request, is asked anew."""
    import openai

    import local_api

    monkeypatch.setenv("CHAINSWARM_REFERENCE_DIR", str(tmp_path))
    options = dict(model="tiny", prompt="the quick brown fox", max_tokens=6, temperature=0)

    def ask(client) -> tuple[str, str]:
        plain = client.completions.create(**options).choices[0].text
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **options))
        return plain, streamed

    with local_api.serve(local_api.make_app(tiny_model, max_length=64, model_name="tiny")) as url:
        live = ask(openai.OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0))
    with local_api.kept_reference(tiny_model, max_length=64, model_name="tiny") as first:
        assert ask(first) == live
        assert first.transport.misses == 2
        with pytest.raises(openai.BadRequestError):  # an invalid request is a 400, as OpenAI answers it
            first.completions.create(**{**options, "max_tokens": -1})
        assert first.transport.misses == 3

    def no_model(*args, **kwargs):
        raise AssertionError("the local API was started although the answer was kept")

    monkeypatch.setattr(local_api, "make_app", no_model)
    with local_api.kept_reference(tiny_model, max_length=64, model_name="tiny") as second:
        assert ask(second) == live
        assert second.transport.misses == 0
        with pytest.raises(AssertionError, match="was started"):  # a refusal is never kept
            second.completions.create(**{**options, "max_tokens": -1})
    monkeypatch.setattr(local_api, "code_digest", lambda: "the handlers changed")
    with local_api.kept_reference(tiny_model, max_length=64, model_name="tiny") as third:
        with pytest.raises(AssertionError, match="was started"):
            ask(third)


def test_kept_answers_key_a_conversation_without_its_tool_call_ids_only_where_they_miss_the_prompt(smollm2_dir):
    """``local_api.without_call_ids``: ids numbered by first appearance (equal stay equal, different stay
    different), nothing else changed — and on SmolLM2, whose template has no tool section, two conversations that
    differ only in their ids render the same prompt (the fact that lets the tool tests' kept answers ignore them)."""
    import json

    from local_api import without_call_ids
    from swarm.api.schemas import ChatCompletionRequest
    from swarm.api.tools import fallback_messages, has_tool_section
    from swarm.model.tokenizer import load_tokenizer

    def conversation(call_id: str, other: str) -> dict:
        return {"model": "m", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "messages": [{"role": "user", "content": "Weather?"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}},
                                 {"id": other, "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                             {"role": "tool", "tool_call_id": call_id, "content": "Sunny."},
                             {"role": "tool", "tool_call_id": other, "content": "Rain."}]}

    first, second = conversation("call_abc", "call_def"), conversation("call_123", "call_456")
    key = json.loads(without_call_ids(json.dumps(first).encode()))
    assert without_call_ids(json.dumps(second).encode()) == without_call_ids(json.dumps(first).encode())
    assert [c["id"] for c in key["messages"][1]["tool_calls"]] == ["id0", "id1"]
    assert [m.get("tool_call_id") for m in key["messages"][2:]] == ["id0", "id1"]
    assert key["messages"][1]["tool_calls"][1]["function"] == first["messages"][1]["tool_calls"][1]["function"]
    assert without_call_ids(json.dumps(conversation("x", "x")).encode()) != without_call_ids(json.dumps(first).encode())
    responses = {"input": [{"type": "function_call", "id": "fc_1", "call_id": "call_9", "name": "f", "arguments": "{}"},
                           {"type": "function_call_output", "call_id": "call_9", "output": "Sunny."}], "model": "m"}
    assert json.loads(without_call_ids(json.dumps(responses).encode()))["input"][1]["call_id"] == "id1"

    tokenizer = load_tokenizer(smollm2_dir)
    assert not has_tool_section(tokenizer.chat_template)
    prompts = {tokenizer.apply_chat_template(fallback_messages(ChatCompletionRequest(**c).messages,
                                                               ChatCompletionRequest(**c).tools),
                                             tokenize=False, add_generation_prompt=True) for c in (first, second)}
    assert len(prompts) == 1 and "Sunny." in prompts.pop()
