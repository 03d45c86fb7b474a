"""KV memory by the token on the Azure trace's own lengths (issue 28): ``chainswarm simulate kv-lengths``.

One swarm, fig8-batching's setting: the BLOOM-176B scenario at J = 20, η = 0.2 (RIPE Atlas draw ``SCENARIO_SEED``),
every server batching by the curve measured on this machine (:func:`experiments.figures.batching.with_curves`),
planned for λ = 0.2 req/s at ρ̄ = 0.7 with the trace's mean lengths (l̄_I = 2,048, l̄_O = 28, the orchestrator's
defaults). Jobs arrive by a Poisson process at several rates; each takes the (prompt, output) lengths of a trace
row drawn at random, and runs for the time those lengths take on its chain
(:func:`experiments.sim.scenarios.service_matrix`), slowed by the sessions its servers hold
(:mod:`experiments.sim.batch_sim`). Three admissions, on the same jobs:

* **max-length slots** (``--kv-admission slots``): the planner's slot is ``max_length`` tokens, and chain k
  runs c_k sessions whatever their lengths;
* **expected-length slots**: the token plan (slots of l̄_I + l̄_O in whole pages), each session taking one of
  c_k slots whatever its length. This is the papers' model. A chain can then hold more KV than it has, and the
  live paged pool would fail those sessions. The simulator does not: it counts how often it happens;
* **tokens** (``--kv-admission tokens``, the default): the same plan, a session reserving its own prompt +
  output in whole pages of chain k's budget c_k · slot_tokens (:class:`planner.token_dispatch.TokenJFFC`).
  As in the orchestrator, the slot count is no bound: c_k · slot_tokens / 16 one-page sessions.

``max_length`` is 8,192, the smallest power of two that holds every request of the trace: 38% of them are
longer than petals' default 2,048. The planner tunes c by bounds for sessions of one length, the expected one.
Tuned over every c, its largest chain budget can be smaller than ``max_length``, and the orchestrator would refuse
the longer requests (``refused_by_tuned_plan`` says how many). So, as in the orchestrator
(:func:`swarm.control.planning.choose_plan`), the token plan is tuned over the c whose chains include one of
capacity c_k ≥ c_min = ⌈max_length / slot_tokens⌉, and every admission runs every job. A sweep runs token
admission on the plans of every c from the least such c up (more KV per chain; GBP-CR forms other chains), to
show how the bound's choice compares.

The same job sequence (lengths and Exp(1) gaps, seed ``JOB_SEED + run``) is replayed at every rate, its gaps
divided by λ. :mod:`experiments.report.kv_lengths` writes the section from the JSON.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np

from experiments.figures.common import Settings, _bar, _jsonable
from experiments.sim.simulator import DEFAULT_WARMUP, Jobs, load_trace
from planner.model import largest_capacity
from swarm.control.planning import KV_PAGE as PAGE  # the orchestrator's reservation unit, tokens
from swarm.control.planning import Expectations  # its slot size and c_min

NAME = "kv_lengths"
MODES = ("max-length slots", "expected-length slots", "tokens")
DEFAULT_RATES = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3)
QUICK_RATES = (0.1, 0.2, 0.3)
DEFAULT_RUNS, DEFAULT_JOBS = 10, 10_000
MAX_LENGTH = 8192
PLAN_RATE, TARGET_LOAD = 0.2, 0.7
NUM_SERVERS, ETA, SCENARIO_SEED = 20, 0.2, 0
MEAN_INPUT, MEAN_OUTPUT = 2048.0, 28.0
JOB_SEED = 5000
SWEEP_SPAN, SWEEP_STOP = 6, 10.0
SAMPLE_NOTE = ("{runs} runs × {jobs:,} jobs per point. Fig. 8 uses 20 × 20,000; this figure's default, 10 × 10,000, "
               "keeps the whole run near a minute and a half on 2 shared cores")
KV_REFERENCE_TOKENS = 2048
"""BLOOM-176B's s_c = 0.11 GB per block is one 2,048-token session (chain-composition §10.1)."""


def pages(tokens) -> np.ndarray:
    """Tokens rounded up to whole KV pages (the orchestrator's ``kv_need``)."""
    return -(-np.asarray(tokens, dtype=np.int64) // PAGE) * PAGE


@dataclasses.dataclass(frozen=True)
class Setup:
    """The swarm, its plans ("max-length", "tokens", and "tokens c=<c>" for the sweep) and the trace's lengths."""

    scenario: object
    servers: list
    plans: dict  # planner Plans
    slot_tokens: int
    max_length: int
    inputs: np.ndarray
    outputs: np.ndarray
    meta: dict


def _plan_for(sc, servers, slot_tokens: int, c: int | None = None, min_c: int = 1):
    from planner.plan import plan

    model = dataclasses.replace(sc.model, cache_slot_gb=sc.model.cache_slot_gb * slot_tokens / KV_REFERENCE_TOKENS)
    return plan(model, servers, PLAN_RATE, target_load=TARGET_LOAD, c=c, min_c=min_c)


def make_setup(max_length: int = MAX_LENGTH, curve=None, sweep_span: int = 0) -> Setup:
    from experiments.figures.batching import measured_curve, with_curves
    from experiments.sim.scenarios import ScenarioConfig, build_scenario

    curve_meta = None
    if curve is None:
        curve, curve_meta = measured_curve()
    cfg = ScenarioConfig(num_servers=NUM_SERVERS, eta=ETA, arrival_rate=PLAN_RATE, target_load=TARGET_LOAD,
                         mean_input=MEAN_INPUT, mean_output=MEAN_OUTPUT)
    sc = build_scenario(cfg, SCENARIO_SEED)
    servers = with_curves(sc, curve)
    trace = load_trace()
    need = np.minimum(pages(trace.input_tokens + trace.output_tokens), max_length)
    # the orchestrator's own slot size and c_min for these lengths
    expect = Expectations(max_length=max_length, input_tokens=MEAN_INPUT, output_tokens=MEAN_OUTPUT,
                          arrival_rate=PLAN_RATE)
    slot, min_c = expect.slot_tokens, expect.min_c
    plan_a = _plan_for(sc, servers, max_length)
    tuned = _plan_for(sc, servers, slot)
    plan_t = _plan_for(sc, servers, slot, min_c=min_c)  # the orchestrator's rule
    least = tuned
    while largest_capacity(least.chains) < min_c:
        least = _plan_for(sc, servers, slot, c=least.c + 1)
    tuned_budget = largest_capacity(tuned.chains) * slot
    plans = {"max-length": plan_a, "tokens": plan_t, f"tokens c={least.c}": least}
    for c in range(least.c + 1, least.c + 1 + sweep_span):
        try:
            plans[f"tokens c={c}"] = _plan_for(sc, servers, slot, c=c)
        except ValueError:  # no chain forms with that many slots
            break

    def describe_plan(p, slot_size):
        return {"c": p.c, "slot_tokens": slot_size, "total_slots": sum(ch.capacity for ch in p.chains),
                "chains": [{"servers": list(ch.servers), "capacity": ch.capacity, "service_time_s": ch.service_time,
                            "budget_tokens": ch.capacity * slot_size} for ch in p.chains]}

    meta = {"scenario": f"BLOOM-176B (L={sc.model.num_blocks}), J={NUM_SERVERS}, η={ETA}, RIPE Atlas draw "
                        f"{SCENARIO_SEED}, batching servers; planned for λ={PLAN_RATE:g} req/s, ρ̄={TARGET_LOAD}, "
                        f"l̄_I={MEAN_INPUT:g}, l̄_O={MEAN_OUTPUT:g}",
            "max_length": max_length, "slot_tokens": slot, "page_tokens": PAGE,
            "kv_gb_per_block_per_token": sc.model.cache_slot_gb / KV_REFERENCE_TOKENS,
            "curve": curve_meta or curve.to_dict(),
            "trace": {"requests": len(trace), "mean_input": float(trace.input_tokens.mean()),
                      "mean_output": float(trace.output_tokens.mean()), "mean_need": float(need.mean()),
                      "median_need": float(np.median(need)), "p95_need": float(np.percentile(need, 95)),
                      "max_need": int(need.max()), "longer_than_2048": float((trace.input_tokens
                                                                              + trace.output_tokens > 2048).mean()),
                      "short_share": float((need <= slot).mean())},
            "plans": {"max-length": describe_plan(plan_a, max_length), "tokens": describe_plan(plan_t, slot)},
            "min_c": min_c,
            "tuned_token_plan": {"c": tuned.c, "largest_budget": tuned_budget,
                                 "refused_by_tuned_plan": float((need > tuned_budget).mean())},
            "sweep": {str(p.c): {"chains": len(p.chains), "total_slots": sum(ch.capacity for ch in p.chains),
                                 "budgets": [ch.capacity * slot for ch in p.chains],
                                 "service_time_s": [ch.service_time for ch in p.chains]}
                      for key, p in plans.items() if key.startswith("tokens c=")}}
    return Setup(sc, servers, plans, slot, max_length,
                 trace.input_tokens, trace.output_tokens, meta)


def sample_jobs(setup: Setup, rate: float, num_jobs: int, run: int) -> Jobs:
    """``num_jobs`` trace rows drawn with replacement, Poisson(λ) arrivals; the same draws at every rate."""
    rng = np.random.default_rng(JOB_SEED + run)
    rows = rng.integers(0, setup.inputs.size, size=num_jobs)
    gaps = rng.exponential(1.0, size=num_jobs)
    return Jobs(np.cumsum(gaps) / rate, np.ones(num_jobs), setup.inputs[rows].copy(), setup.outputs[rows].copy())


def kv_stats(result, needs: np.ndarray, budgets, t0: float, t1: float) -> dict:
    """Occupancy in the window [t0, t1]: time-average sessions, KV held ÷ the chains' budgets, the share of the
    window some chain holds more than its budget, and, over the whole run, the share of sessions that start
    into a chain then over its budget and the highest held ÷ budget."""
    start, finish, chain = result.start, result.finish, result.chain
    span = max(t1 - t0, 1e-9)
    sessions = float((np.clip(finish, t0, t1) - np.clip(start, t0, t1)).sum() / span)
    held_area, over_start, peak = 0.0, 0, 0.0
    over_mask: list[tuple[np.ndarray, np.ndarray]] = []
    for k, budget in enumerate(budgets):
        on = chain == k
        if not on.any():
            continue
        n = needs[on]
        times = np.concatenate([finish[on], start[on]])
        delta = np.concatenate([-n, n])
        is_start = np.concatenate([np.zeros(n.size, bool), np.ones(n.size, bool)])
        order = np.lexsort((is_start, times))  # completions before starts at the same instant, as simulated
        times, held, is_start = times[order], np.cumsum(delta[order]), is_start[order]
        over_start += int((held[is_start] > budget).sum())
        peak = max(peak, float(held.max()) / budget)
        seg = np.clip(np.append(times[1:], times[-1]), t0, t1) - np.clip(times, t0, t1)
        held_area += float((held * seg).sum())
        over_mask.append((times, held > budget))
    over_time = 0.0
    if over_mask:  # the share of the window in which at least one chain is over its budget
        grid = np.unique(np.concatenate([[t0, t1], *(t[(t > t0) & (t < t1)] for t, _ in over_mask)]))
        any_over = np.zeros(grid.size - 1, bool)
        for times, over in over_mask:
            idx = np.searchsorted(times, grid[:-1], side="right") - 1
            any_over |= (idx >= 0) & over[np.maximum(idx, 0)]
        over_time = float((np.diff(grid) * any_over).sum() / span)
    return {"sessions": sessions, "kv_use": held_area / span / float(sum(budgets)), "over_budget_time": over_time,
            "over_budget_starts": over_start / max(1, start.size), "peak_kv_ratio": peak}


def _one(setup: Setup, plan_key: str, tokens: bool, jobs: Jobs, needs: np.ndarray) -> dict:
    """One admission on ``jobs``: the plan ``plan_key`` with slots (c_k sessions) or by tokens."""
    from experiments.sim.batch_sim import simulate_shared_chains
    from experiments.sim.scenarios import service_matrix
    from planner.service_model import chain_services

    p = setup.plans[plan_key]
    slot = setup.max_length if plan_key == "max-length" else setup.slot_tokens
    caps = [ch.capacity for ch in p.chains]
    budgets = [c * slot for c in caps]
    if tokens:  # the orchestrator's slot count, c_k · slot_tokens one-page sessions: the budget is the bound
        caps = [b // PAGE for b in budgets]
    res = simulate_shared_chains(chain_services(p.chains, setup.servers), [ch.rate for ch in p.chains], caps, jobs,
                                 num_servers=len(setup.servers), kv_budgets=budgets if tokens else None,
                                 needs=needs.tolist() if tokens else None,
                                 service_matrix=service_matrix(setup.scenario, p.chains, jobs.input_tokens,
                                                               jobs.output_tokens))
    skip = int(len(jobs) * DEFAULT_WARMUP)
    resp, wait = res.response[skip:], res.waiting[skip:]
    short = needs[skip:] <= setup.slot_tokens
    out = {"mean": float(resp.mean()), "p95": float(np.percentile(resp, 95)), "waiting": float(wait.mean()),
           "waiting_short": float(wait[short].mean()), "waiting_long": float(wait[~short].mean()),
           "p95_short": float(np.percentile(resp[short], 95)), "p95_long": float(np.percentile(resp[~short], 95))}
    out.update(kv_stats(res, needs, budgets, float(jobs.arrivals[skip]), float(jobs.arrivals[-1])))
    return out


MODE_PLANS = {"max-length slots": ("max-length", False), "expected-length slots": ("tokens", False),
              "tokens": ("tokens", True)}


def run_rate(setup: Setup, rate: float, num_jobs: int, run: int, sweep=()) -> dict:
    """Every admission on the same jobs at one rate: {mode: summary}, and token admission on the plans of
    ``sweep`` (values of c) under ``"sweep"``."""
    jobs = sample_jobs(setup, rate, num_jobs, run)
    needs = np.minimum(pages(jobs.input_tokens + jobs.output_tokens), setup.max_length)
    out = {mode: _one(setup, *MODE_PLANS[mode], jobs, needs) for mode in MODES}
    out["sweep"] = {str(c): _one(setup, f"tokens c={c}", True, jobs, needs) for c in sweep}
    return out


def _stats(rows: list[dict]) -> dict:
    """Every metric's mean over runs (the peak: its max), and the Monte Carlo standard error of the mean response."""
    st = {key: float(np.mean([x[key] for x in rows])) for key in rows[0]}
    st["peak_kv_ratio"] = float(max(x["peak_kv_ratio"] for x in rows))
    st["std"] = float(np.std([x["mean"] for x in rows], ddof=1) / np.sqrt(len(rows))) if len(rows) > 1 else 0.0
    return st


def point_stats(runs: list[dict]) -> dict:
    """Per mode, and per c of the sweep (under ``"sweep"``), :func:`_stats` over the runs."""
    out = {mode: _stats([r[mode] for r in runs]) for mode in MODES}
    out["sweep"] = {c: _stats([r["sweep"][c] for r in runs]) for c in runs[0]["sweep"]}
    return out


def kv_lengths(settings: Settings, rates=None, max_length: int = MAX_LENGTH, curve=None, sweep_span: int = SWEEP_SPAN
               ) -> dict:
    """The figure's data. The sweep runs token admission on the plans of c = c_least … c_least + ``sweep_span``
    (c_least: the least c whose chains hold a ``max_length`` session; the token plan's own c, chosen by the
    bound among such c, is the ``tokens`` mode); a c is left out at the rates above the
    first one at which its mean response exceeded ``SWEEP_STOP`` × its mean at the lowest rate (overloaded)."""
    rates = tuple(rates or (QUICK_RATES if settings.quick else DEFAULT_RATES))
    started, load = time.perf_counter(), os.getloadavg()
    setup = make_setup(max_length, curve, sweep_span)
    sweep = [int(c) for c in setup.meta["sweep"] if int(c) != setup.plans["tokens"].c]
    first: dict = {}
    points = []
    for rate in _bar(rates, settings, NAME):
        runs = [run_rate(setup, rate, settings.num_jobs, r, sweep) for r in range(settings.runs)]
        st = point_stats(runs)
        for c in sweep:
            mean = st["sweep"][str(c)]["mean"]
            first.setdefault(c, mean)
        sweep = [c for c in sweep if st["sweep"][str(c)]["mean"] <= SWEEP_STOP * first[c]]
        points.append({"rate": rate, "runs": runs, "stats": st})
    return _jsonable({"figure": NAME, "modes": list(MODES), "rates": list(rates), "plan_rate": PLAN_RATE,
                      "runs": settings.runs, "num_jobs": settings.num_jobs, "warmup": DEFAULT_WARMUP,
                      "job_seed": JOB_SEED, "sweep_stop": SWEEP_STOP, "points": points,
                      "config": {**setup.meta, "sample_size": SAMPLE_NOTE.format(runs=settings.runs,
                                                                                  jobs=settings.num_jobs)},
                      "elapsed_s": time.perf_counter() - started, "load_average_at_start": list(load)})


COLORS = {"max-length slots": "tab:red", "expected-length slots": "tab:gray", "tokens": "tab:blue"}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.report.kv_lengths import sweep_series

    rates, cfg = data["rates"], data["config"]
    fig, axes = plt.subplots(2, 4, figsize=(19, 8))
    panels = [("mean", "mean response (s), log"), ("p95", "P95 response (s), log"),
              ("waiting_short", "mean waiting (s): short — / long - -"),
              ("sessions", "mean concurrent sessions"), ("kv_use", "KV held ÷ the chains' KV (time average)"),
              ("over_budget_starts", "sessions started over their chain's KV (%)")]
    for ax, (key, label) in zip([*axes[0][:3], *axes[1][:3]], panels):
        for mode in data["modes"]:
            st = [p["stats"][mode] for p in data["points"]]
            ys = np.asarray([s[key] for s in st]) * (100.0 if key == "over_budget_starts" else 1.0)
            err = [s["std"] for s in st] if key == "mean" else None
            ax.errorbar(rates, ys, yerr=err, marker="o", ms=4, capsize=2, color=COLORS[mode], label=mode)
            if key == "waiting_short":
                ax.plot(rates, [s["waiting_long"] for s in st], ls="--", marker="s", ms=3, color=COLORS[mode])
        if key == "sessions":
            for name, ls in (("max-length", ":"), ("tokens", "-.")):
                ax.axhline(cfg["plans"][name]["total_slots"], ls=ls, color="k", lw=0.8, label=f"Σc_k, {name} plan")
        if key == "kv_use":
            ax.axhline(1.0, color="k", lw=0.8)
        if key in ("mean", "p95"):
            ax.set_yscale("log")
        elif key == "waiting_short":
            ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylabel(label, fontsize=9)
    for ax, key in zip(axes[:, 3], ("mean", "p95")):
        for i, (c, (xs, ys)) in enumerate(sweep_series(data, key).items()):
            ax.plot(xs, ys, marker="o", ms=3, color=plt.cm.viridis(i / max(1, len(cfg["sweep"]) - 1)),
                    label=f"tokens, c = {c} ({cfg['sweep'][str(c)]['chains']} chain"
                          f"{'s' if cfg['sweep'][str(c)]['chains'] > 1 else ''})")
        ax.plot(rates, [p["stats"]["max-length slots"][key] for p in data["points"]], color=COLORS["max-length slots"],
                ls=":", label="max-length slots")
        ax.set_yscale("log")
        ax.set_ylabel(f"{'mean' if key == 'mean' else 'P95'} response (s), token plan's c", fontsize=9)
    axes[0][3].legend(fontsize=7)
    for ax in axes.flat:
        ax.axvline(data["plan_rate"], color="k", lw=0.5, alpha=0.4)
        ax.set_xlabel("arrival rate λ (req/s)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=7)
    fig.suptitle(f"Azure code trace's own lengths: max_length {cfg['max_length']:,}, slot {cfg['slot_tokens']:,} "
                 f"tokens; {data['runs']} runs × {data['num_jobs']:,} jobs per point; vertical line: the planned λ",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_cli(args) -> int:
    """``chainswarm simulate kv-lengths [--quick] [--runs N] [--jobs N] [--out DIR] [--replot]``."""
    import sys

    from experiments.figures.common import run_figure_cli
    from experiments.report import kv_lengths as kv_report

    def compute() -> dict:
        quick = bool(args.quick)
        settings = Settings(runs=args.runs or (1 if quick else DEFAULT_RUNS),
                            num_jobs=getattr(args, "jobs", None) or (2_000 if quick else DEFAULT_JOBS), quick=quick,
                            progress=not args.no_progress and sys.stderr.isatty())
        return kv_lengths(settings)

    return run_figure_cli(args, NAME, compute, plot, kv_report.section)
