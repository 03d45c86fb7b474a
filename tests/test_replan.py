"""planner/replan.py: the incremental re-planner keeps survivors' ranges, covers the model again, respects
memory, never loads more blocks than the fresh plan, and is deterministic; experiments/sim/churn_sim.py restarts
jobs whose chain breaks."""
from __future__ import annotations

import random

import numpy as np
import pytest

from experiments.sim.churn_sim import EpochChain, simulate_epochs
from planner.auto import auto_placement
from planner.model import ModelSpec, Placement, Server, check_chain, check_memory
from planner.replan import blocks_loaded, incremental_replan, missing_segments
from tests.test_planner_auto import bloom_like


def _current(servers, placement):
    return {s.id: span for s, span in zip(servers, placement.spans)}


def _swarm(n: int, seed: int) -> list[Server]:
    rng = random.Random(seed)
    return [Server(f"s{j:02d}", rng.choice([20.0, 40.0]), 20 * (0.017 + 0.04 * rng.random() + 0.018),
                   rng.choice([0.109, 0.175])) for j in range(n)]


@pytest.mark.parametrize("seed", range(3))
def test_churn_step_keeps_survivors_and_covers_the_model(seed):
    model = ModelSpec(70, 1.32, 0.11)
    servers = _swarm(16, seed)
    lam = 0.2
    start = auto_placement(model, servers, lam).best
    current = _current(servers, start.placement)
    rng = random.Random(100 + seed)
    used = [s for s, span in zip(servers, start.placement.spans) if span is not None]
    gone = set(s.id for s in rng.sample(used, 2))
    joiners = _swarm(19, 50 + seed)[16:]
    joiners = [Server(f"j{k}", s.memory_gb, s.comm_time_s, s.compute_time_s) for k, s in enumerate(joiners)]
    now = [s for s in servers if s.id not in gone] + joiners
    r = incremental_replan(model, now, current, start.allocation.chains, lam)
    assert r == incremental_replan(model, now, current, start.allocation.chains, lam)  # deterministic
    r.placement.validate(model, now)
    check_memory(model, now, r.placement, r.allocation.chains)
    for ch in r.allocation.chains:
        check_chain(ch, model, r.placement, now)
    assert r.allocation.chains, "the swarm serves again"
    assert r.blocks_loaded == blocks_loaded(current, now, r.placement)
    assert r.blocks_loaded <= r.fresh_blocks_loaded
    if r.strategy != "fresh":  # survivors keep their ranges: only idle servers load anything
        for s, span in zip(now, r.placement.spans):
            if s.id in current and current[s.id] is not None:
                assert span == current[s.id]
        assert r.predicted <= r.fresh_predicted * 1.05 + 1e-9 or r.blocks_loaded < r.fresh_blocks_loaded


def test_nothing_lost_nothing_moved_and_a_lost_server_is_replaced_by_its_segment():
    model, servers = bloom_like(12)
    lam = 0.3
    start = auto_placement(model, servers, lam).best
    current = _current(servers, start.placement)
    r = incremental_replan(model, servers, current, start.allocation.chains, lam)
    assert (r.strategy, r.blocks_loaded, r.placement) == ("kept", 0, start.placement)
    fastest = start.allocation.chains[0]
    victim = fastest.servers[len(fastest.servers) // 2]
    segment = fastest.spans[len(fastest.servers) // 2]
    spare = Server("spare", 40.0, 0.5, 0.109)
    now = [s for s in servers if s.id != victim] + [spare]
    assert missing_segments(fastest, {s.id for s in now}) == [segment]
    nothing = lambda model, servers, lam, rho: Placement((None,) * len(servers))  # noqa: E731 (fresh never wins)
    r = incremental_replan(model, now, current, start.allocation.chains, lam, tolerance=0.0, fresh=nothing)
    assert r.strategy == "repaired" and r.placement.spans[-1] == segment
    assert r.blocks_loaded == segment[1] - segment[0]
    assert any(ch.spans[ch.servers.index("spare")] == segment for ch in r.allocation.chains if "spare" in ch.servers)


def test_a_broken_chain_restarts_its_jobs():
    a, b = EpochChain("a", 10.0, 1), EpochChain("b", 20.0, 1)
    # two jobs at t = 0 and 1 on chains a and b; at t = 5 chain a breaks, at t = 30 it is back
    run = simulate_epochs([0.0, 1.0], [1.0, 1.0], [0.0, 5.0, 30.0], [[a, b], [b], [a, b]])
    assert run.restarts.tolist() == [1, 0]
    assert run.finish[1] == pytest.approx(21.0)  # b's job is untouched
    assert run.finish[0] == pytest.approx(41.0)  # requeued at 5, starts on b when it frees at 21: 21 + 20
    static = simulate_epochs([0.0, 1.0], [1.0, 1.0], [0.0], [[a, b]])
    assert np.allclose(static.finish, [10.0, 21.0]) and static.restarts.sum() == 0


def test_churn_experiment_end_to_end(tmp_path):
    """A short churn run with the incremental re-planner and petals' own rebalancing (petals' functions
    applied to constructed module infos), rendered to a section."""
    from experiments.figures.churn import ChurnConfig, churn_events, one_run
    from experiments.report.churn import section

    cfg = ChurnConfig(num_servers=12, horizon_s=300.0, runs=1, churn_per_min=0.2)
    data = one_run(cfg, 0, strategies=("incremental", "incremental + reserve", "petals rebalancing"))
    initial, events = churn_events(cfg, [f"s{j:02d}" for j in range(24)], 0)
    assert data["leaves"] + data["joins"] == len(events) > 0 and len(initial) == 12
    inc, pet = data["strategies"]["incremental"], data["strategies"]["petals rebalancing"]
    assert pet["decisions"]["join"] == data["joins"]  # every petals joiner chooses blocks (and loads them)
    assert pet["blocks_loaded"] > 0 and pet["reloads"] >= data["joins"] - 1
    reserve = data["strategies"]["incremental + reserve"]
    assert sum(inc["decisions"].values()) == sum(reserve["decisions"].values()) == len(events)  # one per change
    assert reserve["blocks_loaded"] > inc["blocks_loaded"]  # idle servers hold standby chains
    for s in (inc, reserve, pet):
        assert s["blocks_new"] <= s["blocks_loaded"]
        assert s["churn"]["jobs"] == s["static"]["jobs"] > 0
        assert s["churn"]["mean"] >= s["static"]["mean"] - 1e-9 or s["churn"]["restarted"] == 0
    agg = {n: {k: {"mean": 1.0, "std": 0.0} for k in ("blocks_loaded", "blocks_new", "reloads", "mean", "p95",
                                                      "static_mean", "cost", "restarted", "no_chain_s", "unfinished")}
           | {"decisions": data["strategies"][n]["decisions"]} for n in data["strategies"]}
    text = section({"config": cfg.__dict__, "aggregate": agg, "runs": [data], "elapsed_s": 1.0,
                    "load_average": [[1.0], [1.0]]})
    assert "| incremental |" in text and "| petals rebalancing |" in text
    assert "as many blocks loaded (1 against 1), the same response-time cost" in text
