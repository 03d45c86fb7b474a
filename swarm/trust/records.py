"""Chainswarm's DHT records: what servers publish about themselves and what the orchestrator tells them.

Three keys live under the model's DHT prefix, next to petals' own block records:

* ``{prefix}._cs.profiles``    subkey = node id [owner: node key]      -> :class:`ServerProfile` (heartbeat)
* ``{prefix}._cs.assignments`` subkey = node id [owner: orchestrator key] -> :class:`Assignment`
* ``{prefix}._cs.orchestrator`` subkey = "main" [owner: orchestrator key] -> :class:`OrchestratorInfo`

A record that is not renewed expires; that is how the orchestrator notices a vanished server and how a
server notices a vanished orchestrator. Values are plain msgpack-friendly dicts; ``from_dict`` validates
them, so a malformed record from a buggy or hostile peer is skipped instead of crashing its reader. Every
record is signed by its writer (owned subkeys, :mod:`swarm.trust.identity`); readers name the owner they believe.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from planner.service_model import BATCH_SIZES, MAX_BATCH_LIMIT, BatchCurve

PROFILES = "_cs.profiles"
ASSIGNMENTS = "_cs.assignments"
ORCHESTRATOR = "_cs.orchestrator"

# Server lifecycle states published in the profile.
WAITING, LOADING, SERVING, DRAINING = "waiting", "loading", "serving", "draining"
SERVER_STATES = (WAITING, LOADING, SERVING, DRAINING)


class RecordError(ValueError):
    """A DHT record is malformed (missing or mistyped fields)."""


def _typed(doc: Mapping[str, Any], cls) -> dict[str, Any]:
    """Pick and type-check the dataclass fields of ``cls`` from ``doc``."""
    if not isinstance(doc, Mapping):
        raise RecordError(f"{cls.__name__} record is not a mapping: {type(doc).__name__}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in doc:
            if f.default is dataclasses.MISSING:
                raise RecordError(f"{cls.__name__} record lacks {f.name!r}")
            continue
        value = doc[f.name]
        kinds = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
                 "tuple[float,...]": (list, tuple)}
        expected = str(f.type).replace(" ", "").split("|")
        ok = value is None and "None" in expected
        for name in expected:
            ok = ok or (name in kinds and isinstance(value, kinds[name]) and not (name != "bool" and isinstance(value, bool)))
        if not ok:
            raise RecordError(f"{cls.__name__}.{f.name} has the wrong type: {value!r}")
        values[f.name] = float(value) if expected[0] == "float" and value is not None else value
    return values


@dataclass(frozen=True)
class ServerProfile:
    """What a server measured about itself, plus its current state (published every heartbeat).

    Times are per block per token, so the orchestrator can turn them into the planner's per-job times
    for its own expected request lengths (chain-composition spec §2.7, footnote 11):
    τp_j = overhead + prefill_s·l̄_I + decode_s·(l̄_O − 1), τc_j = l̄_O·(rtt_s + per-hop overhead).

    ``batch_step_s`` is the per-block time of one decode step of b sessions at b = 1, 2, 4, 8, 16
    (:data:`planner.service_model.BATCH_SIZES`; nondecreasing, at most twice b sessions run one after another)
    and ``max_batch`` the server's batch bound: the planner's g_j (:meth:`batch_curve`). A server without
    them (older servers, declared test profiles) is planned with g ≡ 1.
    """

    node_id: str  # stable name of the volunteer's server (survives restarts of its petals peer)
    peer_id: str  # base58 peer id of the server's petals DHT/p2p peer (what clients route to)
    memory_bytes: int  # memory budget for blocks + KV cache on this server
    block_bytes: int  # one transformer block's weights on this server (dtype/quantisation included)
    cache_bytes_per_token: int  # KV cache of one token for one block
    prefill_s: float  # per block per token, prefill (forward over many tokens)
    decode_s: float  # per block per token, one-token decode step with a KV cache
    rtt_s: float | None  # round-trip time to the orchestrator, measured over the swarm (None = not yet)
    device: str = "cpu"
    torch_dtype: str = "float32"
    quant_type: str = "none"
    state: str = WAITING
    plan_id: str | None = None  # the assignment currently loaded (or being loaded)
    start: int | None = None
    end: int | None = None
    cache_slots: int = 0
    version: str = ""
    batch_step_s: tuple[float, ...] | None = None  # per block: one decode step of b sessions, b in BATCH_SIZES
    max_batch: int | None = None  # the server's batch bound (1: petals' one-session-at-a-time pool)
    prefix_epoch: str | None = None  # its prompt-prefix store's epoch (server.prefix_cache): a new one, new pages
    ends: bool = False  # it embeds token ids at block 0 and chooses tokens at the last block (server.ends)

    def __post_init__(self) -> None:
        if self.state not in SERVER_STATES:
            raise RecordError(f"unknown server state {self.state!r}")
        if self.memory_bytes < 0 or self.block_bytes <= 0 or self.cache_bytes_per_token <= 0:
            raise RecordError("memory, block and cache sizes must be positive")
        if self.prefill_s < 0 or self.decode_s < 0 or (self.rtt_s is not None and self.rtt_s < 0):
            raise RecordError("times must be non-negative")
        if self.batch_step_s is not None:
            object.__setattr__(self, "batch_step_s", check_batch_steps(self.batch_step_s))
        if self.max_batch is not None and not (1 <= self.max_batch <= MAX_BATCH_LIMIT):
            raise RecordError(f"max_batch must be in [1, {MAX_BATCH_LIMIT}]")
        if self.prefix_epoch is not None and not 0 < len(self.prefix_epoch) <= 64:
            raise RecordError("prefix_epoch must be 1 to 64 characters")

    def batch_curve(self) -> BatchCurve | None:
        """g_j for the planner from ``batch_step_s`` and ``max_batch`` (None: not published)."""
        if self.batch_step_s is None:
            return None
        return BatchCurve.from_step_times(self.batch_step_s, self.max_batch)

    def memory_shortfall(self) -> str | None:
        """Why no plan can use this server: its memory budget cannot hold one block's weights (None when it can)."""
        if self.memory_bytes >= self.block_bytes:
            return None
        return (f"--memory-gb {self.memory_bytes / 2**30:.3g} cannot hold one block of this model "
                f"({self.block_bytes / 2**30:.3g} GB of weights, and its KV cache): no plan will use this server")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "ServerProfile":
        return cls(**_typed(doc, cls))


def check_batch_steps(values) -> tuple[float, ...]:
    """A published batch curve as a tuple of floats, or RecordError: one positive finite time (≤ 1 h) per size
    of :data:`~planner.service_model.BATCH_SIZES`, nondecreasing, t(b) ≤ 2·b·t(1)."""
    if not isinstance(values, (list, tuple)) or len(values) != len(BATCH_SIZES):
        raise RecordError(f"batch_step_s must list {len(BATCH_SIZES)} step times (batch sizes {BATCH_SIZES})")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 3600:
            raise RecordError(f"batch_step_s holds an invalid time {v!r}")
        out.append(float(v))
    if any(b < a for a, b in zip(out, out[1:])):
        raise RecordError("batch_step_s must be nondecreasing in the batch size")
    if any(t > 2 * b * out[0] for b, t in zip(BATCH_SIZES, out)):
        raise RecordError("batch_step_s is slower than running the sessions one after another, twice over")
    return tuple(out)


@dataclass(frozen=True)
class Assignment:
    """The orchestrator's instruction to one server: load blocks ``[start, end)`` with a KV pool of
    ``cache_slots`` block-slots of ``slot_tokens`` tokens (0: ``max_length``, the fixed-length case) — the
    planner's Σ_k c_k·m_ij, where a session of chain k holds one slot on each of the m_ij blocks it runs on this
    server — plus ``prefix_cache_tokens`` on every block for prompt-prefix reuse; sessions up to ``max_length``
    tokens are allowed. ``start == end``: hold no blocks."""

    plan_id: str
    start: int
    end: int
    cache_slots: int
    max_length: int
    prefix_cache_tokens: int = 0  # KV token budget per block reserved for prompt-prefix reuse
    slot_tokens: int = 0  # tokens per KV slot (0: max_length)

    def __post_init__(self) -> None:
        if not (0 <= self.start <= self.end) or self.cache_slots < 0 or self.max_length <= 0 or self.slot_tokens < 0:
            raise RecordError(f"invalid assignment {self}")
        if self.prefix_cache_tokens < 0:
            raise RecordError("prefix_cache_tokens must be non-negative")

    @property
    def slot_size(self) -> int:
        """Tokens one KV slot holds."""
        return self.slot_tokens or self.max_length

    def in_place_of(self, current: "Assignment | None") -> "Assignment | None":
        """This assignment as a server loaded for ``current`` serves it without reloading, or None when it must
        reload: same blocks, session length, slot size and prefix budget, and no more KV slots than the loaded
        pool holds (the server keeps its larger pool, so the result carries the loaded slot count)."""
        if current is None or (self.start, self.end, self.max_length, self.prefix_cache_tokens, self.slot_size) != (
                current.start, current.end, current.max_length, current.prefix_cache_tokens, current.slot_size):
            return None
        if self.cache_slots > current.cache_slots:
            return None
        return dataclasses.replace(self, cache_slots=current.cache_slots)

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "Assignment":
        return cls(**_typed(doc, cls))


@dataclass(frozen=True)
class OrchestratorInfo:
    peer_id: str  # base58 id of the orchestrator's DHT peer (servers ping it to measure their RTT)
    http_url: str | None = None
    plan_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "OrchestratorInfo":
        return cls(**_typed(doc, cls))


# -- DHT access (a hivemind.DHT; imported lazily so this module stays light) ----------------------------
#
# Every record is stored under an owned subkey ``<name>[owner:<public key>]`` (swarm.trust.identity): the DHT signs it
# with the writer's key and validating peers refuse it unless the signature matches. Readers choose the owner
# they believe: assignments and the orchestrator record only under the orchestrator key, profiles under the
# key pinned for their node id (swarm.trust.identity.KeyPins).


def dht_now() -> float:
    """The DHT's clock (records' expiration times are in it)."""
    from hivemind.utils.timed_storage import get_dht_time

    return get_dht_time()


def _store(dht, key: str, subkey: str, value: dict, ttl: float) -> bool:
    return bool(dht.store(key, value, expiration_time=dht_now() + ttl, subkey=subkey))


def _claims(dht, key: str, cls, expires: dict | None = None, *, latest: bool = True) -> dict[str, dict[bytes, Any]]:
    """{name: {owner key: record}} of the well-formed owned records under ``key``; ``expires`` (if given) gets
    {(name, owner key): when that record expires (DHT time)}; ``latest``: see :func:`fetch_owned`."""
    from swarm.trust.identity import fetch_owned, group_claims

    parsed = []
    for name, owner, value, until in fetch_owned(dht, key, latest=latest):
        try:
            parsed.append((name, owner, cls.from_dict(value)))
        except (RecordError, TypeError):
            continue  # malformed record: skip it, never crash the reader
        if expires is not None:
            expires[(name, owner)] = until
    return group_claims(parsed)


def publish_profile(dht, prefix: str, profile: ServerProfile, ttl: float, owner: bytes) -> bool:
    """Publish ``profile`` signed by ``owner`` (the public key of the identity the DHT signs with)."""
    from swarm.trust.identity import owned_subkey

    return _store(dht, f"{prefix}.{PROFILES}", owned_subkey(profile.node_id, owner), profile.to_dict(), ttl)


def fetch_profile_claims(dht, prefix: str, expires: dict | None = None) -> dict[str, dict[bytes, ServerProfile]]:
    """{node id: {owner key: profile}}: every key that claims a node id (the orchestrator pins one); ``expires``
    (if given) gets {(node id, owner key): when that record expires (DHT time)}."""
    claims = _claims(dht, f"{prefix}.{PROFILES}", ServerProfile, expires)
    return {node: {k: p for k, p in by.items() if p.node_id == node} for node, by in claims.items()}


def fetch_profiles(dht, prefix: str, pins=None) -> dict[str, ServerProfile]:
    """{node id: profile}: with ``pins`` (a :class:`swarm.trust.identity.KeyPins`) the pinned key's profile, without
    them only node ids claimed by exactly one key."""
    claims = fetch_profile_claims(dht, prefix)
    if pins is not None:
        return pins.select(claims)[0]
    return {node: next(iter(by.values())) for node, by in claims.items() if len(by) == 1}


def publish_assignment(dht, prefix: str, node_id: str, assignment: Assignment, ttl: float, owner: bytes) -> bool:
    from swarm.trust.identity import owned_subkey

    return _store(dht, f"{prefix}.{ASSIGNMENTS}", owned_subkey(node_id, owner), assignment.to_dict(), ttl)


def fetch_assignments(dht, prefix: str, orchestrator: bytes) -> dict[str, Assignment]:
    """{node id: assignment} signed by the ``orchestrator`` key (assignments under any other key are ignored)."""
    return {node: by[orchestrator] for node, by in _claims(dht, f"{prefix}.{ASSIGNMENTS}", Assignment).items()
            if orchestrator in by}


def publish_orchestrator(dht, prefix: str, info: OrchestratorInfo, ttl: float, owner: bytes) -> bool:
    from swarm.trust.identity import owned_subkey

    return _store(dht, f"{prefix}.{ORCHESTRATOR}", owned_subkey("main", owner), info.to_dict(), ttl)


def fetch_orchestrator_claims(dht, prefix: str, *, latest: bool = True) -> dict[bytes, OrchestratorInfo]:
    """{owner key: orchestrator record}: every key that publishes an orchestrator record."""
    return _claims(dht, f"{prefix}.{ORCHESTRATOR}", OrchestratorInfo, latest=latest).get("main", {})


def fetch_orchestrator(dht, prefix: str, orchestrator: bytes | None, *,
                       latest: bool = True) -> OrchestratorInfo | None:
    """The orchestrator record signed by ``orchestrator`` (None: no key known yet, so no record is believed)."""
    if orchestrator is None:
        return None
    return fetch_orchestrator_claims(dht, prefix, latest=latest).get(orchestrator)
