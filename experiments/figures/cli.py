"""``chainswarm simulate``: run the model-driven simulations and regenerate the paper figures and report.

    chainswarm simulate fig3|...|fig9|all|fairness|fig8-batching|churn|kv-lengths [--runs N] [--jobs N] [--quick] [--out DIR] [--replot]

Each figure writes ``<out>/figN.json`` (every number), ``<out>/figN.png`` and ``<out>/sections/figN.md``,
then ``<out>/REPORT.md`` is reassembled from all sections present. ``--replot`` recomputes nothing: it
re-renders the PNGs and sections from the JSON already in ``<out>`` and reassembles the report.
``fairness`` is delegated to ``experiments.figures.fairness.run_cli(args)`` (options it does not share with
the figures pass through), ``fig8-batching`` (Fig. 8 with batching servers, not part of ``all``) to
``experiments.figures.batching.run_cli(args)``, ``churn`` (re-planning while servers join and leave) to
``experiments.figures.churn.run_cli(args)``, ``kv-lengths`` (admission by KV tokens on the Azure trace's own lengths)
to ``experiments.figures.kv_lengths.run_cli(args)``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from experiments.paths import RESULTS

TARGETS = ("fig3", "fig4", "fig5", "fig6", "fig7", "fig8", "fig9", "all", "fairness", "fig8-batching", "churn",
           "kv-lengths")
DEFAULT_OUT = RESULTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=TARGETS, help="which figure to regenerate ('all': fig3..fig9)")
    parser.add_argument("--runs", type=int, default=None,
                        help="Monte Carlo runs per point (default 20; 2 with --quick)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="jobs per simulated run (default 20,000; 2,000 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="small sweeps and 2,000-job runs (under a minute; what the tests run)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes for the sweeps of fig7/fig8 (default: 2, 1 with --quick)")
    parser.add_argument("--comm-model", choices=("per-token", "literal", "authors"), default="per-token",
                        help="τc from RTT (spec §10.2): l̄_O·(RTT+18ms) (default), RTT+18ms, or the authors' MATLAB")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--replot", action="store_true",
                        help="re-render PNGs and report sections from the JSON in --out (no simulation)")
    # options of the fairness simulations, passed along untouched
    parser.add_argument("--workload", default=None, help="(fairness only) workload name")
    parser.add_argument("--policies", default=None, help="(fairness only) comma-separated schedulers")


def run(args: argparse.Namespace) -> int:
    if args.runs is not None and args.runs < 1:
        print("chainswarm simulate: error: --runs must be at least 1", file=sys.stderr)
        return 2
    if getattr(args, "jobs", None) is not None and args.jobs < 100:
        print("chainswarm simulate: error: --jobs must be at least 100", file=sys.stderr)
        return 2
    if args.workers is not None and args.workers < 1:
        print("chainswarm simulate: error: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.target == "fairness":
        return _fairness(args)
    if args.target == "fig8-batching":
        from experiments.figures import batching as fig_batching

        return fig_batching.run_cli(args)
    if args.target == "kv-lengths":
        from experiments.figures import kv_lengths as fig_kv_lengths

        return fig_kv_lengths.run_cli(args)
    if args.target == "churn":
        from experiments.figures.churn import run_cli
        from experiments.report import report

        code = run_cli(args)
        if code == 0:
            report.assemble(Path(args.out))
        return code
    from experiments.figures.paper import FIGURES, Settings, write_figure
    from experiments.report import report

    names = FIGURES if args.target == "all" else (args.target,)
    out = Path(args.out)
    if args.replot:
        return _replot(out, names)
    settings = Settings.make(runs=args.runs, quick=args.quick, workers=args.workers,
                             progress=not args.no_progress and sys.stderr.isatty(), comm_model=args.comm_model,
                             num_jobs=getattr(args, "jobs", None))
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        data = write_figure(name, settings, out)
        held = sum(c["holds"] for c in data["claims"])
        print(f"{name}: {held}/{len(data['claims'])} claims hold, {time.perf_counter() - t0:.1f} s -> "
              f"{out / (name + '.png')}", flush=True)
        for c in data["claims"]:
            print(f"  [{'ok' if c['holds'] else 'NO'}] {c['claim']}: {c['detail']}")
    path = report.assemble(out)
    print(f"report: {path} ({time.perf_counter() - t_all:.1f} s)")
    return 0


def _replot(out: Path, names) -> int:
    """Re-render the figures' PNGs and sections from their JSON in ``out``; reassemble the report."""
    from experiments.figures.paper import replot
    from experiments.report import report

    missing = [n for n in names if not (out / f"{n}.json").exists()]
    if missing:
        print(f"chainswarm simulate: --replot: no {', '.join(f'{n}.json' for n in missing)} in {out}", file=sys.stderr)
        return 2
    for name in names:
        data = replot(name, out)
        print(f"{name}: {sum(c['holds'] for c in data['claims'])}/{len(data['claims'])} claims hold -> "
              f"{out / 'sections' / (name + '.md')}")
    print(f"report: {report.assemble(out)}")
    return 0


def _fairness(args: argparse.Namespace) -> int:
    try:
        module = importlib.import_module("experiments.figures.fairness")
    except ModuleNotFoundError as exc:
        if exc.name != "experiments.figures.fairness":
            raise
        print("chainswarm simulate fairness: not available yet (experiments.figures.fairness is not in this "
              "checkout)", file=sys.stderr)
        return 2
    code = int(module.run_cli(args) or 0)
    if code == 0:
        from experiments.report import report

        report.assemble(Path(args.out))
    return code
