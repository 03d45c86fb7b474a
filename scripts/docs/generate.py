"""Generate every page of ``docs/reference/`` (what ``make docs`` runs before ``mkdocs build --strict``).

* ``reference/cli.md`` — :mod:`cli_reference`: ``chainswarm`` and every subcommand's ``--help`` from argparse;
* ``reference/http-api.md``, ``reference/openapi.json`` — :mod:`http_reference`: the orchestrator's OpenAPI schema;
* ``reference/results.md``, ``reference/tables/``, ``reference/results/``, ``reference/data-provenance.md`` —
  :mod:`results`: tables from the committed JSON in ``experiments/results``.

Usage: ``python scripts/docs/generate.py [--out-dir docs/reference]``
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cli_reference  # noqa: E402
import http_reference  # noqa: E402
import results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE.parents[1] / "docs" / "reference")
    args = parser.parse_args(argv)
    cli_reference.main(["--out", str(args.out_dir / "cli.md")])
    http_reference.main(["--out-dir", str(args.out_dir)])
    results.main(["--out-dir", str(args.out_dir)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
