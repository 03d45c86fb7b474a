"""Incremental re-planning under churn (issue 20, item 5): keep the survivors' ranges, repair what broke.

When servers leave and join, a fresh plan (auto or GBP-CR from scratch) usually moves many ranges, and
every server whose range changes reloads it (Chainswarm's and petals' servers both reload the whole new
range). :func:`incremental_replan` instead

1. **keeps** every surviving server's span (0 blocks loaded);
2. **repairs** the chains of the previous plan that lost servers: each missing segment [a, e) of a chain
   (the blocks its departed servers processed, consecutive ones merged) goes to one idle server (a joiner
   or a survivor without blocks) that can hold it with cache for the chain's c_k jobs — the fastest such
   server, τc_j + τp_j·(e − a); failing that, for at least one job; failing that, the segment is split
   over several idle servers, most blocks first. Chains are repaired fastest first, and only as many as
   needed: the fewest (a prefix of that order) whose placement predicts a mean response time within
   ``tolerance`` of repairing them all. A chain that cannot be repaired is left broken (GCA uses what
   remains);
3. **falls back** to the fresh plan only when it is *clearly* better: its predicted mean response time
   (planner/auto_score.py) is below the repaired plan's by more than ``tolerance`` (relative) *and* the
   swarm keeps serving while the fresh plan loads — the servers whose span the fresh plan leaves alone
   (the others are loading) must predict a response time no worse, within ``tolerance``, than the
   servers the repair leaves alone —; or the repaired placement forms no chain (and the fresh one does);
   or the repair would load more blocks than the fresh plan. When no placement of these servers forms a
   chain, the fresh plan holds nothing.

Block moves are counted as blocks loaded: a server whose span changes (or that gets a span) loads its
whole new span; an unchanged span loads nothing. So the result never loads more blocks than a fresh
plan that forms a chain.

Pure: no I/O, deterministic for a given input (ties by server order).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from planner.allocation import Allocation, gca
from planner.auto import auto_placement
from planner.auto_score import predict
from planner.model import Chain, ModelSpec, Placement, Server, Span, free_slots, max_blocks, validate_servers
from planner.placement import DEFAULT_TARGET_LOAD
from planner.tuning import InfeasibleError

DEFAULT_TOLERANCE = 0.05
"""The fresh plan must predict a mean response time this much lower (relative) to be worth its moves."""

FreshPlanner = Callable[[ModelSpec, Sequence[Server], float, float], Placement]
"""(model, servers, λ, ρ̄) → placement from scratch."""


def auto_fresh(model: ModelSpec, servers: Sequence[Server], arrival_rate: float, target_load: float) -> Placement:
    """A fresh ``placement="auto"`` plan (the default fallback)."""
    return auto_placement(model, servers, arrival_rate, target_load).best.placement


@dataclass(frozen=True)
class Replan:
    """The placement to run next, its chains, and what it costs."""

    placement: Placement
    allocation: Allocation
    strategy: str
    """"kept" (nothing to repair), "repaired", or "fresh"."""
    blocks_loaded: int
    """Σ over servers whose span changed of their new span's length (see the module docstring)."""
    predicted: float
    """Predicted mean response time (s) of ``allocation`` at the planning λ (inf: no chain / unstable)."""
    fresh_blocks_loaded: int
    fresh_predicted: float


def blocks_loaded(current: Mapping[str, Span | None], servers: Sequence[Server], placement: Placement) -> int:
    """Blocks the servers must load to go from ``current`` (spans by server id) to ``placement``."""
    total = 0
    for s, span in zip(servers, placement.spans):
        if span is not None and current.get(s.id) != span:
            total += span[1] - span[0]
    return total


def _score(allocation: Allocation, arrival_rate: float) -> float:
    chains = allocation.chains
    if not chains:
        return math.inf
    return predict([c.rate for c in chains], [c.capacity for c in chains], arrival_rate).value


def _transition_score(model: ModelSpec, servers: Sequence[Server], current: Mapping[str, Span | None],
                      target: Placement, arrival_rate: float) -> float:
    """Predicted response while ``target`` loads: only servers whose span does not change serve."""
    spans = tuple(span if span is not None and current.get(s.id) == span else None
                  for s, span in zip(servers, target.spans))
    return _score(gca(model, servers, Placement(spans)), arrival_rate)


def missing_segments(chain: Chain, alive: set[str]) -> list[tuple[int, int]]:
    """The processed blocks of ``chain`` whose servers are gone, consecutive segments merged."""
    out: list[tuple[int, int]] = []
    for sid, (a, e) in zip(chain.servers, chain.spans):
        if sid in alive:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], e)
        else:
            out.append((a, e))
    return out


def _fill(model: ModelSpec, servers: Sequence[Server], idle: list[int], segment: Span, sessions: int
          ) -> list[tuple[int, Span]] | None:
    """Idle servers to host ``segment``: one server (fastest, cache for ``sessions`` jobs, else for one),
    else several (most blocks first); None when the idle servers cannot cover it."""
    a, e = segment
    n = e - a
    for need in (sessions, 1):
        fits = [j for j in idle if free_slots(servers[j], model, n) >= n * need]
        if fits:
            j = min(fits, key=lambda j: (servers[j].comm_time_s + servers[j].compute_time_s * n, j))
            return [(j, segment)]
    cap = {j: min(n, max_blocks(servers[j], model, 1)) for j in idle}  # cache for one job per block
    out, start = [], a
    for j in sorted(idle, key=lambda j: (-cap[j], servers[j].compute_time_s, j)):
        if start >= e or cap[j] == 0:
            break
        take = min(cap[j], e - start)
        out.append((j, (start, start + take)))
        start += take
    return out if start >= e else None


def repair_steps(model: ModelSpec, servers: Sequence[Server], current: Mapping[str, Span | None],
                 chains: Sequence[Chain]) -> tuple[list[Span | None], list[list[tuple[int, Span]]]]:
    """Survivors' spans (by server index) and, for each chain of ``chains`` that lost servers and can be
    repaired, fastest first, the (idle server, span) fills that repair it."""
    spans: list[Span | None] = [current.get(s.id) for s in servers]
    alive = {s.id for s, span in zip(servers, spans) if span is not None}
    idle = [j for j, span in enumerate(spans) if span is None]
    steps = []
    for chain in sorted(chains, key=lambda c: (c.service_time, c.servers)):
        fills: list[tuple[int, Span]] | None = []
        pool = list(idle)
        for segment in missing_segments(chain, alive):
            got = _fill(model, servers, pool, segment, chain.capacity)
            if got is None:
                fills = None
                break
            fills += got
            used = {k for k, _ in got}
            pool = [j for j in pool if j not in used]
        if not fills:  # intact, or cannot be repaired: left as it is, the idle servers kept for others
            continue
        steps.append(fills)
        alive |= {servers[j].id for j, _ in fills}
        idle = pool
    return spans, steps


def repair(model: ModelSpec, servers: Sequence[Server], current: Mapping[str, Span | None],
           chains: Sequence[Chain], steps: int | None = None) -> Placement:
    """Survivors keep their spans; the first ``steps`` repairable chains (all: None) of ``chains`` get their
    missing segments from idle servers."""
    spans, fills = repair_steps(model, servers, current, chains)
    for step in fills[:steps]:
        for j, span in step:
            spans[j] = span
    return Placement(tuple(spans))


def incremental_replan(model: ModelSpec, servers: Sequence[Server], current: Mapping[str, Span | None],
                       chains: Sequence[Chain], arrival_rate: float, target_load: float = DEFAULT_TARGET_LOAD,
                       *, tolerance: float = DEFAULT_TOLERANCE, fresh: FreshPlanner = auto_fresh) -> Replan:
    """The next plan for ``servers`` (the swarm now) given the spans ``current`` servers hold (by id;
    servers that left are simply absent from ``servers``) and the ``chains`` of the plan in force."""
    servers = validate_servers(servers)
    try:
        fresh_placement = fresh(model, servers, arrival_rate, target_load)
    except InfeasibleError:  # no chain from scratch either: the fresh plan is to hold nothing
        fresh_placement = Placement((None,) * len(servers))
    fresh_alloc = gca(model, servers, fresh_placement)
    fresh_loaded = blocks_loaded(current, servers, fresh_placement)
    fresh_score = _score(fresh_alloc, arrival_rate)
    placement, alloc, score = _fewest_repairs(model, servers, current, chains, arrival_rate, tolerance)
    loaded = blocks_loaded(current, servers, placement)
    strategy = "kept" if loaded == 0 else "repaired"
    clearly_better = fresh_score < score * (1 - tolerance) and (
        _transition_score(model, servers, current, fresh_placement, arrival_rate)
        <= _transition_score(model, servers, current, placement, arrival_rate) * (1 + tolerance))
    if fresh_alloc.chains and (not alloc.chains or clearly_better or loaded > fresh_loaded):
        placement, alloc, loaded, score, strategy = fresh_placement, fresh_alloc, fresh_loaded, fresh_score, "fresh"
    return Replan(placement, alloc, strategy, loaded, score, fresh_loaded, fresh_score)


def _fewest_repairs(model, servers, current, chains, arrival_rate: float, tolerance: float
                    ) -> tuple[Placement, Allocation, float]:
    """The repair of the fewest chains (fastest first) that predicts within ``tolerance`` of repairing all
    of them (all of them when that one is unstable). Found by bisection over the number of chains
    repaired — more repaired chains only add capacity, so the prediction falls as the number grows —:
    O(log K) GCA runs and predictions for K broken chains."""
    base, steps = repair_steps(model, servers, current, chains)
    memo: dict[int, tuple[Placement, Allocation, float]] = {}

    def option(k: int) -> tuple[Placement, Allocation, float]:
        if k not in memo:
            spans = list(base)
            for step in steps[:k]:
                for j, span in step:
                    spans[j] = span
            placement = Placement(tuple(spans))
            alloc = gca(model, servers, placement)
            memo[k] = (placement, alloc, _score(alloc, arrival_rate))
        return memo[k]

    full = option(len(steps))
    if not math.isfinite(full[2]):
        return full
    good = lambda k: bool(option(k)[1].chains) and option(k)[2] <= full[2] * (1 + tolerance)  # noqa: E731
    lo, hi = 0, len(steps)  # the answer is in [lo, hi]; good(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if good(mid):
            hi = mid
        else:
            lo = mid + 1
    return option(lo)
