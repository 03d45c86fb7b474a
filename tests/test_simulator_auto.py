"""fig8's auto column and fig9 (experiments/figures/auto.py) in quick mode, and the report lines they render."""
from __future__ import annotations

import numpy as np

import math

import pytest

from experiments.figures.auto import auto_verdict, azure_jobs
from experiments.figures.methods import _cell_stats
from experiments.report.auto import auto_lines
from experiments.sim.auto_bounds import queue_bound, service_bound
from planner.bounds import exact_mean_response_time
from planner.model import ModelSpec, Server
from planner.plan import plan


def test_azure_jobs_have_the_requested_rate_and_are_seeded():
    a = azure_jobs(0.4, 5000, seed=3)
    assert len(a) == 5000 and np.all(np.diff(a.arrivals) >= 0)
    assert 0.3 < 5000 / a.arrivals[-1] < 0.55
    b = azure_jobs(0.4, 5000, seed=3)
    assert np.array_equal(a.arrivals, b.arrivals) and np.array_equal(a.sizes, b.sizes)
    assert not np.array_equal(a.arrivals, azure_jobs(0.4, 5000, seed=4).arrivals)


def _run(mean, wait=0.0):
    return {"response": {"mean": mean, "p95": 2 * mean}, "waiting": {"mean": wait}, "service": {"mean": mean - wait}}


def test_auto_verdict_and_report_lines():
    methods = ("proposed (c*)", "PETALS", "BPRR", "auto")
    cell = {"J": 10, "eta": 0.2, "runs": {"proposed (c*)": [_run(12.0), _run(12.2)], "PETALS": [_run(11.0), _run(11.1)],
                                          "BPRR": [_run(20.0), _run(21.0)], "auto": [_run(11.5), _run(11.6)]},
            "auto_choice": ["auto: hop-min c=1", "auto: hop-min c=1 + swap a<->b"],
            "bound": {"tmin": [11.0, 11.0], "size_mean": [1.0, 1.02], "service": [11.0, 11.22]}}
    cell["stats"] = _cell_stats(cell, methods)
    v = auto_verdict([cell])
    row = v["rows"][0]
    assert row["vs"]["BPRR"]["ok"] and row["vs"]["proposed (c*)"]["ok"] and not row["vs"]["PETALS"]["ok"]
    assert "PETALS" in row["missed"] and "10% vs c*" in row["missed"] and not v["never_worse"]
    assert row["room"] == pytest.approx(1 - 11.11 / 12.1) and v["grid_avg_room"] == row["room"]
    assert row["auto_over_bound"] == pytest.approx(11.55 / 11.11 - 1)
    v["queue_bounds"] = []
    text = "\n".join(auto_lines({"auto": v, "cells": [cell]}))
    assert "slower than PETALS" in text and "hop-min c=1" in text and "**missed**" in text
    assert "out of reach for any placement" in text and "no placement can meet it" in text


def _tiny():
    """Three servers, L = 4: one fast server holds 3 blocks for one job, two slow ones 2."""
    model = ModelSpec(4, 1.0, 0.25)
    return model, [Server("a", 3.9, 0.5, 1.0), Server("b", 2.6, 0.3, 2.0), Server("c", 2.6, 0.4, 2.0)]


def test_bounds_lie_below_every_plan():
    model, servers = _tiny()
    tmin = service_bound(model, servers)
    assert tmin == pytest.approx(0.5 + 3 * 1.0 + 0.3 + 2.0)  # a takes 3 blocks, b the last one
    lam = 0.12
    q = queue_bound(model, servers, lam, n0=3, time_limit=5.0)
    assert q.tmin == tmin and q.rates[0] == pytest.approx(1 / tmin)
    assert all(r2 >= r1 for r1, r2 in zip(q.rates, q.rates[1:]))
    assert q.value > tmin  # queueing counted: n jobs at once cannot all run at 1/T_min
    for placement in ("auto", "gbp-cr", "whole-model", "petals"):
        try:
            p = plan(model, servers, lam, placement=placement)
        except ValueError:
            continue
        exact = exact_mean_response_time([c.rate for c in p.chains], [c.capacity for c in p.chains], lam)
        assert math.isinf(exact) or exact >= q.value - 1e-9
