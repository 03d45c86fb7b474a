"""Chainswarm's block code against goldens made by a current transformers (``scripts/goldens/``), every family.

The goldens (``tests/data/goldens/<case>/``) are small random-weight checkpoints saved by transformers 5.x with
GQA, biases, q/k norms, the linear/dynamic/llama3 rope scalings, sliding windows shorter than the prompt and
Gemma 3's local/global layers switched on, with their per-block hidden states, logits and greedy tokens. No
transformers ≥ 4.50 is needed here: the checks run the committed files through :mod:`swarm.model`.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from swarm.model.arch import UnsupportedModel, arch_from_config
from swarm.model.block import DecoderBlock, Segment
from swarm.model.local_model import LocalModel, read_config

GOLDENS = Path(__file__).parent / "data" / "goldens"
CASES = sorted(p.name for p in GOLDENS.iterdir() if (p / "golden.safetensors").exists())
NEAR_TIE = 1e-3


def test_every_family_has_a_golden():
    families = {read_config(GOLDENS / c)["model_type"] for c in CASES}
    assert families == {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"}
    kinds = {arch_from_config(read_config(GOLDENS / c)).layers[-1].rope.kind for c in CASES}
    assert {"llama3", "linear", "dynamic", "default"} <= kinds


@pytest.fixture(scope="module", params=CASES)
def case(request):
    path = GOLDENS / request.param
    return path, LocalModel.from_pretrained(path), load_file(str(path / "golden.safetensors"))


def test_block_hidden_states_equal_the_golden(case):
    _, model, golden = case
    states = model.hidden_states(golden["prompt_ids"])
    assert len(states) == model.spec.num_layers + 1
    for i, state in enumerate(states):
        torch.testing.assert_close(state, golden[f"hidden.{i}"], atol=1e-4, rtol=1e-4, msg=f"hidden.{i}")


def test_prompt_logits_and_greedy_tokens_equal_the_golden(case):
    _, model, golden = case
    states = model.hidden_states(golden["prompt_ids"])
    torch.testing.assert_close(model.logits(states[-1]), golden["logits"], atol=1e-4, rtol=1e-4)
    tokens, step_logits = model.greedy(golden["prompt_ids"], 16)
    expected, margins = golden["generated_ids"].tolist(), golden["margins"].tolist()
    for i, (got, want) in enumerate(zip(tokens, expected)):
        if margins[i] < NEAR_TIE:  # past a near tie the continuation may legitimately differ
            break
        assert got == want, f"step {i}: {got} != {want}"
        torch.testing.assert_close(step_logits[i], golden["step_logits"][i], atol=1e-4, rtol=1e-4)


def test_a_mixed_step_equals_each_sequence_alone(case):
    """The batched path (3 decode steps and 2 verification steps with different cache lengths + 1 prefill in one
    ``step``) gives each sequence what it gets alone — through every block, so windows and per-layer ropes are
    exercised."""
    _, model, golden = case
    spec, hidden = model.spec, model.embed(golden["prompt_ids"][None])[0]
    for block in model.layers:
        segments, alone, rows = [], [], []
        for n, t in ((9, 1), (13, 1), (21, 1), (11, 3), (17, 5)):
            _, cache = block.run(hidden[None, :n])
            k = hidden.new_zeros(1, spec.num_kv_heads, spec.head_dim, n + t)
            v = hidden.new_zeros(1, spec.num_kv_heads, n + t, spec.head_dim)
            k[..., :n], v[:, :, :n] = cache
            segments.append(Segment(k, v, n, 1, t))
            alone.append(block.run(hidden[None, n:n + t], cache)[0][0])
            rows.append(hidden[n:n + t])
        segments.append(Segment(hidden.new_zeros(1, spec.num_kv_heads, spec.head_dim, 12),
                                hidden.new_zeros(1, spec.num_kv_heads, 12, spec.head_dim), 0, 1, 12))
        alone.append(block.run(hidden[None, :12])[0][0])
        rows.append(hidden[:12])
        with torch.inference_mode():
            mixed = block.step(torch.cat(rows), segments)
        torch.testing.assert_close(mixed, torch.cat(alone), atol=1e-5, rtol=1e-5)
        hidden = block.run(hidden[None])[0][0]


@pytest.mark.parametrize("decode_batch", [False, True])
def test_a_sliding_window_admits_exactly_w_keys(decode_batch):
    """Mistral's window W = 8: the query at position p sees keys p-7..p; a change at p-8 changes nothing there."""
    model = LocalModel.from_pretrained(GOLDENS / "mistral")
    block, spec = model.layers[0], model.spec
    window = block.layer_spec.window
    assert window == 8
    torch.manual_seed(0)
    hidden = torch.randn(1, 20, spec.hidden_size)

    def last_output(h):
        _, cache = block.run(h[:, :-1])
        if not decode_batch:
            return block.run(h[:, -1:], cache)[0][0, -1]
        n = h.shape[1] - 1  # the same decode step inside a padded batch with a longer sequence
        other, other_cache = torch.randn(1, 30, spec.hidden_size), None
        _, other_cache = block.run(other[:, :-1])
        segs = []
        for (k, v), length in ((cache, n), (other_cache, 29)):
            kk = k.new_zeros(1, spec.num_kv_heads, spec.head_dim, length + 1)
            vv = v.new_zeros(1, spec.num_kv_heads, length + 1, spec.head_dim)
            kk[..., :length], vv[:, :, :length] = k, v
            segs.append(Segment(kk, vv, length, 1, 1))
        with torch.inference_mode():
            return block.step(torch.cat([h[0, -1:], other[0, -1:]]), segs)[0]

    base = last_output(hidden)
    p = hidden.shape[1] - 1
    outside, inside = hidden.clone(), hidden.clone()
    outside[0, p - window] += 1.0
    inside[0, p - window + 1] += 1.0
    torch.testing.assert_close(last_output(outside), base)
    assert not torch.allclose(last_output(inside), base)


def _old_format(cfg: dict) -> dict:
    """The same config as an older transformers wrote it (rope_theta/rope_scaling/torch_dtype, Gemma's
    rope_local_base_freq and sliding_window_pattern, no layer_types)."""
    cfg = copy.deepcopy(cfg)
    params = cfg.pop("rope_parameters")
    cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg["model_type"] == "gemma3_text":
        cfg.pop("layer_types")
        full, local = params["full_attention"], params["sliding_attention"]
        cfg["rope_local_base_freq"] = local["rope_theta"]
        cfg["rope_theta"] = full.pop("rope_theta")
        cfg["rope_scaling"] = None if full["rope_type"] == "default" else full
    else:
        cfg.pop("layer_types", None)
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = None if params["rope_type"] == "default" else {"type": params.pop("rope_type"), **params}
    return cfg


@pytest.mark.parametrize("name", CASES)
def test_configs_of_older_and_current_transformers_read_the_same(name):
    cfg = read_config(GOLDENS / name)
    assert arch_from_config(_old_format(cfg)) == arch_from_config(cfg)


@pytest.mark.parametrize("cfg, words", [
    ({"model_type": "falcon", "hidden_size": 8}, ["'falcon'", "llama", "mistral", "qwen2", "qwen3", "gemma3"]),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "intermediate_size": 8, "vocab_size": 10, "rope_scaling": {"rope_type": "yarn", "factor": 4}}, ["'yarn'"]),
    ({"model_type": "qwen2", "num_attention_heads": 4}, ["hidden_size"]),
])
def test_unsupported_checkpoints_are_refused_in_one_line(cfg, words):
    with pytest.raises(UnsupportedModel) as info:
        arch_from_config(cfg)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_kv_bytes_use_the_real_head_dim_and_kv_heads():
    spec = arch_from_config(read_config(GOLDENS / "qwen3"))
    assert (spec.head_dim, spec.num_kv_heads) == (32, 2)  # heads × head_dim (128) ≠ hidden (64)
    assert spec.kv_bytes_per_token(2) == 2 * 2 * 32 * 2
    block = DecoderBlock(spec, 0)
    assert sum(p.numel() for p in block.parameters()) == spec.block_params()
    versions = json.loads((GOLDENS / "qwen3" / "golden.json").read_text())["versions"]
    assert tuple(int(x) for x in versions["transformers"].split(".")[:2]) >= (4, 50)  # an independent reference


def test_a_steps_cos_and_sin_are_computed_once_for_all_its_blocks():
    """Blocks share one rotary per (rope, head_dim) — Gemma 3's local and global layers two — and the next block
    of a step, with equal positions, gets the cos and sin the first computed, equal to a fresh computation; cos
    and sin made in inference mode never reach a pass that records autograd (the mode is part of the memo)."""
    from swarm.model.rope import Rotary

    model = LocalModel.from_pretrained(GOLDENS / "gemma3")
    rotaries = {id(block._rotary): block._rotary for block in model.layers}
    assert {r.rope.theta for r in rotaries.values()} == {block.layer_spec.rope.theta for block in model.layers}
    assert len(rotaries) == 2
    rotary = model.layers[0]._rotary
    with torch.inference_mode():
        cos, sin = rotary.cos_sin(torch.arange(5, 9), 0)
        again = rotary.cos_sin(torch.arange(5, 9), 0)  # the next block: another tensor, equal positions
        assert again[0] is cos and again[1] is sin
        fresh = Rotary(rotary.rope, rotary.dim).cos_sin(torch.arange(5, 9), 0)
        assert torch.equal(fresh[0], cos) and torch.equal(fresh[1], sin)
        assert rotary.cos_sin(torch.arange(6, 10), 0)[0] is not cos  # other positions: computed anew
        # a step's key (what DecoderBlock.step passes: its segments' positions): no tensor is compared
        keyed = rotary.cos_sin(torch.arange(5, 9), 0, key=("cpu", ((5, 4, 1),)))
        assert rotary.cos_sin(torch.arange(5, 9), 0, key=("cpu", ((5, 4, 1),)))[0] is keyed[0]
        assert rotary.cos_sin(torch.arange(7, 11), 0, key=("cpu", ((7, 4, 1),)))[0] is not keyed[0]
        assert torch.equal(rotary.cos_sin(torch.arange(5, 9), 0, key=("cpu", ((5, 4, 1),)))[0], cos)
    hidden = torch.randn(1, 4, model.spec.hidden_size, requires_grad=True)
    with torch.inference_mode():
        model.layers[0].run(hidden.detach())  # positions 0..3 memoised in inference mode
    out, _ = model.layers[0].run(hidden)  # the same positions with autograd: no inference tensor is saved
    out.sum().backward()
    assert hidden.grad is not None and bool(torch.isfinite(hidden.grad).all())
