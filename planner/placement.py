"""GBP-CR: Greedy Block Placement with Cache Reservation (spec §4, Alg. 1).

Given a required per-server capacity ``c``, every server reserves cache for ``c`` concurrent jobs on each
block it hosts, so it can host ``m_j(c) = min(⌊M_j/(s_m + s_c·c)⌋, L)`` blocks (eq. 8) and needs at most
``t_j(c) = τc_j + τp_j·m_j(c)`` per job (eq. 9). Servers are taken in increasing amortized per-block time
``t̃_j(c) = t_j(c)/m_j(c)`` (eq. 12) and stacked into disjoint chains that cover blocks 0..L−1; the last
server of a chain is shifted back so it ends exactly at block L (it overlaps its predecessor, which the
first-host rule resolves). The loop stops as soon as the scaled rate ``ν̂ = Σ_k 1/T_k`` reaches
``λ/(ρ̄·c)``.

Deterministic tie-break (§4.3): servers sort by ``(t̃_j(c), id)``; t̃ is rounded to 40 significant bits
(relative 1e-12) before sorting so that float noise such as 0.6000000000000001/3 versus 0.2 cannot beat
the id tie-break.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from planner.model import ModelSpec, Placement, Server, Span, validate_servers

DEFAULT_TARGET_LOAD = 0.7
"""ρ̄ used when none is given (the paper's default, §10.1)."""


def validate_load(arrival_rate: float, target_load: float) -> None:
    """λ ≥ 0 finite and 0 < ρ̄ < 1 (§2.1)."""
    if not (isinstance(arrival_rate, (int, float)) and np.isfinite(arrival_rate) and arrival_rate >= 0):
        raise ValueError(f"arrival_rate must be a finite number >= 0, got {arrival_rate!r}")
    if not (isinstance(target_load, (int, float)) and 0 < target_load < 1):
        raise ValueError(f"target_load must be in (0, 1), got {target_load!r}")


class SwarmArrays:
    """Vectorized view of a swarm (integer bytes and float times) shared by the planner's hot loops."""

    def __init__(self, model: ModelSpec, servers: Sequence[Server]):
        self.model = model
        self.servers = validate_servers(servers)
        self.num_blocks = model.num_blocks
        self.memory_bytes = np.array([s.memory_bytes for s in self.servers], dtype=np.int64)
        self.comm = np.array([s.comm_time_s for s in self.servers], dtype=np.float64)
        self.compute = np.array([s.compute_time_s for s in self.servers], dtype=np.float64)
        ranks = np.empty(len(self.servers), dtype=np.int64)
        ranks[np.argsort(np.array([s.id for s in self.servers], dtype=object), kind="stable")] = np.arange(
            len(self.servers)
        )
        self.id_rank = ranks
        """Position of each server's id in sorted id order: the deterministic tie-breaker."""

    def __len__(self) -> int:
        return len(self.servers)

    def max_blocks(self, c: int) -> np.ndarray:
        """m_j(c) for all servers (eq. 8)."""
        per_block = self.model.block_bytes + c * self.model.slot_bytes
        return np.minimum(self.memory_bytes // per_block, self.num_blocks)

    def gbp_cr_order(self, m: np.ndarray) -> np.ndarray:
        """Indices of servers with m_j ≥ 1 in GBP-CR order: ascending (t̃_j, id)."""
        idx = np.flatnonzero(m > 0)
        mj = m[idx].astype(np.float64)
        ttilde = (self.comm[idx] + self.compute[idx] * mj) / mj
        mant, expo = np.frexp(ttilde)
        key = np.ldexp(np.round(mant * 2.0**40), expo - 40)
        return idx[np.lexsort((self.id_rank[idx], key))]


@dataclass
class ChainRun:
    """The raw result of GBP-CR's chain-forming loop over one server order (internal, mutable)."""

    order: list[int]
    """Servers processed, in order."""
    starts: list[int]
    """0-based first block of each processed server."""
    blocks: list[int]
    """m_j(c) of each processed server."""
    chain_ends: list[int]
    """For each complete chain, the number of processed servers when it completed."""
    chain_times: list[float]
    """GBP-CR's conservative T_k = Σ t_j(c) of each complete chain."""
    cumulative_rates: list[float]
    """ν̂ after each complete chain."""

    def num_processed(self, num_chains: int | None) -> int:
        """Servers placed when the loop stops after ``num_chains`` chains (None: all processed)."""
        return len(self.order) if num_chains is None else self.chain_ends[num_chains - 1]

    def chains_needed(self, requirement: float) -> int | None:
        """K = the fewest leading chains with ν̂ ≥ requirement, or None if never reached."""
        lo, hi = 0, len(self.cumulative_rates)
        while lo < hi:  # first index with cumulative >= requirement
            mid = (lo + hi) // 2
            if self.cumulative_rates[mid] >= requirement:
                hi = mid
            else:
                lo = mid + 1
        return lo + 1 if lo < len(self.cumulative_rates) else None


def run_chain_loop(
    blocks_per_server: np.ndarray,
    comm: np.ndarray,
    compute: np.ndarray,
    order: Sequence[int],
    num_blocks: int,
    requirement: float | None,
) -> ChainRun:
    """GBP-CR's loop (§4.2) over ``order``; stops once ν̂ ≥ ``requirement`` (never if None).

    Per server j: start = min(a, L − m_j) (shift back), T += t_j, a = min(a + m_j, L) (0-based next block);
    a chain is complete when a reaches L.
    """
    run = ChainRun([], [], [], [], [], [])
    a = 0
    elapsed = 0.0
    scaled_rate = 0.0
    processed = 0
    L = num_blocks
    for j in order:
        j = int(j)
        m = int(blocks_per_server[j])
        if m <= 0:
            continue
        run.order.append(j)
        run.starts.append(min(a, L - m))
        run.blocks.append(m)
        processed += 1
        elapsed += float(comm[j]) + float(compute[j]) * m
        a = min(a + m, L)
        if a >= L:
            scaled_rate += 1.0 / elapsed
            run.chain_ends.append(processed)
            run.chain_times.append(elapsed)
            run.cumulative_rates.append(scaled_rate)
            if requirement is not None and scaled_rate >= requirement:
                break
            a = 0
            elapsed = 0.0
    return run


def placement_from_run(run: ChainRun, num_servers: int, num_processed: int) -> Placement:
    """The placement made by the first ``num_processed`` servers of a run; everyone else is unused."""
    spans: list[Span | None] = [None] * num_servers
    for j, start, m in zip(run.order[:num_processed], run.starts, run.blocks):
        spans[j] = (start, start + m)
    return Placement(tuple(spans))


@dataclass(frozen=True)
class GbpCrResult:
    """Output of GBP-CR for one c (§4.1)."""

    c: int
    placement: Placement
    chains: tuple[tuple[str, ...], ...]
    """The complete disjoint chains S_1..S_K (server ids), in the order built."""
    chain_times: tuple[float, ...]
    """GBP-CR's conservative T_k = Σ_{j∈S_k} t_j(c) (an upper bound on eq. 2)."""
    scaled_rate: float
    """ν̂ = Σ_k 1/T_k; c·ν̂ is the rate Lemma 3.2 guarantees."""
    requirement: float
    """λ/(ρ̄·c)."""
    requirement_met: bool
    feasible: bool
    """Σ_j m_j(c) ≥ L: at least one complete chain is possible."""

    @property
    def num_chains(self) -> int | None:
        """K(c) of eq. (13): chains built before stopping, None (∞) when the requirement is not met."""
        return len(self.chains) if self.requirement_met else None


def _result_from_run(
    arrays: SwarmArrays, c: int, run: ChainRun, requirement: float, feasible: bool
) -> GbpCrResult:
    met = bool(run.cumulative_rates) and run.cumulative_rates[-1] >= requirement
    placement = placement_from_run(run, len(arrays), len(run.order))
    ids = [s.id for s in arrays.servers]
    chains = []
    begin = 0
    for end in run.chain_ends:
        chains.append(tuple(ids[j] for j in run.order[begin:end]))
        begin = end
    return GbpCrResult(
        c=c,
        placement=placement,
        chains=tuple(chains),
        chain_times=tuple(run.chain_times),
        scaled_rate=run.cumulative_rates[-1] if run.cumulative_rates else 0.0,
        requirement=requirement,
        requirement_met=met,
        feasible=feasible,
    )


def gbp_cr(
    model: ModelSpec,
    servers: Sequence[Server],
    c: int,
    arrival_rate: float,
    target_load: float = DEFAULT_TARGET_LOAD,
    *,
    form_all_chains: bool = False,
    order: Callable[[SwarmArrays, np.ndarray], Sequence[int]] | None = None,
    arrays: SwarmArrays | None = None,
) -> GbpCrResult:
    """Run GBP-CR (Alg. 1) with required capacity ``c`` ≥ 1.

    ``form_all_chains`` ignores the stopping rule (§15.4 option). ``order`` replaces the t̃ order (used by
    the random-placement baseline, §12.5). If Σ m_j(c) < L no chain is possible: the result has an empty
    placement and ``feasible=False``. If servers run out the placement is still returned, including an
    incomplete last chain whose servers keep their spans (§4.3).
    """
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
        raise ValueError(f"c must be an integer >= 1, got {c!r}")
    validate_load(arrival_rate, target_load)
    arrays = arrays or SwarmArrays(model, servers)
    m = arrays.max_blocks(int(c))
    requirement = arrival_rate / (target_load * c)
    feasible = int(m.sum()) >= model.num_blocks
    if not feasible:
        empty = ChainRun([], [], [], [], [], [])
        return _result_from_run(arrays, int(c), empty, requirement, False)
    server_order = arrays.gbp_cr_order(m) if order is None else order(arrays, m)
    run = run_chain_loop(
        m, arrays.comm, arrays.compute, server_order, model.num_blocks, None if form_all_chains else requirement
    )
    return _result_from_run(arrays, int(c), run, requirement, True)
