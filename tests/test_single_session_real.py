"""Speculative decoding on petals' per-session path, on the real model (swarm/engine/single.py).

One swarm for the module: SmolLM2-135M-Instruct (float32), four nodes that the planner splits into two two-hop
chains (the budgets of tests/test_failpoints.py), and an orchestrator with ``--batch-sessions 0``: every request
runs as one petals session — petals' own client path, failover included — and drafts from its own text, the
chain verifying the drafts in the session's steps and its servers taking the rejected ones back. Greedy answers
equal local transformers and the ``speculative: false`` answer (logprobs included), concurrently too; a server
SIGKILLed in the middle of a verification step changes no answer (the session fails over, its input history
replayed without the rejected positions). Every session is spot-checked (``--spot-check-rate 1``): what a
speculating session's servers were sent and returned, with the rejected positions taken back, is re-executed on
the other chain's servers and agrees — no honest server is ever struck.
"""
import concurrent.futures as cf
import time

import pytest

from helpers import HTTP, describe_swarm, wait_for
from real_model import PROMPTS
from server.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm

MAX_LENGTH = 256
MEMORY_GB = 0.24  # GiB per node: half the float32 model plus a few sessions -> two chains of two hops
DECLARED = {"prefill_s": 2e-4, "decode_s": 2e-3, "rtt_s": 0.002}
COPY = ("Copy the list exactly.\nList: red apple, green pear, yellow banana, purple plum, orange peach.\n"
        "Copy: red apple, green pear,")


@pytest.fixture(scope="module")
def swarm(smollm2_dir, tmp_path_factory):
    failpoints = tmp_path_factory.mktemp("failpoints")
    with LocalSwarm(smollm2_dir) as local:
        nodes = [local.add_node(node_id=f"n{i}", memory_gb=MEMORY_GB, wait=False, declared_profile=DECLARED,
                                torch_dtype="float32", failpoint_file=str(failpoints / f"n{i}")) for i in range(4)]
        for node in nodes:
            local.wait_profiled(node, timeout=180)
        local.add_orchestrator(kv_admission="slots", policy="fcfs", expected_rate=1.0, max_length=MAX_LENGTH,
                               expected_input_tokens=32, expected_output_tokens=24, refresh_s=0.5,
                               request_timeout_s=20.0, torch_dtype="float32", replan_tolerance=100.0,
                               batch_sessions=0, speculative="ngram", spot_check_rate=1.0, spot_check_new_rate=1.0)
        local.status = local.wait_chains_ready(timeout=240)
        local.url, local.failpoints = local.orchestrator.info["url"], failpoints
        yield local


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    from real_model import greedy_reference

    return greedy_reference(smollm2_dir)


def _metric(url: str, name: str) -> float:
    text = HTTP.get(f"{url}/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _checks(url: str) -> dict:
    """The spot checks' outcomes so far (``chainswarm_spot_checks_total{outcome=...}``)."""
    text = HTTP.get(f"{url}/metrics", timeout=30).text
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("chainswarm_spot_checks_total{")}


def _complete(url: str, body: dict, client: str = "single") -> dict:
    response = HTTP.post(f"{url}/v1/completions", json={"temperature": 0, **body}, headers={"X-Client-Id": client},
                         timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]


_LAST: dict = {}  # the status _idle read last (what a timed-out wait reports)


def _idle(url: str) -> bool:
    """Every chain ready and idle, and all four servers planned with KV: a server that a session reported failed
    (on a loaded machine a step can time out) is excluded for the orchestrator's grace period, and the plan
    without it leaves its chain partner no sessions, so no span could be re-executed there until it is back."""
    status = HTTP.get(f"{url}/v1/swarm", timeout=30).json()
    _LAST["status"] = status
    whole = len(status["servers"]) == 4 and all(
        not s["suspect"] and s["assignment"] and s["assignment"]["cache_slots"] > 0 for s in status["servers"])
    return whole and bool(status["chains"]) and all(c["ready"] and c["active"] == 0 for c in status["chains"])


def _wait_idle(swarm, timeout: float = 240.0) -> None:
    """Wait (bounded) for :func:`_idle`; on a timeout, say what the swarm still lacked, and for each node the
    orchestrator does not list whether its process lives (its Python stacks, if so, go to stderr)."""
    def explain() -> str:
        status = _LAST.get("status") or {}
        listed = {s["node_id"] for s in status.get("servers", [])}
        missing = []
        for peer in swarm.nodes:
            if peer.name not in listed:
                missing.append(f"{peer.name} " + ("alive" if peer.alive else f"exited ({peer.process.exitcode})"))
                if peer.alive:
                    peer.dump_stacks()
        return f"{describe_swarm(status)}; not listed: {missing}"

    wait_for(lambda: _idle(swarm.url), timeout, what="the whole swarm idle", explain=explain)


def test_a_copying_text_is_verified_several_tokens_per_step_and_changes_no_token(swarm, reference):
    """The prompt's own list drafts its copy: the petals session verifies several tokens per step, and the text and
    logprobs are those of one token per step and of local transformers. No batched step runs in this swarm."""
    _wait_idle(swarm)
    body = {"prompt": COPY, "max_tokens": 24, "logprobs": 2}
    answers, accepted, took = {}, {}, {}
    for speculative in (False, True):
        before = _metric(swarm.url, "chainswarm_speculative_accepted_tokens_total")
        began = time.monotonic()
        answers[speculative] = _complete(swarm.url, dict(body, speculative=speculative))
        took[speculative] = time.monotonic() - began
        accepted[speculative] = _metric(swarm.url, "chainswarm_speculative_accepted_tokens_total") - before
    assert answers[True]["text"] == answers[False]["text"] == reference(COPY, 24)
    assert answers[True]["logprobs"]["tokens"] == answers[False]["logprobs"]["tokens"]
    for mine, theirs in zip(answers[True]["logprobs"]["token_logprobs"], answers[False]["logprobs"]["token_logprobs"]):
        assert abs(mine - theirs) < 1e-3
    assert accepted[False] == 0 and accepted[True] >= 8, accepted
    # sampled with a seed: each token is drawn from the seed and its position, a draft kept when it is that draw
    seeded = dict(body, temperature=0.7, seed=5)
    before = _metric(swarm.url, "chainswarm_speculative_accepted_tokens_total")
    drafted = _complete(swarm.url, dict(seeded, speculative=True))
    assert _metric(swarm.url, "chainswarm_speculative_accepted_tokens_total") - before >= 4
    assert drafted["text"] == _complete(swarm.url, dict(seeded, speculative=False))["text"]
    assert _metric(swarm.url, "chainswarm_batched_steps_total") == 0  # every session ran on petals' path
    # two spans per session: each re-executed on the other chain's server of the same blocks. A recording that still
    # held the rejected positions would not match the session's tokens, and its check would be skipped
    def unchecked() -> str:
        status = HTTP.get(f"{swarm.url}/v1/swarm", timeout=30).json()
        return f"checks {_checks(swarm.url)}, verification {status.get('verification')}, {describe_swarm(status)}"
    wait_for(lambda: _checks(swarm.url)["passed"] >= 4, 120, what="both sessions' spans re-executed and agreed",
             explain=unchecked)
    assert {k: _checks(swarm.url)[k] for k in ("mismatches", "strikes", "skipped")} == dict.fromkeys(
        ("mismatches", "strikes", "skipped"), 0.0)


def test_concurrent_sessions_that_speculate_equal_local_transformers(swarm, reference):
    """Six concurrent greedy completions on the two chains, each drafting from its own text."""
    _wait_idle(swarm)

    def one(i: int) -> str:
        time.sleep(0.1 * i)
        return _complete(swarm.url, {"prompt": PROMPTS[i], "max_tokens": 24}, client=f"c{i % 3}")["text"]

    with cf.ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(one, range(6)))
    for i, text in enumerate(texts):
        assert text == reference(PROMPTS[i], 24), PROMPTS[i][:40]
    assert _checks(swarm.url)["mismatches"] == 0 and _checks(swarm.url)["strikes"] == 0


def test_a_server_killed_in_a_verification_step_changes_no_answer(swarm, reference):
    """The last server of a chain dies at its first step with drafted tokens; the session fails over to the other
    chain's server for those blocks and replays its history there — without the positions it had taken back — and
    the answer is unchanged. A lone request goes to the fastest chain, as a rule: on a loaded machine the
    orchestrator's estimates can send it to the other one, whose servers then never saw the failpoint (its file
    is still there after the answer). Then the other chain's last server is armed and the request sent again."""
    _wait_idle(swarm)
    status = HTTP.get(f"{swarm.url}/v1/swarm", timeout=30).json()
    candidates = [c["servers"][-1] for c in sorted(status["chains"], key=lambda c: c["service_time"])]
    for victim_name in candidates:
        victim = next(p for p in swarm.nodes if p.name == victim_name)
        armed = swarm.failpoints / victim_name
        armed.write_text("verify")
        assert _complete(swarm.url, {"prompt": COPY, "max_tokens": 24})["text"] == reference(COPY, 24)
        if not armed.exists():  # consumed: the victim reached a verification step and killed itself there
            break
        armed.unlink()  # the other chain served it without a failover: its last server is the next victim
        _wait_idle(swarm)
    else:
        raise AssertionError(f"no verification step reached any of {candidates}")
    wait_for(lambda: not victim.alive, 30, what=f"{victim_name} dead at its verify failpoint")
