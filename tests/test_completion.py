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
from swarm.engine.generation import GenerationResult, StopGeneration
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
        self.refusals = []  # resume's ``refused``: whether its timeout would be a refusal
        self.reserves, self.grows, self.room = [], [], 0  # reservations asked, growths asked, growths granted
        self.holds = []  # can_hold's answers in turn (False when used up): whether a chain could hold the rest

    def grow(self, request_id, more_tokens):
        self.grows.append(more_tokens)
        self.room -= 1
        return self.room >= 0

    def can_hold(self, input_tokens, max_new_tokens, reserve):
        return self.holds.pop(0) if self.holds else False

    def prompt_hashes(self, ids):
        return []

    async def acquire(self, client, input_tokens, max_new_tokens, *, page_hashes=(), reserve=None):
        self.reserves.append(reserve)
        try:
            await asyncio.sleep(self.grant_after)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        grant = FakeGrant(f"r{len(self.granted)}", f"chain{len(self.granted)}")
        self.granted.append(grant.request_id)
        return grant

    async def resume(self, request_id, client, input_tokens, max_new_tokens, *, timeout, page_hashes=(),
                     reserve=None, refused=True, kv_freed=()):
        """The real one requeues the running request in its place; the fake grants it again at once (or never:
        ``resume_fails``)."""
        self.resumed.append((request_id, input_tokens, max_new_tokens))
        self.refusals.append(refused)
        self.reserves.append(reserve)
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

    def finish(self, request_id, output_tokens=None, *, kv_freed=()):
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
            produced.append(7 + len(produced))
            try:
                on_token(produced[-1])
            except StopGeneration as stop:  # as the real engine: the callback ended the answer at this token
                return GenerationResult(produced, stop.finish_reason)
        if kind in ("stuck", "tokens-then-stuck"):
            self.release.wait(30)
            raise SessionAborted("released at teardown")
        return GenerationResult(produced, "length")


@pytest.fixture
def run():
    engines = []

    def drive(orchestrator, engine, *, disconnect_after: float | None = None, params=SamplingParams(8, 0.0),
              **options):
        engines.append(engine)
        metrics = SwarmMetrics(orchestrator)
        runner = CompletionRunner(orchestrator, engine, metrics, poll_s=0.05, release_wait_s=0.3, **options)
        started = time.monotonic()

        async def gone():
            return disconnect_after is not None and time.monotonic() - started > disconnect_after

        async def collect():
            items = []
            async for item in runner.run("alice", [1, 2, 3], params, gone):
                items.append(item)
            return items

        outcome: dict = {}
        try:
            outcome["items"] = asyncio.run(asyncio.wait_for(collect(), 20))
        except Exception as exc:
            outcome["error"] = exc
        outcome["elapsed"] = time.monotonic() - started
        outcome["aborted"] = {reason: metrics.registry.get_sample_value(
            "chainswarm_sessions_aborted_total", {"reason": reason}) for reason in ("stalled", "client_gone", "failed", "preempted")}
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
    assert orchestrator.resumed == [("r0", 5, 6)] and orchestrator.refusals == [True]


def test_an_answer_without_max_tokens_reserves_a_part_at_a_time_and_ends_at_length_when_its_chain_is_full(run):
    """max_tokens omitted (SamplingParams.grows): the request reserves grow_tokens of output, asks for more each
    time it has used them, and ends with finish_reason length at the first refusal; an explicit max_tokens
    reserves all of it at once and never asks."""
    orchestrator = FakeOrchestrator()
    orchestrator.room = 1  # one growth granted, the next refused
    out = run(orchestrator, FakeEngine("tokens:20"), params=SamplingParams(40, 0.0, grows=True), grow_tokens=6)
    finished = out["items"][-1]
    assert finished.finish_reason == "length" and len(finished.token_ids) == 12, out
    assert orchestrator.reserves == [6] and orchestrator.grows == [6, 6] and orchestrator.finished == ["r0"]
    plain = FakeOrchestrator()
    out = run(plain, FakeEngine("tokens:8"), grow_tokens=6)
    assert len(out["items"][-1].token_ids) == 8 and plain.reserves == [8] and not plain.grows


def test_a_growing_answer_with_no_room_on_its_chain_is_preempted_and_goes_on_when_a_chain_has_room(run):
    """The chain refuses the second growth but a chain of the plan could hold the rest: the session ends (its
    servers free its KV), the rest queues again from the 12 tokens delivered, and the answer runs to its cap
    with the same tokens as if it had never stopped (counted as a preemption, not a failure)."""
    orchestrator = FakeOrchestrator()
    answers = [True, False]  # the second growth refused; the resumed session's growths granted
    orchestrator.grow = lambda request_id, more: answers.pop(0) if answers else True
    orchestrator.holds = [True]
    out = run(orchestrator, FakeEngine("tokens:20", "tokens:12"), params=SamplingParams(24, 0.0, grows=True),
              grow_tokens=6)
    finished = out["items"][-1]
    assert finished.finish_reason == "length" and finished.token_ids == list(range(7, 31)), out
    assert [i for i in out["items"] if not isinstance(i, Finished)] == list(range(7, 31))  # streamed once each
    assert orchestrator.resumed == [("r0", 15, 12)] and orchestrator.reserves == [6, 6]
    assert out["aborted"].get("preempted") == 1 and not out["aborted"].get("failed")
    assert orchestrator.finished == ["r0"] and not orchestrator.aborted


def test_a_preempted_answer_that_finds_no_chain_in_time_ends_where_it_stopped_not_with_an_error(run):
    orchestrator = FakeOrchestrator()
    orchestrator.room, orchestrator.holds, orchestrator.resume_fails = 1, [True], True
    out = run(orchestrator, FakeEngine("tokens:20"), params=SamplingParams(24, 0.0, grows=True), grow_tokens=6)
    assert "error" not in out, out
    finished = out["items"][-1]
    assert finished.finish_reason == "length" and finished.token_ids == list(range(7, 19))
    assert orchestrator.resumed == [("r0", 15, 12)]
    assert orchestrator.refusals == [False]  # the rest's timeout is not counted as a refused request


def test_a_growing_answer_resumed_after_a_failure_reserves_from_where_it_stopped(run):
    orchestrator = FakeOrchestrator()
    orchestrator.room = 5
    engine = FakeEngine("tokens-then-stuck:7", "tokens:5")
    out = run(orchestrator, engine, params=SamplingParams(12, 0.0, grows=True), grow_tokens=4, stall_timeout_s=0.3)
    assert out["items"][-1].token_ids == list(range(7, 19)), out
    # 4 reserved, grown to 8 after 4 tokens; resumed after 7 with 4 more reserved (the rest is 5); grown at 11
    assert orchestrator.reserves == [4, 4] and orchestrator.resumed == [("r0", 10, 5)]
    assert orchestrator.grows == [4, 1]


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


class LateGrantOrchestrator(FakeOrchestrator):
    """Its grant comes in the very step the wait is cancelled, and acquire() returns it all the same: what the real
    one does on Python 3.11, where ``asyncio.wait_for`` returns a result that arrives as its task is cancelled."""

    async def acquire(self, client, input_tokens, max_new_tokens, *, page_hashes=(), reserve=None):
        try:
            await asyncio.sleep(self.grant_after)
        except asyncio.CancelledError:
            self.cancelled += 1
        grant = FakeGrant(f"r{len(self.granted)}", f"chain{len(self.granted)}")
        self.granted.append(grant.request_id)
        return grant


def test_a_grant_that_comes_as_the_client_leaves_the_queue_is_given_back(run):
    orchestrator = LateGrantOrchestrator(grant_after=60.0)
    out = run(orchestrator, FakeEngine(), disconnect_after=0.2)
    assert isinstance(out["error"], ClientGone)
    assert orchestrator.cancelled == 1 and orchestrator.granted == ["r0"]
    assert orchestrator.finished == ["r0"] and not orchestrator.aborted  # its slot free again, settled once


def test_a_grant_that_comes_as_the_wait_is_cancelled_is_given_back():
    """The request's other runs were refused (a batch, ``n``): its wait is cancelled as its grant comes."""
    orchestrator = LateGrantOrchestrator(grant_after=60.0)
    runner = CompletionRunner(orchestrator, FakeEngine(), SwarmMetrics(orchestrator), poll_s=0.05)

    async def never_gone():
        return False

    async def scenario():
        task = asyncio.ensure_future(runner._wait(orchestrator.acquire("alice", 3, 8), "alice", never_gone))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(10):  # the acquire task ends, then its done callback runs
            await asyncio.sleep(0)

    asyncio.run(scenario())
    assert orchestrator.granted == ["r0"] and orchestrator.finished == ["r0"]


def test_a_client_that_leaves_mid_generation_stops_the_session_and_frees_its_slot(run):
    orchestrator = FakeOrchestrator()
    out = run(orchestrator, FakeEngine("tokens:200"), disconnect_after=0.3)
    assert isinstance(out["error"], ClientGone)
    assert orchestrator.aborted == ["r0"] and not orchestrator.finished
    assert out["aborted"]["client_gone"] == 1
    assert out["elapsed"] < 3  # 200 tokens would take 4 s


def test_a_response_cancelled_while_its_session_is_being_stopped_still_frees_its_slot():
    """The poll sees the client gone and stops the session; while the stop waits for the session thread, the HTTP
    server cancels the response as well (its own disconnect listener): the slot is returned all the same, once
    (a session left active for good after such a race kept a chain slot taken: the overload test saw one)."""
    orchestrator = FakeOrchestrator()
    engine = FakeEngine("stuck")  # the thread ignores the abort: the stop waits release_wait_s
    metrics = SwarmMetrics(orchestrator)
    runner = CompletionRunner(orchestrator, engine, metrics, poll_s=0.05, release_wait_s=0.3)

    async def gone():
        return True

    async def scenario():
        async def consume():
            async for _ in runner.run("alice", [1, 2, 3], SamplingParams(8, 0.0), gone):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.2)  # the poll (every 0.05 s) found the client gone: the stop is waiting
        assert not task.done() and orchestrator.granted == ["r0"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.6)  # a stop in the background waits release_wait_s, then returns the slot

    try:
        asyncio.run(scenario())
    finally:
        engine.release.set()
        engine.executor.shutdown(wait=True)
    assert orchestrator.aborted == ["r0"] and not orchestrator.finished
    assert metrics.registry.get_sample_value("chainswarm_sessions_aborted_total", {"reason": "client_gone"}) == 1
