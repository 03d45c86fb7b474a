"""Fig. 8 with batching servers (issue 20 item 3): ``chainswarm simulate fig8-batching``.

The Fig. 8 grid (BLOOM-176B, λ = 0.2 req/s, ρ̄ = 0.7, J ∈ {10..40} × η ∈ {0.1..0.4}, RIPE Atlas scenarios) is run
in two worlds on the same scenarios and Poisson jobs:

* **paper** — the paper's model, g ≡ 1 for every server (what ``chainswarm simulate fig8`` runs);
* **batching** — every server's decode steps slow down with the sessions it holds, by the batch curve measured
  on this machine (``bench_batching.json``'s ``step_profile``: one batched decode step of b sessions over 15
  SmolLM2 blocks, normalised g(b) = t(b)/t(1); batch bound 8, as the benchmark's servers), applied to the decode
  share of τp_j, D_j = (s_m/b_j)·(l̄_O − 1) (:mod:`planner.service_model`). PETALS' servers batch nothing:
  g(n) = n (petals 2.2). The chain planners know the curves (GCA rates chains at the occupancy their capacities
  imply); ``proposed (c*), blind`` is the plan made with the paper's model, run on the same batching servers.

Every simulation is exact and event-driven (:mod:`experiments.sim.batch_sim` for the chains,
:mod:`experiments.sim.baseline_sim` for PETALS and BPRR). :mod:`experiments.report.batching` writes the report
section, whose conclusions are computed from the JSON.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from experiments.figures.common import Settings, _jsonable, _map
from experiments.paths import RESULTS
from experiments.sim.scenarios import build_scenario, describe
from planner.service_model import BATCH_SIZES, BatchCurve

NAME = "fig8_batching"
BENCH = RESULTS / "bench_batching.json"
WORLDS = ("paper", "batching")
CHAIN_METHODS = ("proposed (c*)", "auto")
METHODS = {"paper": ("proposed (c*)", "auto", "BPRR", "PETALS"),
           "batching": ("proposed (c*)", "proposed (c*), blind", "auto", "BPRR", "PETALS")}
DEFAULT_RUNS, DEFAULT_JOBS = 6, 10_000


def measured_curve(path: Path = BENCH) -> tuple[BatchCurve, dict]:
    """g from the committed benchmark's in-process step profile (batched steps), with the servers' bound."""
    bench = json.loads(Path(path).read_text())
    steps = bench["step_profile"]["step_s"]
    times = [steps[str(b)]["batched"] for b in BATCH_SIZES]
    curve = BatchCurve.from_step_times(times, max_batch=int(bench.get("max_batch", 8)))
    return curve, {"source": Path(path).name, "step_s": times, "model": bench.get("model"),
                   "max_batch": curve.max_batch, "factors": list(curve.factors)}


def with_curves(sc, curve: BatchCurve | None) -> list:
    """The scenario's servers with their decode share D_j and batch curve ``curve`` (None: the paper's)."""
    cfg = sc.config
    out = []
    for j, s in enumerate(sc.servers):
        per_token = sc.gpu(j).per_token_ms(block_size_gb=cfg.model.block_size_gb)[1]
        decode = min(s.compute_time_s, per_token * (cfg.mean_output - 1) / 1000.0)
        out.append(dataclasses.replace(s, decode_time_s=decode, batch=curve))
    return out


def _plans(sc, servers) -> dict:
    from planner.plan import plan

    out = {}
    for name, kwargs in (("proposed (c*)", {}), ("auto", {"placement": "auto"})):
        try:
            out[name] = plan(sc.model, servers, sc.arrival_rate, target_load=sc.target_load, **kwargs)
        except ValueError:
            out[name] = None
    return out


def _summary(result) -> dict:
    s = result.summary()
    return {"mean": s.response.mean, "p95": s.response.p95, "waiting": s.waiting.mean, "service": s.service.mean}


def _baselines(sc, seed: int, servers, petals_servers, jobs) -> dict:
    from experiments.sim.baseline_sim import simulate_bprr, simulate_petals

    out = {}
    try:
        res, _ = simulate_petals(sc.model, petals_servers, sc.rtt_ms, jobs, join_seed=seed,
                                 mean_output=sc.config.mean_output, max_retries_per_job=200)
        out["PETALS"] = _summary(res)
    except (ValueError, OverflowError) as exc:
        out["PETALS"] = {"unstable": str(exc)}
    try:
        res, _ = simulate_bprr(sc.model, servers, jobs, sc.arrival_rate)
        out["BPRR"] = _summary(res)
    except ValueError as exc:
        out["BPRR"] = {"unstable": str(exc)}
    return out


def _run(sc, seed: int, curve: BatchCurve, num_jobs: int) -> dict:
    """One scenario in both worlds: {world: {method: summary}} plus the planners' choices and predictions."""
    from experiments.sim.batch_sim import simulate_plan
    from experiments.sim.simulator import poisson_jobs

    jobs = poisson_jobs(sc.arrival_rate, num_jobs, seed=1000 + seed)
    paper, batching = list(sc.servers), with_curves(sc, curve)
    sequential = with_curves(sc, BatchCurve.sequential())
    plans = {"paper": _plans(sc, paper), "batching": _plans(sc, batching)}
    plans["batching"]["proposed (c*), blind"] = plans["paper"]["proposed (c*)"]
    out: dict = {"paper": _baselines(sc, seed, paper, paper, jobs),
                 "batching": _baselines(sc, seed, batching, sequential, jobs), "choice": {}, "predicted": {}}
    for world, servers in (("paper", paper), ("batching", batching)):
        for name, p in plans[world].items():
            if p is None:
                out[world][name] = {"unstable": "no plan"}
                continue
            out[world][name] = _summary(simulate_plan(p.chains, servers, jobs))
            out["choice"][f"{world}: {name}"] = p.tuning if name == "auto" else p.c
            if p.bounds is not None:
                out["predicted"][f"{world}: {name}"] = {"lower": p.bounds.lower, "upper": p.bounds.upper}
    return out


def _cell(args) -> dict:
    J, eta, settings, curve = args
    runs = []
    for s in range(settings.runs):
        sc = build_scenario(settings.config(num_servers=J, eta=eta), s)
        runs.append(_run(sc, s, curve, settings.num_jobs))
    return {"J": J, "eta": eta, "runs": runs, "stats": cell_stats(runs)}


def cell_stats(runs: list[dict]) -> dict:
    """Per world and method: mean (over runs) of mean and P95 response, its Monte Carlo std, valid runs."""
    stats: dict = {}
    for world in WORLDS:
        for m in METHODS[world]:
            ok = [r[world][m] for r in runs if "mean" in r[world].get(m, {})]
            means = [x["mean"] for x in ok]
            stats[f"{world}: {m}"] = {
                "mean": float(np.mean(means)) if ok else None,
                "std": float(np.std(means, ddof=1) / np.sqrt(len(means))) if len(ok) > 1 else 0.0 if ok else None,
                "p95": float(np.mean([x["p95"] for x in ok])) if ok else None,
                "service": float(np.mean([x["service"] for x in ok])) if ok else None,
                "valid": len(ok), "unstable": len(runs) - len(ok)}
    return stats


def fig8_batching(settings: Settings, curve: BatchCurve | None = None, curve_meta: dict | None = None) -> dict:
    if curve is None:
        curve, curve_meta = measured_curve()
    Js = [10, 20] if settings.quick else [10, 20, 30, 40]
    etas = [0.1, 0.2] if settings.quick else [0.1, 0.2, 0.3, 0.4]
    started = time.perf_counter()
    load = os.getloadavg()
    cells = _map(_cell, [(J, eta, settings, curve) for J in Js for eta in etas], settings, NAME)
    return _jsonable({"figure": NAME, "Js": Js, "etas": etas, "config": describe(settings.config()),
                      "runs": settings.runs, "num_jobs": settings.num_jobs, "curve": curve_meta or curve.to_dict(),
                      "worlds": {w: list(METHODS[w]) for w in WORLDS}, "cells": cells,
                      "elapsed_s": time.perf_counter() - started, "load_average_at_start": list(load)})


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Js, etas = data["Js"], data["etas"]
    colors = {"proposed (c*)": "tab:olive", "proposed (c*), blind": "tab:green", "auto": "tab:purple",
              "BPRR": "tab:blue", "PETALS": "tab:red"}
    fig, axes = plt.subplots(2, len(Js), figsize=(4.0 * len(Js), 7.6), sharey=True, squeeze=False)
    for row, world in enumerate(WORLDS):
        methods = data["worlds"][world]
        width = 0.8 / len(methods)
        for ax, J in zip(axes[row], Js):
            for i, m in enumerate(methods):
                ys, es = [], []
                for eta in etas:
                    st = next(c for c in data["cells"] if c["J"] == J and c["eta"] == eta)["stats"][f"{world}: {m}"]
                    ys.append(np.nan if st["mean"] is None else st["mean"])
                    es.append(0.0 if st["std"] is None else st["std"])
                ax.bar(np.arange(len(etas)) + (i - (len(methods) - 1) / 2) * width, ys, width, yerr=es, capsize=2,
                       color=colors[m], label=m)
            ax.set_xticks(range(len(etas)), [f"η={e}" for e in etas])
            ax.set_title(f"J = {J}, {'g ≡ 1 (paper)' if world == 'paper' else 'batching servers'}", fontsize=9)
            ax.set_yscale("log")
            ax.grid(alpha=0.3, axis="y", which="both")
        axes[row][0].set_ylabel("mean response time (s), log")
        axes[row][0].legend(fontsize=7)
    fig.suptitle("Fig. 8 with batching servers (PETALS: g(n) = n), λ = 0.2 req/s; error bars: Monte Carlo std "
                 "of the mean", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_cli(args) -> int:
    """``chainswarm simulate fig8-batching [--quick] [--runs N] [--workers N] [--out DIR] [--replot]``."""
    import sys

    from experiments.figures.common import run_figure_cli
    from experiments.report import batching as fig_batching_report

    def compute() -> dict:
        quick = bool(args.quick)
        settings = Settings(runs=args.runs or (2 if quick else DEFAULT_RUNS),
                            num_jobs=2_000 if quick else DEFAULT_JOBS, quick=quick,
                            workers=args.workers or (1 if quick else min(2, os.cpu_count() or 1)),
                            progress=not args.no_progress and sys.stderr.isatty(), comm_model=args.comm_model)
        return fig8_batching(settings)

    return run_figure_cli(args, NAME, compute, plot, fig_batching_report.section)
