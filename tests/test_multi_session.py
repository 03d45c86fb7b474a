"""Multi-session streams (server/multi_session.py, swarm/engine/multi_client.py, swarm/engine/batching.py) on loopback.

A two-hop swarm of the tiny model (open sessions): the protocol's answers to bad input — a malformed message
closes the stream with its reason, a bad step fails its own session only and the others go on — and the
continuous batching of ChainGenerator: sessions admitted and retired between steps, cancellation, a callback
that ends its sequence, a route whose server is gone. Token equality is tested on the real model
(tests/test_batching_swarm.py, tests/test_real_model_swarm.py), not on random weights.
"""
import threading
import time

import pytest
import torch

from helpers import client_model, server_info, two_hop_tiny_swarm, wait_for

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def swarm(tiny_model, tmp_path_factory):
    with two_hop_tiny_swarm(tiny_model, str(tmp_path_factory.mktemp("profiles"))) as local:
        yield local


@pytest.fixture(scope="module")
def model(swarm, tiny_model):
    with client_model(swarm, tiny_model) as m:
        yield m


def _stream(model, swarm):
    from swarm.engine.multi_client import _Stream

    peer, start, end = swarm.route[0]
    return _Stream(model.transformer.h.sequence_manager.state.p2p, peer,
                   model.transformer.h.sequence_manager.block_uids[start:end], (peer, start, end))


def _exchange(stream, metadata, tensors):
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    return RemoteExpertWorker.run_coroutine(stream.exchange(metadata, tensors, 20.0))


def test_the_plan_is_two_hops(swarm):
    assert len(swarm.route) == 2 and swarm.route[0][2] == swarm.route[1][1]


def test_a_bad_step_fails_its_own_session_and_the_others_go_on(swarm, model):
    from swarm.engine import multi_wire
    from swarm.engine.multi_wire import Open

    hidden = model.config.hidden_size
    stream = _stream(model, swarm)
    opens = [Open("a", 8), Open("b", 8), Open("c", 8), Open("a", 8)]  # "a" twice: the second open fails
    outputs, failed = _exchange(stream, multi_wire.encode(opens, [("a", 3), ("b", 2), ("c", 1)]),
                                [torch.randn(1, 3, hidden), torch.randn(1, 2, hidden), torch.randn(1, 1, hidden + 1)])
    assert [o.shape for o in outputs] == [(1, 2, hidden)]  # "b" alone
    assert set(failed) == {"a", "c"}, failed
    assert "already open" in failed["a"] and "expected hidden states" in failed["c"]
    # a session that failed is closed ("a", "c"); one that steps past its length fails ("b"), unknown ones too
    outputs, failed = _exchange(stream, multi_wire.encode([], [("a", 1), ("b", 7), ("zz", 1)]),
                                [torch.randn(1, 1, hidden), torch.randn(1, 7, hidden), torch.randn(1, 1, hidden)])
    assert outputs == [] and set(failed) == {"a", "b", "zz"}, failed
    assert "not open" in failed["a"] and "exceed" in failed["b"] and "not open" in failed["zz"]
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
    RemoteExpertWorker.run_coroutine(stream.close())


@pytest.mark.parametrize("metadata, tensors, reason", [
    ({"open": "x"}, 0, "must be lists"),
    ({"open": [["s", 0, None, 0.0]]}, 0, "max_length"),
    ({"open": [["s", 8, None, 99.0]]}, 0, "alloc_timeout"),
    ({"step": [["s", 1]]}, 0, "1 step entries but 0 tensors"),
    ({"step": [["s", 1], ["s", 1]]}, 2, "once per message"),
    ({"step": [["s", 1, -2]]}, 1, "rollback >= 0"),
    ({"close": ["x" * 100]}, 0, "session name"),
    ({"open": [["s", 64, None, 0.0, {"page": 8, "hashes": []}]]}, 0, "a prefix is"),
    ({"open": [["s", 64, None, 0.0, {"page": 16, "hashes": [b"x" * 15]}]]}, 0, "16 bytes"),
    ({"open": [["s", 32, None, 0.0, {"page": 16, "hashes": [b"x" * 16, b"y" * 16], "load": 2}]]}, 0,
     "below max_length"),
])
def test_a_malformed_message_closes_the_stream_with_its_reason(swarm, model, metadata, tensors, reason):
    stream = _stream(model, swarm)
    with pytest.raises(Exception, match=reason):
        _exchange(stream, metadata, [torch.zeros(1, 1, model.config.hidden_size)] * tensors)


def test_sessions_stepped_together_get_the_hidden_states_they_get_alone(swarm, model):
    """Three sessions of different prompt lengths: their prefills in one message, then decode steps in one
    message each, through both servers — each session's outputs equal its own run in a stream of its own."""
    from swarm.engine.multi_client import ChainBatch

    manager = model.transformer.h.sequence_manager
    torch.manual_seed(3)
    prompts = {sid: torch.randn(1, n, model.config.hidden_size) for sid, n in (("a", 5), ("b", 1), ("c", 9))}
    steps = [{sid: torch.randn(1, 1, model.config.hidden_size) for sid in prompts} for _ in range(3)]

    def run(sids):
        with ChainBatch(manager.state.p2p, swarm.route, manager.block_uids) as batch:
            outputs, failed = batch.step({s: prompts[s] for s in sids}, {s: 16 for s in sids})
            assert not failed
            history = [outputs]
            for step in steps:
                outputs, failed = batch.step({s: step[s] for s in sids})
                assert not failed
                history.append(outputs)
        return history

    together = run(list(prompts))
    for sid in prompts:
        alone = run([sid])
        for mine, theirs in zip(alone, together):
            assert torch.allclose(mine[sid], theirs[sid], atol=1e-4, rtol=1e-4), (sid, (mine[sid] - theirs[sid]).abs().max())


def test_a_rollback_forgets_the_last_positions_and_cannot_go_past_the_last_step(swarm, model):
    """Speculative decoding's rollback through both servers: a session that steps 3 drafted positions, rolls 2
    back and steps other tokens gets what a session that never saw the rejected ones gets; a rollback past the
    positions of the previous step is refused and fails that session alone."""
    from swarm.engine.multi_client import ChainBatch

    manager = model.transformer.h.sequence_manager
    hidden = model.config.hidden_size
    torch.manual_seed(5)
    prompt, draft, other = torch.randn(1, 4, hidden), torch.randn(1, 3, hidden), torch.randn(1, 2, hidden)
    with ChainBatch(manager.state.p2p, swarm.route, manager.block_uids) as batch:
        batch.step({"spec": prompt, "plain": prompt, "greedy": prompt}, {"spec": 16, "plain": 16, "greedy": 16})
        batch.step({"spec": draft, "plain": draft[:, :1], "greedy": draft})
        outputs, failed = batch.step({"spec": other, "plain": other, "greedy": other}, rollbacks={"spec": 2, "greedy": 4})
        assert set(failed) == {"greedy"} and "past the 3 positions" in failed["greedy"].reason, failed
        torch.testing.assert_close(outputs["spec"], outputs["plain"], atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="cannot roll back"):
            batch.step({"spec": other[:, :1]}, rollbacks={"plain": 1})  # a session must step to roll back


def test_sessions_hold_kv_pages_as_they_grow_and_give_them_back_at_rollback_and_end(swarm, model):
    """The servers' paged KV pool (server/kv_pool.py), read from their own rpc_info counters: a session opened for
    200 tokens holds no page until it steps, then ⌈positions/16⌉ pages per block it passes; a rollback across a page
    boundary gives the page back at once, the end of the session all of them. petals' own sessions (the client
    declares max_length 200) hold pages the same way, not their max_length."""
    from swarm.engine.multi_client import ChainBatch

    manager = model.transformer.h.sequence_manager
    hidden = model.config.hidden_size
    p2p = manager.state.p2p
    (peer, start, end), blocks = swarm.route[0], swarm.route[0][2] - swarm.route[0][1]
    pages = lambda: server_info(p2p, peer, f"{swarm.dht_prefix}.{start}")["chainswarm_kv"]["pages"]  # noqa: E731
    idle = pages()
    assert idle["used"] == 0 and idle["total"] > 0 and idle["free"] == idle["total"] and idle["page_tokens"] == 16
    with ChainBatch(p2p, swarm.route, manager.block_uids) as batch:
        assert not batch.step({"s": torch.randn(1, 5, hidden)}, {"s": 200})[1]
        assert pages()["used"] == blocks  # 5 positions: one page on each block
        assert not batch.step({"s": torch.randn(1, 12, hidden)})[1]
        assert pages()["used"] == 2 * blocks  # 17 positions
        assert not batch.step({"s": torch.randn(1, 1, hidden)}, rollbacks={"s": 2})[1]
        assert pages()["used"] == blocks  # 17 - 2 + 1 = 16 positions: the second page went back
        assert pages()["free"] == idle["total"] - blocks
    wait_for(lambda: pages()["used"] == 0, 5, what="every page back in the pool when the stream closes")
    with model.transformer.h.inference_session(max_length=200) as session:
        session.step(torch.randn(1, 20, hidden))
        assert pages()["used"] == 2 * blocks  # petals' path: 20 positions, not 200
        for _ in range(13):
            session.step(torch.randn(1, 1, hidden))
        assert pages()["used"] == 3 * blocks and pages()["peak"] >= 3 * blocks  # 33 positions
    wait_for(lambda: pages()["used"] == 0, 5, what="every page back in the pool when the petals session ends")


def test_a_step_the_pool_has_no_pages_for_fails_fast_and_alone(swarm, model):
    """Sessions that together outgrow a server's pool (each one fits): the step that finds no free page fails
    within about a second with "KV pool full" (no session waits on another), and the others go on."""
    from server.kv_pool import GROW_WAIT_S
    from swarm.engine.multi_client import ChainBatch

    manager = model.transformer.h.sequence_manager
    hidden = model.config.hidden_size
    p2p = manager.state.p2p
    (peer, start, end), blocks = swarm.route[0], swarm.route[0][2] - swarm.route[0][1]
    pool = server_info(p2p, peer, f"{swarm.dht_prefix}.{start}")["chainswarm_kv"]["pages"]
    length = 120  # positions per session: 8 pages on each block
    count = pool["total"] // (blocks * 8) + 1  # one session more than the pool holds
    sids = [f"s{i}" for i in range(count)]
    with ChainBatch(p2p, swarm.route, manager.block_uids) as batch:
        for sid in sids[:-1]:
            assert not batch.step({sid: torch.randn(1, length, hidden)}, {sid: 128})[1]
        began = time.monotonic()
        outputs, failed = batch.step({sids[-1]: torch.randn(1, length, hidden)}, {sids[-1]: 128})
        assert set(failed) == {sids[-1]} and "KV pool full" in failed[sids[-1]].reason, failed
        assert time.monotonic() - began < GROW_WAIT_S + 5
        outputs, failed = batch.step({sid: torch.randn(1, 1, hidden) for sid in sids[:2]})
        assert not failed and set(outputs) == set(sids[:2])  # 121 positions: within the pages they hold


def test_continuous_batching_admits_and_retires_sessions_between_steps(swarm, model):
    """Eight generations of different lengths through three session slots: all complete with their lengths,
    in batches of two or three; the servers counted one stream each and every session."""
    from swarm.engine.batching import ChainGenerator

    p2p = model.transformer.h.sequence_manager.state.p2p
    info = lambda peer, start: server_info(p2p, peer, f"{swarm.dht_prefix}.{start}")  # noqa: E731
    multi_stats = lambda peer, start: info(peer, start)["chainswarm_multi"]  # noqa: E731

    before = [multi_stats(peer, start) for peer, start, _ in swarm.route]
    prompts = [[1, 5, 9, 22, 40][: 1 + i % 5] + [i + 3] for i in range(8)]
    lengths = [4 + i % 3 for i in range(8)]
    with ChainGenerator(model, swarm.route, max_sessions=3) as generator:
        got = [f.result(timeout=60) for f in [generator.submit(p, n) for p, n in zip(prompts, lengths)]]
        assert 1 < generator.stepped_sequences / generator.steps <= 3
        # idle, streams still open: the last sessions' KV is freed on the servers all the same (they can drain)
        wait_for(lambda: all(info(peer, start)["chainswarm_kv"]["used"] == 0 for peer, start, _ in swarm.route),
                 3, what="the servers' KV slots free while the generator is idle (before its streams close)")
    assert [len(g) for g in got] == lengths
    after = [multi_stats(peer, start) for peer, start, _ in swarm.route]
    for old, new in zip(before, after):
        assert new["streams"] - old["streams"] == 1 and new["sessions"] - old["sessions"] == 8
        assert new["cohorts"] - old["cohorts"] >= generator.steps and new["failed"] == old["failed"]


def test_a_sequences_kv_freed_resolves_only_once_no_server_counts_it(swarm, model):
    """``kv_freed`` is what the orchestrator waits for before it grants a finished session's KV slots again
    (swarm.control.occupancy): it resolves after the sequence's result, once every server's own counter has let
    the sequence go — while another sequence runs (its close rides on that one's next step), when the generator
    goes idle, and at once for a sequence cancelled before it was ever sent."""
    import concurrent.futures

    from swarm.engine.batching import ChainGenerator, SequenceFailed

    p2p = model.transformer.h.sequence_manager.state.p2p
    used = lambda: [server_info(p2p, peer, f"{swarm.dht_prefix}.{start}")["chainswarm_kv"]["used"]  # noqa: E731
                    for peer, start, _ in swarm.route]
    spans = [end - start for _, start, end in swarm.route]
    assert used() == [0, 0]
    with ChainGenerator(model, swarm.route, max_sessions=2) as generator:
        freed = [concurrent.futures.Future() for _ in range(3)]
        long = generator.submit([7, 8, 9], 120, kv_freed=freed[0])
        short = generator.submit([3, 4], 2, kv_freed=freed[1])
        never = generator.submit([5], 4, kv_freed=freed[2])  # waits: two sessions at most
        generator.cancel(never)
        assert freed[2].result(timeout=10) is None  # never sent: nothing to free
        with pytest.raises(SequenceFailed, match="cancelled"):
            never.result(timeout=10)
        short.result(timeout=60)
        freed[1].result(timeout=10)
        if not long.done():  # (the long one nearly always runs on: each server then counts it alone)
            assert used() == spans and not freed[0].done()
        long.result(timeout=60)
        freed[0].result(timeout=10)
        assert used() == [0, 0]  # read once, no wait: freed means freed


class _Drafts:
    """Drafts for ChainGenerator from the sequence's known greedy continuation: right ones, or each one token off
    (always rejected). Records (step, limit) for every step."""

    def __init__(self, generator, prompt, plain, right=True):
        self.generator, self.prompt, self.plain, self.right = generator, len(prompt), plain, right
        self.limits, self.updates = [], []

    def propose(self, tokens, limit):
        self.limits.append((self.generator.steps, limit))
        done = len(tokens) - self.prompt
        draft = self.plain[done:done + min(limit, 6)]
        return draft if self.right else [(t + 1) % 64 for t in draft]

    def update(self, proposed, accepted):
        self.updates.append((proposed, accepted))


def test_drafted_tokens_change_no_output_and_fill_only_the_steps_free_positions(swarm, model):
    """Speculative decoding through both servers: drafts that are the greedy continuation are all accepted (fewer
    steps), drafts that are wrong are all rejected and rolled back — the tokens are those without drafts either way;
    a lone sequence may draft up to 15 positions a step, and sequences running together share the 16 positions of
    a step (16 running: none)."""
    import collections

    from swarm.engine.batching import ChainGenerator

    prompt = [1, 5, 9, 22, 40, 7]
    with ChainGenerator(model, swarm.route) as generator:
        plain = generator.submit(prompt, 12).result(timeout=60)
        steps = generator.steps
        right = _Drafts(generator, prompt, plain)
        assert generator.submit(prompt, 12, drafts=right).result(timeout=60) == plain
        assert generator.steps - steps <= 4 and right.updates and all(a == p for p, a in right.updates)
        wrong = _Drafts(generator, prompt, plain, right=False)
        assert generator.submit(prompt, 12, drafts=wrong).result(timeout=60) == plain
        assert max(limit for _, limit in wrong.limits) == 10  # 12 tokens: after the first, 10 are left to draft
        assert wrong.updates and all(a == 0 for _, a in wrong.updates)
        crowd = [_Drafts(generator, prompt, plain[:6], right=False) for _ in range(16)]
        futures = [generator.submit(prompt, 6, drafts=d) for d in crowd]
        assert all(f.result(timeout=60) == plain[:6] for f in futures)
    by_step = collections.defaultdict(list)
    for drafts in crowd:
        for step, limit in drafts.limits:
            by_step[step].append(limit)
    assert all(sum(limits) <= 16 - len(limits) for limits in by_step.values()), dict(by_step)
    assert any(len(limits) == 16 and sum(limits) == 0 for limits in by_step.values()), dict(by_step)


def test_callbacks_end_their_own_sequence_and_cancel_works(swarm, model):
    from swarm.engine.batching import ChainGenerator, SequenceFailed, StopSequence

    seen = []

    def stop_after_two(token):
        seen.append(token)
        if len(seen) == 2:
            raise StopSequence()

    def broken(token):
        raise KeyError("boom")

    with ChainGenerator(model, swarm.route, max_sessions=4) as generator:
        stopped = generator.submit([3, 4, 5], 10, on_token=stop_after_two)
        failing = generator.submit([3, 4], 10, on_token=broken)
        slow = generator.submit([7, 8], 100)
        normal = generator.submit([9], 5)
        assert stopped.result(timeout=60) == seen and len(seen) == 2
        with pytest.raises(KeyError, match="boom"):
            failing.result(timeout=60)
        assert generator.idle_s() == 0.0  # "slow" still runs
        generator.cancel(slow)
        with pytest.raises(SequenceFailed, match="cancelled"):
            slow.result(timeout=60)
        assert len(normal.result(timeout=60)) == 5
        wait_for(lambda: generator.idle_s() > 0.2, 10, what="the generator idle")  # what the engine prunes by


def test_a_route_through_a_server_that_is_not_there_fails_every_sequence_in_bounded_time(swarm, model):
    from swarm.engine.batching import ChainGenerator, SequenceFailed

    ghost = "12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"  # a well-formed peer id nobody has
    route = [(ghost, 0, swarm.route[0][2]), swarm.route[1]]
    started = time.monotonic()
    with ChainGenerator(model, route, max_sessions=4, step_timeout=3.0) as generator:
        futures = [generator.submit([1, 2, 3], 4) for _ in range(3)]
        for future in futures:
            with pytest.raises(SequenceFailed) as failure:
                future.result(timeout=60)
            assert failure.value.peer_id == ghost and failure.value.produced == []
        with pytest.raises(RuntimeError, match="closed"):
            generator.submit([1], 1)
    assert time.monotonic() - started < 30


class _SilentBatch:
    """A route whose servers stopped answering (or whose libp2p daemon a Ctrl-C ended): a step waits until
    :meth:`cancel`, as :class:`swarm.engine.multi_client.ChainBatch`'s does until its step timeout."""

    def __init__(self):
        self.recorders, self.open_sessions, self.on_freed = {}, set(), None
        self.stepping, self.cancelled, self.closed = threading.Event(), threading.Event(), False

    pending_closes = False

    def step(self, *args, **kwargs):
        self.stepping.set()
        if not self.cancelled.wait(120):
            raise TimeoutError("no answer")
        raise RuntimeError("the chain batch was closed during its step")

    step_ends = step

    def cancel(self):
        self.cancelled.set()

    def close_sessions(self, sids):
        pass

    def close(self):
        self.closed = True


def test_closing_a_generator_ends_the_step_in_flight_at_once(swarm, model):
    """A shutdown (Ctrl-C) while a step waits for a server that no longer answers: close() cancels that step instead
    of waiting out its step timeout (the orchestrator's exit took that long, or hung behind the generator's lock)."""
    from swarm.engine.batching import ChainGenerator, SequenceFailed

    silent = _SilentBatch()
    generator = ChainGenerator(model, swarm.route, max_sessions=4, step_timeout=120.0)
    generator._open_batch = lambda: silent  # (before anything is submitted: no batch is open yet)
    future = generator.submit([1, 2, 3], 4)
    assert silent.stepping.wait(30)
    started = time.monotonic()
    generator.close()
    assert time.monotonic() - started < 10 and silent.cancelled.is_set() and silent.closed
    with pytest.raises(SequenceFailed) as failure:
        future.result(timeout=10)
    assert failure.value.peer_id is None  # no server is blamed for a close


def test_a_server_that_answers_with_an_error_is_alive_one_that_vanished_is_not():
    """How a broken batch is read: a handler error or a missing protocol comes from a live server (its sessions
    go on on the same route); a lost connection or a timeout is a failed server (they are rerouted around it)."""
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError

    from swarm.engine.multi_client import ChainBatchError

    assert ChainBatchError("p", P2PHandlerError("MultiWireError: bad")).alive
    unsupported = ChainBatchError("p", RuntimeError("failed to negotiate: protocol not supported"))
    assert unsupported.alive and unsupported.unsupported
    for cause in (ConnectionResetError("Connection lost"), TimeoutError(), "the server is known to have failed"):
        error = ChainBatchError("p", cause)
        assert not error.alive and not error.unsupported
    # a stream that broke without an answer may be one a live server ended (a reload): the generator tries new
    # streams once for sessions that hold nothing there yet; a timeout or a known failure is not retried
    assert ChainBatchError("p", ConnectionResetError("Connection lost")).stream_gone
    assert ChainBatchError("p", StopAsyncIteration()).stream_gone
    for cause in (TimeoutError(), "the server is known to have failed", P2PHandlerError("MultiWireError: bad")):
        assert not ChainBatchError("p", cause).stream_gone


@pytest.mark.parametrize("push", [True, False], ids=["push", "relay"])
def test_a_petals_session_takes_rejected_positions_back_on_every_server(swarm, model, push):
    """Speculative decoding on petals' per-session path (swarm/engine/single.py): a session that steps 3 drafted
    positions and takes 2 back gets, on its next step, the hidden states of a session that never saw them — with
    server-to-server pushes (the second server gets the step, rollback included, from the first) and with the client
    relaying every hop, and after a failover that replays the session's input history on a new server session.
    Each server confirms the rollback and grants the room asked for beyond max_length (petals' step loop counts
    the positions taken back); a rollback past the last step is refused by the client, and by the server when a
    client sends one anyway."""
    from petals.utils.misc import DUMMY, DUMMY_INT64

    from swarm.engine.routing import ChainswarmInferenceSession

    manager = model.transformer.h.sequence_manager
    hidden, p2p = model.config.hidden_size, manager.state.p2p
    last_peer, last_start, _ = swarm.route[-1]
    info = lambda: server_info(p2p, last_peer, f"{swarm.dht_prefix}.{last_start}")  # noqa: E731
    pushes = lambda: info()["chainswarm_pushes"]["received"]  # noqa: E731
    torch.manual_seed(7)
    prompt, draft, other = torch.randn(1, 4, hidden), torch.randn(1, 3, hidden), torch.randn(1, 2, hidden)
    saved, manager.config.use_server_to_server = manager.config.use_server_to_server, push
    try:
        before = pushes()

        def run(drafted: bool, failover: bool = False) -> torch.Tensor:
            # max_length 8: the 9 positions sent pass only with the room asked for the 2 taken back
            with ChainswarmInferenceSession(manager, max_length=8, rollback_room=8) as session:
                session.step(prompt)
                assert session.rollback_room == 8  # granted by both servers with the first step
                session.step(draft if drafted else draft[:, :1])
                if drafted:
                    with pytest.raises(ValueError, match="goes past"):
                        session.rollback(4)
                    session.rollback(2)
                    assert session.position == 5 and session.sent_positions == 7
                if failover:  # petals' failover of the second server: a new session there replays the history
                    second = session._server_sessions[1]
                    session._update_sequence(1, second.span.start, 1)
                    assert session._server_sessions[1] is not second
                outputs = session.step(other)
                assert len(session._server_sessions) == 2 and not session.unconfirmed_peers()
                assert session.rollback_room == 8  # still known after a step that took positions back
                return outputs

        plain = run(False)
        torch.testing.assert_close(run(True), plain, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(run(True, failover=True), plain, atol=1e-4, rtol=1e-4)
        assert (pushes() > before) == push
        with ChainswarmInferenceSession(manager, max_length=64) as session:
            session.step(prompt)
            session.step(draft[:, :1])
            first = session._server_sessions[0]
            first.rollback(3)  # the client's own bound is its position; the server's is the previous step
            with pytest.raises(Exception, match="goes past the 1 positions"):
                first.step(other, DUMMY, DUMMY_INT64, step_id="over")
    finally:
        manager.config.use_server_to_server = saved


def test_a_server_that_does_not_confirm_a_rollback_is_noticed(monkeypatch):
    """A vanilla petals server ignores the rollback key: its reply confirms nothing, and the session says so
    (the engine then discards the step and goes on without drafts); a Chainswarm server's reply confirms it."""
    import asyncio

    from hivemind import MSGPackSerializer
    from hivemind.proto import runtime_pb2

    from swarm.model import petals_sessions
    from swarm.model.petals_sessions import ROLLBACK_META_KEY, ROLLBACK_ROOM_KEY, ClosingServerSession

    sent, replies = [], []

    async def server(self, request):
        sent.append(MSGPackSerializer.loads(request.metadata))
        return replies.pop(0)

    monkeypatch.setattr(ClosingServerSession.__mro__[1], "_step", server)
    session = object.__new__(ClosingServerSession)
    session._position, session.history, session._running_step = 5, torch.zeros(1, 5, 2), None
    session._rollback, session.rollback_unconfirmed, session.rollback_room = 0, False, 0
    session.stepped, session.session_metadata = True, {}
    with pytest.raises(ValueError):
        session.rollback(6)
    session.rollback(2)
    assert session._position == 3 and session.history.shape[1] == 3
    step = lambda: asyncio.run(session._step(runtime_pb2.ExpertRequest(  # noqa: E731
        metadata=MSGPackSerializer.dumps({"step_id": "a"}))))
    replies.append(runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({ROLLBACK_META_KEY: 2})))
    step()
    assert sent[-1][ROLLBACK_META_KEY] == 2 and not session.rollback_unconfirmed
    replies.append(runtime_pb2.ExpertResponse())
    step()
    assert ROLLBACK_META_KEY not in sent[-1] and not session.rollback_unconfirmed  # nothing to confirm
    session.rollback(1)
    replies.append(runtime_pb2.ExpertResponse())  # a vanilla server
    step()
    assert sent[-1][ROLLBACK_META_KEY] == 1 and session.rollback_unconfirmed
    assert petals_sessions.inference_session_module._ServerInferenceSession is ClosingServerSession
    # the room beyond max_length, asked with the first step: granted by a Chainswarm server, none by a vanilla one;
    # later replies (a rollback's confirmation) leave it as granted
    for reply, granted in (({ROLLBACK_ROOM_KEY: 40}, 40), ({}, 0)):
        session.stepped, session.session_metadata = False, {"max_length": 40, ROLLBACK_ROOM_KEY: 40}
        replies.append(runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps(reply)))
        step()
        assert session.rollback_room == granted
        session.stepped = True
        session.rollback(1)
        replies.append(runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({ROLLBACK_META_KEY: 1})))
        step()
        assert session.rollback_room == granted


def test_a_petals_session_that_finds_the_pool_full_goes_on_once_pages_are_free(swarm, model):
    """A vanilla petals session is admitted past the orchestrator, so it can find a server's pool full: its step
    fails within about a second ("KV pool full"), and petals' own client retries — a new server session that
    recomputes the inputs so far (petals' failover; vLLM's recompute preemption, driven by the client). Once the
    sessions holding the pool end, it goes on, with the hidden states of a session that never waited."""
    import threading

    from swarm.engine.multi_client import ChainBatch

    manager = model.transformer.h.sequence_manager
    hidden, p2p = model.config.hidden_size, manager.state.p2p
    (peer, start, end), blocks = swarm.route[0], swarm.route[0][2] - swarm.route[0][1]
    pool = server_info(p2p, peer, f"{swarm.dht_prefix}.{start}")["chainswarm_kv"]["pages"]
    torch.manual_seed(11)
    prompt, token = torch.randn(1, 20, hidden), torch.randn(1, 1, hidden)

    def session() -> torch.Tensor:
        with model.transformer.h.inference_session(max_length=64) as s:
            s.step(prompt)
            return s.step(token)

    reference = session()
    saved = {k: getattr(manager.config, k) for k in ("max_retries", "ban_timeout", "min_backoff", "max_backoff")}
    manager.config.max_retries, manager.config.ban_timeout, manager.config.min_backoff, manager.config.max_backoff = \
        20, 0.5, 0.25, 1.0  # a patient client that retries soon (petals' defaults: forever, backing off to 60 s)
    fillers = ChainBatch(p2p, [swarm.route[0]], manager.block_uids)
    try:
        length = 120  # positions per filler: 8 pages on each block
        for i in range(pool["total"] // (blocks * 8)):
            assert not fillers.step({f"f{i}": torch.randn(1, length, hidden)}, {f"f{i}": 128})[1]
        rest = server_info(p2p, peer, f"{swarm.dht_prefix}.{start}")["chainswarm_kv"]["pages"]["free"] // blocks
        if rest:  # the last pages too: not one left on every block
            assert not fillers.step({"last": torch.randn(1, rest * 16, hidden)}, {"last": rest * 16})[1]
        assert server_info(p2p, peer, f"{swarm.dht_prefix}.{start}")["chainswarm_kv"]["pages"]["free"] < blocks
        result: list = []
        worker = threading.Thread(target=lambda: result.append(session()), daemon=True)
        worker.start()
        worker.join(3.0)
        assert worker.is_alive() and not result  # its first steps found no pages
        fillers.close()  # the sessions that held the pool end
        worker.join(60)
        assert result, "the petals session did not go on once the pool had room"
        torch.testing.assert_close(result[0], reference, atol=1e-4, rtol=1e-4)
    finally:
        fillers.close()  # (idempotent) the pool is the module's: never left full for the next test
        for key, value in saved.items():
            setattr(manager.config, key, value)
