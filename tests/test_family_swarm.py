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


def test_a_family_outside_the_supported_ones_is_refused_in_one_line(tmp_path):
    from swarm.model.compat import petals

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3", "hidden_size": 64}))
    with pytest.raises(ValueError) as info:
        petals.AutoDistributedConfig.from_pretrained(str(tmp_path))
    message = str(info.value)
    assert "'phi3'" in message and "qwen3" in message and "gemma3" in message and "\n" not in message
