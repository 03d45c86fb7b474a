"""Session tickets: the orchestrator's signed permission for one granted session on one route.

A ticket is minted where a chain slot is granted (a proxied completion or a client's lease) and travels in the
opening metadata of every petals request of that session (``cs_ticket``). A server that is not ``--open``
serves an inference session (or a forward/backward/prefix-probe call) only with a ticket that

* carries a valid signature of the orchestrator key the server pinned (:mod:`server.trust`),
* has not expired (``expires_at``, DHT time, a short lifetime: the ticket is checked when a session *opens*,
  so a long generation is not cut off; a reroute mints a fresh ticket for the new route),
* names this server's peer id with a span that contains the blocks requested.

``pages`` binds prefix-cache writes: the digest of the prompt's page hashes as the orchestrator computed them
in its secret namespace (:func:`pages_digest`). A server stores prefix pages only when the session's hashes
hash to the digest of the ticket it served, so a ticket holder cannot plant pages under hashes of its choosing
(a ticket without ``pages`` — every lease handed to a client — stores nothing).

Wire format: msgpack ``{"body": msgpack(fields), "sig": base64 RSA-PSS signature of body}``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

from hivemind.utils.serializer import MSGPackSerializer

META_KEY = "cs_ticket"
DEFAULT_TTL_S = 120.0
MAX_TICKET_BYTES = 16384


class TicketError(PermissionError):
    """A session was refused: no ticket, or one that does not grant this server these blocks now."""


@dataclass(frozen=True)
class Ticket:
    request_id: str
    chain_id: str
    route: tuple[tuple[str, int, int], ...]  # (peer id base58, start, end)
    expires_at: float  # DHT time (hivemind.utils.timed_storage.get_dht_time)
    max_length: int
    pages: bytes | None = None  # pages_digest of the prompt's page hashes; None = no prefix writes

    def covers(self, peer_id: str, start: int, end: int) -> bool:
        return any(p == peer_id and s <= start and end <= e for p, s, e in self.route)

    def pushers(self, peer_id: str, start: int, end: int) -> frozenset[str]:
        """The peers that may push into a session of this ticket on ``peer_id``'s blocks ``[start, end)``: the
        route's server for block ``start - 1`` (none for the first span, or when the route does not name
        ``peer_id`` for these blocks)."""
        if start <= 0 or not self.covers(peer_id, start, end):
            return frozenset()
        return frozenset(p for p, s, e in self.route if s <= start - 1 < e)

    def same_grant(self, other: "Ticket") -> bool:
        """Whether both tickets were minted for the same granted session (a reroute keeps both ids)."""
        return (self.request_id, self.chain_id) == (other.request_id, other.chain_id)


def pages_digest(hashes: Sequence[bytes]) -> bytes:
    h = hashlib.blake2b(b"chainswarm-pages", digest_size=16)
    for page in hashes:
        h.update(bytes(page))
    return h.digest()


def now() -> float:
    from hivemind.utils.timed_storage import get_dht_time

    return get_dht_time()


def mint(identity, *, request_id: str, chain_id: str, route: Sequence[Sequence], max_length: int,
         ttl_s: float = DEFAULT_TTL_S, page_hashes: Sequence[bytes] = (), at: float | None = None) -> bytes:
    """A ticket signed by ``identity`` (a :class:`swarm.trust.identity.Identity`, the orchestrator's)."""
    body = MSGPackSerializer.dumps({
        "request_id": str(request_id), "chain_id": str(chain_id),
        "route": [[str(p), int(s), int(e)] for p, s, e in route],
        "expires_at": float((now() if at is None else at) + ttl_s), "max_length": int(max_length),
        "pages": pages_digest(page_hashes) if page_hashes else None,
    })
    return MSGPackSerializer.dumps({"body": body, "sig": identity.sign(body)})


def _parse(body: Any) -> Ticket:
    doc = MSGPackSerializer.loads(body)
    if not isinstance(doc, dict):
        raise TicketError("malformed ticket")
    route = doc.get("route")
    if not isinstance(route, (list, tuple)) or not all(
            isinstance(r, (list, tuple)) and len(r) == 3 and isinstance(r[0], str) and isinstance(r[1], int)
            and isinstance(r[2], int) for r in route):
        raise TicketError("malformed ticket route")
    pages = doc.get("pages")
    if pages is not None and not isinstance(pages, bytes):
        raise TicketError("malformed ticket pages")
    if not isinstance(doc.get("expires_at"), (int, float)) or not isinstance(doc.get("max_length"), int):
        raise TicketError("malformed ticket")
    return Ticket(str(doc.get("request_id")), str(doc.get("chain_id")), tuple((p, s, e) for p, s, e in route),
                  float(doc["expires_at"]), doc["max_length"], pages)


def read(blob: Any, orchestrator_key: bytes) -> Ticket:
    """The ticket in ``blob`` if ``orchestrator_key`` signed it (whatever it grants, expired or not); else
    :class:`TicketError` with a one-line reason."""
    from swarm.trust.identity import verify as verify_signature

    if blob is None:
        raise TicketError("chainswarm: session refused: no ticket (ask the orchestrator for a lease)")
    if not isinstance(blob, bytes) or len(blob) > MAX_TICKET_BYTES:
        raise TicketError("chainswarm: session refused: malformed ticket")
    try:
        doc = MSGPackSerializer.loads(blob)
    except Exception:
        raise TicketError("chainswarm: session refused: malformed ticket") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("body"), bytes) or not isinstance(doc.get("sig"), bytes):
        raise TicketError("chainswarm: session refused: malformed ticket")
    if not verify_signature(orchestrator_key, doc["body"], doc["sig"]):
        raise TicketError("chainswarm: session refused: the ticket is not signed by this swarm's orchestrator")
    try:
        return _parse(doc["body"])
    except TicketError:
        raise
    except Exception:
        raise TicketError("chainswarm: session refused: malformed ticket") from None


def verify(blob: Any, orchestrator_key: bytes, *, peer_id: str, start: int, end: int,
           at: float | None = None) -> Ticket:
    """The ticket in ``blob`` if it grants ``peer_id`` blocks ``[start, end)`` now; else :class:`TicketError`
    with a one-line reason."""
    ticket = read(blob, orchestrator_key)
    if ticket.expires_at < (now() if at is None else at):
        raise TicketError("chainswarm: session refused: the ticket has expired")
    if not ticket.covers(peer_id, start, end):
        raise TicketError(f"chainswarm: session refused: the ticket does not grant blocks [{start}, {end}) "
                          f"on this server")
    return ticket
