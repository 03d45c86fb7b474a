"""petals server sessions that are always closed, within a bounded time, on the thread that owns them.

Why this module exists (the burst freeze of issue 15). petals 2.2's ``_ServerInferenceSession`` talks to one
server over a stream that lives on hivemind's ``RemoteExpertWorker`` event-loop thread; every petals call of
the process (``step``, ``close``, ...) hands a coroutine to that one loop and blocks until it is done.
``close()`` is also its finalizer (``__del__``). Two things combine into a deadlock:

* ``close()`` awaits the end of the stream with no time limit, and when that fails (the stream already broke:
  a step timed out under load, the server dropped the session, a failover replaced it) it raises *before*
  marking the session closed. petals swallows that error (``_exit_server_sessions``) and drops the object,
  which is still "open" and, through the traceback of the swallowed exception, part of a reference cycle.
* The cyclic garbage collector then finalizes it on whatever thread happens to allocate at that moment. When
  that is hivemind's loop thread (it allocates constantly while it serves streams), ``__del__`` → ``close()`` →
  ``run_coroutine()`` waits for a coroutine on the very loop it is blocking. Every session of the process
  waits on that loop too, so all chain slots stay taken and the central queue never moves again.

The fix, by subclassing (:func:`install` makes petals create :class:`ClosingServerSession`):

1. ``close()`` marks the session closed *first*, then ends the stream with a time limit; a failure is logged,
   never left half-closed. Sessions are closed explicitly by their owners on the owning thread (petals'
   ``InferenceSession.close`` via generate's ``with`` block, and ``_update_sequence`` for a replaced server),
   so the finalizer has nothing left to do.
2. If a session still reaches its finalizer open, or ``close()`` runs on the loop thread, it never waits: the
   stream is ended by a task scheduled on the loop. Such a finalization is logged with where the session was
   opened, so a missed close is visible.
3. A running step can be cancelled from another thread (:meth:`ClosingServerSession.cancel_step`): the
   no-progress watchdog uses it to free a session whose server stopped answering.

And one addition, for speculative decoding on petals' per-session path: :meth:`ClosingServerSession.rollback`
takes the session's last positions back — from the client's position and input history (which a failover
replays on a replacement server) and, with the next step, on the server: that step's metadata carries
``{ROLLBACK_META_KEY: n}``. A Chainswarm server takes the positions back before the step and confirms it in the
step's reply; a vanilla petals server ignores the key and confirms nothing (:attr:`rollback_unconfirmed`). As
petals' server counts every position sent against the session's ``max_length``, a session may ask for room beyond
it at open (``ROLLBACK_ROOM_KEY``); the first reply says how much was granted (:attr:`rollback_room`: none from a
vanilla server).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import traceback

from swarm.model.petals_shim import petals  # noqa: F401  (shim first)
import petals.client.inference_session as inference_session_module  # noqa: E402
from hivemind import MSGPackSerializer  # noqa: E402
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
"""How long closing one server session may wait for the server to acknowledge the end of its stream."""

ROLLBACK_META_KEY = "chainswarm_rollback"
"""A petals step's metadata key: positions the server takes back before the step; in its reply: the confirmation."""
ROLLBACK_ROOM_KEY = "chainswarm_rollback_room"
"""A petals session's opening metadata key: how many positions beyond ``max_length`` its steps may send in all (the
positions it will take back; petals' server counts every position sent). The first step's reply says how many
the server granted (within its longest session)."""


def room_positions(value) -> int:
    """A room (:data:`ROLLBACK_ROOM_KEY`'s value, asked or granted) as positions: a positive integer, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def on_worker_loop() -> bool:
    """True on hivemind's RemoteExpertWorker event-loop thread (where blocking on that loop deadlocks)."""
    return threading.current_thread() is RemoteExpertWorker._event_thread


async def _end_stream(queue: asyncio.Queue, stream, stepped: bool, timeout: float) -> None:
    """Tell the server the session is over and wait (bounded) for it to close its side of the stream."""
    async def finish() -> None:
        if stepped:  # an empty request ends a session that has started on the server
            await queue.put(runtime_pb2.ExpertRequest())
            with contextlib.suppress(StopAsyncIteration):
                await stream.__anext__()

    try:
        await asyncio.wait_for(finish(), timeout)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(stream.aclose(), timeout)


class ClosingServerSession(inference_session_module._ServerInferenceSession):
    """A petals server session whose close is explicit, bounded and safe on any thread."""

    close_timeout: float = CLOSE_TIMEOUT_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # where the session was opened, for the finalizer's warning (formatted only if that warning is due)
        self._opened_at = traceback.StackSummary.extract(traceback.walk_stack(sys._getframe(1)), limit=12,
                                                         lookup_lines=False)
        self._running_step: asyncio.Task | None = None
        self._rollback = 0  # positions to take back on the server with the next step
        self.rollback_unconfirmed = False  # a step asked for a rollback and the server did not confirm it
        self.rollback_room = 0  # positions beyond max_length the server granted (known after the first step)

    def rollback(self, positions: int) -> None:
        """Take back the last ``positions`` positions: here at once, on the server with the next step."""
        if not 0 <= positions <= self._position:
            raise ValueError(f"cannot roll back {positions} of {self._position} positions")
        if positions:
            self._position -= positions
            self.history = self.history[:, : self._position] if self.history is not None else None
            self._rollback += positions

    async def _step(self, inputs_serialized):
        self._running_step = asyncio.current_task()
        rollback, self._rollback = self._rollback, 0
        asked = not self.stepped and ROLLBACK_ROOM_KEY in self.session_metadata  # (sent with the first step)
        if rollback:
            metadata = MSGPackSerializer.loads(inputs_serialized.metadata) if inputs_serialized.metadata else {}
            metadata[ROLLBACK_META_KEY] = rollback
            inputs_serialized.metadata = MSGPackSerializer.dumps(metadata)
        try:
            response = await super()._step(inputs_serialized)
        finally:
            self._running_step = None
        if rollback or asked:
            reply = MSGPackSerializer.loads(response.metadata) if response.metadata else {}
            reply = reply if isinstance(reply, dict) else {}
            if rollback and reply.get(ROLLBACK_META_KEY) != rollback:
                self.rollback_unconfirmed = True
            if asked:
                self.rollback_room = room_positions(reply.get(ROLLBACK_ROOM_KEY))
        return response

    def cancel_step(self) -> None:
        """Cancel the step this session is waiting for (from any thread); the owner's ``step`` then raises."""
        task = self._running_step
        if task is not None and not task.done():
            task.get_loop().call_soon_threadsafe(task.cancel)

    def close(self, *, wait: bool = True) -> None:
        """End the session on the server. Never raises and never waits longer than ``close_timeout``; on
        hivemind's loop thread (or with ``wait=False``) it only schedules the end of the stream on that loop."""
        queue, stream = self._inputs_queue, self._outputs_stream
        if stream is None:
            return
        # closed before anything can fail, so no half-closed session is ever left for the finalizer
        self._outputs_stream = self._inputs_queue = None
        self.closed = True
        try:
            # return_future: schedules on hivemind's loop without waiting, from any thread (that loop's included)
            ending = RemoteExpertWorker.run_coroutine(_end_stream(queue, stream, self.stepped, self.close_timeout),
                                                      return_future=True)
            if wait and not on_worker_loop():
                ending.result(self.close_timeout + 1.0)
        except Exception as exc:  # the server is gone or slow: its side times the session out by itself
            logger.debug("closing the session with %s did not complete cleanly: %r", self.span.peer_id, exc)

    def __del__(self):
        if getattr(self, "_outputs_stream", None) is None:
            return
        opened_at = "".join(reversed(getattr(self, "_opened_at", traceback.StackSummary()).format()))
        logger.warning("a petals server session was finalized without an explicit close (span %s); opened at:\n%s",
                       getattr(self, "span", None), opened_at)
        self.close(wait=False)  # a finalizer may run on any thread, hivemind's loop thread included: never wait


def install() -> None:
    """Make petals' ``InferenceSession`` open :class:`ClosingServerSession` objects (idempotent)."""
    inference_session_module._ServerInferenceSession = ClosingServerSession
