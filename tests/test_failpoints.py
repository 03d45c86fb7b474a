"""A server killed in every phase of its work changes no answer (issue 29, item 5): the real model, real processes.

One swarm for the module (SmolLM2-135M-Instruct, float32): a DHT, an orchestrator with prefix reuse and
speculative decoding on (the defaults), and four nodes that the planner splits into two two-hop chains. Each test
arms one node's failpoint (server.failpoints) for one phase — a prefill, a decode step, a verification step with
drafted tokens, the moment between two steps, a prefix probe, the load of a new range — sends one greedy request
that reaches that phase on that node, and checks that the node died exactly there and that the answer is complete
and equal to local transformers. The victim then restarts under the same node id, and the swarm re-plans (in
make-before-break waves) before the next test.
"""
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers import HTTP, describe_swarm, wait_for
from server.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm

MAX_LENGTH = 512
MEMORY_GB = 0.24  # GiB per node: half the float32 model plus a few sessions -> two chains of two hops
DECLARED = {"prefill_s": 2e-4, "decode_s": 2e-3, "rtt_s": 0.002}
# a copy-heavy prompt: its decode steps carry drafts (its own repetition) that the model accepts
COPY_PROMPT = "red, green, blue, red, green, blue, red,"
PREFIX_PROMPT = (" ".join(f"Note {i}: the committee reviewed the budget and the schedule of the bridge." for i in range(6))
                 + "\nIn one sentence, the committee")


class Swarm:
    """The module's swarm: start, restart and arm nodes by name."""

    def __init__(self, local: LocalSwarm, failpoints: Path):
        self.local, self.failpoints = local, failpoints
        self.peers: dict[str, object] = {}

    def add(self, name: str, memory_gb: float = MEMORY_GB, wait: bool = False):
        self.peers[name] = self.local.add_node(node_id=name, memory_gb=memory_gb, wait=wait, declared_profile=DECLARED,
                                               torch_dtype="float32", failpoint_file=str(self.failpoints / name))
        return self.peers[name]

    def arm(self, name: str, phase: str) -> None:
        (self.failpoints / name).write_text(phase)

    def status(self) -> dict:
        return HTTP.get(f"{self.url}/v1/swarm", timeout=30).json()

    def settled(self, names=("n0", "n1", "n2", "n3"), timeout: float = 240.0) -> dict:
        """Wait until the plan covers ``names``, every chain is served, no re-plan is moving servers and nothing
        runs; return the status."""
        last: dict = {}

        def ok() -> bool:
            dead = {name: self.peers[name].process.exitcode for name in names
                    if name in self.peers and not self.peers[name].alive}
            if dead:  # a node that died outside its failpoint never comes back: say so now, not after the timeout
                raise AssertionError(f"nodes died unexpectedly (exit codes; -11 is SIGSEGV, its Python stacks are in "
                                     f"the captured stderr): {dead}; {self.explain(last, names)}")
            status = last["status"] = self.status()
            return (status["transition"] is None and len(status["chains"]) >= 2
                    and all(c["ready"] and c["active"] == 0 for c in status["chains"]) and not status["queue"]
                    and {s for c in status["chains"] for s in c["servers"]} >= set(names))
        wait_for(ok, timeout, what=f"a settled swarm of {names}", explain=lambda: self.explain(last, names))
        return self.status()

    def explain(self, last: dict, names) -> str:
        """The status, and for each named node the orchestrator does not list: whether its process lives (its
        Python stacks, if so, go to stderr)."""
        listed = {s["node_id"] for s in (last.get("status") or {}).get("servers", [])}
        missing = []
        for name in sorted(set(names) - listed):
            peer = self.peers.get(name)
            alive = peer is not None and peer.alive
            missing.append(f"{name} " + ("alive" if alive else f"exited ({peer and peer.process.exitcode})"))
            if alive:
                peer.dump_stacks()
        return f"{describe_swarm(last.get('status') or {})}; not listed: {missing}"


@pytest.fixture(scope="module")
def swarm(smollm2_dir, tmp_path_factory):
    with LocalSwarm(smollm2_dir) as local:
        s = Swarm(local, tmp_path_factory.mktemp("failpoints"))
        for i in range(4):
            s.add(f"n{i}")
        for peer in s.peers.values():
            local.wait_profiled(peer, timeout=180)
        local.add_orchestrator(kv_admission="slots", policy="swarm", expected_rate=1.0, max_length=MAX_LENGTH,
                               expected_input_tokens=64, expected_output_tokens=16, refresh_s=0.5,
                               request_timeout_s=20.0, prefix_cache_tokens=MAX_LENGTH, torch_dtype="float32",
                               suspect_s=10.0)  # a node killed in two tests in a row rejoins after 10 s, not 60
        s.url = local.orchestrator.info["url"]
        s.settled()
        yield s


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    from real_model import greedy_reference

    return greedy_reference(smollm2_dir)


def stream(url: str, prompt: str, max_tokens: int, after_first=None) -> str:
    """A greedy streamed completion; ``after_first()`` runs once the first token has arrived."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    pieces = []
    with HTTP.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Client-Id": "tester"},
                     timeout=300) as response:
        assert response.status_code == 200, (response.status_code, response.read())
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = httpx.Response(200, content=line[6:]).json()
                assert "error" not in event, event
                pieces.append(event["choices"][0]["text"])
                if after_first is not None and len(pieces) == 1:
                    after_first()
    return "".join(pieces)


def crash_during(swarm: Swarm, reference, phase: str, prompt: str, max_tokens: int = 24, *, arm_first: bool,
                 warm: bool = False) -> None:
    """Arm the last server of the request's chain for ``phase`` — before the request (the fastest chain, where JFFC
    puts a lone request; with ``warm``, the chain that holds the prompt's pages) or once its first token arrived
    (the chain it runs on) — run it, and check the answer and the crash; then bring the victim back."""
    swarm.settled()
    if warm:  # the prompt's pages are stored on a chain (and indexed) before the request that probes them
        assert stream(swarm.url, prompt, 2) == reference(prompt, 2)
        swarm.settled()
    victims = []

    def arm(key) -> None:
        chain = max(swarm.status()["chains"], key=key)
        victims.append(chain["servers"][-1])
        swarm.arm(victims[0], phase)

    if arm_first:
        arm(lambda c: (c["cached_prefix_tokens"], -c["service_time"]) if warm else -c["service_time"])
    text = stream(swarm.url, prompt, max_tokens, after_first=None if arm_first else lambda: arm(lambda c: c["active"]))
    assert text == reference(prompt, max_tokens)
    victim = victims[0]
    peer = swarm.peers[victim]
    wait_for(lambda: not peer.alive, 30, what=f"{victim} dead at its {phase} failpoint")
    assert not (swarm.failpoints / victim).exists()  # consumed: it died at the failpoint, not otherwise
    swarm.add(victim)
    swarm.settled()


def test_a_server_killed_in_a_prefill_changes_no_answer(swarm, reference):
    crash_during(swarm, reference, "prefill", "The three primary colours are", arm_first=True)


def test_a_server_killed_in_a_decode_step_changes_no_answer(swarm, reference):
    crash_during(swarm, reference, "decode", "Once upon a time, in a small village by the sea, there lived",
                 arm_first=False)


def test_a_server_killed_in_a_verification_step_changes_no_answer(swarm, reference):
    crash_during(swarm, reference, "verify", COPY_PROMPT, arm_first=False)


def test_a_server_killed_between_two_steps_changes_no_answer(swarm, reference):
    crash_during(swarm, reference, "between_steps", "Water boils at 100 degrees Celsius at sea level, but",
                 arm_first=False)


def test_a_server_killed_in_a_prefix_probe_changes_no_answer(swarm, reference):
    crash_during(swarm, reference, "probe", PREFIX_PROMPT, arm_first=True, warm=True)


def test_a_server_killed_while_it_scores_a_prompt_changes_no_score(swarm):
    """``echo`` with ``logprobs`` and max_tokens 0 (a prompt scored: one prefill whose outputs are kept at every
    position, swarm.engine.scoring), twice: the second time the prompt's pages and prefix scores are there to be
    loaded, and the last server of the chain dies in that prefill; the prompt is scored again in full, its scores
    complete and equal to the first time's, from the servers that took its place."""
    prompt = " ".join(["The capital of France is Paris, and the capital of Italy is Rome."] * 4)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}

    def score() -> tuple[list, int]:
        response = HTTP.post(f"{swarm.url}/v1/completions", json=body, headers={"X-Client-Id": "tester"}, timeout=300)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == prompt
        reused = int(dict(kv.split("=") for kv in response.headers["x-chainswarm-prefix"].split(";"))["reused"])
        return response.json()["choices"][0]["logprobs"]["token_logprobs"], reused

    swarm.settled()
    before, _ = score()
    swarm.settled()
    victim = max(swarm.status()["chains"], key=lambda c: -c["service_time"])["servers"][-1]  # a lone request's chain
    swarm.arm(victim, "prefill")
    after, reused = score()
    assert after[0] is None and after[1:] == pytest.approx(before[1:], abs=1e-4) and len(after) >= 48
    assert reused == 0  # scored in full after the failure
    wait_for(lambda: not swarm.peers[victim].alive, 30, what=f"{victim} dead at its prefill failpoint")
    assert not (swarm.failpoints / victim).exists()
    swarm.add(victim)
    swarm.settled()


def test_a_joining_server_killed_while_it_loads_its_range_changes_no_answer(swarm, reference):
    """A node big enough for a whole chain of its own joins armed for ``load``: it dies as it starts loading the
    range the new plan gives it, while a request runs; the swarm drops it and settles back on the four."""
    swarm.settled()
    swarm.arm("n4", "load")
    joiner = swarm.add("n4", memory_gb=0.8, wait=True)
    answers = []
    worker = threading.Thread(target=lambda: answers.append(stream(swarm.url, "The capital of France is", 16)))
    worker.start()
    wait_for(lambda: not joiner.alive, 120, what="n4 dead at its load failpoint")
    worker.join(300)
    assert answers == [reference("The capital of France is", 16)]
    assert not (swarm.failpoints / "n4").exists()
    began = time.monotonic()
    status = swarm.settled()
    assert all("n4" not in c["servers"] for c in status["chains"])
    assert time.monotonic() - began < 120
