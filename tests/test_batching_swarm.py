"""Batched servers end to end on the real model: 8 concurrent sessions through the orchestrator's
/v1/completions (different prompt lengths and start times, prefix reuse on, spread over two lanes of the chain:
``--batch-lanes 2``) give the greedy tokens of the same model run locally in transformers — which is also what
unbatched (petals) servers give — while the servers really ran decode steps of several sessions in one pass; a
vanilla petals client keeps working against them. (Every other swarm test runs the default single lane.)
"""
import concurrent.futures as cf
import time

import pytest
import torch

from helpers import HTTP, server_info
from real_model import PROMPTS, greedy_reference
from server.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm

MAX_LENGTH = 256
TOKENS = 24
def _budget_gb(model_dir, servers: int, sessions: int) -> float:
    from swarm.model.compat import petals
    from petals.server.block_utils import get_block_size

    from server.profiling import cache_bytes_per_token

    config = petals.AutoDistributedConfig.from_pretrained(model_dir)
    block = get_block_size(config, "memory", dtype=torch.float32)
    share = -(-config.num_hidden_layers // servers)
    return share * (block + sessions * cache_bytes_per_token(config, torch.float32) * MAX_LENGTH) / 1e9


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    generate = greedy_reference(smollm2_dir)
    return {prompt: generate(prompt, TOKENS) for prompt in PROMPTS}


@pytest.fixture(scope="module")
def swarm(smollm2_dir):
    with LocalSwarm(smollm2_dir, open_sessions=True) as local:  # a vanilla petals client drives them too
        gb = _budget_gb(smollm2_dir, 2, 12)
        # a declared compute profile: the plan (chain capacity >= 8) must not depend on how loaded the machine
        # was when the nodes measured themselves (a fresh profile cache on a busy machine planned 6)
        nodes = [local.add_node(node_id=f"b{i}", memory_gb=gb, wait=False, num_handlers=2, torch_dtype="float32",
                                max_batch=8, declared_profile={"prefill_s": 2e-4, "decode_s": 2e-3, "rtt_s": 0.002})
                 for i in range(2)]
        for node in nodes:
            local.wait_profiled(node, timeout=180)
        local.add_orchestrator(expected_rate=0.2, max_length=MAX_LENGTH, expected_input_tokens=32,
                               expected_output_tokens=TOKENS, refresh_s=0.5, torch_dtype="float32",
                               prefix_cache_tokens=MAX_LENGTH, batch_lanes=2)
        local.status = local.wait_chains_ready(timeout=240)
        local.url = local.orchestrator.info["url"]
        yield local


def _complete(url: str, prompt: str, delay: float) -> str:
    time.sleep(delay)
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stop": None}
    response = HTTP.post(f"{url}/v1/completions", json=body, headers={"X-Client-Id": "batch"}, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _batching_stats(model, swarm) -> list[dict]:
    """Each server's batching counters, from petals' rpc_info (a vanilla client's own p2p)."""
    p2p = model.transformer.h.sequence_manager.state.p2p
    chain = swarm.status["chains"][0]
    peers = {node.name: node.peer_id for node in swarm.nodes}
    return [server_info(p2p, peers[name], f"{swarm.dht_prefix}.{span[0]}")["chainswarm_batching"]
            for name, span in zip(chain["servers"], chain["spans"])]


def test_concurrent_sessions_are_batched_and_equal_local_transformers(swarm, reference, smollm2_dir):
    assert len(swarm.status["chains"]) == 1 and len(swarm.status["chains"][0]["servers"]) == 2
    assert swarm.status["chains"][0]["capacity"] >= len(PROMPTS)
    for round_ in range(2):  # the second round loads the prompts' pages from the servers' prefix stores
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(lambda ip: _complete(swarm.url, ip[1], 0.2 * ip[0]), enumerate(PROMPTS)))
        for prompt, text in zip(PROMPTS, texts):
            assert text == reference[prompt], (round_, prompt[:40])
        metrics = HTTP.get(f"{swarm.url}/metrics", timeout=30).text
        assert "chainswarm_batched_generators 2.0" in metrics.splitlines(), "the chain's sessions ran in two lanes"
        # speculative drafts fill a step up to the servers' own batch bound (--max-batch 8), not the default 16
        assert "chainswarm_batched_step_positions 8.0" in metrics.splitlines()
    assert HTTP.get(f"{swarm.url}/v1/swarm", timeout=30).json()["prefix"]["hits"] >= 1

    from swarm.engine.petals_client import open_distributed_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    with open_distributed_model(str(smollm2_dir), initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                torch_dtype=torch.float32) as model:
        stats = _batching_stats(model, swarm)
        assert all(s["max_batch"] == 8 and s["batched_steps"] > 0 and s["largest_batch"] >= 4 for s in stats), stats
        # a vanilla petals client against the batching servers, while HTTP sessions run next to it
        with cf.ThreadPoolExecutor(3) as pool:
            others = [pool.submit(_complete, swarm.url, p, 0.0) for p in PROMPTS[:2]]
            ids = tokenizer(PROMPTS[3], return_tensors="pt").input_ids
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == reference[PROMPTS[3]]
            assert [f.result() for f in others] == [reference[p] for p in PROMPTS[:2]]
