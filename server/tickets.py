"""Sessions only by grant: the server-side check of the orchestrator's session tickets (:mod:`swarm.tickets`).

:class:`TicketHandler` is the handler every orchestrated node runs (:func:`install_ticket_handler`): petals'
handler with the push fix and the prefix store (:mod:`server.prefix_cache`), plus a gate in front of every RPC
that computes or pins anything — ``rpc_inference``, ``rpc_forward``/``rpc_forward_stream``,
``rpc_backward``/``rpc_backward_stream`` and ``rpc_prefix_probe``. Unless the gate is open, a call must carry
(in its opening metadata, key ``cs_ticket``) a ticket signed by the orchestrator key this server pinned, not
expired, that names this server's peer id with a span containing the requested blocks; otherwise the call
fails with a one-line ``TicketError`` before any cache is allocated or any block runs. Prefix pages are stored
only under the page hashes whose digest the session's ticket carries (see :mod:`swarm.tickets`).

The gate is configured in the server process (:func:`configure`) before petals forks the handler processes,
which inherit it: ``open=True`` (``chainswarm server --open``) serves anyone, as petals does (a trusted lab,
vanilla petals clients); otherwise the pinned orchestrator key decides, and with no key pinned yet every
session is refused. ``rpc_info`` (petals' block metadata) and ``rpc_push`` (server-to-server pushes into an
already opened session) are not gated.
"""
from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Sequence

from swarm.compat import petals  # noqa: F401  (the shim must precede petals.server)
from hivemind import MSGPackSerializer
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import anext

from server.prefix_cache import PrefixBackend, PrefixHandler
from swarm import tickets
from swarm.tickets import Ticket, TicketError

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
    """(the stream with its first message put back, the ticket of that first message)."""
    first = await anext(requests)
    ticket = check(_metadata(first), _uids(first))

    async def replay():
        yield first
        async for request in requests:
            yield request

    return replay(), ticket


class TicketHandler(PrefixHandler):
    """The prefix handler behind the ticket gate (see the module doc)."""

    _rpc_handlers = None  # hivemind caches the RPC table per class: collect ours

    async def rpc_inference(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                            context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            replay, ticket = await _checked_stream(requests)
        except StopAsyncIteration:
            return
        _TICKET.set(ticket)
        async for response in super().rpc_inference(replay, context):
            yield response

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        check(_metadata(request), _uids(request))
        return await super().rpc_forward(request, context)

    async def rpc_forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                 context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        replay, _ = await _checked_stream(requests)
        async for response in super().rpc_forward_stream(replay, context):
            yield response

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        check(_metadata(request), _uids(request))
        return await super().rpc_backward(request, context)

    async def rpc_backward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                  context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        replay, _ = await _checked_stream(requests)
        async for response in super().rpc_backward_stream(replay, context):
            yield response

    async def rpc_prefix_probe(self, request: runtime_pb2.ExpertRequest,
                               context: P2PContext) -> runtime_pb2.ExpertResponse:
        check(_metadata(request), _uids(request))
        return await super().rpc_prefix_probe(request, context)

    def _may_store_pages(self, hashes: Sequence[bytes]) -> bool:
        if GATE.open:
            return True
        ticket = _TICKET.get()
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
