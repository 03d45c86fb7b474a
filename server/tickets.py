"""Sessions only by grant: the server-side check of the orchestrator's session tickets (:mod:`swarm.trust.tickets`).

:class:`TicketHandler` is the handler every orchestrated node runs (:func:`install_ticket_handler`): petals'
handler with the push fix and the prefix store (:mod:`server.prefix_cache`), plus a gate in front of every RPC
that computes or pins anything — ``rpc_inference``, ``rpc_forward``/``rpc_forward_stream``,
``rpc_backward``/``rpc_backward_stream`` and ``rpc_prefix_probe``. Unless the gate is open, a call must carry
(in its opening metadata, key ``cs_ticket``) a ticket signed by the orchestrator key this server pinned, not
expired, that names this server's peer id with a span containing the requested blocks; otherwise the call
fails with a one-line ``TicketError`` before any cache is allocated or any block runs. Prefix pages are stored
only under the page hashes whose digest the session's ticket carries (see :mod:`swarm.trust.tickets`).

**Pushes.** ``rpc_push`` puts a step's inputs straight into an open session (petals' server-to-server
push: the server before this one on the route sends its outputs here, racing the client's own copy of the
step). Unless the gate is open, a push is taken only from the peer that the route names for the block just
before this session's span — the route of the session's own ticket, or of a ticket the pusher carries for the
same grant (same request and chain, signed by the pinned key, naming this server for this span): after a
failover the client's new ticket places the replacement server before this one, and the replacement pushes
with it. A push that carries a ticket of another grant, or one not signed by the pinned key, is refused. The pusher is the authenticated libp2p peer of the call (the handler that receives the push writes
it into the push's metadata; the handler that owns the session decides). Anything else is dropped and
counted (``chainswarm_pushes.refused`` in ``rpc_info``, :mod:`server.handler`): the session goes on with the
client's own copy of the step. A stranger that learned a session id (every server before it on the route
sees it in ``next_servers``) cannot step it.

The gate is configured in the server process (:func:`configure`) before petals forks the handler processes,
which inherit it: ``open=True`` (``chainswarm server --open``) serves anyone and takes every push, as petals
does (a trusted lab, vanilla petals clients); otherwise the pinned orchestrator key decides, and with no key
pinned yet every session is refused. ``rpc_info`` (petals' block metadata and the counters) is not gated.
"""
from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from hivemind import MSGPackSerializer
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import anext

from server.handler import count_refused_push
from server.prefix_cache import PrefixBackend, PrefixHandler
from swarm.trust import tickets
from swarm.trust.tickets import Ticket, TicketError

logger = logging.getLogger(__name__)


@dataclass
class Gate:
    open: bool = False
    orchestrator_key: Optional[bytes] = None
    peer_id: Optional[str] = None
    dht_prefix: Optional[str] = None
    refused: int = 0


GATE = Gate()
_TICKET: ContextVar[Optional[Ticket]] = ContextVar("chainswarm_session_ticket", default=None)
PUSHED_BY = "cs_pushed_by"  # push metadata: the authenticated sender, written by the receiving handler
MAX_CARRIED = 4  # carried tickets remembered per session (verified again when more come)


@dataclass
class _Grant:
    """What an open session on this server was granted: its ticket and who may push into it."""

    ticket: Ticket
    blob: bytes
    start: int
    end: int
    pushers: frozenset  # the route's server before this span, as the session's own ticket names it
    carried: dict = field(default_factory=dict)  # a carried ticket blob -> the pushers it names (None: refused)
    refused: int = 0

    def pushers_carried(self, blob) -> Optional[frozenset]:
        """The pushers a ticket carried by a push names for this span (none when its route does not place this
        server there: the pusher's session may be older than this one); None when it is not a ticket of this
        grant signed by the pinned key (the push is refused)."""
        if isinstance(blob, bytes) and blob in self.carried:
            return self.carried[blob]
        try:
            ticket = tickets.read(blob, GATE.orchestrator_key)  # expired or not: the grant is what counts
            named = ticket.pushers(GATE.peer_id, self.start, self.end) if ticket.same_grant(self.ticket) else None
        except TicketError:
            named = None
        if isinstance(blob, bytes) and len(self.carried) < MAX_CARRIED:
            self.carried[blob] = named
        return named

    def allows(self, metadata: dict) -> bool:
        sender = metadata.get(PUSHED_BY)
        if not isinstance(sender, str):
            return False
        if tickets.META_KEY not in metadata:
            return sender in self.pushers
        named = self.pushers_carried(metadata[tickets.META_KEY])
        return named is not None and (sender in named or sender in self.pushers)


def configure(*, open: bool, orchestrator_key: Optional[bytes], peer_id: str, dht_prefix: str) -> None:
    """Set the gate (server process, before the handler processes are forked)."""
    GATE.open, GATE.orchestrator_key, GATE.peer_id, GATE.dht_prefix = open, orchestrator_key, peer_id, dht_prefix


def _blocks(uids: Sequence[str]) -> tuple[int, int]:
    indices = []
    for uid in uids:
        prefix, _, index = uid.rpartition(".")
        if prefix != GATE.dht_prefix or not index.isdigit():
            raise TicketError(f"chainswarm: session refused: unknown block {uid!r}")
        indices.append(int(index))
    if not indices or indices != list(range(indices[0], indices[0] + len(indices))):
        raise TicketError("chainswarm: session refused: blocks must be one contiguous span")
    return indices[0], indices[-1] + 1


def check(metadata: dict, uids: Sequence[str]) -> Optional[Ticket]:
    """The call's ticket (None when the gate is open); :class:`TicketError` when the call is refused."""
    if GATE.open:
        return None
    try:
        if GATE.orchestrator_key is None:
            raise TicketError("chainswarm: session refused: this server has no orchestrator key yet")
        start, end = _blocks(uids)
        return tickets.verify(metadata.get(tickets.META_KEY) if isinstance(metadata, dict) else None,
                              GATE.orchestrator_key, peer_id=GATE.peer_id, start=start, end=end)
    except TicketError as exc:
        GATE.refused += 1
        logger.warning("%s", exc)
        raise


def _metadata(request: runtime_pb2.ExpertRequest) -> dict:
    try:
        found = MSGPackSerializer.loads(request.metadata) if request.metadata else {}
    except Exception:
        raise TicketError("chainswarm: session refused: malformed metadata") from None
    return found if isinstance(found, dict) else {}


def _uids(request: runtime_pb2.ExpertRequest) -> list[str]:
    return [uid for uid in request.uid.split(" ") if uid] if request.uid else []


async def _checked_stream(requests: AsyncIterator[runtime_pb2.ExpertRequest]):
    """(the stream with its first message put back, the ticket of that first message, the first message)."""
    first = await anext(requests)
    ticket = check(_metadata(first), _uids(first))

    async def replay():
        yield first
        async for request in requests:
            yield request

    return replay(), ticket, first


class TicketHandler(PrefixHandler):
    """The prefix handler behind the ticket gate (see the module doc)."""

    _rpc_handlers = None  # hivemind caches the RPC table per class: collect ours

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._grants: dict[str, _Grant] = {}  # session id -> its grant, for the sessions this handler runs

    async def rpc_inference(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                            context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            replay, ticket, first = await _checked_stream(requests)
        except StopAsyncIteration:
            return
        _TICKET.set(ticket)
        metadata, grant = _metadata(first), None
        session_id = metadata.get("session_id")
        if ticket is not None and isinstance(session_id, str) and session_id not in self._grants:
            start, end = _blocks(_uids(first))
            grant = self._grants[session_id] = _Grant(ticket, metadata[tickets.META_KEY], start, end,
                                                      ticket.pushers(GATE.peer_id, start, end))
        try:
            async for response in super().rpc_inference(replay, context):
                yield response
        finally:
            if grant is not None and self._grants.get(session_id) is grant:
                del self._grants[session_id]

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        if not GATE.open:  # the session's owner (maybe another handler process) decides; it needs the sender
            metadata = _metadata(request)
            metadata[PUSHED_BY] = context.remote_id.to_base58()
            request.metadata = MSGPackSerializer.dumps(metadata)
        return await super().rpc_push(request, context)

    async def _get_from_session_queue(self, session_id: str) -> Optional[runtime_pb2.ExpertRequest]:
        while True:  # the pushes into this handler's session, minus those the gate refuses
            request = await super()._get_from_session_queue(session_id)
            if request is None or GATE.open or self._push_allowed(session_id, request):
                return request
            if session_id not in self._session_queues:  # the session ended meanwhile
                return None

    def _push_allowed(self, session_id: str, request: runtime_pb2.ExpertRequest) -> bool:
        grant = self._grants.get(session_id)
        try:
            allowed = grant is not None and grant.allows(_metadata(request))
        except TicketError:
            allowed = False
        if not allowed:
            count_refused_push()
            if grant is not None:
                grant.refused += 1
            (logger.warning if grant is not None and grant.refused == 1 else logger.debug)(
                "chainswarm: push refused: its sender is not the server before this one on the session's route")
        return allowed

    def _push_metadata(self, metadata: dict) -> dict:
        out = {key: value for key, value in metadata.items() if key != PUSHED_BY}
        grant = self._grants.get(metadata.get("session_id"))
        if grant is not None:  # the next server takes our push on the strength of our session's ticket
            out[tickets.META_KEY] = grant.blob
        return out

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        check(_metadata(request), _uids(request))
        return await super().rpc_forward(request, context)

    async def rpc_forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                 context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        replay, _, _ = await _checked_stream(requests)
        async for response in super().rpc_forward_stream(replay, context):
            yield response

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        check(_metadata(request), _uids(request))
        return await super().rpc_backward(request, context)

    async def rpc_backward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                  context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        replay, _, _ = await _checked_stream(requests)
        async for response in super().rpc_backward_stream(replay, context):
            yield response

    async def rpc_prefix_probe(self, request: runtime_pb2.ExpertRequest,
                               context: P2PContext) -> runtime_pb2.ExpertResponse:
        check(_metadata(request), _uids(request))
        return await super().rpc_prefix_probe(request, context)

    def _may_store_pages(self, hashes: Sequence[bytes]) -> bool:
        return pages_allowed(_TICKET.get(), hashes)


def pages_allowed(ticket: Optional[Ticket], hashes: Sequence[bytes]) -> bool:
    """Whether a session with ``ticket`` may store prefix pages under ``hashes``: only those its ticket names
    (any, while the gate is open)."""
    if GATE.open:
        return True
    if ticket is not None and ticket.pages is not None and ticket.pages == tickets.pages_digest(hashes):
        return True
    logger.info("not storing prefix pages: the session's ticket does not name these page hashes (%s)",
                "no ticket" if ticket is None else "no pages" if ticket.pages is None else "other pages")
    return False


TicketHandler.__name__ = TicketHandler.__qualname__ = "TransformerConnectionHandler"


def install_ticket_handler(push_counter=None):
    """Install the gated handler and the prefix backend (server process, before ``Server.run()``)."""
    from server.handler import install

    return install(TicketHandler, PrefixBackend, push_counter=push_counter)
