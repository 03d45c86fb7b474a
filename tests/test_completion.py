"""swarm.engine.completion's liveness rules, driven with a fake orchestrator and fake sessions (no processes).

The fakes keep the real contracts: the orchestrator grants a slot per acquire and must see every grant
settled exactly once (finish or abort); the engine runs a session in its executor thread and reports tokens
through ``on_token`` and step progress through ``SessionControl``.
"""
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from swarm.control.orchestrator import QueueTimeout
from swarm.engine.completion import ClientGone, CompletionFailed, CompletionRunner, Finished
from swarm.engine.generation import GenerationResult
from swarm.engine.sampling import SamplingParams
from swarm.api.metrics import SwarmMetrics
from swarm.engine.routing import SessionAborted
from swarm.trust.verification import CheckPolicy, Ledger


@dataclass
class FakeGrant:
    request_id: str
    chain_id: str
    matched_tokens: int = 0


class FakeOrchestrator:
    def __init__(self, *, grant_after: float = 0.0):
        self.config = SimpleNamespace(expect=SimpleNamespace(max_length=64))
        self.ledger = Ledger(CheckPolicy(0.0, 0.0, 0.0))  # spot checks off (their own tests: test_verification)
        self.grant_after = grant_after
        self.granted, self.finished, self.aborted, self.cancelled = [], [], [], 0
        self.step_s = 0.0
        self.running = {}  # request id -> session control (the orchestrator's registry)
        self.resumed, self.resume_fails = [], False

    def prompt_hashes(self, ids):
        return []

    async def acquire(self, client, input_tokens, max_new_tokens, *, page_hashes=()):
        try:
            await asyncio.sleep(self.grant_after)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        grant = FakeGrant(f"r{len(self.granted)}", f"chain{len(self.granted)}")
        self.granted.append(grant.request_id)
        return grant

    async def resume(self, request_id, client, input_tokens, max_new_tokens, *, timeout, page_hashes=()):
        """The real one requeues the running request in its place; the fake grants it again at once (or never:
        ``resume_fails``)."""
        self.resumed.append((request_id, input_tokens, max_new_tokens))
        if self.resume_fails:
            raise QueueTimeout(f"no chain with room for the rest of the session within {timeout:.0f} s", 1.0)
        return FakeGrant(request_id, f"chain-resumed{len(self.resumed)}")

    def session_tokens(self, request_id):
        return self.config.expect.max_length

    def chain(self, chain_id):
        return SimpleNamespace(route=(("peer", 0, 4),), servers=("node",))

    def planned_step_s(self, chain_id, tokens):
        return self.step_s

    def ticket(self, request_id, chain_id, route, page_hashes=()):
        return b"ticket"  # the session engine is fake too: nothing checks it

    def tokens(self, request_id, count):
        pass

    def finish(self, request_id, output_tokens=None):
        self.finished.append(request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def prefilled(self, *args):
        pass

    def status(self):
        return {"servers": [], "chains": [], "clients": {}, "plan": None}


class FakeEngine:
    """``sessions`` is a list of behaviours, one per session started: 'stuck' (never returns, ignores abort,
    like a petals call on a blocked loop), 'tokens:N' (N tokens, then done), 'tokens-then-stuck:N'."""

    def __init__(self, *sessions):
        self.sessions = list(sessions)
        self.executor = ThreadPoolExecutor(4)
        self.release = threading.Event()  # set at teardown so stuck threads end
        self.priors = []  # the tokens each session was told earlier sessions had delivered

    def generate(self, lease, provider, input_ids, params, on_token, *, page_hashes=None, on_prefix=None,
                 control=None, prior=None, recorder=None, client=""):
        kind, _, n = self.sessions.pop(0).partition(":")
        self.priors.append(list(prior.tokens) if prior is not None else None)
        produced = list(prior.tokens) if prior is not None else []
        for i in range(int(n or 0)):
            time.sleep(0.02)
            on_token(7 + len(produced))
            produced.append(7 + len(produced))
        if kind in ("stuck", "tokens-then-stuck"):
            self.release.wait(30)
            raise SessionAborted("released at teardown")
        return GenerationResult(produced, "length")


@pytest.fixture
def run():
    engines = []

    def drive(orchestrator, engine, *, disconnect_after: float | None = None, **options):
        engines.append(engine)
        metrics = SwarmMetrics(orchestrator)
        runner = CompletionRunner(orchestrator, engine, metrics, poll_s=0.05, release_wait_s=0.3, **options)
        started = time.monotonic()

        async def gone():
            return disconnect_after is not None and time.monotonic() - started > disconnect_after

        async def collect():
            items = []
            async for item in runner.run("alice", [1, 2, 3], SamplingParams(8, 0.0), gone):
                items.append(item)
            return items

        outcome: dict = {}
        try:
            outcome["items"] = asyncio.run(asyncio.wait_for(collect(), 20))
        except Exception as exc:
            outcome["error"] = exc
        outcome["elapsed"] = time.monotonic() - started
        outcome["aborted"] = {reason: metrics.registry.get_sample_value(
            "chainswarm_sessions_aborted_total", {"reason": reason}) for reason in ("stalled", "client_gone", "failed")}
        return outcome

    yield drive
    for engine in engines:
        engine.release.set()
        engine.executor.shutdown(wait=True)


def test_a_session_that_never_returns_is_aborted_and_resumed_in_its_place(run):
    orchestrator = FakeOrchestrator()
    out = run(orchestrator, FakeEngine("stuck", "tokens:3"), stall_timeout_s=0.3)
    items = out["items"]
    assert items[:3] == [7, 8, 9] and isinstance(items[-1], Finished) and items[-1].attempts == 2
    # the stuck session's request went back to its place in the queue (resume, not a new request) and finished
    assert orchestrator.granted == ["r0"] and orchestrator.resumed == [("r0", 3, 8)]
    assert orchestrator.finished == ["r0"] and not orchestrator.aborted
    assert out["aborted"]["stalled"] == 1
    assert out["elapsed"] < 5  # bounded by the stall limit + release wait, not by the stuck call


def test_every_attempt_stuck_ends_in_a_clear_failure_with_its_slot_returned(run):
    orchestrator = FakeOrchestrator()
    out = run(orchestrator, FakeEngine("stuck", "stuck", "stuck"), stall_timeout_s=0.2)
    assert isinstance(out["error"], CompletionFailed) and "3 attempt" in str(out["error"])
    assert orchestrator.aborted == ["r0"] and len(orchestrator.resumed) == 2 and not orchestrator.finished
    assert out["aborted"]["stalled"] == 3


def test_a_session_that_stalls_after_tokens_goes_on_from_them(run):
    engine = FakeEngine("tokens-then-stuck:2", "tokens-then-stuck:1", "tokens:3")
    orchestrator = FakeOrchestrator()
    out = run(orchestrator, engine, stall_timeout_s=0.3)
    items = out["items"]
    # every token once, in order, over three sessions; the last one's result holds them all
    assert items[:-1] == [7, 8, 9, 10, 11, 12] and items[-1].token_ids == [7, 8, 9, 10, 11, 12]
    assert items[-1].attempts == 3 and engine.priors == [None, [7, 8], [7, 8, 9]]
    # continuations: prompt (3) + tokens so far, the rest of the 8-token budget
    assert orchestrator.resumed == [("r0", 5, 6), ("r0", 6, 5)] and orchestrator.finished == ["r0"]


def test_no_chain_for_the_rest_within_the_route_wait_is_a_clear_503(run):
    orchestrator = FakeOrchestrator()
    orchestrator.resume_fails = True
    out = run(orchestrator, FakeEngine("tokens-then-stuck:2"), stall_timeout_s=0.3, route_wait_s=7)
    assert isinstance(out["error"], QueueTimeout) and "rest of the session within 7 s" in str(out["error"])
    assert orchestrator.resumed == [("r0", 5, 6)]


def test_the_default_stall_limit_follows_the_planned_step_time_within_bounds():
    orchestrator = FakeOrchestrator()
    runner = CompletionRunner(orchestrator, FakeEngine(), SwarmMetrics(orchestrator))
    orchestrator.step_s = 0.01
    assert runner.stall_limit("c", 1) == runner.stall_floor_s == 30.0
    orchestrator.step_s = 10.0
    assert runner.stall_limit("c", 100) == 40.0  # 4 x the planned step
    orchestrator.step_s = 600.0
    assert runner.stall_limit("c", 100) == runner.stall_cap_s == 60.0  # never minutes


def test_a_client_that_leaves_while_queued_leaves_the_queue_at_once(run):
    orchestrator = FakeOrchestrator(grant_after=60.0)
    out = run(orchestrator, FakeEngine(), disconnect_after=0.2)
    assert isinstance(out["error"], ClientGone)
    assert orchestrator.cancelled == 1 and not orchestrator.granted  # taken out of the queue, never granted
    assert out["elapsed"] < 2


def test_a_client_that_leaves_mid_generation_stops_the_session_and_frees_its_slot(run):
    orchestrator = FakeOrchestrator()
    out = run(orchestrator, FakeEngine("tokens:200"), disconnect_after=0.3)
    assert isinstance(out["error"], ClientGone)
    assert orchestrator.aborted == ["r0"] and not orchestrator.finished
    assert out["aborted"]["client_gone"] == 1
    assert out["elapsed"] < 3  # 200 tokens would take 4 s
