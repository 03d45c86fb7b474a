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

The chain's ends (:mod:`server.ends`): three optional keys move the embeddings, the LM head and the choice of token
onto the servers that hold the first and last blocks; servers that do not know them ignore them, so a client sends
them only to servers that publish ``ends`` in their profile:

* ``"ids": [sid, ...]`` (to the server of block 0): those steps' tensors are token ids ``(1, tokens)`` (int64), which
  the server embeds;
* ``"sample": {sid: spec}`` (to the server of the last block, with a session's first chosen step, and again with the
  first step on a new chain after a failover): the request's sampling controls, draw seed and tokens so far
  (:func:`swarm.engine.sampling.sampling_to_wire`); a session chosen without one is greedy;
* ``"choose": {sid: [draft, left]}`` (to the same server, every step): run the final norm and head over the step's
  last ``len(draft) + 1`` positions and choose the tokens (:func:`swarm.engine.sampling.choose_step`: ``draft`` the
  drafted ids the step verifies, ``left`` the most tokens the session may still emit). The reply carries no tensor
  for those sessions but ``"chosen": {sid: [tokens, logprobs or None]}`` in its metadata — token ids, never a
  vocabulary-sized tensor;
* ``"keep": [sid, ...]`` (with ``choose``): those sessions' hidden states are sent back as well (a session whose
  spans a spot check records: :mod:`swarm.engine.recording`).

The reply (``ExpertResponse``) carries one tensor per step entry that succeeded (and was not chosen), in order, and
metadata ``{"failed": {sid: message}}``: a session that fails (refused ticket, no KV slot, length exceeded, a compute
error) fails alone, is closed on the server, and must not be stepped again. Servers without the RPC (vanilla
petals) answer the call with an error; clients then use one petals session per sequence.

The same rollback travels on petals' own per-session stream (``rpc_inference``), for a session that speculates
there (:data:`swarm.model.petals_sessions.ROLLBACK_META_KEY`), under the same bound (:func:`checked_rollback`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    ids: frozenset = frozenset()  # sessions whose step tensor is token ids (the chain's first server embeds them)
    samples: dict = field(default_factory=dict)  # sid -> sampling spec (swarm.engine.sampling.sampling_to_wire)
    chooses: dict = field(default_factory=dict)  # sid -> (draft ids, left): the last server chooses the tokens
    keeps: frozenset = frozenset()  # chosen sessions whose hidden states are sent back too


MAX_DRAFT = 64  # drafted tokens one step of one session verifies


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


def encode(opens=(), steps=(), closes=(), *, ids=(), samples=None, chooses=None, keeps=()) -> dict:
    """The metadata of one request (``steps`` as (sid, tokens) or (sid, tokens, rollback) tuples; the chain's ends:
    ``ids``, ``samples`` and ``chooses`` as the module doc says, left out when empty)."""
    metadata = {"open": [[o.sid, o.max_length, o.ticket, o.alloc_timeout] + ([o.prefix.to_wire()] if o.prefix else [])
                         for o in opens],
                "step": [_step_entry(*step) for step in steps], "close": list(closes)}
    if ids:
        metadata["ids"] = list(ids)
    if samples:
        metadata["sample"] = dict(samples)
    if chooses:
        metadata["choose"] = {sid: [list(draft), int(left)] for sid, (draft, left) in chooses.items()}
    if keeps:
        metadata["keep"] = list(keeps)
    return metadata


def _ends(metadata: dict, steps: list) -> tuple[frozenset, dict, dict, frozenset]:
    """The chain's-ends keys of a request, validated against its steps."""
    tokens = {sid: n for sid, n, _ in steps}
    ids, samples, chooses = metadata.get("ids", []), metadata.get("sample", {}), metadata.get("choose", {})
    if not isinstance(ids, list) or not isinstance(samples, dict) or not isinstance(chooses, dict):
        raise MultiWireError("'ids' must be a list, 'sample' and 'choose' maps")
    for sid in ids:
        if _sid(sid) not in tokens:
            raise MultiWireError(f"'ids' names {sid!r}, which does not step in this message")
    if len(samples) > MAX_SESSIONS or not all(isinstance(v, dict) for v in samples.values()):
        raise MultiWireError("'sample' maps a session to its sampling spec (a map)")
    parsed = {}
    for sid, entry in chooses.items():
        if _sid(sid) not in tokens:
            raise MultiWireError(f"'choose' names {sid!r}, which does not step in this message")
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], list)
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in entry[0])
                or not isinstance(entry[1], int) or isinstance(entry[1], bool) or entry[1] < 1):
            raise MultiWireError("a choose entry is [draft token ids, left >= 1]")
        if len(entry[0]) > MAX_DRAFT or len(entry[0]) + 1 > tokens[sid]:
            raise MultiWireError(f"session {sid!r}: a draft of {len(entry[0])} tokens in a step of {tokens[sid]} "
                                 f"positions (at most {MAX_DRAFT}, and one position more than the draft)")
        parsed[sid] = (tuple(entry[0]), entry[1])
    for sid in samples:
        _sid(sid)
    keeps = metadata.get("keep", [])
    if not isinstance(keeps, list) or not all(isinstance(sid, str) and sid in parsed for sid in keeps):
        raise MultiWireError("'keep' lists sessions this message asks to choose")
    return frozenset(ids), dict(samples), parsed, frozenset(keeps)


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
    return Request(tuple(opens), tuple(steps), tuple(_sid(s) for s in raw_closes), *_ends(metadata, steps))
