"""Orchestrated routing for petals sessions.

petals normally routes each inference session itself (Dijkstra over what the DHT announces). In Chainswarm
the orchestrator decides: a session runs on the chain it was granted (a *lease*), and when a server of that
chain fails mid-session the orchestrator names the replacement. This module plugs that into petals by
subclassing, in the two places the integration guide (§6.3.2) identifies:

* :class:`OrchestratedSequenceManager` answers ``make_sequence`` from the current lease instead of the DHT.
  The lease lives in a context variable of the thread running the session, so one model object serves
  many concurrent sessions (the orchestrator's proxy) and each session routes on its own chain.
* :class:`ChainswarmInferenceSession` fixes petals 2.2.0.post1's mid-session failover ("Broken input
  cache", upstream issue #587: the replacement server session must continue at the failed one's position)
  and releases a lease it acquired itself when it closes.

Who provides leases is a :class:`LeaseProvider`: the orchestrator in-process, or the HTTP client of
``client.direct`` talking to a remote orchestrator.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

from swarm.model.compat import petals  # noqa: F401  (shim first)
import torch  # noqa: E402
import petals.client.remote_sequential as remote_sequential_module  # noqa: E402
from hivemind import PeerID  # noqa: E402
from petals.client.inference_session import InferenceSession  # noqa: E402
from petals.client.routing.sequence_manager import RemoteSequenceManager  # noqa: E402
from petals.data_structures import RemoteSpanInfo, ServerInfo, ServerState  # noqa: E402

from swarm.model import petals_sessions as server_sessions  # noqa: E402
from swarm.model.petals_sessions import ROLLBACK_ROOM_KEY  # noqa: E402
from swarm.trust.tickets import META_KEY as TICKET_META_KEY  # noqa: E402
from swarm.trust.prefix import META_KEY as PREFIX_META_KEY, MISSING_MESSAGE as PREFIX_MISSING, PROBE_RPC as PREFIX_PROBE_RPC  # noqa: E402

logger = logging.getLogger(__name__)

RouteSpan = tuple[str, int, int]
"""(peer id in base58, start block, end block): one server's part of a chain, 0-based half-open."""


class NoRouteError(RuntimeError):
    """The orchestrator has no chain to offer for the requested blocks."""


@dataclass
class Lease:
    """A granted chain slot: the session's route and the id to release it with."""

    lease_id: str
    chain_id: str
    route: tuple[RouteSpan, ...]
    max_length: int | None = None
    ticket: bytes | None = None  # the orchestrator's signed session ticket (swarm.trust.tickets), sent to every server


class LeaseProvider(Protocol):
    def acquire(self, *, max_length: int) -> Lease:
        """Block until the orchestrator grants a chain slot for a session of ``max_length`` tokens."""

    def reroute(self, lease: Lease, start: int, end: int, failed_peers: Sequence[str]) -> tuple[RouteSpan, ...]:
        """Replacement spans covering ``[start, end)`` that avoid ``failed_peers``."""

    def release(self, lease: Lease, *, processed_tokens: int) -> None:
        """Return the slot: the session ended after ``processed_tokens`` positions (prompt + generated)."""


@dataclass
class PrefixPlan:
    """Prompt-prefix reuse for the session opened in this context (protocol: :mod:`swarm.trust.prefix`).

    ``hashes`` are the prompt's full-page hashes (every server stores the new pages after the prefill);
    ``load_pages`` the pages every server of the route holds (the chain minimum from the probe): each server
    loads them, and the first step sends hidden states only for the positions after them.
    """

    hashes: list[bytes]
    load_pages: int = 0
    page_tokens: int = 16

    @property
    def reused_tokens(self) -> int:
        return self.load_pages * self.page_tokens

    def metadata(self) -> dict:
        return {"page": self.page_tokens, "hashes": list(self.hashes), "load": self.load_pages}


class PrefixSessionFailed(RuntimeError):
    """A server failed during a session that reused a prefix: petals' history replay cannot rebuild the
    reused positions on a replacement, so the session must restart from the full tokens (spec §6.2.3 item 5).
    ``missing`` is True when the server only reported that the pinned pages were gone (not a server fault)."""

    def __init__(self, peer_id: str | None, missing: bool, cause: BaseException | None):
        super().__init__(f"prefix-reuse session failed on {peer_id}: {cause!r}")
        self.peer_id, self.missing = peer_id, missing


class SessionAborted(RuntimeError):
    """The session was stopped from outside (no progress, client gone): it must not retry or reroute."""


class SessionControl:
    """Watch and stop one running session from another thread (the orchestrator's no-progress watchdog).

    The session thread marks progress after every server step and every generated token; ``abort`` makes the
    session raise :class:`SessionAborted` at its next step, retry or token, and cancels a step it is waiting
    for, so a server that stopped answering cannot hold the session (or its chain slot) any longer;
    ``peer_failed`` cancels only a step waiting for a server known to have failed (the session fails over).
    """

    def __init__(self) -> None:
        self.last_progress = time.monotonic()
        self.aborted: str | None = None
        self.session: "ChainswarmInferenceSession | None" = None
        self.chooser = None  # the session's TokenChooser (None: plain greedy), set by the engine
        self._peer_watchers: list = []  # callables told of a known failed server (a batched session's generator)

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def check(self) -> None:
        if self.aborted is not None:
            raise SessionAborted(f"session aborted: {self.aborted}")

    def abort(self, reason: str) -> None:
        self.aborted = reason
        self._cancel_steps()

    def peer_failed(self, peer_id: str) -> None:
        """The orchestrator knows ``peer_id`` failed: cancel a step waiting for it, so that petals' retry loop
        fails over now instead of at the request timeout (the session itself goes on)."""
        self._cancel_steps(peer_id)
        for watcher in list(self._peer_watchers):
            watcher(peer_id)

    def watch_peers(self, watcher: Callable[[str], None]) -> Callable[[], None]:
        """Call ``watcher(peer_id)`` on every :meth:`peer_failed`; returns the function that stops it."""
        self._peer_watchers.append(watcher)
        return lambda: self._peer_watchers.remove(watcher) if watcher in self._peer_watchers else None

    def _cancel_steps(self, peer_id: str | None = None) -> None:
        """Cancel the running steps of the session's server sessions (those on ``peer_id`` only, if given)."""
        if self.session is not None:  # its server sessions are ClosingServerSessions (swarm.model.compat installs them)
            for server_session in list(self.session._server_sessions):
                if peer_id is None or server_session.span.peer_id.to_base58() == peer_id:
                    server_session.cancel_step()


@dataclass
class LeaseContext:
    lease: Lease
    provider: LeaseProvider | None  # None: the lease is managed by whoever set the context
    owned: bool  # acquired by the sequence manager itself -> released when the session closes
    failed_peers: list[str] = field(default_factory=list)
    prefix: PrefixPlan | None = None
    control: SessionControl | None = None
    recorder: object | None = None  # swarm.engine.recording.SpanRecorder: hidden states kept for a spot check
    unopened_peer: str | None = None  # the server whose session could not be opened (petals reports no peer then)


_current: ContextVar[LeaseContext | None] = ContextVar("chainswarm_lease", default=None)


@contextlib.contextmanager
def use_lease(lease: Lease, provider: LeaseProvider | None = None,
              control: SessionControl | None = None) -> Iterator[LeaseContext]:
    """Route every petals session opened in this thread/task inside the block on ``lease``."""
    context = LeaseContext(lease, provider, owned=False, control=control)
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def clip_route(route: Sequence[RouteSpan], start: int, end: int) -> list[RouteSpan]:
    """The part of a chain's route that covers blocks ``[start, end)`` (spans clipped at both ends)."""
    clipped = [(peer, max(s, start), min(e, end)) for peer, s, e in route if s < end and e > start]
    if not clipped or clipped[0][1] != start or clipped[-1][2] != end:
        raise NoRouteError(f"route {list(route)} does not cover blocks [{start}, {end})")
    for (_, _, prev_end), (_, next_start, _) in zip(clipped, clipped[1:]):
        if prev_end != next_start:
            raise NoRouteError(f"route {list(route)} has a gap at block {prev_end}")
    return clipped


class OrchestratedSequenceManager(RemoteSequenceManager):
    """A petals sequence manager whose routes come from orchestrator leases.

    ``lease_provider`` (class attribute, set by :func:`install`) acquires a lease when a session starts
    without one. Keeps petals' constructor signature, because petals rebuilds managers by type when
    slicing a RemoteSequential.
    """

    lease_provider: LeaseProvider | None = None

    def make_sequence(self, start_index: int = 0, end_index: int | None = None, *, mode: str,
                      cache_tokens_needed: int | None = None) -> list[RemoteSpanInfo]:
        end_index = len(self) if end_index is None else end_index
        context = _current.get()
        if context is None:
            if self.lease_provider is None:
                raise NoRouteError("no lease for this session and no lease provider configured")
            lease = self.lease_provider.acquire(max_length=cache_tokens_needed or 0)
            context = LeaseContext(lease, self.lease_provider, owned=True)
            _current.set(context)
        if context.failed_peers:
            provider = context.provider or self.lease_provider
            if provider is None:
                raise NoRouteError("a server failed and nobody can reroute this session")
            route = provider.reroute(context.lease, start_index, end_index, tuple(context.failed_peers))
            context.lease.route = _splice(context.lease.route, route)
            context.failed_peers.clear()
        spans = clip_route(context.lease.route, start_index, end_index)
        return [RemoteSpanInfo(PeerID.from_base58(peer), s, e, ServerInfo(ServerState.ONLINE, 1.0))
                for peer, s, e in spans]

    def get_request_metadata(self, protocol: str, *args, **kwargs):
        metadata = super().get_request_metadata(protocol, *args, **kwargs)
        context = _current.get()
        if protocol == "rpc_inference" and context is not None and context.prefix is not None:
            metadata = dict(metadata or {})
            metadata[PREFIX_META_KEY] = context.prefix.metadata()
        if context is not None and context.lease.ticket is not None:  # every RPC of a granted session
            metadata = dict(metadata or {})
            metadata[TICKET_META_KEY] = context.lease.ticket
        return metadata

    def on_request_success(self, peer_id: PeerID) -> None:
        super().on_request_success(peer_id)
        context = _current.get()
        if context is not None and context.control is not None:
            context.control.progress()

    def on_request_failure(self, peer_id: PeerID | None) -> None:
        context = _current.get()
        if peer_id is None and context is not None and context.unopened_peer is not None:
            peer_id, context.unopened_peer = PeerID.from_base58(context.unopened_peer), None  # could not be reached
        if context is not None and context.control is not None:
            context.control.check()  # aborted from outside: leave petals' retry loop at once
        super().on_request_failure(peer_id)
        if context is not None and context.prefix is not None and context.prefix.load_pages > 0:
            # called inside petals' retry loop while the step's exception is being handled
            cause = sys.exc_info()[1]
            missing = cause is not None and PREFIX_MISSING in str(cause)
            raise PrefixSessionFailed(peer_id.to_base58() if peer_id is not None else None, missing, cause)
        if context is not None and peer_id is not None:
            context.failed_peers.append(peer_id.to_base58())


def splice(route: Sequence[RouteSpan], replacement: Sequence[RouteSpan]) -> tuple[RouteSpan, ...]:
    """The route after a reroute: ``replacement`` in place of the blocks it covers (public for ticket minting)."""
    return _splice(route, replacement)


def _splice(route: Sequence[RouteSpan], replacement: Sequence[RouteSpan]) -> tuple[RouteSpan, ...]:
    """Replace the part of ``route`` covered by ``replacement`` (a contiguous block range)."""
    start, end = replacement[0][1], replacement[-1][2]
    before = [(p, s, min(e, start)) for p, s, e in route if s < start]
    after = [(p, max(s, end), e) for p, s, e in route if e > end]
    return tuple(before) + tuple(replacement) + tuple(after)


class ChainswarmInferenceSession(InferenceSession):
    """petals' inference session with the failover fix, prefix reuse, rollback (speculative decoding) and lease
    release on close.

    With a :class:`PrefixPlan` that loads pages, the first step sends only the positions after the reused
    prefix; its output is padded back to the full length (the reused positions' outputs are zeros — only
    the last position's logits matter for generation), and the position counts the reused tokens.
    """

    def __init__(self, *args, rollback_room: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        context = _current.get()
        if context is not None and context.control is not None:
            context.control.session = self
        self._last_step = 0  # positions of the last step (the most a rollback may take back)
        self.rolled_back = 0  # positions taken back so far
        self._room_asked = int(rollback_room)  # positions beyond max_length asked of every server for rollbacks

    @property
    def rollback_room(self) -> int:
        """The positions beyond ``max_length`` that every server of the chain granted for the ones taken back (0
        before the first step, or where a server granted none: a vanilla petals server)."""
        return min((getattr(s, "rollback_room", 0) for s in self._server_sessions), default=0)

    @property
    def sent_positions(self) -> int:
        """Positions the servers' step loops have counted: the session's position plus every position taken back
        (petals' server checks this count against the session's ``max_length``)."""
        return self._position + self.rolled_back

    def rollback(self, positions: int) -> None:
        """Take back the last ``positions`` positions of the last step (speculative decoding's rejected drafts), on
        every server of the chain with the next step (:meth:`ClosingServerSession.rollback`)."""
        if not 0 <= positions <= self._last_step:
            raise ValueError(f"a rollback of {positions} positions goes past the last step's {self._last_step}")
        if positions:
            for server_session in self._server_sessions:
                server_session.rollback(positions)
            self._position -= positions
            self._last_step -= positions
            self.rolled_back += positions
            context = _current.get()
            if context is not None and context.recorder is not None:
                context.recorder.rollback(positions)

    def unconfirmed_peers(self) -> list[str]:
        """The servers of the chain that did not confirm a rollback (vanilla petals servers: their caches still hold
        the positions, so the session's later outputs would be wrong); empty when every one did."""
        return [s.span.peer_id.to_base58() for s in self._server_sessions if getattr(s, "rollback_unconfirmed", False)]

    def step(self, inputs, prompts=None, hypo_ids=None):
        outputs = self._step(inputs, prompts, hypo_ids)
        self._last_step = outputs.shape[1]
        return outputs

    def _step(self, inputs, prompts=None, hypo_ids=None):
        context = _current.get()
        if context is not None and context.control is not None:
            context.control.check()
        skip = context.prefix.reused_tokens if context is not None and context.prefix is not None else 0
        if self._position > 0 or skip <= 0:
            return super().step(inputs, prompts, hypo_ids)
        if context.recorder is not None:
            context.recorder.skip_prefix(skip)
        if inputs.shape[1] <= skip or (prompts is not None and prompts.numel() > 0):
            raise ValueError("prefix reuse needs a first step longer than the reused prefix and no deep prompts")
        outputs = super().step(inputs[:, skip:], prompts, hypo_ids)
        self._position += skip
        pad = torch.zeros(outputs.shape[0], skip, outputs.shape[2], dtype=outputs.dtype, device=outputs.device)
        return torch.cat([pad, outputs], dim=1)

    def _enter_server_sessions(self, chosen_spans):
        """petals' opening of the spans' server sessions, one span at a time, so that a span that cannot be opened
        (its server is unreachable: it died) names its server to the failure handling — petals reports an opening
        failure without a peer, and the session would retry the same dead server until it gave up."""
        opened = []
        try:
            for span in chosen_spans:
                try:
                    opened += super()._enter_server_sessions([span])
                    if self._room_asked:  # sent with the session's first step
                        opened[-1].session_metadata[ROLLBACK_ROOM_KEY] = self._room_asked
                except Exception:
                    context = _current.get()
                    if context is not None:
                        context.unopened_peer = span.peer_id.to_base58()
                    raise
            return opened
        except BaseException:
            self._exit_server_sessions(opened)
            raise

    def _update_sequence(self, server_idx: int, block_idx: int, attempt_no: int) -> int:
        failed = self._server_sessions[server_idx] if server_idx < len(self._server_sessions) else None
        position = failed._position if failed is not None else None
        result = super()._update_sequence(server_idx, block_idx, attempt_no)
        context = _current.get()
        if context is not None and context.recorder is not None:
            if failed is not None or attempt_no > 0:
                context.recorder.route_changed(f"failover at block {block_idx}")
            for server_session in self._server_sessions:
                _tap(server_session, context.recorder)
        if failed is not None and self._server_sessions[server_idx].history is not None:
            # the inherited history already holds this step's inputs; continue where the failed server was
            self._server_sessions[server_idx]._position = position
        return result

    def close(self, *exc_details) -> None:
        was_closed = self._closed
        super().close(*exc_details)
        context = _current.get()
        if not was_closed and context is not None and context.owned and not server_sessions.on_worker_loop():
            _current.set(None)
            with contextlib.suppress(Exception):
                context.provider.release(context.lease, processed_tokens=self._position)


def _tap(server_session, recorder) -> None:
    """Record what ``server_session`` (one server's span) is sent and returns, for a spot check."""
    if getattr(server_session, "_chainswarm_tapped", False):
        return
    span = server_session.span
    key = (span.peer_id.to_base58(), span.start, span.end)
    step = server_session.step

    def tapped(inputs, *args, **kwargs):
        outputs = step(inputs, *args, **kwargs)
        if recorder.wants(key):
            recorder.add(key, inputs[:, -outputs.shape[1]:], outputs)
        return outputs

    server_session.step, server_session._chainswarm_tapped = tapped, True


def probe_route(manager: RemoteSequenceManager, route: Sequence[RouteSpan], hashes: Sequence[bytes], *,
                page_tokens: int = 16, pin_s: float = 10.0, timeout: float = 5.0,
                ticket: bytes | None = None) -> list[int]:
    """Ask every server of ``route`` (in parallel) how many leading pages of ``hashes`` it holds for its
    span's blocks; a server that does not answer (or has no prefix store) counts as holding none."""
    from hivemind import MSGPackSerializer
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
    from hivemind.proto import runtime_pb2
    from petals.data_structures import CHAIN_DELIMITER

    probe = {"page": page_tokens, "hashes": list(hashes), "pin_s": pin_s}
    if ticket is not None:
        probe[TICKET_META_KEY] = ticket
    metadata = MSGPackSerializer.dumps(probe)
    p2p = manager.state.p2p

    async def one(peer: str, start: int, end: int) -> int:
        request = runtime_pb2.ExpertRequest(uid=CHAIN_DELIMITER.join(manager.block_uids[start:end]),
                                            metadata=metadata)
        try:
            response = await asyncio.wait_for(p2p.call_protobuf_handler(
                PeerID.from_base58(peer), PREFIX_PROBE_RPC, request, runtime_pb2.ExpertResponse), timeout)
            answer = MSGPackSerializer.loads(response.metadata) if response.metadata else {}
        except Exception as exc:
            logger.debug("prefix probe of %s failed: %r", peer, exc)
            return 0
        pages = answer.get("pages", 0)
        return pages if answer.get("page") == page_tokens and isinstance(pages, int) and pages >= 0 else 0

    async def all_spans() -> list[int]:
        return list(await asyncio.gather(*(one(peer, s, e) for peer, s, e in route)))

    return RemoteExpertWorker.run_coroutine(all_spans())


def install(model, lease_provider: LeaseProvider | None = None) -> OrchestratedSequenceManager:
    """Switch a petals distributed model to orchestrated routing; return its new sequence manager.

    (Its server sessions are :class:`swarm.model.petals_sessions.ClosingServerSession` objects, as every petals client's
    in our processes: :mod:`swarm.model.compat` installs them.)"""
    remote_sequential_module.InferenceSession = ChainswarmInferenceSession
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    old = layers.sequence_manager
    manager_class = type("BoundOrchestratedSequenceManager", (OrchestratedSequenceManager,),
                         {"lease_provider": lease_provider})
    manager = manager_class(old.config, old.block_uids, dht=old.dht, state=old.state)
    layers.sequence_manager = manager
    old.shutdown()  # stops petals' own routing-table updater thread; the shared p2p/DHT stay up
    return manager
