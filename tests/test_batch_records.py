"""Servers' published batch curves: measured and cached (server/profiling.py), declared, bounded by the profile
record's schema (swarm/trust/records.py, enforced by every DHT peer's validator), and turned into planner servers by
the orchestrator (swarm/control/planning.py)."""
from __future__ import annotations

import json

import pytest

from planner.service_model import BatchCurve
from server import profiling
from swarm.trust import records
from swarm.control.planning import Expectations, RoutableChain, choose_plan, planned_step_s, planner_inputs
from test_orchestrator_logic import profile
from test_signing import NODE, _accepts, _record, _signed

STEPS = (0.010, 0.0146, 0.0148, 0.0211, 0.0275)


def test_profile_schema_accepts_a_curve_and_refuses_malformed_ones():
    good = dict(profile("n1", 3).to_dict(), node_id="n1", batch_step_s=list(STEPS), max_batch=8)
    assert records.ServerProfile.from_dict(good).batch_curve() == BatchCurve.from_step_times(STEPS, 8)
    assert _accepts(_signed(NODE, _record(records.PROFILES, NODE.subkey("n1"), good)))
    for field, bad in (("batch_step_s", [0.01, 0.02]),  # not one time per batch size
                       ("batch_step_s", [0.01, 0.02, "x", 0.04, 0.05]),
                       ("batch_step_s", [0.02, 0.01, 0.03, 0.04, 0.05]),  # a larger batch faster
                       ("batch_step_s", [0.01, 0.02, 0.04, 0.08, 0.5]),  # > 2 × sequential
                       ("batch_step_s", [0.01, 0.02, 0.04, float("inf"), 0.1]),
                       ("batch_step_s", {"1": 0.01}), ("max_batch", 0), ("max_batch", 10**6), ("max_batch", 2.5),
                       ("prefix_epoch", ""), ("prefix_epoch", "e" * 65), ("prefix_epoch", 7)):
        value = dict(good, **{field: bad})
        with pytest.raises(records.RecordError):
            records.ServerProfile.from_dict(value)
        assert not _accepts(_signed(NODE, _record(records.PROFILES, NODE.subkey("n1"), value))), (field, bad)
    plain = records.ServerProfile.from_dict(profile("n1", 3).to_dict())  # older servers: no curve
    assert plain.batch_step_s is None and plain.batch_curve() is None and plain.prefix_epoch is None
    assert records.ServerProfile.from_dict(dict(good, prefix_epoch="3f2a9c01d4e5")).prefix_epoch == "3f2a9c01d4e5"


def test_a_profile_says_when_its_memory_cannot_hold_one_block():
    fits = records.ServerProfile.from_dict(profile("n1", 3).to_dict())
    assert fits.memory_bytes >= fits.block_bytes and fits.memory_shortfall() is None
    small = records.ServerProfile.from_dict(dict(fits.to_dict(), memory_bytes=3 * 2**20, block_bytes=14 * 2**20))
    assert small.memory_shortfall() == ("--memory-gb 0.00293 cannot hold one block of this model (0.0137 GB of "
                                        "weights, and its KV cache): no plan will use this server")


def test_measured_declared_and_sequential_curves(tiny_model, tmp_path):
    from swarm.model.compat import petals  # noqa: F401
    from petals.utils.auto_config import AutoDistributedConfig

    config = AutoDistributedConfig.from_pretrained(tiny_model)
    measured = profiling.batch_step_times(config, max_batch=8, decode_s=0.002, cache_dir=tmp_path)
    assert measured[0] == pytest.approx(0.002) and list(measured) == sorted(measured)
    assert measured[-1] > measured[0] and all(t <= b * 0.002 + 1e-12 for t, b in zip(measured, (1, 2, 4, 8, 16)))
    factors = json.loads((tmp_path / profiling.CACHE_FILE).read_text())[
        profiling.batch_cache_key(config, "cpu", "float32", "none")]
    again = profiling.batch_step_times(config, max_batch=4, decode_s=0.004, cache_dir=tmp_path)  # cached shape
    assert again == pytest.approx(tuple(0.004 * f for f in factors))
    assert profiling.batch_step_times(config, max_batch=1, decode_s=0.003, cache_dir=tmp_path) == pytest.approx(
        (0.003, 0.006, 0.012, 0.024, 0.048))  # petals' pool: sessions one after another, nothing measured
    published = lambda declared: profiling.published_batch_steps(  # noqa: E731
        declared, config, "cpu", "float32", "none", max_batch=8, decode_s=0.002, cache_dir=tmp_path)
    assert published({"prefill_s": 1e-4, "decode_s": 1e-3}) is None  # declared compute alone: g ≡ 1
    assert published({"batch_step_s": list(STEPS)}) == STEPS
    with pytest.raises(records.RecordError):
        published({"batch_step_s": [1, 2]})
    assert profiling.with_emulated_decode(STEPS, 0.5) == pytest.approx(tuple(t + 0.5 for t in STEPS))


def test_orchestrator_plans_with_the_published_curves():
    expect = Expectations(max_length=512, input_tokens=100, output_tokens=21, arrival_rate=0.5)
    base = profile("n1", 3)
    with_curve = records.ServerProfile.from_dict(dict(base.to_dict(), batch_step_s=list(STEPS), max_batch=8))
    _, (plain,) = planner_inputs([base], 8, expect)
    _, (server,) = planner_inputs([with_curve], 8, expect)
    assert plain.batch is None and plain.decode_time_s == pytest.approx(base.decode_s * 20)
    assert server.batch == BatchCurve.from_step_times(STEPS, 8)
    assert (server.compute_time_s, server.decode_time_s) == (plain.compute_time_s, plain.decode_time_s)


def test_orchestrator_plans_and_times_steps_with_the_curves():
    expect = Expectations(max_length=512, input_tokens=100, output_tokens=21, arrival_rate=0.5)
    steps = [5e-4 * f for f in (1, 1.5, 1.6, 2.2, 3.0)]
    curved = [records.ServerProfile.from_dict(dict(profile(n, 3).to_dict(), batch_step_s=steps, max_batch=8))
              for n in ("n1", "n2")]
    plan, _ = choose_plan(curved, 8, expect, None)
    plain, _ = choose_plan([profile(n, 3) for n in ("n1", "n2")], 8, expect, None)
    assert all(ch.solo_time is not None and ch.service_time > ch.solo_time for ch in plan.chains)
    assert all(ch.solo_time is None for ch in plain.chains)
    assert plan.total_rate < plain.total_rate  # ν at capacity occupancy: the batch slows full chains
    # the stall timeout's planned decode step: g(sessions) on a curve, one session after another without
    chain = RoutableChain("p/0", 0, ("n1",), ((0, 8),), 4, 1.0, (("peer", 0, 8),), True)
    assignment = {"n1": records.Assignment("p", 0, 8, cache_slots=8 * 4, max_length=512)}
    rtt = curved[0].rtt_s
    assert planned_step_s(chain, {"n1": curved[0]}, assignment, 1) == pytest.approx(8 * 5e-4 * 1.6 + rtt)
    assert planned_step_s(chain, {"n1": profile("n1", 3)}, assignment, 1) == pytest.approx(8 * 5e-4 * 4 + rtt)
