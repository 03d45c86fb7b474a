"""The event-driven simulator against exact results, the worked JFFC trace, determinism and trace replay;
the scenario builder against §10.1; the PETALS/BPRR request-level simulations' invariants."""
from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.sim.scenarios import (
    BLOOM_176B,
    HIGH_GPU,
    LOW_GPU,
    ScenarioConfig,
    build_scenario,
    chain_time_coefficients,
    comm_time_ms,
    service_matrix,
)
from experiments.sim.simulator import (
    Jobs,
    load_trace,
    poisson_jobs,
    reference_jffc,
    simulate_chains,
    trace_jobs,
)
from planner.bounds import exact_mean_response_time, response_time_bounds
from planner.dispatch import POLICIES
from planner.model import max_blocks


def erlang_c_mean_response(lam: float, mu: float, c: int) -> float:
    """M/M/c mean response time (Erlang C)."""
    a = lam / mu
    rho = a / c
    tail = a**c / math.factorial(c) / (1 - rho)
    p_wait = tail / (sum(a**k / math.factorial(k) for k in range(c)) + tail)
    return p_wait / (c * mu - lam) + 1 / mu


def max_concurrency(result, chain: int) -> int:
    events = []
    for s, f, k in zip(result.start, result.finish, result.chain):
        if k == chain:
            events += [(s, 1), (f, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # departures first at equal times
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    return peak


def test_mmc_matches_erlang_c():
    lam, mu, c = 2.0, 1.0, 3
    jobs = poisson_jobs(lam, 200_000, seed=11)
    sim = simulate_chains([1 / mu], [c], jobs).mean_response()
    assert sim == pytest.approx(erlang_c_mean_response(lam, mu, c), rel=0.03)


@pytest.mark.parametrize("lam", [0.3, 1.0])
def test_jffc_matches_exact_ctmc(lam):
    """Example 3's chains (§9.3): μ = (1/3, 1/4, 1/5.2), c = (2, 2, 1)."""
    T, caps = [3.0, 4.0, 5.2], [2, 2, 1]
    exact = exact_mean_response_time([1 / t for t in T], caps, lam)
    sims = [simulate_chains(T, caps, poisson_jobs(lam, 50_000, seed=s)).mean_response() for s in range(4)]
    assert np.mean(sims) == pytest.approx(exact, rel=0.03)
    b = response_time_bounds([1 / t for t in T], caps, lam)
    assert b.lower < np.mean(sims) < b.upper


def test_example6_trace():
    """§9.6: the deterministic JFFC trace."""
    jobs = Jobs(np.array([0, 0.5, 1.0, 1.5, 1.6]), np.array([1, 1, 0.5, 1, 0.25]))
    r = simulate_chains([2.0, 4.0], [1, 2], jobs)
    assert r.response.tolist() == pytest.approx([2, 4, 2, 2.5, 2.4])
    assert r.waiting.tolist() == pytest.approx([0, 0, 0, 0.5, 1.4])
    assert r.chain.tolist() == [0, 1, 1, 0, 1]
    for policy in POLICIES:  # every policy serves every job exactly once
        out = simulate_chains([2.0, 4.0], [1, 2], jobs, policy)
        assert np.all(out.finish > out.start - 1e-12) and np.all(out.start >= out.arrival)


def test_inlined_jffc_equals_dispatcher_driven():
    T, caps = [2.0, 3.5, 3.5, 6.0], [3, 1, 2, 4]
    jobs = poisson_jobs(1.3, 20_000, seed=5)
    a = simulate_chains(T, caps, jobs)
    b = reference_jffc(T, caps, jobs)
    assert np.array_equal(a.start, b.start) and np.array_equal(a.finish, b.finish)
    assert np.array_equal(a.chain, b.chain)


@pytest.mark.parametrize("policy", POLICIES)
def test_capacities_respected_and_deterministic(policy):
    T, caps = [2.0, 3.0, 5.0], [2, 1, 3]
    jobs = poisson_jobs(1.0, 3_000, seed=2)
    r1 = simulate_chains(T, caps, jobs, policy, seed=4)
    r2 = simulate_chains(T, caps, jobs, policy, seed=4)
    assert np.array_equal(r1.finish, r2.finish)
    for k, cap in enumerate(caps):
        assert max_concurrency(r1, k) <= cap
    assert np.allclose(r1.service, jobs.sizes * np.asarray(T)[r1.chain])
    assert np.all(r1.waiting >= 0)


def test_poisson_jobs_seeded():
    a, b, c = poisson_jobs(0.5, 1000, seed=1), poisson_jobs(0.5, 1000, seed=1), poisson_jobs(0.5, 1000, seed=2)
    assert np.array_equal(a.arrivals, b.arrivals) and not np.array_equal(a.arrivals, c.arrivals)
    assert np.mean(np.diff(poisson_jobs(0.5, 100_000, seed=3).arrivals)) == pytest.approx(2.0, rel=0.02)


def test_summary_discards_warmup():
    jobs = Jobs(np.arange(10.0), np.ones(10))
    s = simulate_chains([1.0], [1], jobs).summary(warmup=0.2)
    assert s.jobs == 8 and s.response.mean == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------------
# Trace replay
# ------------------------------------------------------------------------------------------------


def test_trace_facts_and_replay():
    trace = load_trace()
    assert len(trace) == 8819
    assert trace.offsets[-1] == pytest.approx(3435.9, abs=0.1)
    assert trace.input_tokens.mean() == pytest.approx(2047.8, abs=0.1)
    assert trace.output_tokens.mean() == pytest.approx(27.9, abs=0.1)
    gaps = np.diff(trace.offsets)
    assert gaps.std() / gaps.mean() == pytest.approx(13.15, abs=0.01)
    jobs = trace_jobs(trace, rate_scale=2.0, num_jobs=1000, max_length=2048, max_new_tokens=128)
    assert len(jobs) == 1000 and jobs.arrivals[-1] == pytest.approx(trace.offsets[999] / 2)
    assert jobs.input_tokens.max() <= 1920


def test_trace_driven_service_times():
    from planner.plan import plan

    sc = build_scenario(ScenarioConfig(num_servers=20, eta=0.2), seed=0)
    p = plan(sc.model, sc.servers, 0.2, c=7)
    for ch in p.chains:  # the affine model reproduces T_k at the mean lengths
        a, b, c = chain_time_coefficients(sc, ch)
        assert a + b * 2000 + c * 20 == pytest.approx(ch.service_time, rel=1e-9)
    jobs = trace_jobs(load_trace(), num_jobs=500)
    S = service_matrix(sc, p.chains, jobs.input_tokens, jobs.output_tokens)
    r = simulate_chains([ch.service_time for ch in p.chains], [ch.capacity for ch in p.chains], jobs,
                        service_matrix=S)
    assert np.allclose(r.service, S[np.arange(len(jobs)), r.chain])
    assert np.all(r.waiting >= 0)


# ------------------------------------------------------------------------------------------------
# Scenarios (§10.1, §13.3)
# ------------------------------------------------------------------------------------------------


def test_bloom_parameters():
    assert HIGH_GPU.compute_time_ms() == pytest.approx(108.92, abs=0.01)
    assert LOW_GPU.compute_time_ms() == pytest.approx(175.18, abs=0.01)
    sc = build_scenario(ScenarioConfig(num_servers=20, eta=0.2), seed=3)
    hi = [s for s, h in zip(sc.servers, sc.high_performance) if h]
    lo = [s for s, h in zip(sc.servers, sc.high_performance) if not h]
    assert len(hi) == 4 and len(lo) == 16
    assert max_blocks(hi[0], BLOOM_176B, 7) == 19 and max_blocks(lo[0], BLOOM_176B, 7) == 9
    assert comm_time_ms(30.0) == pytest.approx(20 * 48.0)
    assert comm_time_ms(30.0, "literal") == pytest.approx(48.0)
    assert comm_time_ms(30.0, "authors") == pytest.approx(80 + 19 * 30)


def test_scenario_matches_wan_config_and_is_deterministic():
    from wan import WanConfig

    cfg = ScenarioConfig(num_servers=10, eta=0.3)
    a, b = build_scenario(cfg, seed=7), build_scenario(cfg, seed=7)
    assert a == b and build_scenario(cfg, seed=8).anchors != a.anchors
    wan = WanConfig.from_ripe_atlas(num_servers=10, seed=7, eta=0.3)
    for j, s in enumerate(a.servers):
        assert s.comm_time_s == pytest.approx(20 * (wan.rtt("client", f"s{j}") + 18) / 1000)
    assert sum(a.high_performance) == 3


# ------------------------------------------------------------------------------------------------
# Baselines
# ------------------------------------------------------------------------------------------------


def test_bprr_belief_ledger_matches_the_sorted_schedule():
    """BeliefLedger.wait is the definition it replaces: sort the entries that end after t by end and free
    their slots in that order until ``need`` slots are free (random adds, removals, queries, equal ends)."""
    from experiments.sim.baseline_sim import BeliefLedger

    rng = np.random.default_rng(7)
    for trial in range(30):
        cap = int(rng.integers(1, 40))
        ledger, entries, t, job = BeliefLedger(cap), {}, 0.0, 0
        for _ in range(400):
            op = rng.random()
            if op < 0.45:
                end = t + float(rng.choice([0.0, 1.0, 2.5, rng.exponential(5.0)]))
                slots = int(rng.integers(1, cap + 1))
                ledger.add(job, slots, end)
                entries[job] = (slots, end)
                job += 1
            elif op < 0.65 and entries:
                gone = list(entries)[int(rng.integers(len(entries)))]
                ledger.remove(gone)
                del entries[gone]
            else:
                t += float(rng.choice([0.0, rng.exponential(1.0)]))
                need = int(rng.integers(1, cap + 2))
                live = sorted((end, s) for s, end in entries.values() if end > t)
                free, want = cap - sum(s for _, s in live), (math.inf if need > cap else 0.0)
                if need <= cap and free < need:
                    for end, s in live:
                        free += s
                        if free >= need:
                            want = end - t
                            break
                assert ledger.wait(need, t) == want
                assert ledger.held(t) == sum(s for _, s in live) and ledger.total == sum(s for s, _ in entries.values())


def test_petals_and_bprr_simulations():
    from experiments.sim.baseline_sim import simulate_bprr, simulate_petals

    sc = build_scenario(ScenarioConfig(num_servers=20, eta=0.2), seed=1)
    light = poisson_jobs(0.005, 300, seed=1)  # nearly no overlap between requests
    r, info = simulate_petals(sc.model, sc.servers, sc.rtt_ms, light, join_seed=1)
    assert r.waiting.max() == 0 and np.allclose(r.service, light.sizes * info["fastest_path_time"])
    r2, _ = simulate_petals(sc.model, sc.servers, sc.rtt_ms, light, join_seed=1)
    assert np.array_equal(r.finish, r2.finish)
    r, info = simulate_bprr(sc.model, sc.servers, light, 0.005)
    assert np.median(r.waiting) == 0 and info["reservation"] >= 1
    busy = poisson_jobs(0.2, 2000, seed=2)
    for res, _ in (simulate_petals(sc.model, sc.servers, sc.rtt_ms, busy, join_seed=1),
                   simulate_bprr(sc.model, sc.servers, busy, 0.2)):
        assert np.all(res.start >= res.arrival) and np.all(res.finish >= res.start)
        assert res.summary().waiting.mean > 0
