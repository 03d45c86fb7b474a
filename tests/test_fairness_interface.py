"""The event interface the orchestrator and simulator drive: errors, failures, reconciliation."""

from __future__ import annotations

import pytest

from planner.fairness import (
    ChainSpec,
    DLPMScheduler,
    DuplicateRequestError,
    FCFSScheduler,
    InvalidEventError,
    SwarmScheduler,
    UnknownChainError,
    UnknownClientError,
    UnknownRequestError,
    VTCScheduler,
    make_scheduler,
)


def dlpm(**kw):
    s = DLPMScheduler(quantum=100, **kw)
    s.set_chains([ChainSpec("fast", 1, decode_time=0.05), ChainSpec("slow", 1, decode_time=0.1)])
    return s


def test_orchestrator_flow_and_jffc():
    s = dlpm()
    assert s.submit("r1", "alice", 30, 0.0, max_new_tokens=8)
    (g,) = s.dispatch(0.0)
    assert (g.request_id, g.chain_id, g.extend_tokens) == ("r1", "fast", 30)  # JFFC: fastest free chain
    assert s.deficit("alice") == 70
    s.on_prefill("r1", 0, 0.1)
    s.on_tokens("r1", 3, 0.2)
    assert s.deficit("alice") == 64 and s.service("alice") == 36
    s.submit("r2", "bob", 10, 0.3)
    assert s.choose_chain("r2", 0.3).chain_id == "slow"
    s.submit("r3", "bob", 10, 0.4)
    assert s.dispatch(0.4) == [] and s.is_backlogged("bob")
    s.on_finish("r1", 0.5, output_tokens=5)  # lease-style: 2 more tokens charged at the end
    assert s.service("alice") == 40 and s.client_view_service("alice") == 40
    g = s.pick_for_chain("fast", 0.5)
    assert (g.request_id, g.chain_id) == ("r3", "fast")
    assert s.pick_for_chain("fast", 0.6) is None
    assert s.work_conserving()


def test_prefill_report_reconciles_in_both_directions():
    s = dlpm(prefix_match=lambda r, k: 20)
    s.submit("r", "a", 50, 0)
    (g,) = s.dispatch(0)
    assert g.matched_tokens == 20 and s.deficit("a") == 70
    s.on_prefill("r", 0, 1)  # stale index: nothing was reused
    assert s.deficit("a") == 50 and s.service("a") == 50
    s.on_prefill("r", 40, 2)  # more than predicted: refund
    assert s.deficit("a") == 90 and s.service("a") == 10
    s.on_prefill("r", 500, 3)  # capped at len - 1
    assert s.request("r").matched_tokens == 49


def test_failure_requeues_at_head_without_recharge():
    s = dlpm()
    s.set_chains([ChainSpec("only", 1)])
    s.submit("r1", "a", 30, 0)
    s.submit("r2", "a", 30, 0)
    s.dispatch(0)
    s.on_tokens("r1", 2, 1)
    q = s.deficit("a")
    s.on_failure("r1", 2, input_tokens=32)
    assert [r.request_id for r in s.waiting("a")] == ["r1", "r2"]
    (g,) = s.dispatch(2)
    assert g.request_id == "r1" and s.deficit("a") == q  # recomputation not charged
    s.on_tokens("r1", 1, 3)
    assert s.deficit("a") == q - 2
    s.on_failure("r1", 4, requeue=False)
    with pytest.raises(UnknownRequestError):
        s.on_tokens("r1", 1, 5)


def test_cancel_queued_and_running():
    s = dlpm()
    s.submit("r1", "a", 30, 0)
    s.submit("r2", "a", 30, 0)
    s.submit("r3", "a", 30, 0)
    s.dispatch(0)
    s.cancel("r3", 1)
    before = s.deficit("a")
    assert [r.request_id for r in s.waiting()] == []
    s.cancel("r1", 1)  # running: keeps its charges, frees the slot
    assert s.deficit("a") == before and s.free_slots()["fast"] == 1


def test_explicit_errors():
    s = dlpm()
    s.submit("r", "a", 5, 0)
    with pytest.raises(DuplicateRequestError):
        s.submit("r", "a", 5, 0)
    with pytest.raises(InvalidEventError):
        s.on_tokens("r", 1, 0)  # still queued
    with pytest.raises(InvalidEventError):
        s.submit("bad", "a", 0, 0)
    with pytest.raises(InvalidEventError, match="max_new_tokens must be >= 0"):
        s.submit("bad", "a", 5, 0, max_new_tokens=-1)
    assert s.submit("score", "a", 5, 0, max_new_tokens=0)  # a prompt scored (echo with logprobs): no output
    with pytest.raises(UnknownRequestError, match="unknown request 'nope' in on_finish"):
        s.on_finish("nope", 0)
    with pytest.raises(UnknownClientError, match="unknown client 'zed'"):
        s.deficit("zed")
    with pytest.raises(UnknownClientError):
        VTCScheduler().counter("zed")
    with pytest.raises(UnknownChainError, match="unknown chain 'x' in pick_for_chain"):
        s.pick_for_chain("x", 0)
    with pytest.raises(ValueError, match="unknown fairness policy"):
        make_scheduler("nope")
    with pytest.raises(ValueError):
        DLPMScheduler(quantum=0)


def test_chain_fit_health_and_replan():
    s = FCFSScheduler()
    s.set_chains([ChainSpec("short", 2, max_length=64), ChainSpec("long", 1, decode_time=2.0)])
    s.submit("big", "a", 100, 0)
    s.submit("small", "b", 10, 0)
    grants = {g.request_id: g.chain_id for g in s.dispatch(0)}
    assert grants == {"big": "long", "small": "short"}  # big skipped the short chain, not blocking others
    s.set_chain_health("short", False)
    s.submit("x", "c", 10, 1)
    assert s.dispatch(1) == [] and s.work_conserving()  # the unhealthy chain offers no slot
    s.set_chains([ChainSpec("long", 1, decode_time=2.0), ChainSpec("new", 1)])
    assert s.active_sessions() == {"long": 1, "new": 0}
    assert [g.chain_id for g in s.dispatch(2)] == ["new"]
    s.on_finish("small", 3)  # its chain was removed by the re-plan: still a valid finish


def test_make_scheduler_names():
    for name in ("fcfs", "lpm", "vtc", "lcf", "dlpm", "swarm", "bfio"):
        assert make_scheduler(name).policy_name in (name, "swarm")
    assert make_scheduler("bfio").chain_mode == "bfio"
    assert make_scheduler("rpm", limit_rpm=3).limit_rpm == 3


def test_output_estimate_moving_average():
    s = SwarmScheduler()
    s.set_chains([ChainSpec("k", 4)])
    s.submit("r1", "a", 10, 0, max_new_tokens=100)
    assert s.output_estimate(s.request("r1")) == 100
    s.dispatch(0)
    s.on_finish("r1", 1, output_tokens=50)
    s.submit("r2", "a", 10, 2, max_new_tokens=40)
    assert s.output_estimate(s.request("r2")) == 40  # capped
    s.dispatch(2)
    s.on_finish("r2", 3, output_tokens=25)
    s.submit("r3", "a", 10, 4)
    assert s.output_estimate(s.request("r3")) == (4 * 50 + 25) / 5


def test_forget_idle_clients():
    s = dlpm()
    s.submit("r", "a", 5, 0)
    s.dispatch(0)
    s.on_finish("r", 1)
    assert s.forget_idle_clients(now=10, idle_for=100) == []
    assert s.forget_idle_clients(now=5000, idle_for=100) == ["a"]
    with pytest.raises(UnknownClientError):
        s.deficit("a")


def test_bfio_mode_avoids_loaded_servers():
    s = make_scheduler("bfio", quantum=1000, bfio_horizon=2, server_kv_time={"s1": 1.0, "s2": 1.0, "s3": 1.0})
    s.set_chains([
        ChainSpec("a", 2, decode_time=0.05, servers=("s1", "s2")),
        ChainSpec("b", 1, decode_time=0.10, servers=("s3",)),
    ])
    s.submit("long", "x", 500, 0, max_new_tokens=50)
    assert s.dispatch(0)[0].chain_id == "a"  # empty swarm: J ties, JFFC picks the faster chain
    s.submit("next", "y", 400, 1, max_new_tokens=50)
    # on "a" it would pile 900 tokens on s1/s2 while s3 idles; "b" balances the servers
    assert s.dispatch(1)[0].chain_id == "b"


def test_metrics_helpers():
    from planner.fairness_metrics import max_backlogged_gap, percentile, service_rates

    events = [(0, "f", 10), (1, "g", 4), (2, "f", 2), (3, "g", 10)]
    assert service_rates(events, 0, 4) == {"f": 3.0, "g": 3.5}
    gap, where = max_backlogged_gap(events, {"f": [(0, 3)], "g": [(1, 5)]})
    assert gap == 12 and where[:2] == ("f", "g")  # D over [1, 3]: -4, -2, -12 (from 0)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
