"""The service model of batching servers (planner/service_model.py), GCA's rates at the occupancy its capacities
imply, and the occupancy-dependent simulators (experiments/sim/batch_sim.py, the PETALS/BPRR request simulations)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experiments.sim.baseline_sim import simulate_bprr, simulate_petals
from experiments.sim.batch_sim import simulate_plan, simulate_shared_chains
from experiments.sim.scenarios import ScenarioConfig, build_scenario
from experiments.sim.simulator import Jobs, poisson_jobs, simulate_chains
from planner.allocation import gca
from planner.batch_bounds import allocation_bounds, fill_death_rates
from planner.bounds import death_rates, response_time_bounds
from planner.model import ModelSpec, Placement, Server
from planner.plan import parse_swarm, plan
from planner.service_model import BatchCurve, ChainService

MEASURED = BatchCurve.from_step_times([22.55, 32.84, 33.43, 47.58, 62.12], max_batch=8)  # an earlier bench_batching run, ms


def test_curve_interpolates_extrapolates_and_runs_rounds_past_the_batch_bound():
    g = BatchCurve((1.0, 1.5, 2.0, 3.0, 4.0))
    assert [g(n) for n in (0, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24)] == [1, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5]
    bounded = dataclasses.replace(g, max_batch=4)
    assert bounded(4) == 2.0 and bounded(8) == 4.0 and bounded(9) == 5.0 and bounded(10) == 5.5
    assert [BatchCurve.sequential()(n) for n in (1, 3, 16, 40)] == [1, 3, 16, 40]
    assert BatchCurve.constant().is_constant and BatchCurve.constant()(100) == 1.0
    assert not BatchCurve((1, 1, 1, 1, 1), max_batch=2).is_constant  # rounds of 2
    # measured times are normalised and made nondecreasing (noise never makes a larger batch faster)
    assert BatchCurve.from_step_times([2, 3, 2.5, 4, 8]).factors == (1, 1.5, 1.5, 2, 4)
    for bad in ((1, 0.5, 1, 1, 1), (2, 2, 2, 2, 2), (1, 2, float("nan"), 3, 4), (1, 2, 3)):
        with pytest.raises(ValueError):
            BatchCurve(bad)
    with pytest.raises(ValueError):
        BatchCurve((1, 2, 3, 4, 5), max_batch=0)


def test_gca_uses_the_rate_at_the_occupancy_its_capacities_imply():
    # two single-server chains; a job alone takes τc + τp = 0.5 + 4 s on s0, 1 + 4 s on s1; D = 2 s of τp
    model = ModelSpec(1, 1.0, 1.0)
    seq, flat = BatchCurve.sequential(), BatchCurve.constant()
    servers = [Server("s0", 4, 0.5, 4.0, decode_time_s=2.0, batch=seq),  # 3 slots, petals-like
               Server("s1", 3, 1.0, 4.0, decode_time_s=2.0, batch=flat)]  # 2 slots, perfect batching
    alloc = gca(model, servers, Placement(((0, 1), (0, 1))))
    # s0 full: 3 sessions, T = 4.5 + 2·(3 − 1) = 8.5 > s1's 5.0: the chains are re-sorted by that rate
    assert [(ch.servers, ch.capacity, ch.service_time, ch.solo_time) for ch in alloc.chains] == [
        (("s1",), 2, 5.0, 5.0), (("s0",), 3, 8.5, 4.5)]
    assert alloc.total_rate == pytest.approx(2 / 5 + 3 / 8.5)
    # no curve, or g ≡ 1: exactly today's chains (solo_time unset)
    for batch in (None, flat):
        same = [dataclasses.replace(s, batch=batch) for s in servers]
        chains = gca(model, same, Placement(((0, 1), (0, 1)))).chains
        assert [(ch.servers, ch.service_time, ch.solo_time) for ch in chains] == [(("s0",), 4.5, None),
                                                                               (("s1",), 5.0, None)]


def test_bounds_rate_each_state_at_the_occupancy_it_implies():
    model = ModelSpec(1, 1.0, 1.0)
    seq = BatchCurve.sequential()
    servers = [Server("s0", 4, 0.5, 4.0, decode_time_s=2.0, batch=seq),  # 3 slots, T(n) = 4.5 + 2(n − 1)
               Server("s1", 3, 1.0, 4.0)]  # 2 slots, T = 5, g ≡ 1
    chains = gca(model, servers, Placement(((0, 1), (0, 1)))).chains  # s1 (5.0) first, then s0 (8.5 when full)
    assert fill_death_rates(chains, servers, fastest_first=True) == pytest.approx(
        [1 / 5, 2 / 5, 2 / 5 + 1 / 4.5, 2 / 5 + 2 / 6.5, 2 / 5 + 3 / 8.5])
    assert fill_death_rates(chains, servers, fastest_first=False) == pytest.approx(
        [1 / 4.5, 2 / 6.5, 3 / 8.5, 3 / 8.5 + 1 / 5, 3 / 8.5 + 2 / 5])
    b = allocation_bounds(chains, servers, 0.3)
    assert b.lower < response_time_bounds([ch.rate for ch in chains], [2, 3], 0.3).lower  # light load: faster
    assert allocation_bounds(chains, servers, 2 / 5 + 3 / 8.5) is None  # ν = the rate at capacity occupancy
    # without batching: the paper's eqs. (28)-(29) exactly
    plain = [dataclasses.replace(s, batch=None) for s in servers]
    chains = gca(model, plain, Placement(((0, 1), (0, 1)))).chains
    for first in (True, False):
        assert fill_death_rates(chains, plain, fastest_first=first) == pytest.approx(
            death_rates([ch.rate for ch in chains], [ch.capacity for ch in chains], fastest_first=first))
    assert allocation_bounds(chains, plain, 0.3) == response_time_bounds([1 / 4.5, 1 / 5], [3, 2], 0.3)


def test_plan_with_flat_curves_is_todays_plan_and_swarm_files_carry_curves():
    sc = build_scenario(ScenarioConfig(num_servers=12, eta=0.25), 3)
    flat = [dataclasses.replace(s, decode_time_s=s.compute_time_s / 4, batch=BatchCurve.constant())
            for s in sc.servers]
    for method in ("gbp-cr", "petals"):
        assert plan(sc.model, flat, 0.2, placement=method).to_dict() == plan(sc.model, sc.servers, 0.2,
                                                                             placement=method).to_dict()
    batched = [dataclasses.replace(s, batch=MEASURED) for s in flat]
    p = plan(sc.model, batched, 0.2)
    assert all(ch.service_time >= ch.solo_time for ch in p.chains) and any(
        ch.service_time > ch.solo_time for ch in p.chains)
    assert [ch.service_time for ch in p.chains] == sorted(ch.service_time for ch in p.chains)
    doc = {"model": {"num_blocks": 2, "block_size_gb": 1, "cache_slot_gb": 0.5}, "arrival_rate": 0.1,
           "servers": [{"id": "a", "memory_gb": 4, "comm_time_s": 1, "compute_time_s": 2, "decode_time_s": 1,
                        "batch": MEASURED.to_dict()}]}
    assert parse_swarm(doc)[1][0].batch == MEASURED
    doc["servers"][0]["batch"] = {"factors": [1, 0.5, 1, 1, 1]}
    with pytest.raises(ValueError, match="servers\\[0\\].batch"):
        parse_swarm(doc)


def _scenario_servers(batch):
    sc = build_scenario(ScenarioConfig(num_servers=10, eta=0.3), 1)
    return sc, [dataclasses.replace(s, decode_time_s=s.compute_time_s / 4, batch=batch) for s in sc.servers]


@pytest.mark.parametrize("batch", [None, BatchCurve.constant()])
def test_with_g_identically_one_the_simulators_equal_todays_on_the_same_seed(batch):
    sc, servers = _scenario_servers(batch)
    p = plan(sc.model, sc.servers, 0.3)
    jobs = poisson_jobs(0.3, 3000, seed=5)
    times = [ch.service_time for ch in p.chains]
    for policy in ("jffc", "sed"):
        old = simulate_chains(times, [ch.capacity for ch in p.chains], jobs, policy, seed=2)
        new = simulate_plan(p.chains, servers, jobs, policy, seed=2)
        assert np.array_equal(old.finish, new.finish) and np.array_equal(old.chain, new.chain)
    light = jobs.head(400)
    for run in (lambda srv: simulate_petals(sc.model, srv, sc.rtt_ms, light, join_seed=1)[0],
                lambda srv: simulate_bprr(sc.model, srv, light, 0.3)[0]):
        assert np.array_equal(run(sc.servers).finish, run(servers).finish)


def test_shared_service_by_hand():
    # one chain, capacity 2; T(1) = 2 s of which a 1 s decode share on a server with g(2) = 1.5, g(n) = n past 2
    g = BatchCurve((1.0, 1.5, 2.0, 4.0, 8.0), max_batch=2)
    service = ChainService(2.0, (0,), (1.0,), (g,))
    jobs = Jobs(np.array([0.0, 0.0, 0.5]), np.array([1.0, 2.0, 0.25]))
    res = simulate_shared_chains([service], [0.5], [2], jobs, num_servers=1)
    # jobs 0 and 1 share: T(2) = 2 + 0.5 = 2.5, speed 0.8: job 0 needs 2 s alone → done at 2.5 (job 2 waits)
    # job 2 (0.5 s alone) starts at 2.5 with job 1 (4 − 2 = 2 s left): both at 0.8 → job 2 ends at 3.125,
    # job 1 has 2 − 0.5 = 1.5 s left alone → ends at 4.625
    assert res.start.tolist() == [0.0, 0.0, 2.5]
    assert res.finish.tolist() == pytest.approx([2.5, 4.625, 3.125])
    # petals-like server (g(n) = n on a service that is all decode): processor sharing, 1/n each
    ps = ChainService(1.0, (0,), (1.0,), (BatchCurve.sequential(),))
    res = simulate_shared_chains([ps], [1.0], [3], Jobs(np.array([0.0, 0.0, 1.0]), np.array([1.0, 3.0, 1.0])),
                                 num_servers=1)
    # [0, 1): 2 jobs at 1/2 → job 0 has 0.5 left at t = 1; then 3 jobs at 1/3 → job 0 ends at 2.5;
    # jobs 1, 2 then have 3 − 0.5 − 0.5 = 2 and 0.5 left at 1/2 → job 2 ends at 3.5, job 1 at 3.5 + 1.5 = 5
    assert res.finish.tolist() == pytest.approx([2.5, 5.0, 3.5])


def test_batching_servers_slow_every_method_and_petals_most():
    sc, batched = _scenario_servers(MEASURED)
    _, sequential = _scenario_servers(BatchCurve.sequential())
    jobs = poisson_jobs(0.4, 1500, seed=7)
    p = plan(sc.model, sc.servers, 0.4)
    base = simulate_chains([ch.service_time for ch in p.chains], [ch.capacity for ch in p.chains], jobs)
    mean = lambda r: r.summary().service.mean  # noqa: E731
    assert mean(base) < mean(simulate_plan(p.chains, batched, jobs)) < mean(simulate_plan(p.chains, sequential,
                                                                                         jobs))
    petals = [simulate_petals(sc.model, srv, sc.rtt_ms, jobs.head(600), join_seed=1)[0] for srv in
              (sc.servers, sequential)]
    assert mean(petals[0]) < mean(petals[1])
