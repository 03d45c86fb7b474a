"""The system model of chain composition (spec ``chain-composition.md`` §2).

Everything here is pure: frozen dataclasses and functions over them, no I/O.

Conventions (spec §0.2, §2.8, §15.17):

* Blocks are **0-based** and spans are **half-open**: a server hosting the paper's blocks
  ``a_j .. a_j + m_j - 1`` (1-based) has ``span = (a_j - 1, a_j - 1 + m_j)``. An unused server
  (``m_j = 0``) has ``span = None``.
* The dummy server ``j0`` is the empty span ending at boundary 0 and ``jE`` the span ``[L, L + 1)``;
  only their ends matter, so they never appear as objects here.
* Memory is converted **once** to integer bytes (``round(gb * 1e9)``) and every floor in eqs. (1), (3),
  (8) is integer division of bytes, so ``(2.4 - 2) / 0.1`` is exactly 4 slots.
* Times are mean seconds per job (all tokens).

Symbols: ``L`` = ``ModelSpec.num_blocks``, ``s_m`` = ``block_size_gb``, ``s_c`` = ``cache_slot_gb``,
``M_j`` = ``Server.memory_gb``, ``τc_j`` = ``Server.comm_time_s``, ``τp_j`` = ``Server.compute_time_s``;
for batching servers ``D_j`` = ``Server.decode_time_s`` and ``g_j`` = ``Server.batch``
(:mod:`planner.service_model`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from planner.service_model import BatchCurve

BYTES_PER_GB = 10**9

Span = tuple[int, int]
"""A 0-based half-open block range ``(start, end)``."""

# Relative tolerance used when two chain times are compared for a tie (GCA shortest paths, sorting).
TIME_RTOL = 1e-9


def gb_to_bytes(gb: float) -> int:
    """Convert GB (10^9 bytes) to integer bytes, rounding to the nearest byte (spec §2.8)."""
    return int(round(gb * BYTES_PER_GB))


def _check_number(name: str, value: float, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """The served model: ``L`` identical blocks of ``s_m`` GB each, ``s_c`` GB of KV cache per block per job."""

    num_blocks: int
    """L, the number of transformer blocks."""
    block_size_gb: float
    """s_m, the parameter memory of one block (GB)."""
    cache_slot_gb: float
    """s_c, the KV cache of one block for one job at the maximum sequence length (GB)."""

    def __post_init__(self) -> None:
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        _check_number("block_size_gb", self.block_size_gb, positive=True)
        _check_number("cache_slot_gb", self.cache_slot_gb, positive=True)
        if self.block_bytes <= 0 or self.slot_bytes <= 0:
            raise ValueError("block_size_gb and cache_slot_gb must be at least one byte")

    @property
    def block_bytes(self) -> int:
        """s_m in integer bytes."""
        return gb_to_bytes(self.block_size_gb)

    @property
    def slot_bytes(self) -> int:
        """s_c in integer bytes."""
        return gb_to_bytes(self.cache_slot_gb)


@dataclass(frozen=True)
class Server:
    """One GPU server j: memory M_j, communication time τc_j, per-block compute time τp_j."""

    id: str
    memory_gb: float
    """M_j, memory usable for blocks plus KV cache (GB)."""
    comm_time_s: float
    """τc_j, mean time to involve j in one job, summed over all tokens (s)."""
    compute_time_s: float
    """τp_j, mean time to run one block for one job, summed over all tokens (s)."""
    decode_time_s: float = 0.0
    """D_j, the decode steps' share of τp_j (s, per block per job): the part that slows down with occupancy."""
    batch: BatchCurve | None = None
    """g_j, the server's decode step time with n sessions relative to one (None: g ≡ 1, the paper's model)."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"server id must be a non-empty string, got {self.id!r}")
        _check_number(f"server {self.id}: memory_gb", self.memory_gb)
        _check_number(f"server {self.id}: comm_time_s", self.comm_time_s)
        _check_number(f"server {self.id}: compute_time_s", self.compute_time_s)
        if self.comm_time_s + self.compute_time_s <= 0:
            raise ValueError(f"server {self.id}: comm_time_s + compute_time_s must be > 0")
        _check_number(f"server {self.id}: decode_time_s", self.decode_time_s)
        if self.decode_time_s > self.compute_time_s:
            raise ValueError(f"server {self.id}: decode_time_s must not exceed compute_time_s")
        if self.batch is not None and not isinstance(self.batch, BatchCurve):
            raise ValueError(f"server {self.id}: batch must be a BatchCurve or None")

    @property
    def memory_bytes(self) -> int:
        return gb_to_bytes(self.memory_gb)


def validate_servers(servers: Sequence[Server]) -> tuple[Server, ...]:
    """Return the servers as a tuple after checking that ids are unique and there is at least one."""
    servers = tuple(servers)
    if not servers:
        raise ValueError("the swarm has no servers")
    seen: set[str] = set()
    for s in servers:
        if not isinstance(s, Server):
            raise TypeError(f"expected Server, got {type(s).__name__}")
        if s.id in seen:
            raise ValueError(f"duplicate server id {s.id!r}")
        seen.add(s.id)
    return servers


# ----------------------------------------------------------------------------------------------
# Per-server quantities, eqs. (8), (9), (12), (3)
# ----------------------------------------------------------------------------------------------


def max_blocks(server: Server, model: ModelSpec, c: int) -> int:
    """m_j(c) = min(⌊M_j / (s_m + s_c·c)⌋, L), eq. (8), in integer bytes."""
    if c < 0:
        raise ValueError("c must be >= 0")
    return min(server.memory_bytes // (model.block_bytes + c * model.slot_bytes), model.num_blocks)


def server_time(server: Server, num_blocks: int) -> float:
    """t_j = τc_j + τp_j·m_j, eq. (9): j's time per job when it processes all its ``num_blocks`` blocks."""
    return server.comm_time_s + server.compute_time_s * num_blocks


def free_slots(server: Server, model: ModelSpec, num_blocks: int) -> int:
    """M̃_j = ⌊(M_j − s_m·m_j)/s_c⌋: cache slots left after hosting ``num_blocks`` blocks (eq. 3).

    Negative when the blocks alone do not fit (an infeasible placement).
    """
    return (server.memory_bytes - num_blocks * model.block_bytes) // model.slot_bytes


def c_max(model: ModelSpec, servers: Sequence[Server]) -> int:
    """c_max = ⌊(max_j M_j − s_m)/s_c⌋ (§5.1); 0 when no server can host even one block."""
    best = max(s.memory_bytes for s in servers)
    return max(0, (best - model.block_bytes) // model.slot_bytes)


# ----------------------------------------------------------------------------------------------
# Placement, links, chains
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Block placement (a, m): ``spans[j]`` is server j's hosted span, aligned with the servers tuple.

    ``None`` means the server hosts nothing (m_j = 0) and is not a node of the routing topology.
    """

    spans: tuple[Span | None, ...]

    def num_blocks(self, index: int) -> int:
        span = self.spans[index]
        return 0 if span is None else span[1] - span[0]

    def placed(self) -> tuple[int, ...]:
        """Indices of the servers that host at least one block."""
        return tuple(i for i, s in enumerate(self.spans) if s is not None)

    def validate(self, model: ModelSpec, servers: Sequence[Server]) -> None:
        """Check spans lie in [0, L) and that every server's blocks fit its memory (eq. 1 with no jobs)."""
        if len(self.spans) != len(servers):
            raise ValueError("placement and servers differ in length")
        for server, span in zip(servers, self.spans):
            if span is None:
                continue
            start, end = span
            if not (0 <= start < end <= model.num_blocks):
                raise ValueError(f"server {server.id}: span {span} outside [0, {model.num_blocks})")
            if free_slots(server, model, end - start) < 0:
                raise ValueError(f"server {server.id}: {end - start} blocks exceed its memory")


@dataclass(frozen=True)
class Link:
    """A feasible consecutive pair (i, j) of §2.2; ``-1`` is j0 and ``len(servers)`` is jE.

    ``num_blocks`` is m_ij = (a_j + m_j) − (a_i + m_i), the blocks j processes after i (1 into jE).
    """

    src: int
    dst: int
    num_blocks: int


def feasible_links(placement: Placement, num_blocks: int) -> list[Link]:
    """ℰ_{a,m}: every pair satisfying the link rule a_j ≤ a_i + m_i ≤ a_j + m_j − 1 (§2.2).

    In 0-based spans: j may follow i iff ``start_j <= end_i < end_j``; j0 has end 0, and (i, jE) exists iff
    ``end_i == L``. Order: by src (j0 first), then dst. O(|ℰ| + J²); for inspection and tests.
    """
    n = len(placement.spans)
    ends = [(-1, 0)] + [(i, s[1]) for i, s in enumerate(placement.spans) if s is not None]
    out: list[Link] = []
    for i, end_i in ends:
        for j, span in enumerate(placement.spans):
            if span is None or j == i:
                continue
            if span[0] <= end_i < span[1]:
                out.append(Link(i, j, span[1] - end_i))
        if i >= 0 and end_i == num_blocks:
            out.append(Link(i, n, 1))
    return out


@dataclass(frozen=True)
class Chain:
    """A server chain k with its capacity: the unit JFFC dispatches to.

    ``spans[i]`` is the 0-based half-open range of blocks ``servers[i]`` *processes* under the first-host
    rule, ``[end of the previous server, end of its own span)``; the first starts at 0, the last ends at L.
    """

    servers: tuple[str, ...]
    spans: tuple[Span, ...]
    capacity: int
    """c_k, the maximum number of concurrent jobs on the chain."""
    service_time: float
    """T_k of eq. (2), mean seconds per job; with batching servers T_k(n^cap), at the occupancy the
    capacities imply (:mod:`planner.service_model`)."""
    solo_time: float | None = None
    """T_k(1), a job alone on the chain's servers, when it differs from ``service_time`` (batching servers)."""

    @property
    def alone_time(self) -> float:
        """T_k of a job alone on the chain's servers (= ``service_time`` without batching servers)."""
        return self.service_time if self.solo_time is None else self.solo_time

    @property
    def rate(self) -> float:
        """μ_k = 1/T_k (jobs per second per job server)."""
        return 1.0 / self.service_time

    @property
    def slots_needed(self) -> tuple[int, ...]:
        """m_ij for each server: cache slots one job holds on it."""
        return tuple(e - s for s, e in self.spans)


def processed_spans(hosted: Sequence[Span]) -> tuple[Span, ...]:
    """Apply the first-host rule to a chain's hosted spans; raise if consecutive servers cannot link.

    Returns the processed span of each server. The chain must start at block 0 and end at block L is
    *not* checked here (see ``check_chain``).
    """
    out: list[Span] = []
    boundary = 0
    for start, end in hosted:
        if not (start <= boundary < end):
            raise ValueError(f"span {(start, end)} cannot follow boundary {boundary} (link rule)")
        out.append((boundary, end))
        boundary = end
    return tuple(out)


def chain_service_time(servers: Sequence[Server], processed: Sequence[Span]) -> float:
    """T_k = Σ_{(i,j)∈k} (τc_j + τp_j·m_ij), eq. (2); the link into jE costs 0."""
    total = 0.0
    for server, (start, end) in zip(servers, processed):
        total += server.comm_time_s + server.compute_time_s * (end - start)
    return total


def check_chain(chain: Chain, model: ModelSpec, placement: Placement, servers: Sequence[Server]) -> None:
    """Check a chain is a j0→jE path of the routing topology: links valid, covers 0..L−1 in order."""
    index = {s.id: i for i, s in enumerate(servers)}
    hosted = []
    for sid in chain.servers:
        span = placement.spans[index[sid]]
        if span is None:
            raise ValueError(f"chain uses unplaced server {sid}")
        hosted.append(span)
    processed = processed_spans(hosted)
    if processed != tuple(chain.spans):
        raise ValueError(f"chain spans {chain.spans} differ from first-host spans {processed}")
    if not processed or processed[0][0] != 0 or processed[-1][1] != model.num_blocks:
        raise ValueError("chain does not cover blocks 0..L-1")


def allocated_slots(chains: Iterable[Chain], servers: Sequence[Server]) -> tuple[int, ...]:
    """Σ over chains k through j of c_k·m_ij, per server (the left side of eq. 3)."""
    index = {s.id: i for i, s in enumerate(servers)}
    used = [0] * len(servers)
    for chain in chains:
        for sid, (start, end) in zip(chain.servers, chain.spans):
            used[index[sid]] += chain.capacity * (end - start)
    return tuple(used)


def check_memory(
    model: ModelSpec, servers: Sequence[Server], placement: Placement, chains: Iterable[Chain]
) -> None:
    """Check eq. (1)/(3): s_m·m_j + s_c·Σ c_k·m_ij ≤ M_j on every server, in integer bytes."""
    used = allocated_slots(chains, servers)
    for i, server in enumerate(servers):
        bytes_used = placement.num_blocks(i) * model.block_bytes + used[i] * model.slot_bytes
        if bytes_used > server.memory_bytes:
            raise ValueError(
                f"server {server.id}: {bytes_used} bytes needed, {server.memory_bytes} available"
            )


def total_rate(chains: Iterable[Chain]) -> float:
    """ν = Σ_k c_k·μ_k, eq. (4)."""
    return sum(ch.capacity * ch.rate for ch in chains)


def total_capacity(chains: Iterable[Chain]) -> int:
    """C = Σ_k c_k, the number of job servers."""
    return sum(ch.capacity for ch in chains)


def largest_capacity(chains: Iterable[Chain]) -> int:
    """max_k c_k (0 without chains): the most slots one chain holds, i.e. the longest session it can take when a
    slot holds a fixed number of tokens."""
    return max((ch.capacity for ch in chains), default=0)
