"""Property tests (hypothesis) of the planner on random small swarms.

Times are multiples of 1/8 s, so chain times are exact binary sums and ties are real ties; this lets the
fast GCA be compared exactly with a brute-force textbook GCA.
"""
from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.allocation import gca
from planner.baselines import cg_bp, petals_placement, random_placement, whole_model_placement
from planner.bounds import exact_mean_occupancy, occupancy_bounds
from planner.model import (
    ModelSpec,
    Placement,
    Server,
    c_max,
    check_chain,
    check_memory,
    feasible_links,
    free_slots,
    max_blocks,
    processed_spans,
    chain_service_time,
)
from planner.placement import gbp_cr
from planner.tuning import iter_candidates, tune_c

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = 1e-9


@st.composite
def swarms(draw, max_servers: int = 6, equal_memory: bool = False):
    L = draw(st.integers(1, 6))
    model = ModelSpec(L, draw(st.sampled_from([0.5, 1.0, 1.5])), draw(st.sampled_from([0.125, 0.25, 0.5])))
    n = draw(st.integers(1, max_servers))
    shared = draw(st.integers(1, 24)) * 0.5
    servers = [
        Server(
            f"s{i}",
            shared if equal_memory else draw(st.integers(0, 24)) * 0.5,
            draw(st.integers(0, 16)) / 8,
            draw(st.integers(1, 16)) / 8,
        )
        for i in range(n)
    ]
    return model, servers


@st.composite
def arbitrary_placements(draw):
    """Any placement whose blocks fit memory (not necessarily GBP-CR's)."""
    model, servers = draw(swarms())
    spans = []
    for s in servers:
        most = min(max_blocks(s, model, 0), model.num_blocks)
        if most == 0 or draw(st.booleans()) is False and draw(st.integers(0, 3)) == 0:
            spans.append(None)
            continue
        m = draw(st.integers(1, most))
        start = draw(st.integers(0, model.num_blocks - m))
        spans.append((start, start + m))
    return model, servers, Placement(tuple(spans))


def reference_gca(model, servers, placement, budget=None):
    """Alg. 2 as written: explicit links, all j0→jE paths enumerated, ties (T, hops, ids)."""
    J, L = len(servers), model.num_blocks
    links = feasible_links(placement, L)
    residual = list(budget) if budget is not None else [
        free_slots(s, model, placement.num_blocks(i)) for i, s in enumerate(servers)
    ]
    out = []
    while True:
        usable = {}
        for link in links:
            if link.dst == J or residual[link.dst] >= link.num_blocks:
                usable.setdefault(link.src, []).append(link)
        paths = []

        def walk(node, path):
            if node == J:
                paths.append(list(path))
                return
            for link in usable.get(node, []):
                path.append(link)
                walk(link.dst, path)
                path.pop()

        walk(-1, [])
        if not paths:
            return out

        def key(path):
            hops = [lk for lk in path if lk.dst != J]
            t = sum(servers[lk.dst].comm_time_s + servers[lk.dst].compute_time_s * lk.num_blocks for lk in hops)
            return (t, len(hops), tuple(servers[lk.dst].id for lk in hops))

        best = min(paths, key=key)
        hops = [lk for lk in best if lk.dst != J]
        cap = min(residual[lk.dst] // lk.num_blocks for lk in hops)
        for lk in hops:
            residual[lk.dst] -= cap * lk.num_blocks
        out.append((key(best)[2], cap, key(best)[0]))


def assert_valid_allocation(model, servers, placement, alloc):
    check_memory(model, servers, placement, alloc.chains)  # eq. (1)/(3) on every server
    for total, used in zip(alloc.slots_total, alloc.slots_allocated):
        assert 0 <= used <= total
    for ch in alloc.chains:
        check_chain(ch, model, placement, servers)  # blocks 0..L-1 in order, first-host rule
        assert ch.capacity >= 1
        assert ch.spans[0][0] == 0 and ch.spans[-1][1] == model.num_blocks
        for (a, b), (c, d) in zip(ch.spans, ch.spans[1:]):
            assert b == c and a < b
        hosted = [placement.spans[[s.id for s in servers].index(sid)] for sid in ch.servers]
        assert processed_spans(hosted) == ch.spans
    times = [ch.service_time for ch in alloc.chains]
    for a, b in zip(times, times[1:]):  # fastest first
        assert a <= b * (1 + TOL)


@FAST
@given(swarms(), st.integers(1, 6), st.sampled_from([0.05, 0.3, 1.0, 5.0]), st.booleans())
def test_gbp_cr_and_gca_invariants(swarm, c, lam, all_chains):
    model, servers = swarm
    result = gbp_cr(model, servers, c, lam, 0.7, form_all_chains=all_chains)
    placement = result.placement
    placement.validate(model, servers)
    if not result.feasible:
        assert sum(max_blocks(s, model, c) for s in servers) < model.num_blocks
        assert placement.placed() == ()
        return
    # every GBP-CR server reserves cache for c jobs on each hosted block
    for i, s in enumerate(servers):
        m = placement.num_blocks(i)
        if m:
            assert m == max_blocks(s, model, c)
            assert free_slots(s, model, m) >= c * m
    alloc = gca(model, servers, placement)
    assert_valid_allocation(model, servers, placement, alloc)
    if result.chains:
        # each complete GBP-CR chain is a valid chain, and GCA's fastest is at least as fast as its fastest
        index = {s.id: i for i, s in enumerate(servers)}
        real_times = []
        for chain, conservative in zip(result.chains, result.chain_times):
            spans = processed_spans([placement.spans[index[sid]] for sid in chain])
            assert spans[0][0] == 0 and spans[-1][1] == model.num_blocks
            real = chain_service_time([servers[index[sid]] for sid in chain], spans)
            assert real <= conservative * (1 + TOL)
            real_times.append(real)
        assert alloc.chains
        assert alloc.chains[0].service_time <= min(real_times) * (1 + TOL)
        if result.requirement_met and not all_chains:
            assert result.scaled_rate >= result.requirement
            # the stopping rule: one chain fewer would not have met the requirement
            assert sum(1 / t for t in result.chain_times[:-1]) < result.requirement


@FAST
@given(swarms(), st.integers(1, 4))
def test_gca_matches_textbook_on_gbp_cr(swarm, c):
    model, servers = swarm
    result = gbp_cr(model, servers, c, 100.0, 0.7)
    alloc = gca(model, servers, result.placement)
    expected = reference_gca(model, servers, result.placement)
    assert [(ch.servers, ch.capacity) for ch in alloc.chains] == [(ids, cap) for ids, cap, _ in expected]
    assert [ch.service_time for ch in alloc.chains] == [t for _, _, t in expected]


@FAST
@given(arbitrary_placements())
def test_gca_any_placement(case):
    model, servers, placement = case
    alloc = gca(model, servers, placement)
    assert_valid_allocation(model, servers, placement, alloc)
    expected = reference_gca(model, servers, placement)
    assert [(ch.servers, ch.capacity) for ch in alloc.chains] == [(ids, cap) for ids, cap, _ in expected]
    # termination: with the final residuals no usable path is left
    assert reference_gca(model, servers, placement, budget=alloc.slots_free) == []


@settings(max_examples=25, deadline=None)
@given(swarms(max_servers=5), st.sampled_from([0.1, 0.6, 3.0]), st.sampled_from(["lower-bound", "surrogate", "upper-bound"]))
def test_tuning_matches_direct_computation(swarm, lam, how):
    """The interval/memo shortcuts in iter_candidates give exactly GBP-CR(c) + GCA for every c."""
    model, servers = swarm
    top = c_max(model, servers)
    assume(1 <= top <= 60)
    evaluations = list(iter_candidates(model, servers, lam, 0.7))
    assert [ev.candidate.c for ev in evaluations] == list(range(1, top + 1))
    for ev in evaluations:
        direct = gbp_cr(model, servers, ev.candidate.c, lam, 0.7)
        assert ev.gbp == direct
        assert ev.candidate.num_chains == direct.num_chains
        if direct.feasible:
            assert ev.allocation == gca(model, servers, direct.placement)
    if any(ev.candidate.feasible and ev.candidate.total_capacity for ev in evaluations):
        chosen = tune_c(model, servers, lam, 0.7, tuning=how)
        field = {"lower-bound": "lower", "upper-bound": "upper", "surrogate": "g"}[how]
        values = [(getattr(ev.candidate, field), ev.candidate.c) for ev in evaluations]
        finite = [(v, c) for v, c in values if v is not None]
        if finite:
            assert chosen.c == min(finite)[1]  # argmin, ties to the smaller c
        else:
            best_rate = max(ev.candidate.total_rate for ev in evaluations)
            assert chosen.candidate.total_rate == best_rate


@settings(max_examples=40, deadline=None)
@given(swarms(max_servers=5), st.sampled_from([0.1, 0.6, 3.0]), st.integers(1, 12))
def test_tuning_with_a_least_chain_capacity_picks_among_the_c_that_have_one(swarm, lam, need):
    """tune_c(min_c=n): the lower-bound argmin over the c whose GCA forms a chain of capacity >= n, or over all
    of them when none does; with n = 1 it is the paper's rule."""
    model, servers = swarm
    top = c_max(model, servers)
    assume(1 <= top <= 60)
    evaluations = list(iter_candidates(model, servers, lam, 0.7))
    assume(any(ev.candidate.feasible and ev.candidate.total_capacity for ev in evaluations))
    holding = [ev for ev in evaluations if max((ch.capacity for ch in ev.allocation.chains), default=0) >= need]
    chosen = tune_c(model, servers, lam, 0.7, min_c=need)
    pool = holding or evaluations
    finite = [(ev.candidate.lower, ev.candidate.c) for ev in pool if ev.candidate.lower is not None]
    if finite:
        assert chosen.c == min(finite)[1]
    else:
        assert chosen.candidate.total_rate == max(ev.candidate.total_rate for ev in pool)
    if holding:
        assert max(ch.capacity for ch in chosen.allocation.chains) >= need
    assert tune_c(model, servers, lam, 0.7, min_c=1).c == tune_c(model, servers, lam, 0.7).c


@st.composite
def chain_sets(draw):
    k = draw(st.integers(1, 4))
    rates = sorted((draw(st.integers(1, 20)) / 4 for _ in range(k)), reverse=True)
    caps = [draw(st.integers(1, 4)) for _ in range(k)]
    nu = sum(r * c for r, c in zip(rates, caps))
    lam = nu * draw(st.sampled_from([0.05, 0.3, 0.6, 0.9, 0.99]))
    return rates, caps, lam


@settings(max_examples=80, deadline=None)
@given(chain_sets())
def test_bounds_bracket_exact(case):
    rates, caps, lam = case
    lower, upper = occupancy_bounds(rates, caps, lam)
    exact = exact_mean_occupancy(rates, caps, lam)
    assert lower <= exact * (1 + 1e-7) + 1e-12
    assert exact <= upper * (1 + 1e-7) + 1e-12
    if len(rates) == 1 or len(set(rates)) == 1:  # all chains equal: M/M/C, bounds are exact
        assert lower == pytest.approx(exact, rel=1e-7)
        assert upper == pytest.approx(exact, rel=1e-7)


def _best_scaled_rate(times: list[float], group: int, k: int) -> float:
    """max Σ 1/T over k disjoint groups of ``group`` servers (brute force)."""
    best = -math.inf

    def rec(remaining: tuple[int, ...], left: int, acc: float):
        nonlocal best
        if left == 0:
            best = max(best, acc)
            return
        if len(remaining) < group * left:
            return
        first, rest = remaining[0], remaining[1:]
        rec(rest, left, acc)  # first unused
        for others in itertools.combinations(rest, group - 1):
            members = (first,) + others
            rec(tuple(x for x in rest if x not in others), left - 1, acc + 1 / sum(times[i] for i in members))

    rec(tuple(range(len(times))), k, 0.0)
    return best


@settings(max_examples=60, deadline=None)
@given(swarms(max_servers=7, equal_memory=True), st.integers(1, 3), st.floats(0.01, 3.0))
def test_equal_memory_gbp_cr_is_optimal(swarm, c, lam):
    """Theorem 3.4: with equal memories GBP-CR's K(c) is the optimum of problem (10)."""
    model, servers = swarm
    m = max_blocks(servers[0], model, c)
    assume(m >= 1)
    group = math.ceil(model.num_blocks / m)
    times = [s.comm_time_s + s.compute_time_s * m for s in servers]
    result = gbp_cr(model, servers, c, lam, 0.7)
    got = result.num_chains if result.num_chains is not None else math.inf

    def k_opt(requirement: float) -> float:
        for k in range(1, len(servers) // group + 1):
            if _best_scaled_rate(times, group, k) >= requirement:
                return k
        return math.inf

    req = lam / (0.7 * c)
    assert k_opt(req * (1 - 1e-9)) <= got <= k_opt(req * (1 + 1e-9))


@settings(max_examples=40, deadline=None)
@given(swarms(), st.integers(1, 3), st.integers(0, 5))
def test_baseline_placements_are_valid(swarm, c, seed):
    model, servers = swarm
    whole = whole_model_placement(model, servers)
    alloc = gca(model, servers, whole)
    assert_valid_allocation(model, servers, whole, alloc)
    for ch in alloc.chains:
        assert len(ch.servers) == 1
        s = servers[[x.id for x in servers].index(ch.servers[0])]
        expected = int((s.memory_bytes - model.num_blocks * model.block_bytes) // (model.num_blocks * model.slot_bytes))
        assert ch.capacity == expected
    petals = petals_placement(model, servers, seed=seed)
    alloc = gca(model, servers, petals.placement, slot_budget=petals.slot_pool)
    assert_valid_allocation(model, servers, petals.placement, alloc)
    assert all(a <= p for a, p in zip(alloc.slots_allocated, petals.slot_pool))
    bprr = cg_bp(model, servers, c)
    assert_valid_allocation(model, servers, bprr.placement, gca(model, servers, bprr.placement))
    rnd = random_placement(model, servers, c, 1.0, 0.7, seed=seed)
    assert_valid_allocation(model, servers, rnd.placement, gca(model, servers, rnd.placement))
