"""placement="auto" (planner/auto.py, planner/auto_score.py): never worse than GBP-CR(c*) by its own score,
deterministic, valid plans; the score's methods agree with the exact CTMC and the Theorem 3.7 bounds.

The J = 1,000 time budget is measured in experiments/bench/planning.py, not here.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.auto import auto_placement, hop_min_placements
from planner.auto_score import predict, simulate_jffc
from planner.auto_trace import TraceScore
from planner.bounds import exact_mean_response_time, response_time_bounds
from planner.fastest_chain import fastest_chain
from planner.model import ModelSpec, Server, check_chain, check_memory, max_blocks
from planner.placement import SwarmArrays
from planner.plan import plan
from planner.tuning import InfeasibleError, tune_c
from tests.test_planner_properties import swarms

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bloom_like(n: int = 8) -> tuple[ModelSpec, list[Server]]:
    model = ModelSpec(70, 1.32, 0.11)
    servers = [Server(f"s{j:02d}", 40.0 if j % 4 == 0 else 20.0, 20 * (0.017 + 0.004 * j + 0.018),
                      0.109 if j % 4 == 0 else 0.175) for j in range(n)]
    return model, servers


@PROPS
@given(swarms(max_servers=6), st.sampled_from([0.05, 0.3, 1.0, 3.0]))
def test_auto_never_worse_than_gbp_cr_c_star(swarm, lam):
    model, servers = swarm
    try:
        star = tune_c(model, servers, lam, 0.7)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            auto_placement(model, servers, lam, 0.7)
        return
    res = auto_placement(model, servers, lam, 0.7)
    assert res.baseline.c == star.c
    assert res.baseline.allocation.chains == star.allocation.chains
    chains = star.allocation.chains
    own = predict([ch.rate for ch in chains], [ch.capacity for ch in chains], lam).value
    assert res.baseline.score == own
    assert res.best.score <= own
    check_memory(model, servers, res.best.placement, res.best.allocation.chains)
    for ch in res.best.allocation.chains:
        check_chain(ch, model, res.best.placement, servers)


@settings(max_examples=15, deadline=None)
@given(swarms(max_servers=6), st.sampled_from([0.3, 2.0]))
def test_auto_is_deterministic(swarm, lam):
    model, servers = swarm
    try:
        a = auto_placement(model, servers, lam, 0.7)
    except InfeasibleError:
        return
    b = auto_placement(model, servers, lam, 0.7)
    assert (a.best.label, a.best.placement, a.best.allocation, a.best.score) == (
        b.best.label, b.best.placement, b.best.allocation, b.best.score)


def test_plan_auto_on_a_bloom_swarm():
    model, servers = bloom_like(12)
    p = plan(model, servers, 0.3, placement="auto")
    again = plan(model, servers, 0.3, placement="auto")
    assert p.placement_method == "auto" and p.tuning.startswith("auto: ")
    assert p.to_dict() == again.to_dict()
    check_memory(model, servers, p.placement, p.chains)
    star = plan(model, servers, 0.3)
    score = lambda pl: predict([c.rate for c in pl.chains], [c.capacity for c in pl.chains], 0.3).value  # noqa: E731
    assert score(p) <= score(star)
    with pytest.raises(ValueError):
        plan(model, servers, 0.3, placement="auto", c=3)


def test_hop_min_chains_cover_the_model_with_fewest_hops():
    model, servers = bloom_like(12)
    arrays = SwarmArrays(model, servers)
    label, c, placement = next(hop_min_placements(arrays, 1, math.inf))
    assert label == "hop-min c=1"
    assert c == 1
    spans = [s for s in placement.spans if s is not None]
    starts = sorted(s[0] for s in spans)
    assert starts.count(0) >= 1
    fast = [placement.spans[j] for j in range(12) if j % 4 == 0]
    # 3 fast servers (40 GB) form the first chain (27 blocks each at c = 1); its common reservation rises to
    # x = 3 (24 blocks each, 72 >= 70; x = 4 gives 22 each, 66 < 70), the last one trimmed to 22
    assert sorted(e - a for a, e in fast) == [22, 24, 24]


def test_predict_methods():
    rates, caps = [1 / 10, 1 / 12], [3, 2]
    p = predict(rates, caps, 0.3)
    assert p.method == "exact"
    assert p.value == pytest.approx(exact_mean_response_time(rates, caps, 0.3))
    assert p.lower <= p.value <= p.upper
    # one chain: the bounds coincide (M/M/c) and are used as they are
    big = predict([0.1], [400], 5.0, exact_states=10)
    assert big.method == "bounds" and big.lower == pytest.approx(big.upper)
    # many chains: simulation, clamped to the bounds, reproducible
    r, c = [1 / (10 + k) for k in range(8)], [3] * 8
    sim = predict(r, c, 0.8)
    b = response_time_bounds(r, c, 0.8)
    assert sim.method == "simulation" and b.lower <= sim.value <= b.upper
    assert sim == predict(r, c, 0.8)
    assert predict([0.1], [1], 0.2).method == "unstable"


def test_simulation_agrees_with_the_exact_ctmc():
    rates, caps = [1 / 10, 1 / 11, 1 / 13], [3, 4, 2]
    exact = exact_mean_response_time(rates, caps, 0.5)
    assert simulate_jffc(rates, caps, 0.5, num_jobs=60_000, seed=3) == pytest.approx(exact, rel=0.02)


def _brute_fastest(model, servers, sessions):
    """Every way to give each server 0..m_j(sessions) blocks summing to L."""
    best = math.inf
    caps = [max_blocks(s, model, sessions) for s in servers]
    for counts in itertools.product(*[range(c + 1) for c in caps]):
        if sum(counts) == model.num_blocks:
            best = min(best, sum(s.comm_time_s + s.compute_time_s * m for s, m in zip(servers, counts) if m))
    return best


@PROPS
@given(swarms(max_servers=5), st.integers(1, 3))
def test_fastest_chain_is_exact_and_no_plan_beats_it(swarm, sessions):
    model, servers = swarm
    fc = fastest_chain(model, servers, sessions)
    assert fc.time == pytest.approx(_brute_fastest(model, servers, sessions), rel=1e-12, abs=1e-12) or (
        math.isinf(fc.time) and math.isinf(_brute_fastest(model, servers, sessions)))
    if math.isinf(fc.time):
        return
    assert sum(m for _, m in fc.parts) == model.num_blocks
    assert all(1 <= m <= max_blocks(servers[j], model, sessions) for j, m in fc.parts)
    spans = [span for _, span in fc.spans()]
    assert spans[0][0] == 0 and spans[-1][1] == model.num_blocks
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # every chain of every plan is at least as slow as T_min(1)
    tmin = fastest_chain(model, servers, 1).time
    for placement in ("auto", "gbp-cr", "whole-model"):
        try:
            p = plan(model, servers, 0.3, placement=placement)
        except ValueError:
            continue
        assert all(ch.service_time >= tmin * (1 - 1e-12) for ch in p.chains)


def test_trace_score_matches_the_ctmc_on_poisson_gaps_and_steers_auto_under_bursts():
    rng = np.random.default_rng(5)
    rates, caps = [1 / 10, 1 / 11, 1 / 13], [3, 4, 2]
    poisson = TraceScore(tuple(rng.exponential(1.0, 40_000).tolist()))
    p = poisson(rates, caps, 0.5)
    assert p.method == "trace" and p.value == pytest.approx(exact_mean_response_time(rates, caps, 0.5), rel=0.03)
    # bursts: 20 requests at once, then a long pause (mean gap 1): more slots beat faster ones
    bursty = TraceScore(tuple(([0.0] * 19 + [20.0]) * 200))
    assert bursty([0.1], [2], 0.05).value > bursty([0.09], [6], 0.05).value
    model, servers = bloom_like(12)
    res = auto_placement(model, servers, 0.2, 0.7, score=bursty)
    assert res == auto_placement(model, servers, 0.2, 0.7, score=bursty)
    assert res.best.score <= res.baseline.score and res.best.prediction.method == "trace"
    check_memory(model, servers, res.best.placement, res.best.allocation.chains)
    assert sum(c.capacity for c in res.best.allocation.chains) >= sum(
        c.capacity for c in auto_placement(model, servers, 0.2, 0.7).best.allocation.chains)
