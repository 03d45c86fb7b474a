"""The methods Figs. 8 and 9 compare (:mod:`experiments.figures.baselines`, :mod:`experiments.figures.auto`):
the chain-composing plans (Proposed with c = 7 and the tuned c*, auto) and the PETALS and BPRR baselines,
planned and simulated on one scenario, and the per-cell statistics of their runs."""
from __future__ import annotations

import numpy as np

from experiments.figures.common import C_UNIT, _mean_std
from experiments.sim.simulator import simulate_chains


METHODS_FIG8 = ("proposed (c=7)", "proposed (c*)", "PETALS", "BPRR", "auto")


PLAN_METHODS = {"proposed (c=7)": {"c": C_UNIT}, "proposed (c*)": {}, "auto": {"placement": "auto"}}


def plan_methods(sc, names) -> dict:
    """The plans of the chain-composing ``names`` (keys of PLAN_METHODS) on one scenario (None: infeasible)."""
    from planner.plan import plan

    plans = {}
    for name in names:
        try:
            plans[name] = plan(sc.model, sc.servers, sc.arrival_rate, target_load=sc.target_load, **PLAN_METHODS[name])
        except ValueError:
            plans[name] = None
    return plans


def run_methods(sc, s: int, plans: dict, jobs, base_jobs: int, out: dict, extra: dict) -> None:
    """Simulate every plan in ``plans`` and the PETALS and BPRR baselines on ``jobs`` (scenario seed ``s``);
    append the summaries to ``out[method]`` and the bookkeeping to ``extra``."""
    from experiments.sim.baseline_sim import simulate_bprr, simulate_petals

    for name, p in plans.items():
        if p is None:
            out[name].append(None)
            continue
        if name == "proposed (c*)":
            extra["c_star"].append(p.c)
        if name == "auto":
            extra.setdefault("auto_choice", []).append(p.tuning)
        if p.overloaded:
            extra["unstable"][name] += 1
        res = simulate_chains([ch.service_time for ch in p.chains], [ch.capacity for ch in p.chains], jobs)
        out[name].append(res.summary().to_dict())
    bjobs = jobs.head(base_jobs)
    try:
        res, info = simulate_petals(sc.model, sc.servers, sc.rtt_ms, bjobs, join_seed=s,
                                    mean_output=sc.config.mean_output, max_retries_per_job=200)
        extra["petals_retries"].append(info["retries"])
        out["PETALS"].append(res.summary().to_dict())
    except (ValueError, OverflowError) as exc:
        extra["unstable"]["PETALS"] += 1
        out["PETALS"].append({"unstable": str(exc)})
    try:
        res, info = simulate_bprr(sc.model, sc.servers, bjobs, sc.arrival_rate)
        extra["bprr_R"].append(info["reservation"])
        extra["bprr_surprises"].append(info["surprise_failures"])
        out["BPRR"].append(res.summary().to_dict())
    except ValueError as exc:
        extra["unstable"]["BPRR"] += 1
        out["BPRR"].append({"unstable": str(exc)})


def empty_cell(methods) -> tuple[dict, dict]:
    return ({m: [] for m in methods}, {"c_star": [], "bprr_R": [], "petals_retries": [], "bprr_surprises": [],
                                       "unstable": {m: 0 for m in methods}})


def _cell_stats(cell: dict, methods=METHODS_FIG8) -> dict:
    stats = {}
    for m in methods:
        ok = [r for r in cell["runs"][m] if r and "response" in r]
        mean = [r["response"]["mean"] for r in ok]
        p95 = [r["response"]["p95"] for r in ok]
        stats[m] = {"mean": float(np.mean(mean)) if mean else None, "mean_std": _mean_std(mean)[1] if mean else None,
                    "p95": float(np.mean(p95)) if p95 else None, "waiting": float(np.mean([r["waiting"]["mean"] for r in ok])) if ok else None,
                    "service": float(np.mean([r["service"]["mean"] for r in ok])) if ok else None,
                    "valid_runs": len(ok)}
    for prop, bases in (("proposed (c=7)", ("PETALS", "BPRR")), ("proposed (c*)", ("PETALS", "BPRR")),
                        ("auto", ("PETALS", "BPRR", "proposed (c*)", "proposed (c=7)"))):
        for base in bases:
            if prop not in methods or base not in methods:
                continue
            pairs = [(a, b) for a, b in zip(cell["runs"][prop], cell["runs"][base])
                     if a and b and "response" in a and "response" in b]
            red = [1 - a["response"]["mean"] / b["response"]["mean"] for a, b in pairs]
            red95 = [1 - a["response"]["p95"] / b["response"]["p95"] for a, b in pairs]
            key = f"{prop} vs {base}"
            sp, sb = stats[prop], stats[base]
            stats[key] = {
                "reduction_mean": None if not (sp["mean"] and sb["mean"]) else 1 - sp["mean"] / sb["mean"],
                "reduction_p95": None if not (sp["p95"] and sb["p95"]) else 1 - sp["p95"] / sb["p95"],
                "per_run_mean": float(np.mean(red)) if red else None,
                "per_run_std": _mean_std(red)[1] if red else None,
                "per_run_min": float(np.min(red)) if red else None,
                "per_run_max": float(np.max(red)) if red else None,
                "per_run_p95_mean": float(np.mean(red95)) if red95 else None,
                "pairs": len(pairs),
            }
    return stats
