"""Tuning the cache reservation c (spec §5).

For every c in [c_max] = {1, …, ⌊(max_j M_j − s_m)/s_c⌋} the tuner runs GBP-CR(c) with its stopping rule,
GCA on the resulting placement, and the Theorem 3.7 bounds on GCA's chains at the planning λ, and records
one :class:`Candidate` row: c, K(c), g(c) = c·K(c), ν(c), lower and upper bounds. Then it picks

* ``"lower-bound"`` (default, §5.3): argmin of the Theorem 3.7 lower bound on mean response time;
* ``"upper-bound"``: argmin of the upper bound;
* ``"surrogate"`` (§5.2, eq. 14): argmin of g(c) = c·K(c);

ties to the smaller c. If no c has a finite value the tuner falls back to the c with the largest ν(c)
(ties to the smaller c) and flags the result ``overloaded`` when λ ≥ ν there (§5.3, §15.8).

Speed (results are identical to running everything per c): m_j(c) is piecewise constant in c, so the c
range splits into intervals with the same m-vector, hence the same GBP-CR server order and chain sequence;
within an interval only the stopping point K(c) moves (the requirement λ/(ρ̄·c) falls as c grows) and is
found by bisection. GCA and the bounds depend only on the placement, so they are memoized by placement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from planner.allocation import Allocation, allocate
from planner.batch_bounds import allocation_bounds
from planner.model import ModelSpec, Server, largest_capacity
from planner.placement import (
    DEFAULT_TARGET_LOAD,
    ChainRun,
    GbpCrResult,
    SwarmArrays,
    _result_from_run,
    run_chain_loop,
    validate_load,
)

TUNINGS = ("lower-bound", "surrogate", "upper-bound")

OrderFn = Callable[[SwarmArrays, np.ndarray], Sequence[int]]


class InfeasibleError(ValueError):
    """No server set can hold the model with at least one cache slot per block (no chain for any c)."""


@dataclass(frozen=True)
class Candidate:
    """One row of the c-tuning table (§5, §6.7)."""

    c: int
    num_chains: int | None
    """K(c) of eq. (13); None stands for ∞ (GBP-CR never met λ/(ρ̄·c))."""
    g: int | None
    """g(c) = c·K(c), eq. (13); None for ∞."""
    total_rate: float
    """ν(c) = Σ c_k·μ_k of GCA's chains on GBP-CR(c)'s placement (0 when no chain exists)."""
    total_capacity: int
    lower: float | None
    """Theorem 3.7 lower bound on mean response time (s) at the planning λ; None when λ ≥ ν(c)."""
    upper: float | None
    """Theorem 3.7 upper bound (s); None when λ ≥ ν(c)."""
    feasible: bool
    """Σ_j m_j(c) ≥ L (GBP-CR can form at least one chain)."""

    def to_dict(self) -> dict:
        return {
            "c": self.c,
            "K": self.num_chains,
            "g": self.g,
            "total_rate": self.total_rate,
            "lower": self.lower,
            "upper": self.upper,
        }


@dataclass(frozen=True)
class TuningResult:
    """The chosen c with everything computed for it, so nothing is recomputed downstream."""

    c: int
    tuning: str
    """How c was chosen: "lower-bound", "surrogate", "upper-bound" or "fixed"."""
    candidates: tuple[Candidate, ...]
    overloaded: bool
    """λ ≥ ν(c) for the chosen c (no candidate is stable)."""
    gbp_cr: GbpCrResult
    allocation: Allocation

    @property
    def candidate(self) -> Candidate:
        return next(cand for cand in self.candidates if cand.c == self.c)


class _Evaluation:
    """One c's GBP-CR result (built lazily: it is O(J)), GCA allocation and candidate row."""

    __slots__ = ("_arrays", "_run", "_requirement", "_feasible", "_gbp", "allocation", "candidate")

    def __init__(self, arrays, run, requirement, feasible, allocation, candidate):
        self._arrays, self._run, self._requirement, self._feasible = arrays, run, requirement, feasible
        self._gbp = None
        self.allocation: Allocation = allocation
        self.candidate: Candidate = candidate

    @property
    def gbp(self) -> GbpCrResult:
        if self._gbp is None:
            self._gbp = _result_from_run(
                self._arrays, self.candidate.c, self._run, self._requirement, self._feasible
            )
        return self._gbp


def _c_intervals(arrays: SwarmArrays, cmax: int) -> list[tuple[int, int]]:
    """Split [1, cmax] into maximal intervals on which every m_j(c) is constant.

    m_j(c) ≥ k ⇔ c ≤ ⌊(M_j − k·s_m)/(k·s_c)⌋ =: b_jk, so m-vectors change only right after some b_jk.
    """
    model = arrays.model
    k = np.arange(1, model.num_blocks + 1, dtype=np.int64)
    breaks = (arrays.memory_bytes[:, None] - k[None, :] * model.block_bytes) // (k[None, :] * model.slot_bytes)
    breaks = np.unique(breaks[(breaks >= 1) & (breaks < cmax)])
    starts = [1] + [int(b) + 1 for b in breaks]
    ends = starts[1:] + [cmax + 1]
    return [(lo, hi - 1) for lo, hi in zip(starts, ends)]


def iter_candidates(
    model: ModelSpec,
    servers: Sequence[Server],
    arrival_rate: float,
    target_load: float = DEFAULT_TARGET_LOAD,
    *,
    order: OrderFn | None = None,
    arrays: SwarmArrays | None = None,
    c_values: Sequence[int] | None = None,
) -> Iterator[_Evaluation]:
    """Evaluate GBP-CR(c) + GCA + bounds for c = 1..c_max (or the given ``c_values``), in increasing c."""
    validate_load(arrival_rate, target_load)
    arrays = arrays or SwarmArrays(model, servers)
    cmax = int(max(0, (int(arrays.memory_bytes.max()) - model.block_bytes) // model.slot_bytes))
    wanted = None if c_values is None else sorted(set(int(c) for c in c_values))
    top = cmax if wanted is None else max(max(wanted), 1)
    memo: dict[tuple, tuple[Allocation, float, int, float | None, float | None]] = {}
    L = model.num_blocks
    ids = [s.id for s in arrays.servers]
    comm = arrays.comm.tolist()
    compute = arrays.compute.tolist()
    ranks = arrays.id_rank.tolist()
    empty_run = ChainRun([], [], [], [], [], [])
    no_slots = tuple(0 for _ in ids)
    for lo, hi in _c_intervals(arrays, max(top, 1)):
        cs = range(lo, hi + 1) if wanted is None else [c for c in wanted if lo <= c <= hi]
        if not cs:
            continue
        m = arrays.max_blocks(lo)
        feasible = int(m.sum()) >= L
        if feasible:
            server_order = arrays.gbp_cr_order(m) if order is None else order(arrays, m)
            run = run_chain_loop(
                m, arrays.comm, arrays.compute, server_order, L, arrival_rate / (target_load * cs[0])
            )
        for c in cs:
            requirement = arrival_rate / (target_load * c)
            if not feasible:
                alloc = Allocation((), no_slots, no_slots)
                cand = Candidate(c, None, None, 0.0, 0, None, None, False)
                yield _Evaluation(arrays, empty_run, requirement, False, alloc, cand)
                continue
            num_chains = run.chains_needed(requirement)
            processed = run.num_processed(num_chains)
            sub = _truncate(run, processed)
            key = tuple(zip(sub.order, sub.starts, sub.blocks))
            if key not in memo:
                alloc = _allocate_run(arrays, sub, ids, comm, compute, ranks)
                bounds = allocation_bounds(alloc.chains, arrays.servers, arrival_rate)
                memo[key] = (
                    alloc,
                    alloc.total_rate,
                    alloc.total_capacity,
                    None if bounds is None else bounds.lower,
                    None if bounds is None else bounds.upper,
                )
            alloc, nu, cap, lower, upper = memo[key]
            cand = Candidate(
                c=c,
                num_chains=num_chains,
                g=None if num_chains is None else c * num_chains,
                total_rate=nu,
                total_capacity=cap,
                lower=lower,
                upper=upper,
                feasible=True,
            )
            yield _Evaluation(arrays, sub, requirement, True, alloc, cand)


def _allocate_run(arrays: SwarmArrays, run: ChainRun, ids, comm, compute, ranks) -> Allocation:
    """GCA on the placement of a (truncated) GBP-CR run, with M̃_j computed vectorized."""
    model = arrays.model
    blocks = np.zeros(len(ids), dtype=np.int64)
    blocks[run.order] = run.blocks
    budget = ((arrays.memory_bytes - blocks * model.block_bytes) // model.slot_bytes).tolist()
    placed = [(j, a, a + m) for j, a, m in zip(run.order, run.starts, run.blocks)]
    return allocate(model.num_blocks, ids, placed, budget, comm, compute, ranks, servers=arrays.servers)


def _truncate(run: ChainRun, processed: int) -> ChainRun:
    """The run as it stands after ``processed`` servers (GBP-CR stopped earlier)."""
    n_chains = sum(1 for e in run.chain_ends if e <= processed)
    return ChainRun(
        order=run.order[:processed],
        starts=run.starts[:processed],
        blocks=run.blocks[:processed],
        chain_ends=run.chain_ends[:n_chains],
        chain_times=run.chain_times[:n_chains],
        cumulative_rates=run.cumulative_rates[:n_chains],
    )


def _argmin(values: list[tuple[float | None, int]]) -> int | None:
    """Index of the smallest finite value; ties to the earliest (smaller c)."""
    best, best_i = math.inf, None
    for i, (v, _) in enumerate(values):
        if v is not None and v < best:
            best, best_i = v, i
    return best_i


def tune_c(
    model: ModelSpec,
    servers: Sequence[Server],
    arrival_rate: float,
    target_load: float = DEFAULT_TARGET_LOAD,
    *,
    tuning: str = "lower-bound",
    order: OrderFn | None = None,
    arrays: SwarmArrays | None = None,
    min_c: int = 1,
) -> TuningResult:
    """Choose c by ``tuning`` ∈ {"lower-bound", "surrogate", "upper-bound"} over c = 1..c_max.

    ``min_c`` = c_min (default 1: every c of [c_max] qualifies, the paper's rule): only candidates whose GCA
    forms some chain k with capacity c_k ≥ c_min qualify, e.g. the slots one chain needs to hold the longest
    session when a slot is sized for an expected-length session (token admission). Every c is still evaluated
    (the candidate table is complete); when no candidate qualifies, the choice is over all of them.
    Raises InfeasibleError if no c admits a complete chain.
    """
    if tuning not in TUNINGS:
        raise ValueError(f"tuning must be one of {', '.join(TUNINGS)}, got {tuning!r}")
    evaluations = list(
        iter_candidates(model, servers, arrival_rate, target_load, order=order, arrays=arrays)
    )
    candidates = tuple(ev.candidate for ev in evaluations)
    if not any(cand.feasible and cand.total_capacity > 0 for cand in candidates):
        raise InfeasibleError(_infeasible_message(model, servers))
    allowed = [ev for ev in evaluations if largest_capacity(ev.allocation.chains) >= min_c] or evaluations
    chosen = allowed[_pick([ev.candidate for ev in allowed], tuning)]
    return TuningResult(
        c=chosen.candidate.c,
        tuning=tuning,
        candidates=candidates,
        overloaded=chosen.candidate.lower is None,
        gbp_cr=chosen.gbp,
        allocation=chosen.allocation,
    )


def _pick(candidates: Sequence[Candidate], tuning: str) -> int:
    """Index of the candidate ``tuning`` chooses; when no value is finite, the largest ν(c) (ties: smaller c)."""
    if tuning == "lower-bound":
        pick = _argmin([(cand.lower, cand.c) for cand in candidates])
    elif tuning == "upper-bound":
        pick = _argmin([(cand.upper, cand.c) for cand in candidates])
    else:
        pick = _argmin([(None if cand.g is None else float(cand.g), cand.c) for cand in candidates])
    if pick is None:
        pick = max(range(len(candidates)), key=lambda i: (candidates[i].total_rate, -candidates[i].c))
    return pick


def evaluate_c(
    model: ModelSpec,
    servers: Sequence[Server],
    c: int,
    arrival_rate: float,
    target_load: float = DEFAULT_TARGET_LOAD,
    *,
    order: OrderFn | None = None,
    arrays: SwarmArrays | None = None,
) -> TuningResult:
    """GBP-CR + GCA + bounds at a fixed c (``tuning="fixed"``, one candidate row).

    Raises InfeasibleError if GBP-CR(c) cannot form a chain (Σ_j m_j(c) < L).
    """
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
        raise ValueError(f"c must be an integer >= 1, got {c!r}")
    (ev,) = list(
        iter_candidates(model, servers, arrival_rate, target_load, order=order, arrays=arrays, c_values=[c])
    )
    if not ev.candidate.feasible or ev.candidate.total_capacity == 0:
        held = sum(min(s.memory_bytes // (model.block_bytes + c * model.slot_bytes), model.num_blocks)
                   for s in servers)
        raise InfeasibleError(
            f"c={c} is infeasible: with cache for {c} jobs per block the servers hold "
            f"{held} of {model.num_blocks} blocks"
        )
    return TuningResult(
        c=int(c),
        tuning="fixed",
        candidates=(ev.candidate,),
        overloaded=ev.candidate.lower is None,
        gbp_cr=ev.gbp,
        allocation=ev.allocation,
    )


def _infeasible_message(model: ModelSpec, servers: Sequence[Server]) -> str:
    held = sum(
        min(s.memory_bytes // (model.block_bytes + model.slot_bytes), model.num_blocks) for s in servers
    )
    return (
        f"no server set can hold the model: with one cache slot per block the servers hold {held} "
        f"of {model.num_blocks} blocks"
    )
