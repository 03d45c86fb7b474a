"""Multi-session inference streams: several sessions' steps in one message (the wire format).

petals' ``rpc_inference`` carries one session per stream, so every generated token costs every server one
message, one deserialization, one task hand-off to the runtime and one reply per session. A client that drives
many sessions over the same server span (the orchestrator's engine, a batch job) opens one
``rpc_multi_inference`` stream to that server instead and sends, per step, one message for all of them; the
server runs their one-token decode steps as one batched forward pass and answers with one message.

A request is a hivemind ``ExpertRequest``:

* ``uid``: the span's block uids joined by spaces (petals' ``CHAIN_DELIMITER``), the same in every message of
  the stream (later messages may leave it empty);
* ``metadata`` (msgpack): ``{"open": [[sid, max_length, ticket or None, alloc_timeout(, prefix)], ...],
  "step": [[sid, tokens] or [sid, tokens, rollback], ...], "close": [sid, ...]}`` — closes are applied first (a
  new session may take the memory a finished one leaves), then opens, then steps; ``sid`` names a session within
  this stream. ``rollback`` (speculative decoding, :mod:`swarm.engine.speculative`): before its step, the session
  forgets its last ``rollback`` positions (the drafted tokens the previous pass rejected); a rollback past the
  positions of the session's previous step is refused. ``prefix`` (prompt-prefix reuse, :mod:`swarm.trust.prefix`)
  is ``{"page": 16, "hashes": [...], "load": n}``: the server copies the first ``n`` pages it holds into the new
  session's cache (the session then starts at position ``n · page``; the first step sends only the positions after
  them) and stores the prompt's new full pages after that first step;
* ``tensors``: one hidden-state tensor ``(1, tokens, hidden)`` per step entry, in order.

The reply (``ExpertResponse``) carries one tensor per step entry that succeeded, in order, and metadata
``{"failed": {sid: message}}``: a session that fails (refused ticket, no KV slot, length exceeded, a compute
error) fails alone, is closed on the server, and must not be stepped again. Servers without the RPC (vanilla
petals) answer the call with an error; clients then use one petals session per sequence.

The same rollback travels on petals' own per-session stream (``rpc_inference``), for a session that speculates
there (:data:`swarm.model.petals_sessions.ROLLBACK_META_KEY`), under the same bound (:func:`checked_rollback`).
"""
from __future__ import annotations

from dataclasses import dataclass

from swarm.trust.prefix import PAGE_TOKENS, parse_session_spec, session_spec

RPC = "TransformerConnectionHandler.rpc_multi_inference"
MAX_SESSIONS = 256  # sessions open at once in one stream
MAX_SID = 64  # characters of a session name
MAX_ALLOC_TIMEOUT_S = 30.0


class MultiWireError(ValueError):
    """A malformed multi-session message: the stream is closed with this message."""


@dataclass(frozen=True)
class Prefix:
    """A session's prompt pages: ``hashes`` of its full pages, the first ``load`` of them held by the server."""

    hashes: tuple[bytes, ...]
    load: int = 0

    def to_wire(self) -> dict:
        return session_spec(self.hashes, self.load)


@dataclass(frozen=True)
class Open:
    sid: str
    max_length: int
    ticket: bytes | None = None
    alloc_timeout: float = 0.0
    prefix: Prefix | None = None


@dataclass(frozen=True)
class Request:
    opens: tuple[Open, ...]
    steps: tuple[tuple[str, int, int], ...]  # (sid, tokens, rollback)
    closes: tuple[str, ...]


def _sid(value) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SID:
        raise MultiWireError(f"a session name must be a string of 1-{MAX_SID} characters, got {value!r}")
    return value


def _prefix(value, max_length: int) -> Prefix:
    try:
        hashes, load = parse_session_spec(value)
    except ValueError as exc:
        raise MultiWireError(f"a prefix is {{'page': {PAGE_TOKENS}, 'hashes': [...], 'load': n}}: {exc}") from None
    if load * PAGE_TOKENS >= max_length:
        raise MultiWireError(f"a prefix's load ({load} pages) must leave positions below max_length {max_length}")
    return Prefix(tuple(hashes), load)


def checked_rollback(value, last_step: int) -> int:
    """A per-session step's rollback (``ROLLBACK_META_KEY``'s value; None: 0), refused (ValueError) unless it is an
    integer within the positions of the session's previous step (``last_step``): a client can take back only what
    it just sent."""
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a rollback must be a non-negative integer, got {value!r}")
    if value > last_step:
        raise ValueError(f"a rollback of {value} positions goes past the {last_step} positions of the session's "
                         f"previous step")
    return value


def _step_entry(sid: str, tokens: int, rollback: int = 0) -> list:
    """One step entry: ``[sid, tokens]``, or ``[sid, tokens, rollback]`` when positions are taken back (a rollback
    of 0 is left out, so a stream without speculation sends what servers before it understood)."""
    return [sid, int(tokens)] + ([int(rollback)] if rollback else [])


def encode(opens=(), steps=(), closes=()) -> dict:
    """The metadata of one request (``steps`` as (sid, tokens) or (sid, tokens, rollback) tuples)."""
    return {"open": [[o.sid, o.max_length, o.ticket, o.alloc_timeout] + ([o.prefix.to_wire()] if o.prefix else [])
                     for o in opens],
            "step": [_step_entry(*step) for step in steps], "close": list(closes)}


def decode(metadata, tensors: int) -> Request:
    """Validate a request's metadata (``tensors``: how many tensors it carries); :class:`MultiWireError` if bad."""
    if not isinstance(metadata, dict):
        raise MultiWireError("multi-session metadata must be a map")
    raw_opens, raw_steps, raw_closes = (metadata.get(k, []) for k in ("open", "step", "close"))
    if not all(isinstance(v, list) for v in (raw_opens, raw_steps, raw_closes)):
        raise MultiWireError("'open', 'step' and 'close' must be lists")
    if max(len(raw_opens), len(raw_steps), len(raw_closes)) > MAX_SESSIONS:
        raise MultiWireError(f"at most {MAX_SESSIONS} entries of each kind per message")
    opens = []
    for entry in raw_opens:
        if not isinstance(entry, list) or len(entry) not in (4, 5):
            raise MultiWireError("an open entry is [sid, max_length, ticket, alloc_timeout] or [..., prefix]")
        sid, max_length, ticket, alloc_timeout = entry[:4]
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise MultiWireError(f"max_length must be a positive integer, got {max_length!r}")
        if ticket is not None and not isinstance(ticket, bytes):
            raise MultiWireError("a ticket must be bytes")
        if not isinstance(alloc_timeout, (int, float)) or not 0 <= alloc_timeout <= MAX_ALLOC_TIMEOUT_S:
            raise MultiWireError(f"alloc_timeout must be within 0-{MAX_ALLOC_TIMEOUT_S} s")
        prefix = _prefix(entry[4], max_length) if len(entry) == 5 else None
        opens.append(Open(_sid(sid), max_length, ticket, float(alloc_timeout), prefix))
    steps = []
    for entry in raw_steps:
        if (not isinstance(entry, list) or len(entry) not in (2, 3)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry[1:])):
            raise MultiWireError("a step entry is [sid, tokens] or [sid, tokens, rollback] with tokens, rollback >= 0")
        steps.append((_sid(entry[0]), entry[1], entry[2] if len(entry) == 3 else 0))
    if len({step[0] for step in steps}) != len(steps):
        raise MultiWireError("a session may step once per message")
    if len(steps) != tensors:
        raise MultiWireError(f"{len(steps)} step entries but {tensors} tensors")
    return Request(tuple(opens), tuple(steps), tuple(_sid(s) for s in raw_closes))
