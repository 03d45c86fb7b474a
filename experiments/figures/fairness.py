"""``chainswarm simulate fairness``: fair, locality-aware scheduling on simulated multi-client workloads.

Runs every (scenario, policy, seed) of the grid through the token-level
simulator (``experiments.sim.token_sim``) on chains of a real GBP-CR + GCA plan
and the workloads of ``experiments.sim.workloads`` (fairness-locality.md §10), and
computes the §9 metrics:

* service rate per client over time (actual service = w_e * extend + w_q *
  output, and client view = w_p * input + w_q * output, §9.1);
* Jain's index over the all-active window (from the last client's first
  program start to the first client's last program start), on actual service
  (the one the bounds speak about) and on the client view;
* throughput: client-view service per second in that window (the [DLPM]
  "service rate sum": cached prefixes count as delivered work), plus output
  tokens/s;
* latency of well-behaved clients, P50/P99: TTFT for long-document QA, program
  end-to-end time for tree-of-thought, judge and chat (§9.3, §15 Q4).  Programs
  unfinished when the simulation stops count with their elapsed time (a lower
  bound) and are reported as censored;
* prefix hit rate (reused / input tokens of granted calls);
* the largest service difference between two clients over any interval in
  which both are continuously backlogged in the central queue (§9.4, P1),
  against the §14.8 bound 2 * (U_sw + Q^u).

Outputs (``--out``, default experiments/results): fairness.json, PNG plots and
the report section sections/fairness.md (``--replot`` rewrites the plots and the
section from an existing fairness.json without running anything).

This module is the command; the work is split by job:
``sim.fairness_suite`` (scenarios, configuration, runner), ``sim.fairness_metrics_sim``
(per-run metrics and the claims), ``report.fairness_plots`` (matplotlib),
``report.fairness_tables`` and ``report.fairness`` (the report section).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.sim.fairness_metrics_sim import (  # noqa: F401  (re-exported: the tests and callers use these names)
    TPUT_KEY,
    add_common_window,
    max_backlogged_gap_fast,
    mean_of,
)
from experiments.report.fairness import write_section
from experiments.report.fairness_plots import write_plots
from experiments.sim.fairness_suite import (  # noqa: F401  (re-exported)
    ALL_SCENARIOS,
    DEFAULT_POLICIES,
    DEFAULT_RUNS,
    KNOWN_POLICIES,
    WORKLOADS,
    Config,
    UsageError,
    get_workload,
    make_policy,
    parse_policies,
    parse_scenarios,
    run_one,
    run_suite,
    write_json,
)
from experiments.report.fairness_tables import fmt


def replot(out: Path) -> list:
    """Rewrite the plots and the section from ``<out>/fairness.json``; return the paths written."""
    doc = json.loads((out / "fairness.json").read_text())
    return [*write_plots(doc, out), write_section(doc, out, doc.get("command", "chainswarm simulate fairness"))]


def run_cli(args) -> int:
    """Entry point of ``chainswarm simulate fairness``; ``args`` is an argparse Namespace
    with (at least) ``quick``, ``out``, ``runs``, ``workload`` and ``policies``."""
    try:
        scenarios = parse_scenarios(getattr(args, "workload", None))
        policies = parse_policies(getattr(args, "policies", None))
        quick = bool(getattr(args, "quick", False))
        runs = getattr(args, "runs", None)
        runs = (1 if quick else DEFAULT_RUNS) if runs is None else int(runs)
        if runs < 1:
            raise UsageError("--runs must be at least 1")
        workers = getattr(args, "workers", None)
        workers = (1 if quick else 2) if workers is None else int(workers)
        if workers < 1:
            raise UsageError("--workers must be at least 1")
    except (UsageError, ValueError) as e:
        print(f"chainswarm simulate fairness: error: {e}", file=sys.stderr)
        return 2
    out = Path(getattr(args, "out", None) or "experiments/results")
    out.mkdir(parents=True, exist_ok=True)
    if getattr(args, "replot", False):  # rewrite plots and section from an existing fairness.json
        for p in replot(out):
            print(f"wrote {p}")
        return 0
    cfg = Config(quick=quick)
    sweep = getattr(args, "sweep_quantum", None)
    if sweep is not None:
        cfg.sweep_quantum = bool(sweep)
    cmd = "chainswarm simulate fairness" + (f" --workload {','.join(scenarios)}" if getattr(args, "workload", None) else "") \
        + (f" --policies {','.join(policies)}" if getattr(args, "policies", None) else "") \
        + (" --quick" if quick else "") + (f" --runs {runs}" if getattr(args, "runs", None) is not None else "")
    t0 = time.perf_counter()
    doc = run_suite(scenarios, policies, runs, cfg, progress=not getattr(args, "no_progress", False), workers=workers)
    doc["command"] = cmd
    doc["wall_s"] = time.perf_counter() - t0
    doc["workers"] = workers
    paths = [write_json(doc, out), *write_plots(doc, out), write_section(doc, out, cmd)]
    for s, entry in doc["scenarios"].items():
        for p in entry["policies"]:
            print(f"{s:9s} {p:6s} jain={mean_of(entry, p, 'jain_actual'):.3f} tput={mean_of(entry, p, TPUT_KEY):8.0f} "
                  f"wbP99={fmt(mean_of(entry, p, 'wb_latency_p99'), 1):>8s}s hit={mean_of(entry, p, 'hit_rate'):.2f} "
                  f"gap={mean_of(entry, p, 'max_gap'):.0f}/{mean_of(entry, p, 'bound'):.0f}")
    for p in paths:
        print(f"wrote {p}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.figures.fairness", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=None,
                    help=f"comma list of scenarios ({', '.join(ALL_SCENARIOS)}), workloads ({', '.join(WORKLOADS)}), "
                         "s1/s2, or all (default)")
    ap.add_argument("--policies", default=None, help=f"comma list of {', '.join(KNOWN_POLICIES)} (default: {','.join(DEFAULT_POLICIES)})")
    ap.add_argument("--quick", action="store_true", help="short horizons (smoke runs and tests)")
    ap.add_argument("--runs", type=int, default=None, help=f"seeds per point (default {DEFAULT_RUNS}; 1 with --quick)")
    ap.add_argument("--workers", type=int, default=None, help="processes (default 2; 1 with --quick)")
    ap.add_argument("--replot", action="store_true", help="only rewrite plots and section from <out>/fairness.json")
    ap.add_argument("--out", default="experiments/results")
    ap.add_argument("--sweep-quantum", dest="sweep_quantum", action="store_true", default=None,
                    help="also sweep DLPM's Q^u (default on in full runs)")
    ap.add_argument("--no-sweep-quantum", dest="sweep_quantum", action="store_false")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv=None) -> int:
    return run_cli(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())