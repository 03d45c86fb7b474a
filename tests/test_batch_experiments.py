"""Fig. 8 with batching servers (experiments/figures/batching.py) and the batch term of the validation experiment
(experiments/live/batch_validation.py), on small inputs and on the committed benchmark."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from experiments.figures.batching import METHODS, fig8_batching, measured_curve, run_cli
from experiments.figures.common import Settings
from experiments.live import batch_validation as bv
from planner.service_model import BatchCurve

RESULTS = Path(__file__).resolve().parents[1] / "experiments" / "results"


def test_service_time_under_the_observed_occupancy_by_hand():
    steps = bv.occupancy([{"servers": ["a"], "started": 0.0, "completed": 1.0},
                          {"servers": ["a"], "started": 0.0, "completed": 5.0}])
    assert steps["a"] == ([0.0, 0.0, 1.0, 5.0], [1, 2, 1, 0])
    # alone 2 s, 1 s of it decode on a server with g(n) = n: 2 sessions until t = 1 (speed 2/3), then alone
    assert bv.ps_service_time(0.0, 2.0, [("a", 1.0, BatchCurve.sequential())], steps) == pytest.approx(1 + 4 / 3)
    assert bv.ps_service_time(2.0, 2.0, [("a", 1.0, BatchCurve.sequential())], steps) == pytest.approx(2.0)


def test_the_batch_term_explains_the_benchmarks_slowdown_with_sessions():
    rows = bv.bench_check(json.loads((RESULTS / "bench_batching.json").read_text()))
    assert {r["servers"] for r in rows} == {"vanilla_petals", "chainswarm_batched", "chainswarm_multi"}
    for kind in ("vanilla_petals", "chainswarm_batched", "chainswarm_multi"):
        multi = [r for r in rows if r["servers"] == kind and r["sessions"] > 1]
        err = lambda key: np.median([abs(np.log(r[key])) for r in multi])  # noqa: E731
        assert err("ratio") < err("ratio_no_batch"), kind
    # the multi-session path pays the per-request costs once per step: the step profile predicts its latency
    multi = [r for r in rows if r["servers"] == "chainswarm_multi" and r["sessions"] > 1]
    assert np.median([abs(np.log(r["ratio"])) for r in multi]) < 0.15
    one = [r for r in rows if r["sessions"] == 1]
    assert one and all(r["ratio"] == r["ratio_no_batch"] == 1.0 for r in one)


def test_fig8_batching_small_run_and_its_report(tmp_path):
    curve, meta = measured_curve()
    assert curve.max_batch == 8 and curve.factors[-1] > curve.factors[0] == 1.0
    data = fig8_batching(Settings(runs=1, num_jobs=600, quick=True, workers=1, progress=False), curve, meta)
    assert [(c["J"], c["eta"]) for c in data["cells"]] == [(10, 0.1), (10, 0.2), (20, 0.1), (20, 0.2)]
    for cell in data["cells"]:
        run = cell["runs"][0]
        assert set(run["batching"]) == set(METHODS["batching"]) and set(run["paper"]) == set(METHODS["paper"])
        # the same plan and jobs on batching servers take longer than with g ≡ 1
        assert run["batching"]["proposed (c*), blind"]["service"] > run["paper"]["proposed (c*)"]["service"]
    (tmp_path / f"{data['figure']}.json").write_text(json.dumps(data))
    args = argparse.Namespace(out=tmp_path, replot=True, quick=True, runs=None, workers=None, no_progress=True,
                              comm_model="per-token")
    assert run_cli(args) == 0
    section = (tmp_path / "sections" / "fig8_batching.md").read_text()
    assert "| 20 | 0.2 |" in section and "**Proposed (c*) vs PETALS**" in section and "Cost of real servers" in section
    assert (tmp_path / "fig8_batching.png").stat().st_size > 0 and (tmp_path / "REPORT.md").exists()


def test_bench_batching_runs_both_swarms_end_to_end(tiny_model):
    """experiments/bench/batching.py against live swarms (the tiny model, 2 sessions × 3 tokens): vanilla petals
    servers and batched Chainswarm nodes both serve petals' own client (the nodes open to it), and each run
    records tokens, latencies and the servers' CPU time per token."""
    from tqdm import tqdm

    from experiments.bench.batching import SETUPS, bench_servers

    results = bench_servers(tiny_model, [2], tokens=3, max_batch=8, repeats=1, progress=tqdm(disable=True))
    for name in SETUPS:
        assert [r["client"] for r in results[name]] == ["generate", "blocks_only"]
        for row in results[name]:
            assert row["errors"] == [] and row["tokens"] == 6, (name, row["errors"])
            assert row["server_cpu_ms_per_token"] > 0 and row["ttft_ms_median"] > 0
        assert [len(out) for out in results[name][0]["outputs"]] == [3, 3]
    assert results["chainswarm_batched"][0]["server_cpu_ratio"] > 0
