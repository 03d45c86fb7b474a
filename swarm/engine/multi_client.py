"""The client side of multi-session streams: many sessions stepped through one chain, one message per server.

:class:`ChainBatch` opens one ``rpc_multi_inference`` stream (:mod:`swarm.engine.multi_wire`) to every server of a route
and steps any number of sessions through the whole chain at once: the first server gets all their hidden
states in one message, its reply goes (relay, through the client) to the next server in one message, and so
on. Sessions open and close between steps, so a caller can run continuous batching: new sessions' prefills
travel in the same messages as the running sessions' one-token decode steps.

Every coroutine runs on hivemind's ``RemoteExpertWorker`` event loop (as petals' own client does); the public
methods block the calling thread, never that loop, and every wait is bounded (``step_timeout``). A session a
server refuses or fails is reported in the step's ``failed`` map and closed everywhere; a server that stops
answering fails the step with :class:`ChainBatchError` (the caller fails its sessions over).

When a session's KV is free on every server (the message carrying its close went through the whole chain, or the
batch closed its streams) ``on_freed`` hears of it: the orchestrator keeps counting a finished session's KV until
then, so it never grants a slot that a server still holds (:meth:`swarm.control.occupancy.Occupancy.retire`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from typing import Callable, Iterable, Mapping, NamedTuple, Optional, Sequence

from swarm.model.compat import petals  # noqa: F401  (shim first)
import torch  # noqa: E402
from hivemind import MSGPackSerializer, PeerID, deserialize_torch_tensor, serialize_torch_tensor  # noqa: E402
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker  # noqa: E402
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402
from hivemind.utils.asyncio import anext  # noqa: E402
from petals.data_structures import CHAIN_DELIMITER  # noqa: E402

from swarm.engine import multi_wire  # noqa: E402
from swarm.engine.routing import RouteSpan  # noqa: E402

logger = logging.getLogger(__name__)


class ChainBatchError(RuntimeError):
    """A server of the route failed or stopped answering: every session of the batch is lost there.

    ``alive``: the server itself answered with an error (its handler ended the stream), so it is not a failed
    server; ``unsupported``: it answered that it has no multi-session streams (vanilla petals). Either way its
    sessions should go on one petals session each, on the same route. ``stream_gone``: the stream broke without an
    answer (the connection was lost, or the server ended it), not a timeout: a dead server, or a live one that
    reloaded its blocks (or ended an idle stream) after the stream was opened."""

    def __init__(self, peer_id: str, cause: BaseException | str):
        super().__init__(f"multi-session stream to {peer_id} failed: {cause!r}")
        self.peer_id = peer_id
        text = str(cause).lower()
        self.unsupported = "protocol not supported" in text or "protocols not supported" in text
        self.alive = self.unsupported or isinstance(cause, P2PHandlerError)
        self.stream_gone = not self.alive and isinstance(cause, (ConnectionError, EOFError, StopAsyncIteration))


class SessionFailure(NamedTuple):
    """Why a server failed one session of a step (the others went on)."""

    peer_id: str
    reason: str

    def __str__(self) -> str:
        return f"{self.peer_id}: {self.reason}"


class _Stream:
    """One ``rpc_multi_inference`` stream to one server span (lives on hivemind's loop)."""

    def __init__(self, p2p, peer_id: str, uids: Sequence[str], span: RouteSpan):
        self.p2p, self.peer_id, self.uid, self.span = p2p, peer_id, CHAIN_DELIMITER.join(uids), span
        self.queue: Optional[asyncio.Queue] = None
        self.replies = None
        self.first = True
        self.chosen: dict = {}  # the last reply's chosen tokens (the chain's last server: server.ends)

    async def _requests(self):
        while True:
            request = await self.queue.get()
            if request is None:
                return
            yield request

    async def exchange(self, metadata: dict, tensors: list, timeout: float) -> tuple[list, dict]:
        if self.queue is None:
            self.queue = asyncio.Queue()
            self.replies = await asyncio.wait_for(self.p2p.iterate_protobuf_handler(
                PeerID.from_base58(self.peer_id), multi_wire.RPC, self._requests(), runtime_pb2.ExpertResponse),
                timeout)
        self.queue.put_nowait(runtime_pb2.ExpertRequest(
            uid=self.uid if self.first else "", metadata=MSGPackSerializer.dumps(metadata),
            tensors=[serialize_torch_tensor(t) for t in tensors]))
        self.first = False
        reply = await asyncio.wait_for(anext(self.replies), timeout)
        answer = MSGPackSerializer.loads(reply.metadata) if reply.metadata else {}
        answer = answer if isinstance(answer, dict) else {}
        failed, chosen = answer.get("failed", {}), answer.get("chosen", {})
        if not isinstance(failed, dict) or not isinstance(chosen, dict):
            raise ValueError("a malformed reply ('failed' and 'chosen' must be maps)")
        self.chosen = dict(chosen)
        return [deserialize_torch_tensor(t) for t in reply.tensors], dict(failed)

    async def close(self) -> None:
        if self.queue is not None:
            self.queue.put_nowait(None)
        if self.replies is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.replies.aclose(), 5)


class ChainBatch:
    """Sessions stepped together through one route (see the module doc). Not thread-safe: one caller thread.

    ``route`` is a chain's spans ``(peer id, start, end)``; ``block_uids`` the model's block uids (petals'
    sequence manager has them). ``tickets`` maps a session to the orchestrator ticket its opens carry."""

    def __init__(self, p2p, route: Sequence[RouteSpan], block_uids: Sequence[str], *, step_timeout: float = 30.0,
                 alloc_timeout: float = 5.0, on_freed: Optional[Callable[[Iterable[str]], None]] = None):
        self.route = tuple(route)
        self.on_freed = on_freed  # called (from any thread) with sessions whose KV every server has freed
        self._unfreed: set[str] = set()  # sessions sent to the servers whose KV some server may still hold
        self.streams = [_Stream(p2p, peer, block_uids[start:end], (peer, start, end)) for peer, start, end in self.route]
        self.step_timeout, self.alloc_timeout = step_timeout, alloc_timeout
        self.open_sessions: set[str] = set()
        self._closing: set[str] = set()  # closed by the caller or failed: closed on every server next message
        self._closed = False
        self._inflight = None  # the running step's future (on hivemind's loop)
        self._failed_peer: Optional[str] = None
        self._cancelled = False  # the caller closed it during a step (cancel)
        # sid -> a recorder (swarm.engine.recording) of the spans a spot check will re-execute
        self.recorders: dict = {}

    def step(self, inputs: Mapping[str, torch.Tensor], opens: Mapping[str, int] = (),
             tickets: Mapping[str, bytes] = (), rollbacks: Mapping[str, int] = (),
             prefixes: Mapping[str, multi_wire.Prefix] = ()
             ) -> tuple[dict[str, torch.Tensor], dict[str, SessionFailure]]:
        """Open ``opens`` (session -> max_length; with ``prefixes[sid]``, its prompt pages: the servers load the held
        ones and store the rest after the first step), then run ``inputs`` (session -> hidden ``(1, n, H)``) through
        the chain, each session first forgetting ``rollbacks[sid]`` of its last positions on every server (the
        drafts its previous step rejected). Returns (outputs of the last block by session, failed sessions -> the
        server and its reason)."""
        outputs, failed, _ = self.step_ends(inputs, opens, tickets, rollbacks, prefixes)
        return outputs, failed

    def step_ends(self, inputs: Mapping[str, torch.Tensor], opens: Mapping[str, int] = (),
                  tickets: Mapping[str, bytes] = (), rollbacks: Mapping[str, int] = (),
                  prefixes: Mapping[str, multi_wire.Prefix] = (), *, ids: Iterable[str] = (),
                  samples: Mapping[str, dict] = (), chooses: Mapping[str, tuple] = (), keeps: Iterable[str] = ()
                  ) -> tuple[dict[str, torch.Tensor], dict[str, SessionFailure], dict[str, list]]:
        """:meth:`step` with the chain's ends on its servers (:mod:`server.ends`): the sessions in ``ids`` send token
        ids ``(1, n)`` (int64) that the first server embeds; those in ``chooses`` (sid -> (draft ids, tokens left))
        get their tokens chosen by the last server, with ``samples[sid]``'s controls when given (and their hidden
        states too, for those in ``keeps``). Returns (outputs of the last block of the other sessions and the kept
        ones, failed sessions, sid -> [token ids, logprobs or None])."""
        if self._closed or self._cancelled:
            raise RuntimeError("the chain batch is closed")
        if self._failed_peer is not None:
            raise ChainBatchError(self._failed_peer, "the server is known to have failed")
        opens, tickets, prefixes = dict(opens), dict(tickets), dict(prefixes)
        for sid in opens:
            if sid in self.open_sessions:
                raise ValueError(f"session {sid!r} is already open")
        rollbacks = {sid: int(n) for sid, n in dict(rollbacks).items() if n}
        for sid, n in rollbacks.items():
            if sid not in inputs or sid not in self.open_sessions or n < 0:
                raise ValueError(f"session {sid!r} cannot roll back {n} positions (open and stepping only)")
            recorder = self.recorders.get(sid)
            if recorder is not None:
                recorder.rollback(n)
        ends = (set(ids), dict(samples), dict(chooses), set(keeps))
        self._inflight = RemoteExpertWorker.run_coroutine(
            self._step(dict(inputs), opens, tickets, rollbacks, prefixes, ends), return_future=True)
        try:
            return self._inflight.result()
        except concurrent.futures.CancelledError:
            if self._failed_peer is None and self._cancelled:
                raise RuntimeError("the chain batch was closed during its step") from None
            raise ChainBatchError(self._failed_peer or "?", "the server is known to have failed") from None
        finally:
            self._inflight = None

    def abort(self, peer_id: str) -> None:
        """``peer_id`` failed: stop waiting for the running step (it raises :class:`ChainBatchError`), refuse more."""
        self._failed_peer = peer_id
        inflight = self._inflight
        if inflight is not None:
            inflight.cancel()

    def cancel(self) -> None:
        """The caller is closing (from any thread): stop waiting for the running step (it raises ``RuntimeError``,
        which names no server: none failed), refuse more. The streams close with :meth:`close`."""
        self._cancelled = True
        inflight = self._inflight
        if inflight is not None:
            inflight.cancel()

    @property
    def pending_closes(self) -> bool:
        """Sessions closed (or failed) since the last message: the next one closes them on the servers."""
        return bool(self._closing)

    def close_sessions(self, sids) -> None:
        """Close these sessions (on every server, with the next message or :meth:`close`)."""
        for sid in sids:
            if sid in self.open_sessions:
                self.open_sessions.discard(sid)
                self._closing.add(sid)

    async def _step(self, inputs: dict, opens: dict, tickets: dict, rollbacks: dict,
                    prefixes: dict, ends: tuple = (set(), {}, {}, set())) -> tuple[dict, dict, dict]:
        ids, samples, chooses, keeps = ends
        chosen: dict = {}
        failed: dict[str, SessionFailure] = {}
        hidden = dict(inputs)
        closes, self._closing = sorted(self._closing), set()
        new = [multi_wire.Open(sid, int(length), tickets.get(sid), self.alloc_timeout, prefixes.get(sid))
               for sid, length in opens.items()]
        self.open_sessions.update(opens)
        self._unfreed.update(opens)
        sent = closes
        for index, stream in enumerate(self.streams):
            order = list(hidden)  # the sessions still going (those failed upstream are not in it)
            first, last = index == 0, index == len(self.streams) - 1
            metadata = multi_wire.encode(
                [o for o in new if o.sid not in failed],
                [(sid, hidden[sid].shape[1], rollbacks.get(sid, 0)) for sid in order], closes,
                ids=[sid for sid in order if sid in ids] if first else (),
                samples={sid: samples[sid] for sid in order if sid in samples} if last else None,
                chooses={sid: chooses[sid] for sid in order if sid in chooses} if last else None,
                keeps=[sid for sid in order if sid in keeps and sid in chooses] if last else ())
            try:
                outputs, refused = await stream.exchange(metadata, [hidden[sid] for sid in order], self.step_timeout)
            except Exception as exc:
                raise ChainBatchError(stream.peer_id, exc) from exc
            failed.update({sid: SessionFailure(stream.peer_id, why) for sid, why in refused.items()})
            if last and stream.chosen:
                chosen = {sid: answer for sid, answer in stream.chosen.items() if sid in chooses and sid in order
                          and sid not in refused}
            done = [sid for sid in order if sid not in refused and (sid not in chosen or sid in keeps)]
            if len(outputs) != len(done):
                raise ChainBatchError(stream.peer_id, f"{len(outputs)} outputs for {len(done)} steps")
            if self.recorders:
                for sid, output in zip(done, outputs):
                    recorder = self.recorders.get(sid)
                    if recorder is not None and recorder.wants(stream.span):
                        recorder.add(stream.span, hidden[sid], output)
            hidden = dict(zip(done, outputs))
            closes = sorted(set(closes) | set(failed))  # sessions failed upstream: close them downstream too
        if failed:  # close the failed sessions on the servers before the one that failed them
            self.open_sessions.difference_update(failed)
            self._closing.update(failed)
        self._freed(sent)  # every server processed the closes first thing in this message
        return hidden, failed, chosen

    def _freed(self, sids) -> None:
        freed = self._unfreed.intersection(sids)
        if freed:
            self._unfreed.difference_update(freed)
            if self.on_freed is not None:
                self.on_freed(freed)

    def close(self) -> None:
        """Close every session and stream (bounded)."""
        if self._closed:
            return
        self._closed = True

        async def close_all():
            await asyncio.gather(*(s.close() for s in self.streams), return_exceptions=True)

        with contextlib.suppress(Exception):
            RemoteExpertWorker.run_coroutine(close_all(), return_future=True).result(timeout=10)
        self._freed(set(self._unfreed))  # a server frees a stream's sessions when it ends (or times it out)

    def __enter__(self) -> "ChainBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
