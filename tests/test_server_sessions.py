"""swarm.model.petals_sessions: a petals server session is closed without ever blocking hivemind's event loop.

The burst freeze (issue 15) was petals' own finalizer running on hivemind's RemoteExpertWorker loop thread and
waiting for a coroutine on that same loop. These tests run the finalizer and close() where that happened, on
sessions whose stream is a local async generator (no server needed).
"""
import asyncio
import threading
from types import SimpleNamespace

import pytest

from swarm.model.compat import petals  # noqa: F401  (installs ClosingServerSession)
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from swarm.model.petals_sessions import ClosingServerSession


def open_session(*, fails: bool = False):
    """A session as petals leaves it after its first step, whose stream records that the server saw the end."""
    ended = threading.Event()
    queue: asyncio.Queue = asyncio.Queue()

    async def outputs():
        await queue.get()  # the empty request that ends the session
        ended.set()
        if fails:
            raise BrokenPipeError(32, "Broken pipe")  # what petals' own close raised before marking itself closed
        return
        yield  # an async generator

    session = ClosingServerSession.__new__(ClosingServerSession)
    session._inputs_queue, session._outputs_stream, session.stepped, session.closed = queue, outputs(), True, False
    session.span, session._running_step = SimpleNamespace(peer_id="test-peer"), None
    return session, ended


def on_loop(fn):
    async def call():
        return fn()
    return RemoteExpertWorker.run_coroutine(call(), return_future=True).result(timeout=5)


def test_a_finalizer_on_hiveminds_loop_thread_returns_at_once_and_still_ends_the_stream():
    session, ended = open_session()
    on_loop(session.__del__)  # petals' own finalizer would wait here for the loop it blocks: a timeout
    assert ended.wait(5) and session.closed and session._outputs_stream is None


@pytest.mark.parametrize("fails", [False, True])
def test_close_waits_for_the_server_never_raises_and_is_idempotent(fails):
    session, ended = open_session(fails=fails)
    session.close()
    assert ended.is_set() and session.closed and session._outputs_stream is None
    session.close()  # a second close (petals' finalizer later) does nothing
    on_loop(session.__del__)


def test_close_on_the_loop_thread_does_not_wait():
    session, ended = open_session()
    on_loop(session.close)
    assert ended.wait(5) and session.closed
