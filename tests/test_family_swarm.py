"""Every family through a real swarm: the goldens' checkpoints served by two petals servers on Chainswarm's block
code, driven by a vanilla petals client (petals' single-session path) and by the orchestrator-side batched
client (:class:`swarm.engine.batching.ChainGenerator`-style multi-session streams are covered on the real model
in test_batched_sessions_real); greedy tokens equal the goldens made by transformers 5.x.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from server.local_swarm import LocalSwarm
from helpers import HTTP

pytestmark = pytest.mark.swarm

GOLDENS = Path(__file__).parent / "data" / "goldens"
NEAR_TIE = 1e-3


def _compare(tokens: list[int], golden) -> int:
    expected, margins = golden["generated_ids"].tolist(), golden["margins"].tolist()
    for i, (got, want) in enumerate(zip(tokens, expected)):
        if margins[i] < NEAR_TIE:
            return i
        assert got == want, f"step {i}: {got} != {want} (tokens {tokens}, golden {expected})"
    return len(expected)


@pytest.mark.parametrize("case", ["gemma3", "qwen3", "mistral", "llama3"])
def test_a_family_served_by_two_servers_generates_the_golden_tokens(case):
    from swarm.engine.petals_client import open_distributed_model

    model_dir = GOLDENS / case
    golden = load_file(str(model_dir / "golden.safetensors"))
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    split = layers // 2 + 1  # uneven spans: each server binds blocks to their own layer indices
    with LocalSwarm(model_dir) as swarm:
        swarm.add_server((0, split), torch_dtype="float32", max_length=64)
        swarm.add_server((split, layers), torch_dtype="float32", max_length=64)
        with open_distributed_model(str(model_dir), initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                    torch_dtype=torch.float32) as model:
            assert type(model).__name__.startswith("Distributed")
            ids = golden["prompt_ids"][None]
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
                compared = _compare(out[0, ids.shape[1]:].tolist(), golden)
                # the forward path (petals' rpc_forward, no cache) agrees with the golden's prompt logits
                logits = model(ids).logits[0]
            assert compared >= 4
            torch.testing.assert_close(logits, golden["logits"], atol=1e-3, rtol=1e-3)


def test_a_checkpoint_written_by_make_model_is_served_like_the_local_block_code(tmp_path):
    """What a volunteer without a model hub tries first: ``chainswarm make-model --family qwen2`` (q/k/v biases,
    GQA, a window shorter than the prompt) served by two servers; a vanilla petals client's greedy tokens equal
    :class:`LocalModel`'s (up to the first near tie of the random weights)."""
    from swarm.cli import main
    from swarm.engine.petals_client import open_distributed_model
    from swarm.model.local_model import LocalModel
    from transformers import AutoTokenizer

    model_dir = tmp_path / "qwen2"
    assert main(["make-model", "--family", "qwen2", "--out", str(model_dir), "--layers", "4", "--kv-heads", "2",
                 "--window", "6", "--vocab", "512", "--max-length", "64", "--seed", "5"]) == 0
    ids = torch.tensor(AutoTokenizer.from_pretrained(model_dir)("volunteers run servers on their own machines").input_ids)
    assert len(ids) > 6  # the window is shorter than the prompt: the servers' sliding mask is exercised
    expected, logits = LocalModel.from_pretrained(model_dir).greedy(ids, 12)
    top2 = logits.topk(2).values
    golden = {"generated_ids": torch.tensor(expected), "margins": top2[:, 0] - top2[:, 1]}
    with LocalSwarm(model_dir) as swarm:
        swarm.add_server((0, 3), torch_dtype="float32", max_length=64)
        swarm.add_server((3, 4), torch_dtype="float32", max_length=64)
        with open_distributed_model(str(model_dir), initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                    torch_dtype=torch.float32) as model:
            with torch.inference_mode():
                out = model.generate(ids[None], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert _compare(out[0, len(ids):].tolist(), golden) >= 4


def test_a_family_outside_the_supported_ones_is_refused_in_one_line(tmp_path):
    from swarm.model.compat import petals

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3", "hidden_size": 64}))
    with pytest.raises(ValueError) as info:
        petals.AutoDistributedConfig.from_pretrained(str(tmp_path))
    message = str(info.value)
    assert "'phi3'" in message and "qwen3" in message and "gemma3" in message and "\n" not in message


def test_gemma3_through_the_orchestrator_batched_path_equals_the_block_code_run_locally(tmp_path):
    """The product's path for a family transformers 4.34 cannot run: an orchestrator and two Chainswarm nodes
    serve the Gemma 3 golden checkpoint (local and global layers, windows shorter than the prompts); concurrent
    ``/v1/completions`` go through the continuous-batching engine (multi-session streams, one LM head per step)
    and each answer equals :class:`LocalModel`'s greedy continuation — which equals transformers 5.x's
    (test_family_goldens)."""
    import concurrent.futures as cf
    import shutil

    from swarm.model.checkpoint import _train_tokenizer
    from swarm.model.local_model import LocalModel

    model_dir = tmp_path / "gemma3"
    shutil.copytree(GOLDENS / "gemma3", model_dir)
    tokenizer = _train_tokenizer(512)
    assert len(tokenizer) <= 512
    tokenizer.save_pretrained(model_dir)
    local = LocalModel.from_pretrained(model_dir)
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    candidates = ["the swarm serves blocks of a model", "volunteers run servers on their own machines",
                  "a request waits in the central queue", "every chain has a capacity", "prefix pages are reused",
                  "the planner places blocks on servers"]
    expected = {}
    for prompt in candidates:
        ids = tokenizer(prompt).input_ids
        tokens, logits = local.greedy(torch.tensor(ids), 10)
        top2 = logits.topk(2).values
        if bool(((top2[:, 0] - top2[:, 1]) > NEAR_TIE).all()):  # no near tie: the answer is determined
            tokens = tokens[:tokens.index(eos)] if eos in tokens else tokens
            expected[prompt] = tokenizer.decode(tokens, skip_special_tokens=True)
    assert len(expected) >= 3, "too few prompts without a near tie"
    with LocalSwarm(model_dir) as swarm:
        nodes = [swarm.add_node(node_id=f"g{i}", memory_gb=0.0012, wait=False, num_handlers=2, torch_dtype="float32",
                                max_batch=8) for i in range(2)]
        for node in nodes:
            swarm.wait_profiled(node, timeout=180)
        swarm.add_orchestrator(expected_rate=0.2, max_length=64, expected_input_tokens=16, expected_output_tokens=10,
                               refresh_s=0.5, torch_dtype="float32", placement="gbp-cr")
        status = swarm.wait_chains_ready(timeout=240)
        assert any(len(chain["servers"]) == 2 for chain in status["chains"]), status["chains"]
        url = swarm.orchestrator.info["url"]

        def complete(prompt):
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "stop": None}
            response = HTTP.post(f"{url}/v1/completions", json=body, headers={"X-Client-Id": "family"}, timeout=300)
            response.raise_for_status()
            return response.json()["choices"][0]["text"]

        with cf.ThreadPoolExecutor(len(expected)) as pool:
            answers = dict(zip(expected, pool.map(complete, expected)))
        metrics = HTTP.get(f"{url}/metrics", timeout=30).text
    assert answers == expected
    batched = [line for line in metrics.splitlines() if line.startswith("chainswarm_batched_session_steps_total")]
    assert batched and float(batched[0].split()[-1]) > 0, batched
