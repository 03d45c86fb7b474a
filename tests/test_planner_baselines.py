"""Placement baselines of §12 and the plan facade."""
from __future__ import annotations

import json
import math

import pytest

from planner.allocation import gca
from planner.baselines import (
    bprr_reservation,
    cg_bp,
    petals_num_blocks,
    petals_placement,
    petals_throughput,
    random_order,
    random_placement,
    whole_model_placement,
)
from planner.model import ModelSpec, Server
from planner.placement import gbp_cr
from planner.plan import PLACEMENTS, parse_swarm, plan
from planner.tuning import InfeasibleError

EX3_MODEL = ModelSpec(4, 1.0, 0.25)
EX3_SERVERS = [
    Server("A", 6, 1, 0.5),
    Server("B", 4.5, 0.5, 0.5),
    Server("C", 3, 0.2, 1),
    Server("D", 3, 1, 1),
    Server("E", 1.5, 0.1, 2),
    Server("F", 1.4, 0.1, 0.1),
]


def test_petals_num_blocks_and_throughput():
    model = ModelSpec(8, 1.0, 0.5)
    s = Server("s", 10, 0.5, 0.25)
    # per block 1.01 GB of weights + 2 slots of 0.5 GB cache = 2.01 GB -> ⌊10/2.01⌋ = 4
    assert petals_num_blocks(s, model) == 4
    assert petals_num_blocks(s, model, autograd_gb=2.0) == 3
    assert petals_num_blocks(Server("big", 100, 1, 1), model) == 8  # capped at L
    # min(forward_rps/((m+1)/2), network_rps) = min(4/2.5, 2)
    assert petals_throughput(s, 4) == pytest.approx(1.6)
    assert petals_throughput(Server("n", 10, 2.0, 0.01), 1) == pytest.approx(0.5)


def test_petals_join_covers_least_served_blocks():
    model = ModelSpec(4, 1.0, 0.5)
    servers = [Server("a", 4.02, 1, 0.5), Server("b", 4.02, 1, 0.5), Server("c", 2.01, 1, 0.25)]
    result = petals_placement(model, servers)
    # a: 2 blocks, all-zero windows tie -> start 0. b: window [2,4) is all zeros -> start 2.
    # c: 1 block; every block has the same total -> start 0 (smallest start).
    assert result.placement.spans == ((0, 2), (2, 4), (0, 1))
    assert result.slot_pool == (4, 4, 2)
    thr_a = min(2 / 1.5, 1.0)
    assert result.throughputs[0] == pytest.approx(thr_a)
    # a random join order is a permutation and still a valid placement
    shuffled = petals_placement(model, servers, seed=3)
    assert sorted(shuffled.join_order) == [0, 1, 2]
    alloc = gca(model, servers, result.placement, slot_budget=result.slot_pool)
    assert all(used <= pool for used, pool in zip(alloc.slots_allocated, result.slot_pool))


def test_cg_bp_hand_example():
    servers = EX3_SERVERS[:3]  # A, B, C
    result = cg_bp(EX3_MODEL, servers, 2)
    # order B (t̃ 0.667), A (0.75), C (1.1); B takes [0,3) (equal sums, first), A must take [0,4),
    # C (2 blocks) then takes the window with the smallest sorted capacity vector: C_b = (4,4,4,2) -> [2,4)
    assert result.placement.spans == ((0, 4), (0, 3), (2, 4))
    assert result.feasible
    assert result.block_capacity == (4, 4, 6, 4)
    infeasible = cg_bp(EX3_MODEL, servers[1:2], 2)
    assert not infeasible.feasible


def test_bprr_reservation_formula():
    servers = EX3_SERVERS
    r = bprr_reservation(EX3_MODEL, servers, 0.6)
    fastest = gca(EX3_MODEL, servers, cg_bp(EX3_MODEL, servers, 1).placement).chains[0].service_time
    r_hat = 0.6 * fastest
    total = sum(s.memory_gb for s in servers)
    r_max = math.floor((total - 1.0 * (4 + 6)) / (0.25 * (4 + 6)))
    assert r == max(1, math.ceil(min(r_hat + math.sqrt(max(r_hat, 1)), r_max)))


def test_whole_model_capacities():
    placement = whole_model_placement(EX3_MODEL, EX3_SERVERS)
    assert placement.spans == ((0, 4), (0, 4), None, None, None, None)
    alloc = gca(EX3_MODEL, EX3_SERVERS, placement)
    # ⌊(M − L·s_m)/(L·s_c)⌋: A ⌊2/1⌋ = 2, B ⌊0.5/1⌋ = 0 (no chain)
    assert [(ch.servers, ch.capacity, ch.service_time) for ch in alloc.chains] == [(("A",), 2, 3.0)]


def test_random_placement_is_gbp_cr_loop_in_random_order():
    a = random_placement(EX3_MODEL, EX3_SERVERS, 2, 0.3, 0.5, seed=1)
    b = random_placement(EX3_MODEL, EX3_SERVERS, 2, 0.3, 0.5, seed=1)
    assert a == b
    seen = {random_placement(EX3_MODEL, EX3_SERVERS, 2, 5.0, 0.5, seed=s).placement for s in range(20)}
    assert len(seen) > 1
    # with the t̃ order itself the loop reproduces GBP-CR
    def tilde_order(arrays, m):
        return arrays.gbp_cr_order(m)

    assert gbp_cr(EX3_MODEL, EX3_SERVERS, 2, 0.3, 0.5, order=tilde_order) == gbp_cr(EX3_MODEL, EX3_SERVERS, 2, 0.3, 0.5)
    assert list(random_order(0)(type("A", (), {"__len__": lambda self: 3})(), [1, 0, 1])) in ([0, 2], [2, 0])


def test_plan_facade_contract():
    p = plan(EX3_MODEL, EX3_SERVERS, 0.6, target_load=0.5)
    assert (p.c, p.tuning) == (1, "lower-bound")
    doc = p.to_dict()
    assert list(doc) == ["c", "tuning", "candidates", "servers", "chains", "total_rate", "total_capacity", "bounds"]
    assert list(doc["servers"][0]) == ["id", "start", "end", "slots_free", "slots_allocated"]
    assert list(doc["chains"][0]) == ["servers", "spans", "capacity", "service_time", "rate"]
    assert list(doc["candidates"][0]) == ["c", "K", "g", "total_rate", "lower", "upper"]
    json.dumps(doc, allow_nan=False)
    assert doc["total_rate"] == pytest.approx(1.5838, abs=1e-4)
    assert doc["bounds"]["lower"] == pytest.approx(2.6223, abs=1e-4)
    assert doc["bounds"]["upper"] == pytest.approx(3.9048, abs=1e-4)
    assert doc["servers"][1] == {"id": "B", "start": 1, "end": 4, "slots_free": 1, "slots_allocated": 5}
    assert doc["chains"][0]["spans"] == [[0, 1], [1, 4]]
    assert p.dispatcher().arrive("job") == 0
    assert plan(EX3_MODEL, EX3_SERVERS, 0.6, target_load=0.5, tuning="surrogate").c == 5
    fixed = plan(EX3_MODEL, EX3_SERVERS, 0.6, target_load=0.5, c=3)
    assert fixed.tuning == "fixed" and len(fixed.candidates) == 1
    for method in PLACEMENTS:
        assert plan(EX3_MODEL, EX3_SERVERS, 0.6, target_load=0.5, placement=method).chains
    overloaded = plan(EX3_MODEL, EX3_SERVERS, 50.0, target_load=0.5)
    assert overloaded.bounds is None and overloaded.to_dict()["bounds"] is None
    assert overloaded.c == max(overloaded.candidates, key=lambda c: (c.total_rate, -c.c)).c


def test_plan_rejects_bad_input():
    with pytest.raises(InfeasibleError):
        plan(ModelSpec(40, 1.0, 0.25), EX3_SERVERS, 0.3)
    with pytest.raises(InfeasibleError):
        plan(EX3_MODEL, EX3_SERVERS, 0.3, c=9)
    with pytest.raises(ValueError):
        plan(EX3_MODEL, EX3_SERVERS, 0.3, placement="petals", c=2)
    with pytest.raises(ValueError):
        plan(EX3_MODEL, EX3_SERVERS, -1.0)
    with pytest.raises(ValueError):
        plan(EX3_MODEL, EX3_SERVERS, 0.3, target_load=1.0)
    with pytest.raises(ValueError):
        plan(EX3_MODEL, EX3_SERVERS + [Server("A", 1, 1, 1)], 0.3)  # duplicate id
    with pytest.raises(ValueError):
        Server("x", -1, 1, 1)
    with pytest.raises(ValueError):
        parse_swarm({"model": {"num_blocks": 4, "block_size_gb": 1}, "servers": [], "arrival_rate": 1})


def test_ws_rr_route_penalizes_waiting():
    from planner.baselines import ws_rr_route

    placement = cg_bp(EX3_MODEL, EX3_SERVERS[:3], 2).placement  # A [0,4), B [0,3), C [2,4)
    ids = [s.id for s in EX3_SERVERS[:3]]
    free = ws_rr_route(EX3_MODEL, EX3_SERVERS[:3], placement, lambda j, slots: 0.0)
    assert free.servers == ("A",) and free.start_delay == 0 and free.service_time == 3.0
    # A busy for 2 s: B (3 blocks, 2.0 s) then C (block 3, 0.2 + 1 = 1.2 s) costs 3.2 < 3 + 2
    busy_a = ws_rr_route(EX3_MODEL, EX3_SERVERS[:3], placement, lambda j, slots: 2.0 if ids[j] == "A" else 0.0)
    assert busy_a.servers == ("B", "C") and busy_a.spans == ((0, 3), (3, 4))
    assert busy_a.service_time == pytest.approx(3.2) and busy_a.start_delay == 0
    # everything waits: the smallest total wait + time wins, and the start is the largest wait on it
    waits = {"A": 1.0, "B": 0.5, "C": 0.75}
    route = ws_rr_route(EX3_MODEL, EX3_SERVERS[:3], placement, lambda j, slots: waits[ids[j]])
    assert route.servers == ("A",) and route.start_delay == 1.0
    assert ws_rr_route(EX3_MODEL, EX3_SERVERS[:3], placement, lambda j, slots: math.inf) is None
