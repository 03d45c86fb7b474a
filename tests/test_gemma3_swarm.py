"""The real Gemma 3 270M through a planned two-hop swarm, with speculative decoding on both paths.

Gemma 3 is a family transformers 4.34 cannot run: its servers run Chainswarm's own block code (local and global
layers, a 512-token sliding window, q/k norms, (1 + w) norms, embedding scale). One swarm for the module: two nodes
that hold half of the 18 blocks each, and an orchestrator with the default serving options (the batched path,
``--speculative ngram``); then the same nodes under an orchestrator with ``--batch-sessions 0`` (every request one
petals session, drafts verified in its own steps). On each path a text that restates its prompt is verified several
tokens per step, and the answer equals the ``speculative: false`` answer and the block code run locally in the
same dtype (:class:`swarm.model.local_model.LocalModel`, itself checked against transformers 5.24 in
tests/test_gemma3_real.py), with no near tie in the reference's logits.
"""
from __future__ import annotations

import pytest
import torch

from helpers import HTTP, wait_for
from server.local_swarm import LocalSwarm
from test_gemma3_real import NEAR_TIE, gemma_dir  # noqa: F401  (the cached checkpoint, or a skip)

pytestmark = pytest.mark.swarm

TOKENS = 24
PROMPT = ("Copy the list exactly.\nList: red apple, green pear, yellow banana, purple plum, orange peach, brown "
          "walnut.\nCopy: red apple, green pear,")


@pytest.fixture(scope="module")
def reference(gemma_dir):  # noqa: F811
    """The block code's greedy text for PROMPT, run locally (float32), checked free of near ties."""
    from swarm.model.local_model import LocalModel
    from swarm.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(gemma_dir)
    model = LocalModel.from_pretrained(gemma_dir, torch.float32)
    with torch.inference_mode():
        tokens, logits = model.greedy(torch.tensor(tokenizer(PROMPT).input_ids), TOKENS)
    top2 = logits.topk(2).values
    if tokenizer.eos_token_id in tokens:  # the swarm's answer ends there
        tokens = tokens[:tokens.index(tokenizer.eos_token_id) + 1]
    assert bool(((top2[:len(tokens), 0] - top2[:len(tokens), 1]) > NEAR_TIE).all()), \
        "the reference has a near tie: choose another prompt"
    return tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def swarm(gemma_dir):  # noqa: F811
    with LocalSwarm(gemma_dir) as local:
        nodes = [local.add_node(node_id=f"g{i}", memory_gb=0.26, wait=False, torch_dtype="float32") for i in range(2)]
        for node in nodes:
            local.wait_profiled(node, timeout=180)
        yield local


def _metric(url: str, name: str) -> float:
    text = HTTP.get(f"{url}/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _answers(url: str) -> tuple[dict, float]:
    """PROMPT without and with drafts: the texts, and the drafted tokens the chain accepted."""
    answers, accepted = {}, 0.0
    for speculative in (False, True):
        before = _metric(url, "chainswarm_speculative_accepted_tokens_total")
        body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "speculative": speculative}
        response = HTTP.post(f"{url}/v1/completions", json=body, headers={"X-Client-Id": "gemma"}, timeout=300)
        response.raise_for_status()
        answers[speculative] = response.json()["choices"][0]["text"]
        accepted = _metric(url, "chainswarm_speculative_accepted_tokens_total") - before
    return answers, accepted


def _orchestrate(local: LocalSwarm, **options) -> str:
    local.add_orchestrator(max_length=256, expected_input_tokens=48, expected_output_tokens=TOKENS, refresh_s=0.5,
                           torch_dtype="float32", **options)
    status = local.wait_chains_ready(timeout=240)
    assert any(len(chain["servers"]) == 2 for chain in status["chains"]), status["chains"]
    return local.orchestrator.info["url"]


@pytest.mark.parametrize("path", ["batched", "per-session"])
def test_speculative_decoding_on_gemma3_changes_no_token(swarm, reference, path):
    if swarm.orchestrator is not None:  # the previous path's orchestrator: the nodes stay, the next one re-plans
        swarm.stop_server(swarm.orchestrator)
        wait_for(lambda: not swarm.orchestrator.process.is_alive(), 30, what="the orchestrator stopped")
    url = _orchestrate(swarm, **({"batch_sessions": 0} if path == "per-session" else {}))
    answers, accepted = _answers(url)
    assert answers[True] == answers[False] == reference
    assert accepted >= 4, accepted
    batched = _metric(url, "chainswarm_batched_steps_total")
    assert (batched > 0) == (path == "batched"), batched
