"""``chainswarm experiment``: the live-swarm experiments (WAN-emulated swarm on this machine).

    chainswarm experiment table1|fairness|validation [--quick] [--out DIR] ...

Each writes ``<out>/live_<name>.json``, ``.png`` and ``<out>/sections/live_<name>.md`` (``_quick`` names with
``--quick``), then, at full settings, reassembles ``<out>/REPORT.md``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

EXPERIMENTS = {"table1": "experiments.live.table1", "fairness": "experiments.live.fairness",
               "validation": "experiments.live.validation"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", choices=sorted(EXPERIMENTS), help="which live experiment to run")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of the experiment (--quick, --out ...)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(EXPERIMENTS[args.experiment])
    parser = argparse.ArgumentParser(prog=f"chainswarm experiment {args.experiment}")
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(args.rest)) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(experiment=sys.argv[1], rest=sys.argv[2:])))
