"""``placement="auto"``: pick the placement with the lowest predicted mean response time (issue 20).

Everything is in three steps, each readable on its own:

1. **Candidates** (:func:`seed_candidates`), in a fixed order:
   * ``gbp-cr c=…``: GBP-CR for every feasible c (one candidate per distinct placement; the tuner's
     c*, the lower-bound argmin of §5.3, is marked and always scored);
   * ``hop-min c=…``: every server keeps cache for at least c jobs per block; servers are taken in
     GBP-CR's t̃ order and stacked into as many chains as they can fill (no stopping rule: leftover
     capacity is free under JFFC). Inside each chain the blocks are re-split so that the chain has
     the fewest hops its servers allow and the largest common capacity x (Σ m_j(x) ≥ L), fastest
     servers filled first — fast servers get as many blocks as their memory allows while the chain
     keeps the cache the load needs;
   * ``fastest c=…`` (the first ``fastest_cs`` c of hop-min): the same, but the first chain is the exact
     fastest chain whose servers hold cache for c jobs (a knapsack DP over the servers,
     planner/fastest_chain.py), so the T_min chain of the lower bound is always a candidate;
   * ``petals`` and ``whole-model`` (planner/baselines.py), with GCA over their full memory.
   GCA runs on each, and Theorem 3.7's bounds bracket each one's mean response time.
2. **Score** (``score``; default :func:`planner.auto_score.predict`, Poisson arrivals): exact CTMC when
   small, else the bounds when tight, else a fixed-seed simulation. Only candidates whose lower bound is
   below the best upper bound can win; the ``refine`` best of them by lower bound (plus GBP-CR(c*)) are
   scored. When the arrival process is known to be bursty, :class:`planner.auto_trace.TraceScore` scores
   by JFFC on a sample of it instead (Theorem 3.7's Poisson bounds then prune nothing).
3. **Local search** (:func:`_moves`) from the best candidate: move a range boundary between two
   consecutive servers of a fast chain, let one absorb its neighbour's part (one hop less), or swap
   two servers' spans; first improvement is kept, at most ``move_budget`` moves are evaluated.

The choice is the lowest score, ties to the earliest candidate (so GBP-CR(c*) wins ties). Deterministic
for a given input; the budgets (``refine``, ``move_budget``, ``hop_min_cs``, ``fastest_cs``) keep J = 1,000 under 1 s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from planner.allocation import Allocation, gca
from planner.auto_score import Prediction
from planner.auto_trace import POISSON, Scorer
from planner.baselines import petals_placement, whole_model_placement
from planner.bounds import response_time_bounds
from planner.fastest_chain import fastest_chain_caps
from planner.model import ModelSpec, Placement, Server, Span, free_slots, validate_servers
from planner.placement import DEFAULT_TARGET_LOAD, SwarmArrays, validate_load
from planner.tuning import _argmin, iter_candidates

HOP_MIN_HEADROOM = 3.0
"""hop-min stops adding chains once they guarantee this multiple of λ/ρ̄."""


@dataclass(frozen=True)
class Scored:
    """One evaluated placement."""

    label: str
    placement: Placement
    allocation: Allocation
    c: int | None
    lower: float
    """Theorem 3.7 lower bound (s); inf when λ ≥ ν."""
    upper: float
    prediction: Prediction | None = None
    """None: not scored (its lower bound shows it cannot win, or it fell outside the refine budget)."""

    @property
    def score(self) -> float:
        return math.inf if self.prediction is None else self.prediction.value


@dataclass(frozen=True)
class AutoResult:
    """The choice (``best``), the reference it must not lose to, the seeds and the local-search counts."""

    best: Scored
    baseline: Scored  # GBP-CR at the tuner's c*, always scored: best.score <= baseline.score
    candidates: tuple[Scored, ...]  # the seeds in their fixed order (scored or not)
    moves_tried: int
    moves_accepted: int


def auto_placement(model: ModelSpec, servers: Sequence[Server], arrival_rate: float,
                   target_load: float = DEFAULT_TARGET_LOAD, *, refine: int | None = None,
                   move_budget: int | None = None, hop_min_cs: int = 24, fastest_cs: int | None = None,
                   score: Scorer = POISSON) -> AutoResult:
    """Choose the placement (and GCA chains) with the lowest predicted mean response time.

    ``refine`` defaults to ``max(4, min(12, 1200 // J))`` scored seeds and ``move_budget`` to
    ``max(8, min(80, 8000 // J))`` local-search evaluations, ``fastest_cs`` to ``max(1, min(8, 2000 // J))``
    ``fastest`` candidates. Raises
    planner.tuning.InfeasibleError (via GBP-CR) when no chain can be formed at all.
    """
    servers = validate_servers(servers)
    validate_load(arrival_rate, target_load)
    arrays = SwarmArrays(model, servers)
    J = len(servers)
    budget = max(8, min(80, 8000 // J)) if move_budget is None else move_budget
    refine = max(4, min(12, 1200 // J)) if refine is None else refine
    fastest_cs = max(1, min(8, 2000 // J)) if fastest_cs is None else fastest_cs
    seeds, star = seed_candidates(model, servers, arrival_rate, target_load, arrays=arrays, hop_min_cs=hop_min_cs,
                                  fastest_cs=fastest_cs)
    if star is None:
        from planner.tuning import InfeasibleError, _infeasible_message

        raise InfeasibleError(_infeasible_message(model, servers))
    scored = _score_seeds(seeds, star, arrival_rate, refine, score)
    baseline = scored[star]
    best = min((s for s in scored if s.prediction is not None), key=lambda s: s.score)
    if not math.isfinite(best.score):
        best = baseline
    best, tried, accepted = _local_search(model, servers, best, arrival_rate, budget, score)
    return AutoResult(best, baseline, tuple(scored), tried, accepted)


# ------------------------------------------------------------------------------------------------
# 1. Candidates
# ------------------------------------------------------------------------------------------------


def _evaluate(model, servers, label: str, placement: Placement, c: int | None, arrival_rate: float,
              allocation: Allocation | None = None) -> Scored:
    alloc = gca(model, servers, placement) if allocation is None else allocation
    b = response_time_bounds([ch.rate for ch in alloc.chains], [ch.capacity for ch in alloc.chains], arrival_rate)
    lo, up = (math.inf, math.inf) if b is None else (b.lower, b.upper)
    return Scored(label, placement, alloc, c, lo, up)


def seed_candidates(model, servers, arrival_rate, target_load, *, arrays: SwarmArrays, hop_min_cs: int,
                    fastest_cs: int = 0) -> tuple[list[Scored], int | None]:
    """The seed candidates in their fixed order and the index of GBP-CR(c*) among them (None: no chain)."""
    seeds: list[Scored] = []
    index_of_alloc: dict[int, int] = {}
    evs = list(iter_candidates(model, servers, arrival_rate, target_load, arrays=arrays))
    cands = [ev.candidate for ev in evs]
    pick = _argmin([(cand.lower, cand.c) for cand in cands])
    if pick is None and any(c.feasible and c.total_capacity > 0 for c in cands):
        pick = max(range(len(cands)), key=lambda i: (cands[i].total_rate, -cands[i].c))
    star = None
    for i, ev in enumerate(evs):
        if not ev.candidate.feasible or ev.candidate.total_capacity == 0:
            continue
        key = id(ev.allocation)
        if key not in index_of_alloc:
            index_of_alloc[key] = len(seeds)
            cand = ev.candidate
            seeds.append(Scored(f"gbp-cr c={cand.c}", ev.gbp.placement, ev.allocation, cand.c,
                                math.inf if cand.lower is None else cand.lower,
                                math.inf if cand.upper is None else cand.upper))
        if i == pick:
            star = index_of_alloc[key]
            s = seeds[star]
            seeds[star] = Scored(f"gbp-cr c={ev.candidate.c} (c*)", s.placement, s.allocation, ev.candidate.c,
                                 s.lower, s.upper)
    seen = {s.placement for s in seeds}
    for label, c, placement in hop_min_placements(arrays, hop_min_cs, HOP_MIN_HEADROOM * arrival_rate / target_load,
                                                  fastest_first=fastest_cs):
        if placement not in seen:
            seen.add(placement)
            seeds.append(_evaluate(model, servers, label, placement, c, arrival_rate))
    for label, placement in (("petals", petals_placement(model, servers).placement),
                             ("whole-model", whole_model_placement(model, servers))):
        if placement not in seen and placement.placed():
            seen.add(placement)
            seeds.append(_evaluate(model, servers, label, placement, None, arrival_rate))
    return [s for s in seeds if s.allocation.chains], star


def hop_min_placements(arrays: SwarmArrays, how_many: int, enough_rate: float, *, fastest_first: int = 0
                       ) -> Iterator[tuple[str, int, Placement]]:
    """``hop-min`` placements for the first ``how_many`` distinct m-vectors c = 1, 2, … (see module doc),
    as (label, c, placement); for the first ``fastest_first`` of them also a ``fastest`` variant whose
    first chain is the exact fastest chain with cache for c jobs (planner/fastest_chain.py), the rest
    stacked as in hop-min.

    Chains stop once their guaranteed rate Σ x_k/T_k (x_k: the chain's common reservation, T_k: its
    time) reaches ``enough_rate``; the servers left over stay unused."""
    L = arrays.num_blocks
    model = arrays.model
    cmax = int(max(0, (int(arrays.memory_bytes.max()) - model.block_bytes) // model.slot_bytes))
    last = None
    done = 0
    for c in range(1, cmax + 1):
        if done >= how_many:
            return
        m = arrays.max_blocks(c)
        if int(m.sum()) < L:
            return
        key = m.tobytes()
        if key == last:
            continue
        last = key
        done += 1
        order = arrays.gbp_cr_order(m).tolist()
        placement = _stack_chains(arrays, order, m, c, cmax, enough_rate, [None] * len(arrays), 0.0)
        if placement is not None:
            yield f"hop-min c={c}", c, placement
        if done <= fastest_first:
            first = fastest_chain_caps(arrays, m)
            spans: list[Span | None] = [None] * len(arrays)
            for j, span in first.spans():
                spans[j] = span
            used = {j for j, _ in first.parts}
            placement = _stack_chains(arrays, [j for j in order if j not in used], m, c, cmax, enough_rate, spans,
                                      c / first.time)
            if placement is not None:
                yield f"fastest c={c}", c, placement


def _stack_chains(arrays: SwarmArrays, order: list[int], m: np.ndarray, c: int, cmax: int, enough_rate: float,
                  spans: list, rate: float) -> Placement | None:
    """Stack the servers of ``order`` into chains (hop-min) after the chains already in ``spans`` (of
    guaranteed rate ``rate``) until the rate reaches ``enough_rate``; None if no server got a span."""
    L = arrays.num_blocks
    chain: list[int] = []
    covered = 0
    for j in order:
        if rate >= enough_rate:
            break
        chain.append(j)
        covered += int(m[j])
        if covered >= L:
            rate += _split_chain(arrays, chain, c, cmax, spans)
            chain, covered = [], 0
    return Placement(tuple(spans)) if any(s is not None for s in spans) else None


def _split_chain(arrays: SwarmArrays, chain: list[int], c: int, cmax: int, spans: list) -> float:
    """Give ``chain`` (t̃ order) consecutive spans covering [0, L) with the largest common reservation
    x ≥ c (Σ m_j(x) ≥ L), fastest servers filled first; servers left without blocks stay unused.
    Returns x/T, the rate the chain guarantees."""
    L = arrays.num_blocks
    idx = np.asarray(chain)
    lo, hi = c, cmax
    while lo < hi:  # largest x with Σ_j m_j(x) ≥ L (monotone in x)
        mid = (lo + hi + 1) // 2
        if int(arrays.max_blocks(mid)[idx].sum()) >= L:
            lo = mid
        else:
            hi = mid - 1
    m = arrays.max_blocks(lo)[idx].tolist()
    start, time = 0, 0.0
    for j, mj in zip(chain, m):
        take = min(int(mj), L - start)
        if take > 0:
            spans[j] = (start, start + take)
            start += take
            time += float(arrays.comm[j] + arrays.compute[j] * take)
    return lo / time


# ------------------------------------------------------------------------------------------------
# 2. Scoring the seeds
# ------------------------------------------------------------------------------------------------


def _with_prediction(s: Scored, arrival_rate: float, score: Scorer, memo: dict | None = None) -> Scored:
    """``s`` with its score; ``memo`` caches predictions by the chains' (rates, capacities)."""
    chains = s.allocation.chains
    key = tuple((ch.service_time, ch.capacity) for ch in chains)
    p = None if memo is None else memo.get(key)
    if p is None:
        p = score([ch.rate for ch in chains], [ch.capacity for ch in chains], arrival_rate)
        if memo is not None:
            memo[key] = p
    return Scored(s.label, s.placement, s.allocation, s.c, s.lower, s.upper, p)


def _score_seeds(seeds: list[Scored], star: int, arrival_rate: float, refine: int, score: Scorer) -> list[Scored]:
    """Score GBP-CR(c*) and the ``refine`` seeds with the lowest lower bound among those that can win
    (lower bound below the best upper bound; under a non-Poisson score every stable seed can); the others
    keep ``prediction=None``."""
    best_upper = min(s.upper for s in seeds) if score.poisson else math.inf
    contenders = sorted((i for i, s in enumerate(seeds) if s.lower <= best_upper and math.isfinite(s.lower)),
                        key=lambda i: (seeds[i].lower, i))[:refine]
    out = list(seeds)
    for i in sorted(set(contenders) | {star}):
        out[i] = _with_prediction(seeds[i], arrival_rate, score)
    return out


# ------------------------------------------------------------------------------------------------
# 3. Local search
# ------------------------------------------------------------------------------------------------


def _local_search(model, servers, best: Scored, arrival_rate: float, budget: int, score: Scorer
                  ) -> tuple[Scored, int, int]:
    tried = accepted = 0
    memo: dict = {}
    improved = True
    while improved and tried < budget:
        improved = False
        seen = {best.placement}
        for label, spans in _moves(model, servers, best):
            if tried >= budget:
                break
            placement = Placement(tuple(spans))
            if placement in seen:
                continue
            seen.add(placement)
            tried += 1
            cand = _evaluate(model, servers, f"{best.label} + {label}", placement, best.c, arrival_rate)
            if not cand.allocation.chains or (score.poisson and cand.lower >= best.score):
                continue  # its (Poisson) score is at least its lower bound: no improvement possible
            cand = _with_prediction(cand, arrival_rate, score, memo)
            if cand.score < best.score * (1 - 1e-9):
                best, improved, accepted = cand, True, accepted + 1
                break
    return best, tried, accepted


def _fits(model: ModelSpec, server: Server, span: Span) -> bool:
    """The span lies in [0, L) and leaves cache for at least one job on all its blocks."""
    a, e = span
    return 0 <= a < e <= model.num_blocks and free_slots(server, model, e - a) >= e - a


def _moves(model: ModelSpec, servers: Sequence[Server], best: Scored, top_chains: int = 3):
    """Neighbouring placements of ``best``, in a fixed order: for the fastest ``top_chains`` GCA chains,
    absorb a neighbour's part (one hop less), move each internal range boundary by ±1, ±2, ±4 blocks,
    then swap a chain server's span with another server's (fastest-per-block servers first)."""
    index = {s.id: i for i, s in enumerate(servers)}
    spans = list(best.placement.spans)
    chains = best.allocation.chains[:top_chains]
    for ch in chains:
        hops = [(index[sid], span) for sid, span in zip(ch.servers, ch.spans)]
        for (i, (pa, pb)), (j, (qa, qb)) in zip(hops, hops[1:]):
            ai, aj = spans[i][0], spans[j][0]
            for who, new in ((i, (ai, qb)), (j, (min(aj, pa), qb))):  # i takes j's part / j takes i's part
                if _fits(model, servers[who], new):
                    out = list(spans)
                    out[who] = new
                    yield f"absorb {servers[who].id}", out
    for ch in chains:
        hops = [(index[sid], span) for sid, span in zip(ch.servers, ch.spans)]
        for (i, (pa, pb)), (j, (qa, qb)) in zip(hops, hops[1:]):
            for delta in (1, -1, 2, -2, 4, -4):
                b = pb + delta
                new_i, new_j = (spans[i][0], b), (min(spans[j][0], b) if delta < 0 else b, spans[j][1])
                if _fits(model, servers[i], new_i) and _fits(model, servers[j], new_j):
                    out = list(spans)
                    out[i], out[j] = new_i, new_j
                    yield f"boundary {servers[i].id}|{servers[j].id} {delta:+d}", out
    speed = sorted(range(len(servers)), key=lambda k: (servers[k].compute_time_s, servers[k].comm_time_s,
                                                        servers[k].id))
    for ch in chains:
        for sid in ch.servers:
            i = index[sid]
            for j in speed:
                if j == i or spans[j] == spans[i]:
                    continue
                if _fits(model, servers[j], spans[i]) and (spans[j] is None or _fits(model, servers[i], spans[j])):
                    out = list(spans)
                    out[i], out[j] = spans[j], spans[i]
                    yield f"swap {servers[i].id}<->{servers[j].id}", out
