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

import contextlib
import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

from swarm.compat import petals  # noqa: F401  (shim first)
import petals.client.remote_sequential as remote_sequential_module  # noqa: E402
from hivemind import PeerID  # noqa: E402
from petals.client.inference_session import InferenceSession  # noqa: E402
from petals.client.routing.sequence_manager import RemoteSequenceManager  # noqa: E402
from petals.data_structures import RemoteSpanInfo, ServerInfo, ServerState  # noqa: E402

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


class LeaseProvider(Protocol):
    def acquire(self, *, max_length: int) -> Lease:
        """Block until the orchestrator grants a chain slot for a session of ``max_length`` tokens."""

    def reroute(self, lease: Lease, start: int, end: int, failed_peers: Sequence[str]) -> tuple[RouteSpan, ...]:
        """Replacement spans covering ``[start, end)`` that avoid ``failed_peers``."""

    def release(self, lease: Lease, *, processed_tokens: int) -> None:
        """Return the slot: the session ended after ``processed_tokens`` positions (prompt + generated)."""


@dataclass
class LeaseContext:
    lease: Lease
    provider: LeaseProvider | None  # None: the lease is managed by whoever set the context
    owned: bool  # acquired by the sequence manager itself -> released when the session closes
    failed_peers: list[str] = field(default_factory=list)


_current: ContextVar[LeaseContext | None] = ContextVar("chainswarm_lease", default=None)


@contextlib.contextmanager
def use_lease(lease: Lease, provider: LeaseProvider | None = None) -> Iterator[LeaseContext]:
    """Route every petals session opened in this thread/task inside the block on ``lease``."""
    context = LeaseContext(lease, provider, owned=False)
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

    def on_request_failure(self, peer_id: PeerID | None) -> None:
        context = _current.get()
        if context is not None and peer_id is not None:
            context.failed_peers.append(peer_id.to_base58())
        super().on_request_failure(peer_id)


def _splice(route: Sequence[RouteSpan], replacement: Sequence[RouteSpan]) -> tuple[RouteSpan, ...]:
    """Replace the part of ``route`` covered by ``replacement`` (a contiguous block range)."""
    start, end = replacement[0][1], replacement[-1][2]
    before = [(p, s, min(e, start)) for p, s, e in route if s < start]
    after = [(p, max(s, end), e) for p, s, e in route if e > end]
    return tuple(before) + tuple(replacement) + tuple(after)


class ChainswarmInferenceSession(InferenceSession):
    """petals' inference session with the failover fix and lease release on close."""

    def _update_sequence(self, server_idx: int, block_idx: int, attempt_no: int) -> int:
        failed = self._server_sessions[server_idx] if server_idx < len(self._server_sessions) else None
        position = failed._position if failed is not None else None
        result = super()._update_sequence(server_idx, block_idx, attempt_no)
        if failed is not None and self._server_sessions[server_idx].history is not None:
            # the inherited history already holds this step's inputs; continue where the failed server was
            self._server_sessions[server_idx]._position = position
        return result

    def close(self, *exc_details) -> None:
        was_closed = self._closed
        super().close(*exc_details)
        context = _current.get()
        if not was_closed and context is not None and context.owned:
            _current.set(None)
            with contextlib.suppress(Exception):
                context.provider.release(context.lease, processed_tokens=self._position)


def install(model, lease_provider: LeaseProvider | None = None) -> OrchestratedSequenceManager:
    """Switch a petals distributed model to orchestrated routing; return its new sequence manager."""
    remote_sequential_module.InferenceSession = ChainswarmInferenceSession
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    old = layers.sequence_manager
    manager_class = type("BoundOrchestratedSequenceManager", (OrchestratedSequenceManager,),
                         {"lease_provider": lease_provider})
    manager = manager_class(old.config, old.block_uids, dht=old.dht, state=old.state)
    layers.sequence_manager = manager
    old.shutdown()  # stops petals' own routing-table updater thread; the shared p2p/DHT stay up
    return manager
