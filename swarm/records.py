"""Chainswarm's DHT records: what servers publish about themselves and what the orchestrator tells them.

Three keys live under the model's DHT prefix, next to petals' own block records:

* ``{prefix}._cs.profiles``    subkey = server node id -> :class:`ServerProfile` (heartbeat, renewed by the server)
* ``{prefix}._cs.assignments`` subkey = server node id -> :class:`Assignment` (renewed by the orchestrator)
* ``{prefix}._cs.orchestrator`` subkey = "main"        -> :class:`OrchestratorInfo`

A record that is not renewed expires; that is how the orchestrator notices a vanished server and how a
server notices a vanished orchestrator. Values are plain msgpack-friendly dicts; ``from_dict`` validates
them, so a malformed record from a buggy or hostile peer is skipped instead of crashing its reader.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

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
        kinds = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
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

    def __post_init__(self) -> None:
        if self.state not in SERVER_STATES:
            raise RecordError(f"unknown server state {self.state!r}")
        if self.memory_bytes < 0 or self.block_bytes <= 0 or self.cache_bytes_per_token <= 0:
            raise RecordError("memory, block and cache sizes must be positive")
        if self.prefill_s < 0 or self.decode_s < 0 or (self.rtt_s is not None and self.rtt_s < 0):
            raise RecordError("times must be non-negative")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "ServerProfile":
        return cls(**_typed(doc, cls))


@dataclass(frozen=True)
class Assignment:
    """The orchestrator's instruction to one server: load blocks ``[start, end)`` with a KV pool of
    ``cache_slots`` block-slots of ``max_length`` tokens — the planner's Σ_k c_k·m_ij, where a session of
    chain k holds one slot on each of the m_ij blocks it runs on this server — plus
    ``prefix_cache_tokens`` on every block for prompt-prefix reuse. ``start == end``: hold no blocks."""

    plan_id: str
    start: int
    end: int
    cache_slots: int
    max_length: int
    prefix_cache_tokens: int = 0  # KV token budget per block reserved for prompt-prefix reuse

    def __post_init__(self) -> None:
        if not (0 <= self.start <= self.end) or self.cache_slots < 0 or self.max_length <= 0:
            raise RecordError(f"invalid assignment {self}")
        if self.prefix_cache_tokens < 0:
            raise RecordError("prefix_cache_tokens must be non-negative")

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


def _now() -> float:
    from hivemind.utils.timed_storage import get_dht_time

    return get_dht_time()


def _store(dht, key: str, subkey: str, value: dict, ttl: float) -> bool:
    return bool(dht.store(key, value, expiration_time=_now() + ttl, subkey=subkey))


def _fetch_all(dht, key: str, cls) -> dict[str, Any]:
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    records = {}
    for subkey, item in found.value.items():
        try:
            records[str(subkey)] = cls.from_dict(item.value)
        except (RecordError, TypeError):
            continue  # malformed record: skip it, never crash the reader
    return records


def publish_profile(dht, prefix: str, profile: ServerProfile, ttl: float) -> bool:
    return _store(dht, f"{prefix}.{PROFILES}", profile.node_id, profile.to_dict(), ttl)


def fetch_profiles(dht, prefix: str) -> dict[str, ServerProfile]:
    return _fetch_all(dht, f"{prefix}.{PROFILES}", ServerProfile)


def publish_assignment(dht, prefix: str, node_id: str, assignment: Assignment, ttl: float) -> bool:
    return _store(dht, f"{prefix}.{ASSIGNMENTS}", node_id, assignment.to_dict(), ttl)


def fetch_assignments(dht, prefix: str) -> dict[str, Assignment]:
    return _fetch_all(dht, f"{prefix}.{ASSIGNMENTS}", Assignment)


def publish_orchestrator(dht, prefix: str, info: OrchestratorInfo, ttl: float) -> bool:
    return _store(dht, f"{prefix}.{ORCHESTRATOR}", "main", info.to_dict(), ttl)


def fetch_orchestrator(dht, prefix: str) -> OrchestratorInfo | None:
    return _fetch_all(dht, f"{prefix}.{ORCHESTRATOR}", OrchestratorInfo).get("main")
