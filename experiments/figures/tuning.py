"""Figs. 6 and 7 (spec chain-composition.md §10.3): tuning the cache reservation c, and c* against λ."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from experiments.figures.common import Settings, _claim, _map, _mean_std
from experiments.sim.scenarios import build_scenario, describe
from experiments.sim.simulator import poisson_jobs, simulate_chains
from planner.tuning import iter_candidates


# ================================================================================================
# Figs. 6 and 7: tuning c
# ================================================================================================


def _c_sweep(sc, lam: float, settings: Settings, c_limit: int, sim_runs: int, sim_jobs: int):
    """Candidate rows for c = 1..c_limit with the simulated JFFC mean (simulations shared by every c that
    yields the same chains)."""
    rows, cache = [], {}
    for ev in iter_candidates(sc.model, sc.servers, lam, sc.target_load, c_values=range(1, c_limit + 1)):
        cand = ev.candidate
        row = {"c": cand.c, "K": cand.num_chains, "g": cand.g, "total_rate": cand.total_rate,
               "lower": cand.lower, "upper": cand.upper, "sim": None, "sim_std": None}
        chains = ev.allocation.chains
        if chains and cand.lower is not None:
            key = tuple((ch.service_time, ch.capacity) for ch in chains)
            if key not in cache:
                T = [ch.service_time for ch in chains]
                caps = [ch.capacity for ch in chains]
                means = []
                for r in range(sim_runs):
                    jobs = poisson_jobs(lam, sim_jobs, seed=r)
                    means.append(simulate_chains(T, caps, jobs).mean_response())
                cache[key] = _mean_std(means)
            row["sim"], row["sim_std"] = cache[key]
        rows.append(row)
    return rows, len(cache)


def _argmin(rows, key):
    vals = [(r[key], r["c"]) for r in rows if r[key] is not None]
    return min(vals)[1] if vals else None


def _c_limit(sc, cap: int) -> int:
    """The largest c ≤ cap for which the servers can still hold all L blocks (Σ m_j(c) ≥ L)."""
    from planner.model import max_blocks

    best = 1
    for c in range(1, cap + 1):
        if sum(max_blocks(s, sc.model, c) for s in sc.servers) >= sc.model.num_blocks:
            best = c
    return best


def fig6(settings: Settings) -> dict:
    """Surrogate c·K(c)/λ, Theorem 3.7 bounds and simulated mean response time against c (λ fixed)."""
    lam = 0.2
    sc = build_scenario(settings.config(arrival_rate=lam), 0)
    c_limit = _c_limit(sc, 30 if settings.quick else 120)
    runs = settings.runs
    rows, distinct = _c_sweep(sc, lam, settings, c_limit, runs, settings.num_jobs)
    for r in rows:
        r["surrogate_time"] = None if r["g"] is None else r["g"] / lam
    c_sim = _argmin(rows, "sim")
    c_lo, c_up, c_sur = _argmin(rows, "lower"), _argmin(rows, "upper"), _argmin(rows, "g")
    by_c = {r["c"]: r for r in rows}
    sim_best = by_c[c_sim]
    at_lo = by_c[c_lo]
    se = math.hypot(sim_best["sim_std"], at_lo["sim_std"]) / math.sqrt(runs)
    gap = at_lo["sim"] - sim_best["sim"]
    claims = [
        _claim("the lower bound's minimiser c* matches the simulation's optimum", c_lo == c_sim or gap <= 2 * se,
               f"lower-bound c* = {c_lo}, simulated c* = {c_sim}; simulated mean at lower-bound c* is "
               f"{at_lo['sim']:.3f} s vs optimum {sim_best['sim']:.3f} s (gap {gap:.3f} s, 2 SE = {2 * se:.3f} s)"),
        _claim("the surrogate reserves too little cache (c*_sur < simulated c*)", c_sur is not None and c_sur < c_sim,
               f"surrogate c* = {c_sur}, simulated c* = {c_sim}"),
        _claim("the upper bound reserves too much cache (c*_upper > simulated c*)", c_up is not None and c_up > c_sim,
               f"upper-bound c* = {c_up}, simulated c* = {c_sim}"),
    ]
    return {"figure": "fig6", "arrival_rate": lam, "config": describe(settings.config(arrival_rate=lam)),
            "runs": runs, "num_jobs": settings.num_jobs, "distinct_chain_sets": distinct,
            "c_star": {"simulation": c_sim, "lower": c_lo, "upper": c_up, "surrogate": c_sur},
            "rows": rows, "claims": claims}


def plot_fig6(data: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = data["rows"]
    c = [r["c"] for r in rows]
    nan = lambda v: np.nan if v is None else v  # noqa: E731
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    ax.plot(c, [nan(r["surrogate_time"]) for r in rows], "-", color="tab:purple", label="surrogate c·K(c)/λ")
    ax.plot(c, [nan(r["lower"]) for r in rows], "g--", label="lower bound (31)")
    ax.plot(c, [nan(r["upper"]) for r in rows], "r--", label="upper bound (32)")
    sim = np.array([nan(r["sim"]) for r in rows], dtype=float)
    sd = np.array([nan(r["sim_std"]) for r in rows], dtype=float)
    ax.plot(c, sim, "k-", lw=1.2, label="simulation (JFFC)")
    ax.fill_between(c, sim - sd, sim + sd, color="k", alpha=0.15)
    cs = data["c_star"]
    for key, color in (("simulation", "k"), ("lower", "g"), ("upper", "r"), ("surrogate", "tab:purple")):
        if cs[key] is not None:
            ax.axvline(cs[key], color=color, ls=":", lw=1)
    ax.set_xlabel("cache reservation c")
    ax.set_ylabel("mean response time (s)")
    finite = [v for r in rows for v in (r["lower"], r["sim"]) if v is not None]
    if finite:
        ax.set_ylim(0, 2.5 * min(finite) + 5)
    ax.set_title(f"Fig. 6: tuning c at λ = {data['arrival_rate']} (c*: sim {cs['simulation']}, lower {cs['lower']}, "
                 f"upper {cs['upper']}, surrogate {cs['surrogate']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fig7_point(args):
    lam, settings, c_cap = args
    sc = build_scenario(settings.config(arrival_rate=lam), 0)
    c_limit = _c_limit(sc, c_cap)
    runs = max(2, settings.runs // 2)
    jobs = max(2000, settings.num_jobs // 2)
    rows, _ = _c_sweep(sc, lam, settings, c_limit, runs, jobs)
    sim_c = _argmin(rows, "sim")
    by_c = {r["c"]: r for r in rows}
    return {"arrival_rate": lam, "c_sim": sim_c, "c_lower": _argmin(rows, "lower"), "c_upper": _argmin(rows, "upper"),
            "c_surrogate": _argmin(rows, "g"), "sim_at_lower": by_c[_argmin(rows, "lower")]["sim"] if _argmin(rows, "lower") else None,
            "sim_best": by_c[sim_c]["sim"] if sim_c else None, "runs": runs, "num_jobs": jobs}


def fig7(settings: Settings) -> dict:
    """c* against λ: Theorem 3.7 lower/upper bound, surrogate and simulation."""
    rates = [0.1, 0.3, 0.6] if settings.quick else [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1]
    c_cap = 30 if settings.quick else 120
    args = [(lam, settings, c_cap) for lam in rates]
    points = _map(_fig7_point, args, settings, "fig7")
    points = [p for p in points if p["c_lower"] is not None]
    lo = [p["c_lower"] for p in points]
    mono = all(a <= b for a, b in zip(lo, lo[1:]))
    sim = [p["c_sim"] for p in points]
    corr = float(np.corrcoef(lo, sim)[0, 1]) if len(points) > 2 and np.std(sim) > 0 and np.std(lo) > 0 else float("nan")
    rel = [(p["sim_at_lower"] - p["sim_best"]) / p["sim_best"] for p in points]
    up_ok = sum(1 for p in points if p["c_upper"] is not None and p["c_upper"] >= p["c_sim"])
    sur_ok = sum(1 for p in points if p["c_surrogate"] is not None and p["c_surrogate"] <= p["c_sim"])
    claims = [
        _claim("the lower-bound c* increases monotonically with λ", mono, f"lower-bound c* = {lo} at λ = {[p['arrival_rate'] for p in points]}"),
        _claim("the simulated c* follows the lower-bound c*", rel and max(rel) <= 0.03,
               f"simulated c* = {sim}; correlation {corr:.2f}; the lower-bound c* costs at most "
               f"{100 * max(rel):.1f}% over the simulated optimum"),
        _claim("the upper bound is over-aggressive (c*_upper ≥ simulated c*) and the surrogate over-conservative "
               "(c*_sur ≤ simulated c*)", up_ok == len(points) and sur_ok == len(points),
               f"upper ≥ sim at {up_ok}/{len(points)} λ; surrogate ≤ sim at {sur_ok}/{len(points)} λ "
               f"(surrogate c* = {[p['c_surrogate'] for p in points]}, upper c* = {[p['c_upper'] for p in points]})"),
    ]
    return {"figure": "fig7", "config": describe(settings.config()), "points": points, "claims": claims}


def plot_fig7(data: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    pts = data["points"]
    lam = [p["arrival_rate"] for p in pts]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    nan = lambda v: np.nan if v is None else v  # noqa: E731
    ax.plot(lam, [nan(p["c_lower"]) for p in pts], "g-o", label="lower bound")
    ax.plot(lam, [nan(p["c_sim"]) for p in pts], "k-s", label="simulation")
    ax.plot(lam, [nan(p["c_upper"]) for p in pts], "r--^", label="upper bound")
    ax.plot(lam, [nan(p["c_surrogate"]) for p in pts], ":v", color="tab:purple", label="surrogate c·K(c)")
    ax.set_xlabel("arrival rate λ (req/s)")
    ax.set_ylabel("optimal cache reservation c*")
    ax.set_title("Fig. 7: c* against λ (J = 20, η = 0.2)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
