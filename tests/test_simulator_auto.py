"""fig8's auto column and fig9 (experiments/fig_auto.py) in quick mode, and the report lines they render."""
from __future__ import annotations

import numpy as np

from experiments.auto_report import auto_lines
from experiments.fig_auto import auto_verdict, azure_jobs, reduced_instance
from experiments.fig_baselines import _cell_stats
from experiments.figure_common import Settings
from experiments.scenarios import ScenarioConfig, build_scenario


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
            "auto_choice": ["auto: hop-min c=1", "auto: hop-min c=1 + swap a<->b"]}
    cell["stats"] = _cell_stats(cell, methods)
    v = auto_verdict([cell])
    row = v["rows"][0]
    assert row["vs"]["BPRR"]["ok"] and row["vs"]["proposed (c*)"]["ok"] and not row["vs"]["PETALS"]["ok"]
    assert "PETALS" in row["missed"] and "10% vs c*" in row["missed"] and not v["never_worse"]
    v["exhaustive"] = []
    text = "\n".join(auto_lines({"auto": v, "cells": [cell]}))
    assert "slower than PETALS" in text and "hop-min c=1" in text and "**missed**" in text


def test_reduced_instance_keeps_the_share_of_the_model():
    sc = build_scenario(ScenarioConfig(num_servers=10, eta=0.2), 0)
    model, servers = reduced_instance(sc)
    assert model.num_blocks == 5 and len(servers) == 5
    from planner.model import max_blocks
    assert {max_blocks(s, model, 1) for s in servers} <= {1, 2}
