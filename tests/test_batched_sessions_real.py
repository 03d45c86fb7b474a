"""The orchestrator's batched path on the real model: sessions of a chain stepped together, with failover.

SmolLM2-135M-Instruct (float32) split by the planner into two two-hop chains (four nodes, the budgets of
tests/test_real_model_swarm.py), no prefix reuse, so every completion joins its chain's ChainGenerator
(swarm/engine/batching.py): one multi-session message per server and step, one LM-head pass in the orchestrator.
Concurrent greedy completions with different prompt lengths and start times give the tokens of the same
model run locally in transformers; a server SIGKILLed in the middle of a batch loses no answer: its chain's
sessions go on from their tokens as petals sessions on the surviving chain. Speculative decoding is on
(``--speculative ngram``): every answer above is also verified drafts, a kill lands in the middle of
verification steps, and a text that copies its prompt is drafted from itself and equals the one-token-per-step
answer, logprobs included.
"""
import concurrent.futures as cf
import threading
import time

import httpx
import pytest

from helpers import HTTP, wait_for
from real_model import PROMPTS, greedy_reference
from server.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm

MAX_LENGTH = 256
MEMORY_GB = 0.24
DECLARED = {"prefill_s": 2e-4, "decode_s": 2e-3, "rtt_s": 0.002}


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    return greedy_reference(smollm2_dir)


@pytest.fixture(scope="module")
def swarm(smollm2_dir):
    with LocalSwarm(smollm2_dir) as local:
        nodes = [local.add_node(node_id=f"n{i}", memory_gb=MEMORY_GB, wait=False, declared_profile=DECLARED,
                                torch_dtype="float32") for i in range(4)]
        for node in nodes:
            local.wait_profiled(node, timeout=180)
        # max-length KV slots: the chain layout and capacities this test's swarm is sized for (token admission:
        # tests/test_kv_admission.py, test_family_swarm.py, bench_batching's HTTP rows)
        local.add_orchestrator(kv_admission="slots", policy="fcfs", expected_rate=1.0, max_length=MAX_LENGTH, expected_input_tokens=32,
                               expected_output_tokens=24, refresh_s=0.5, request_timeout_s=20.0,
                               torch_dtype="float32", replan_tolerance=100.0, speculative="ngram")
        local.status = local.wait_chains_ready(timeout=240)
        local.url = local.orchestrator.info["url"]
        yield local


def _metric(url: str, name: str) -> float:
    text = HTTP.get(f"{url}/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _stream(url: str, prompt: str, max_tokens: int, pieces: list, errors: list, on_piece=None,
            sampling=None) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, **(sampling or {"temperature": 0})}
    with HTTP.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Client-Id": "batch"},
                     timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = httpx.Response(200, content=line[6:]).json()
                if "error" in event:
                    errors.append(event["error"])
                    return
                pieces.append(event["choices"][0]["text"])
                if on_piece is not None:
                    on_piece(len(pieces))


def idle(url: str) -> bool:
    status = HTTP.get(f"{url}/v1/swarm", timeout=30).json()
    return bool(status["chains"]) and all(c["active"] == 0 for c in status["chains"]) and not status["queue"]


def test_concurrent_completions_are_batched_and_equal_local_transformers(swarm, reference):
    chains = swarm.status["chains"]
    assert len(chains) >= 2 and all(len(c["servers"]) >= 2 for c in chains)
    steps, session_steps, chosen = (_metric(swarm.url, f"chainswarm_batched_{n}_total")
                                    for n in ("steps", "session_steps", "chosen_steps"))
    accepted = _metric(swarm.url, "chainswarm_speculative_accepted_tokens_total")

    def one(i: int) -> str:
        time.sleep(0.15 * i)  # different start times: sessions join running batches
        body = {"prompt": PROMPTS[i], "max_tokens": 24, "temperature": 0}
        response = HTTP.post(f"{swarm.url}/v1/completions", json=body, headers={"X-Client-Id": f"c{i % 3}"},
                             timeout=300)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(one, range(len(PROMPTS))))
    for prompt, text in zip(PROMPTS, texts):
        assert text == reference(prompt, 24), prompt[:40]
    steps = _metric(swarm.url, "chainswarm_batched_steps_total") - steps
    session_steps = _metric(swarm.url, "chainswarm_batched_session_steps_total") - session_steps
    assert steps > 0 and session_steps / steps >= 2.0, (steps, session_steps)  # sessions really shared steps
    # the chains' last servers chose the tokens (new servers' sessions are also spot-checked: the head runs here)
    assert _metric(swarm.url, "chainswarm_batched_chosen_steps_total") - chosen >= session_steps / 2
    accepted = _metric(swarm.url, "chainswarm_speculative_accepted_tokens_total") - accepted
    # no session left the batched path (a cohort step failed once on a handle freed mid-step: server/batching.py)
    assert _metric(swarm.url, "chainswarm_batched_fallbacks_total") == 0
    assert session_steps + accepted == 24 * len(PROMPTS)  # a step gives one token plus the drafts it verified


def test_a_server_killed_mid_batch_changes_no_answer(swarm, reference):
    """Six concurrent streamed completions, a seventh sampled with a seed and an eighth constrained by a JSON schema;
    when the first has 8 tokens, the last server of the chain it runs on is SIGKILLed. That chain's batch breaks; its
    sessions go on from their tokens on the other chain — the seeded and the constrained ones too: draws depend on
    the seed and positions only, and the tokens they had are replayed into their new choosers (the grammar's state
    with them), so they end as the same requests run without a failure."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"]}
    extra = [(PROMPTS[6], {"temperature": 0.8, "seed": 41, "top_p": 0.95}),  # seeded sampling
             (PROMPTS[7], {"temperature": 0, "response_format": {  # a grammar, chosen on the last server too
                 "type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})]
    unbroken = []
    for prompt, sampling in extra:
        wait_for(lambda: idle(swarm.url), 60, what="an idle swarm")
        unbroken.append(HTTP.post(f"{swarm.url}/v1/completions", json={"prompt": prompt, "max_tokens": 32, **sampling},
                                  timeout=300).json()["choices"][0]["text"])
    wait_for(lambda: idle(swarm.url), 60, what="an idle swarm")
    status = HTTP.get(f"{swarm.url}/v1/swarm", timeout=30).json()
    victim_name = status["chains"][0]["servers"][-1]  # JFFC fills the fastest chain, chain 0, first
    victim = next(p for p in swarm.nodes if p.name == victim_name)
    prompts = PROMPTS[:6]
    results = [([], []) for _ in prompts]
    eighth = threading.Event()
    fallbacks = _metric(swarm.url, "chainswarm_batched_fallbacks_total")
    threads = [threading.Thread(target=_stream, args=(swarm.url, p, 32, *results[i]),
                                kwargs={"on_piece": (lambda n: n >= 8 and eighth.set()) if i == 0 else None})
               for i, p in enumerate(prompts)]
    sampled = [([], []) for _ in extra]
    threads += [threading.Thread(target=_stream, args=(swarm.url, prompt, 32, *out), kwargs={"sampling": sampling})
                for (prompt, sampling), out in zip(extra, sampled)]
    for t in threads:
        t.start()
    assert eighth.wait(120)
    swarm.kill(victim)
    for t in threads:
        t.join(300)
    for (pieces, errors), text in zip(sampled, unbroken):
        assert not errors and "".join(pieces) == text
    for prompt, (pieces, errors) in zip(prompts, results):
        assert not errors, (prompt[:40], errors, HTTP.get(f"{swarm.url}/v1/swarm", timeout=30).json()["chains"], victim_name)
        assert "".join(pieces) == reference(prompt, 32), prompt[:40]
    assert _metric(swarm.url, "chainswarm_batched_fallbacks_total") > fallbacks  # the batch did break
    wait_for(lambda: idle(swarm.url), 60, what="every slot free and the queue empty after the failure")
    began = time.monotonic()
    response = HTTP.post(f"{swarm.url}/v1/completions", json={"prompt": "After the failure,", "max_tokens": 4},
                         timeout=60)
    assert response.status_code == 200 and time.monotonic() - began < 15


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "seed": 5}], ids=["greedy", "seeded"])
def test_speculative_decoding_verifies_drafts_and_changes_no_token(swarm, sampling):
    """A prompt whose continuation repeats it (a list it restates): drafted from the request's own tokens, verified
    by the chain several at a time — the same text and logprobs as with ``speculative: false``, greedy and sampled
    with a seed (each token is drawn from the seed and its position, and a draft is kept when it is that draw)."""
    prompt = ("Copy the list exactly.\nList: red apple, green pear, yellow banana, purple plum, orange peach.\n"
              "Copy: red apple, green pear,")
    body = {"prompt": prompt, "max_tokens": 24, "logprobs": 2, **sampling}
    wait_for(lambda: idle(swarm.url), 60, what="an idle swarm")
    answers, accepted = {}, {}
    for speculative in (False, True):
        before = _metric(swarm.url, "chainswarm_speculative_accepted_tokens_total")
        response = HTTP.post(f"{swarm.url}/v1/completions", json=dict(body, speculative=speculative),
                             headers={"X-Client-Id": "spec"}, timeout=300)
        response.raise_for_status()
        answers[speculative] = response.json()["choices"][0]
        accepted[speculative] = _metric(swarm.url, "chainswarm_speculative_accepted_tokens_total") - before
    assert answers[True]["text"] == answers[False]["text"] and "yellow banana" in answers[True]["text"]
    assert answers[True]["logprobs"]["tokens"] == answers[False]["logprobs"]["tokens"]
    for mine, theirs in zip(answers[True]["logprobs"]["token_logprobs"], answers[False]["logprobs"]["token_logprobs"]):
        assert abs(mine - theirs) < 1e-3
    assert accepted[False] == 0 and accepted[True] >= 8, accepted  # the opt-out drafts nothing; copying drafts well
