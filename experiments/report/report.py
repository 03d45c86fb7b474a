"""The simulation report: ``REPORT.md`` assembled from the sections under ``<out>/sections/*.md``.

Figure sections come first in figure order, then any other section (for example ``fairness.md``, written
by the fairness simulations, or the live experiments' sections) in name order. The figure sections
themselves are rendered by :mod:`experiments.report.paper` (``section``, ``write_all_sections``, re-exported
here); this module only reads them.
"""
from __future__ import annotations

import json
from pathlib import Path

from experiments.report.paper import FIGURES, section, write_all_sections  # noqa: F401  (re-exported)


def assemble(out_dir: str | Path) -> Path:
    """Write ``REPORT.md`` from the sections present under ``out_dir/sections``."""
    out_dir = Path(out_dir)
    sec_dir = out_dir / "sections"
    sec_dir.mkdir(parents=True, exist_ok=True)
    names = [f"{n}.md" for n in FIGURES if (sec_dir / f"{n}.md").exists()]
    others = sorted(p.name for p in sec_dir.glob("*.md") if p.name not in names and p.name != "intro.md")
    parts = [_intro(out_dir)]
    for n in names + others:
        parts.append((sec_dir / n).read_text().rstrip() + "\n")
    report = out_dir / "REPORT.md"
    report.write_text("\n".join(parts))
    return report


def _intro(out_dir: Path) -> str:
    intro = out_dir / "sections" / "intro.md"
    if intro.exists():
        return intro.read_text().rstrip() + "\n"
    figs = [n for n in FIGURES if (out_dir / f"{n}.json").exists()]
    timing = []
    for n in figs:
        d = json.loads((out_dir / f"{n}.json").read_text())
        timing.append(f"{n} {d.get('elapsed_s', 0):.0f} s")
    return "\n".join([
        "# Chainswarm model-driven simulations: the paper's Figures 3–8",
        "",
        "Regenerate with `chainswarm simulate all` (or one figure: `chainswarm simulate fig5`; `--quick` for a "
        "small run, `--runs N` for the Monte Carlo runs, `--out DIR`; `--replot` re-renders the PNGs and sections "
        "from the JSON without recomputing). Spec: `shared/spec/chain-composition.md` "
        "§10, §12, §13. Every figure has a JSON file with every number, a PNG and a section below that checks "
        "the paper's claim rather than assuming it.",
        "",
        "Model (§10.1–10.2): BLOOM-176B, L = 70 blocks of 1.32 GB, 0.11 GB KV cache per block per job; "
        "high-performance GPUs 40 GB / τp = 108.9 ms, low-performance 20 GB / τp = 175.2 ms; τc_j = l̄_O·(RTT(o, j) + "
        "18 ms) with l̄_O = 20 and RTT(o, j) from the RIPE Atlas EU anchors (orchestrator and servers drawn per "
        "scenario seed, `wan.WanConfig.from_ripe_atlas`); Poisson arrivals, Exp(1) job sizes; exact "
        "event-driven simulation with the central queue served at completion instants (`experiments/sim/simulator.py`).",
        "",
        "Computation time: " + (", ".join(timing) if timing else "–") + ".",
        "",
    ])
