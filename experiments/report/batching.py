"""The report section of ``chainswarm simulate fig8-batching`` (``sections/fig8_batching.md``), every number and
every conclusion computed from ``fig8_batching.json`` (:mod:`experiments.figures.batching`)."""
from __future__ import annotations

import math

import numpy as np

WORLD_LABEL = {"paper": "g ≡ 1 (the paper's model)", "batching": "batching servers"}


def _stat(cell: dict, world: str, method: str) -> dict:
    return cell["stats"][f"{world}: {method}"]


def _reductions(cells: list[dict], world: str, method: str, base: str) -> list[tuple[dict, float]]:
    """(cell, 1 − mean(method)/mean(base)) for the cells where both have stable runs."""
    out = []
    for c in cells:
        a, b = _stat(c, world, method)["mean"], _stat(c, world, base)["mean"]
        if a is not None and b is not None:
            out.append((c, 1.0 - a / b))
    return out


def _where(pairs) -> str:
    return "; ".join(f"J = {c['J']}, η = {c['eta']} ({100 * r:+.1f}%)" for c, r in pairs) or "none"


def _range(pairs) -> str:
    if not pairs:
        return "no cell with both stable"
    vals = [r for _, r in pairs]
    return (f"{100 * min(vals):.1f}% to {100 * max(vals):.1f}% lower (grid average {100 * np.mean(vals):.1f}%, "
            f"{len(vals)} cells)")


def _unstable(cells: list[dict], world: str, method: str) -> list[dict]:
    return [c for c in cells if _stat(c, world, method)["mean"] is None]


def auto_not_worse(cells: list[dict], world: str, bases) -> tuple[int, int, list]:
    """Cells where auto's mean ≤ every stable baseline's + the combined standard error; (ok, cells, misses)."""
    ok, total, misses = 0, 0, []
    for c in cells:
        a = _stat(c, world, "auto")
        if a["mean"] is None:
            continue
        total += 1
        worse = []
        for b in bases:
            s = _stat(c, world, b)
            if s["mean"] is not None and a["mean"] > s["mean"] + math.hypot(a["std"] or 0.0, s["std"] or 0.0):
                worse.append(f"{b} {s['mean']:.2f} s")
        if worse:
            misses.append(f"J = {c['J']}, η = {c['eta']}: auto {a['mean']:.2f} s vs {', '.join(worse)}")
        else:
            ok += 1
    return ok, total, misses


def conclusions(data: dict) -> list[str]:
    """What changes between the two worlds, one bullet per comparison, from the data."""
    cells = data["cells"]
    lines = []
    for base in ("PETALS", "BPRR"):
        parts = []
        for world in ("paper", "batching"):
            pairs = _reductions(cells, world, "proposed (c*)", base)
            losses = [(c, r) for c, r in pairs if r < 0]
            unstable = "; ".join(f"J = {c['J']}, η = {c['eta']}" for c in _unstable(cells, world, base))
            parts.append(f"{WORLD_LABEL[world]}: {_range(pairs)}; {base} better in {len(losses)} cell(s) "
                         f"[{_where(losses)}]; {base} unstable (every run) in {unstable or 'no cell'}")
        lines.append(f"* **Proposed (c*) vs {base}** — " + " — ".join(parts) + ".")
    for world in ("paper", "batching"):
        bases = [m for m in data["worlds"][world] if m not in ("auto", "proposed (c*), blind")]
        ok, total, misses = auto_not_worse(cells, world, bases)
        red = [r for _, r in _reductions(cells, world, "auto", "proposed (c*)")]
        lines.append(f"* **auto, {WORLD_LABEL[world]}** — no worse than {', '.join(bases)} (within the combined "
                     f"standard error) in {ok} of {total} cells"
                     + (f"; missed: {'; '.join(misses)}" if misses else "")
                     + (f"; grid average {100 * np.mean(red):.1f}% below Proposed (c*)" if red else "") + ".")
    aware = _reductions(cells, "batching", "proposed (c*)", "proposed (c*), blind")
    if aware:
        better = [(c, r) for c, r in aware if r > 0]
        changed = sum(1 for c in cells for run in c["runs"]
                      if run["choice"].get("batching: proposed (c*)") != run["choice"].get("paper: proposed (c*)"))
        lines.append(f"* **Planning with the batch curves** (Proposed c* tuned by the bounds of "
                     f"planner/batch_bounds.py) against the same method planned with g ≡ 1 and run on the same "
                     f"batching servers: {_range(aware)}; better in {len(better)} of {len(aware)} cells; c* differs "
                     f"in {changed} of {sum(len(c['runs']) for c in cells)} scenarios.")
    ratios_lo, ratios_up = [], []
    for c in cells:
        for run in c["runs"]:
            pred, sim = run["predicted"].get("batching: proposed (c*)"), run["batching"].get("proposed (c*)", {})
            if pred and "mean" in sim:
                ratios_lo.append(sim["mean"] / pred["lower"])
                ratios_up.append(sim["mean"] / pred["upper"])
    if ratios_lo:
        lo, up = np.asarray(ratios_lo), np.asarray(ratios_up)
        inside = int(((lo >= 1) & (up <= 1)).sum())
        lines.append(f"* **The planner's prediction** (the plan's bounds: birth–death rates at the occupancy each "
                     f"state implies, planner/batch_bounds.py) against the simulated mean response of Proposed (c*) on "
                     f"batching servers, over {lo.size} scenarios: simulated ÷ lower median {np.median(lo):.3f} "
                     f"(range {lo.min():.3f}–{lo.max():.3f}), simulated ÷ upper median {np.median(up):.3f} (range "
                     f"{up.min():.3f}–{up.max():.3f}); inside [lower, upper] in {inside}. These are the two fill "
                     "orders' estimates, not proven bounds (see the module).")
    slow = []
    for m in ("proposed (c*)", "auto", "BPRR", "PETALS"):
        r = [_stat(c, "batching", m)["mean"] / _stat(c, "paper", m)["mean"] for c in cells
             if _stat(c, "batching", m)["mean"] is not None and _stat(c, "paper", m)["mean"] is not None]
        if r:
            slow.append(f"{m} ×{np.mean(r):.3f}")
    lines.append("* **Cost of real servers** (mean response on batching servers ÷ with g ≡ 1, grid average over "
                 f"cells stable in both): {', '.join(slow)}.")
    return lines


def _cell_value(cell: dict, world: str, method: str) -> str:
    s = _stat(cell, world, method)
    if s["mean"] is None:
        return "unstable"
    return f"{s['mean']:.2f}" + ("*" if s["unstable"] else "")


def section(data: dict) -> str:
    curve = data["curve"]
    factors = ", ".join(f"g({b}) = {f:.2f}" for b, f in zip((1, 2, 4, 8, 16), curve["factors"]))
    load = data.get("load_average_at_start")
    cols = [(w, m) for w in ("paper", "batching") for m in data["worlds"][w]]
    lines = [
        "## Fig. 8 with batching servers",
        "",
        f"`chainswarm simulate fig8-batching` — {data['config']}; {data['runs']} Monte Carlo runs per cell of "
        f"{data['num_jobs']:,} Poisson jobs (the first 10% left out), the same scenarios and jobs in both worlds; "
        f"{data['elapsed_s']:.0f} s" + (f" (load average {load[0]:.1f} at the start, 2 shared cores)" if load else "")
        + ".",
        "",
        f"Batching servers: the decode share of τp_j, D_j = (s_m/b_j)·(l̄_O − 1), slows down with the sessions j "
        f"holds by the curve measured on this machine ({curve.get('source', 'given')}: one batched decode step of "
        f"SmolLM2 over 15 blocks, {factors}; batch bound {curve.get('max_batch')}, more sessions run in rounds); "
        "PETALS' servers run sessions one at a time, g(n) = n. Proposed and auto plan with the curves (GCA rates "
        "chains at the occupancy their capacities imply; Proposed's c is tuned by bounds that rate each state at "
        "its own occupancy, auto scores candidates by the chains' rates); *blind* is Proposed planned with g ≡ 1 "
        "and run on the batching servers. Exact event-driven simulation with occupancy-dependent speeds (`experiments/sim/batch_sim.py`).",
        "",
        "Mean response time (s; * = some runs unstable, left out):",
        "",
        "| J | η | " + " | ".join(f"{m} ({'g≡1' if w == 'paper' else 'batch'})" for w, m in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for c in data["cells"]:
        lines.append(f"| {c['J']} | {c['eta']} | " + " | ".join(_cell_value(c, w, m) for w, m in cols) + " |")
    lines += ["", "What changes (computed from the data):", "", *conclusions(data), "",
              "![Fig. 8 with batching servers](fig8_batching.png)", ""]
    return "\n".join(lines)
