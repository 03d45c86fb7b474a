"""What the model-driven figures share: run settings, progress bars, JSON conversion, claims, simulation
helpers and the worker pool (used by :mod:`experiments.figures.paper`, :mod:`experiments.figures.tuning`,
:mod:`experiments.figures.baselines` and :mod:`experiments.figures.auto`)."""
from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from experiments.sim.scenarios import ScenarioConfig
from experiments.sim.simulator import DEFAULT_WARMUP, poisson_jobs, simulate_chains


C_UNIT = 7
"""The cache reservation of the unit tests and of "Proposed" in the draft's Fig. 8 (§10.3, §15.3)."""


@dataclass(frozen=True)
class Settings:
    runs: int = 20
    num_jobs: int = 20_000
    quick: bool = False
    workers: int = 1
    progress: bool = True
    comm_model: str = "per-token"

    @classmethod
    def make(cls, *, runs: int | None = None, quick: bool = False, workers: int | None = None,
             progress: bool = True, comm_model: str = "per-token", num_jobs: int | None = None) -> "Settings":
        if quick:
            return cls(runs=runs or 2, num_jobs=num_jobs or 2_000, quick=True, workers=workers or 1, progress=False,
                       comm_model=comm_model)
        return cls(runs=runs or 20, num_jobs=num_jobs or 20_000, quick=False,
                   workers=workers or min(2, os.cpu_count() or 1), progress=progress, comm_model=comm_model)

    def config(self, **changes) -> ScenarioConfig:
        return ScenarioConfig(comm_model=self.comm_model).with_(**changes)


def _bar(iterable, settings: Settings, desc: str, total: int | None = None):
    if not settings.progress:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if math.isfinite(v) else None
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def _claim(text: str, holds: bool, detail: str) -> dict:
    return {"claim": text, "holds": bool(holds), "detail": detail}


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else 0.0


def _sim_mean(chains, arrival_rate: float, settings: Settings, policy: str = "jffc", seed0: int = 0):
    """Per-run summaries of JFFC (or ``policy``) on ``chains`` with Poisson/Exp jobs."""
    T = [ch.service_time for ch in chains]
    caps = [ch.capacity for ch in chains]
    out = []
    for r in range(settings.runs):
        jobs = poisson_jobs(arrival_rate, settings.num_jobs, seed=seed0 + r)
        out.append(simulate_chains(T, caps, jobs, policy, seed=seed0 + r).summary(DEFAULT_WARMUP))
    return out



def _map(fn: Callable, args: list, settings: Settings, desc: str) -> list:
    if settings.workers > 1 and len(args) > 1:
        with ProcessPoolExecutor(max_workers=settings.workers) as pool:
            return list(_bar(pool.map(fn, args), settings, desc, total=len(args)))
    return [fn(a) for a in _bar(args, settings, desc)]


def run_figure_cli(args, name: str, compute: Callable[[], dict], plot: Callable[[dict, Any], None],
                   section: Callable[[dict], str]) -> int:
    """The CLI of one simulated figure: compute ``name``.json into ``args.out`` (with ``args.replot``: read it),
    draw ``name``.png, write the report section ``sections/name.md``, reassemble REPORT.md and print the
    section."""
    import json
    import sys
    from pathlib import Path

    from experiments.report import report

    out = Path(args.out)
    path = out / f"{name}.json"
    if args.replot:
        if not path.exists():
            print(f"chainswarm simulate: --replot: no {path.name} in {out}", file=sys.stderr)
            return 2
        data = json.loads(path.read_text())
    else:
        data = compute()
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, out / f"{name}.png")
    text = section(data)
    (out / "sections").mkdir(parents=True, exist_ok=True)
    (out / "sections" / f"{name}.md").write_text(text)
    report.assemble(out)
    print(text)
    return 0
