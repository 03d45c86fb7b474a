"""Where the experiments' committed files live (standard library only, so anything may import it).

* :data:`RESULTS` — ``experiments/results``: the committed JSON, PNG, sections and ``REPORT.md``.
* :data:`DATA` — ``experiments/data``: the datasets with their provenance (Azure trace, RIPE Atlas RTTs).
* :data:`EXAMPLES` — ``experiments/examples``: example swarm files.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
DATA = ROOT / "data"
EXAMPLES = ROOT / "examples"
