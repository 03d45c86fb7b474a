"""Chain selectors (§14.4 step 2, §14.7) driven directly on tiny chain tables."""

from __future__ import annotations

import pytest

from planner.fairness import (
    BFIO,
    CHAIN_MODES,
    JFFC,
    ChainSelector,
    ChainSpec,
    EstimatedTime,
    FCFSScheduler,
    LongestPrefixMatch,
    MostFree,
    SwarmScheduler,
    make_scheduler,
)
from planner.fairness.selectors import QUANTUM_PENALTY, selector_class
from planner.fairness.types import ChainState

FAST = ChainSpec("fast", 1, decode_time=0.05, prefill_time=0.005, servers=("s1",))
SLOW = ChainSpec("slow", 1, decode_time=0.1, prefill_time=0.01, servers=("s2",))


def table(sched, specs, active=None):
    """Register ``specs`` with the scheduler and return the free-chain list a round would see."""
    sched.set_chains(specs)
    active = active or {}
    return [ChainState(spec, order, active=active.get(spec.chain_id, 0)) for order, spec in enumerate(specs)]


def queued(sched, *requests):
    for rid, client, tokens, out in requests:
        sched.submit(rid, client, tokens, 0.0, max_new_tokens=out)
    return [sched.request(rid) for rid, *_ in requests]


def placed(assignment):
    return [(r.request_id, c.spec.chain_id) for r, c in assignment]


def test_jffc_takes_the_fastest_chain_where_est_time_and_lpm_take_the_prefix():
    sched = FCFSScheduler()
    free = table(sched, [FAST, SLOW])
    (r,) = queued(sched, ("r", "a", 1000, 8))
    matches = {"r": {"fast": 0, "slow": 900}}
    # T_fast = 0.005 * 1000 + 0.05 * 8 = 5.4 s;  T_slow = 0.01 * 100 + 0.1 * 8 = 1.8 s
    assert EstimatedTime().pair_cost(sched, r, free[0], matches) == pytest.approx(5.4)
    assert EstimatedTime().pair_cost(sched, r, free[1], matches) == pytest.approx(1.8)
    assert LongestPrefixMatch().pair_cost(sched, r, free[1], matches) == -900.0
    assert placed(JFFC().assign(sched, [r], free, matches)) == [("r", "fast")]
    assert placed(EstimatedTime().assign(sched, [r], free, matches)) == [("r", "slow")]
    assert placed(LongestPrefixMatch().assign(sched, [r], free, matches)) == [("r", "slow")]
    # no locality anywhere: est_time and lpm fall back to the JFFC order
    cold = {"r": {"fast": 0, "slow": 0}}
    for selector in (EstimatedTime(), LongestPrefixMatch()):
        assert placed(selector.assign(sched, [r], free, cold)) == [("r", "fast")]


def test_joint_matching_beats_greedy_pick_order():
    fast, slow = (ChainSpec(k, 1, decode_time=t, prefill_time=0.0) for k, t in (("fast", 0.05), ("slow", 0.1)))
    sched = FCFSScheduler()
    free = table(sched, [fast, slow])
    picked = queued(sched, ("short", "a", 10, 1), ("long", "b", 10, 100))
    matches = {"short": {"fast": 0, "slow": 0}, "long": {"fast": 0, "slow": 0}}
    # greedy: short takes fast (0.05 < 0.1), long gets slow (10 s); joint: 0.1 + 5 s
    assert placed(EstimatedTime(joint=False).assign(sched, picked, free, matches)) == [("short", "fast"), ("long", "slow")]
    assert placed(EstimatedTime().assign(sched, picked, free, matches)) == [("short", "slow"), ("long", "fast")]


def test_quantum_penalised_pair_loses_to_a_slower_choice():
    sched = SwarmScheduler(chain_quantum=100.0)
    free = table(sched, [FAST, SLOW])
    (r,) = queued(sched, ("r", "a", 1000, 8))
    sched.set_stickiness("a", "slow", -5.0)  # client a used its Q^w on the prefix chain
    sched.set_stickiness("a", "fast", 50.0)
    matches = {"r": {"fast": 0, "slow": 900}}
    selector = EstimatedTime()
    avail = selector.avail(sched, r)
    assert avail == {"fast"}
    key = selector.single_key(sched, r, free[1], matches, avail, 1)
    assert key[0] == pytest.approx(1.8 + QUANTUM_PENALTY)
    assert placed(selector.assign(sched, [r], free, matches)) == [("r", "fast")]
    assert placed(LongestPrefixMatch().assign(sched, [r], free, matches)) == [("r", "fast")]
    # penalised, never excluded: with only the penalised chain free the request still goes there
    assert placed(selector.assign(sched, [r], free[1:], matches)) == [("r", "slow")]
    # JFFC and most_free ignore the quanta
    assert JFFC().avail(sched, r) is None and MostFree().avail(sched, r) is None


def test_most_free_ties_go_to_list_order():
    specs = [ChainSpec(k, 2, decode_time=t) for k, t in (("a", 0.01), ("b", 0.5), ("c", 0.5))]
    sched = FCFSScheduler(chain_mode="most_free")
    free = table(sched, specs, active={"a": 1})  # free slots a=1, b=2, c=2
    picked = queued(sched, *[(f"r{i}", "x", 10, 4) for i in range(4)])
    matches = {r.request_id: {"a": 0, "b": 0, "c": 0} for r in picked}
    # most free first (b before c by list order), then the three-way tie at 1 goes to a
    assert placed(MostFree().assign(sched, picked, free, matches)) == [
        ("r0", "b"), ("r1", "c"), ("r2", "a"), ("r3", "b"),
    ]
    assert [c for _, c in placed(JFFC().assign(sched, picked[:1], free, matches))] == ["a"]


def test_bfio_avoids_the_loaded_server_and_breaks_ties_by_extend():
    fast = ChainSpec("fast", 2, decode_time=0.05, servers=("s1",))
    sched = SwarmScheduler(chain_mode=BFIO(horizon=2), chain_quantum=None)
    sched.set_chains([fast, SLOW])
    sched.submit("busy", "a", 500, 0.0, max_new_tokens=50)
    assert [g.chain_id for g in sched.dispatch(0.0)] == ["fast"]
    (r,) = queued(sched, ("r", "b", 100, 10))
    free = [ChainState(fast, 0, active=1), ChainState(SLOW, 1)]
    matches = {"r": {"fast": 0, "slow": 0}}
    assert placed(sched.selector.assign(sched, [r], free, matches)) == [("r", "slow")]
    assert placed(JFFC().assign(sched, [r], free, matches)) == [("r", "fast")]
    # two chains on idle servers with equal J_k(r): the smaller extend wins over JFFC order
    twins = [ChainSpec("t1", 1, decode_time=0.05, servers=("s3",)), ChainSpec("t2", 1, decode_time=0.1, servers=("s4",))]
    sched.set_chains([fast, SLOW, *twins])
    free = [ChainState(spec, i + 2) for i, spec in enumerate(twins)]
    matches = {"r": {"t1": 0, "t2": 40}}
    assert placed(sched.selector.assign(sched, [r], free, matches)) == [("r", "t2")]


def test_selectors_by_name_and_object():
    assert CHAIN_MODES == ("jffc", "most_free", "est_time", "lpm", "bfio")
    for name in CHAIN_MODES:
        sched = FCFSScheduler(chain_mode=name)
        assert sched.chain_mode == name and isinstance(sched.selector, selector_class(name))
    assert FCFSScheduler().chain_mode == "jffc"
    assert make_scheduler("lpm").chain_mode == "lpm" and make_scheduler("swarm").chain_mode == "est_time"
    s = make_scheduler("bfio", bfio_horizon=3, server_kv_time={"s1": 2.0})
    assert (s.selector.horizon, s.selector.kv_time) == (3, {"s1": 2.0})
    assert make_scheduler("swarm", joint_assignment=False).selector.joint is False
    own = LongestPrefixMatch(joint=False)
    s = SwarmScheduler(chain_mode=own)
    assert s.selector is own and s.chain_mode == "lpm"


def test_unknown_selector_name_and_misplaced_options_raise():
    with pytest.raises(ValueError, match="unknown chain_mode 'nearest'"):
        FCFSScheduler(chain_mode="nearest")
    with pytest.raises(ValueError, match="unknown chain_mode"):
        make_scheduler("swarm", chain_mode="nearest")
    with pytest.raises(ValueError, match="unknown chain_mode"):
        selector_class("JFFC")
    with pytest.raises(ValueError, match="bfio_horizon"):
        SwarmScheduler(chain_mode=BFIO(), bfio_horizon=4)
    with pytest.raises(NotImplementedError):
        ChainSelector().single_key(None, None, None, {}, None, 1)
