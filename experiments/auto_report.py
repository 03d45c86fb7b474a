"""Report lines for placement="auto" (Fig. 8's auto part and Fig. 9), every number and verdict from the JSON
that :func:`experiments.fig_auto.auto_verdict` and :func:`experiments.fig_auto.exhaustive_check` wrote."""
from __future__ import annotations

import math


def _s(v, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _p(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def _where(r: dict) -> str:
    extra = "" if "arrival_rate" not in r else f", λ = {r['arrival_rate']:g}, {r['arrivals']}"
    return f"J = {r['J']}, η = {r['eta']}{extra}"


def _reason(r: dict, exhaustive: list[dict], target: float) -> str:
    out = []
    for b, v in r["vs"].items():
        if not v["ok"]:
            out.append(f"slower than {b} by {_s(v['diff'])} s (paired standard error {_s(v['se'])} s)")
    if "10% vs c*" in r["missed"]:
        text = f"{_p(r['gain_vs_cstar'])} below Proposed (c*), short of {_p(target)}"
        share = r["cstar_wait_share"]
        if share is not None and share < 0.05:
            text += (f": c* waits only {_p(share)} of its response time, so the response is the service time of the "
                     f"chain used (auto {_s(r['auto_service'])} s, c* {_s(r['cstar_service'])} s) and the gain is "
                     "bounded by how much faster the fastest possible chain is")
        elif share is not None:
            text += f" (c* waits {_p(share)} of its response time)"
        out.append(text)
    ex = next((e for e in exhaustive if (e["J"], e["eta"]) == (r["J"], r["eta"])
               and e["arrival_rate"] == r.get("arrival_rate", e["arrival_rate"])), None)
    if ex and ex.get("proposed (c*)") and math.isfinite(ex["optimum"]):
        room = 1 - ex["optimum"] / ex["proposed (c*)"]
        out.append(f"exhaustive search on the reduced instance: the best of {ex['placements']} placements is "
                   f"{_p(room)} below c* there ({_s(ex['optimum'], 3)} s vs {_s(ex['proposed (c*)'], 3)} s; auto "
                   f"{_s(ex['auto'], 3)} s)")
    return "; ".join(out)


def auto_lines(d: dict) -> list[str]:
    v = d["auto"]
    bases = list(v["rows"][0]["vs"]) if v["rows"] else []
    has_lam = bool(v["rows"]) and "arrival_rate" in v["rows"][0]
    head = "| " + ("λ | arrivals | " if has_lam else "") + "J | η | auto (s) | " + " | ".join(
        f"vs {b}: reduction (ok?)" for b in bases) + " | auto's choice (most common) |"
    out = ["### placement=auto", "",
           "auto = GBP-CR for every c, hop-min chains, PETALS-style and whole-model placements and local-search "
           "moves, scored by predicted mean response time (planner/auto.py). Per cell: mean response (s), "
           "reduction 1 − auto/baseline on the cell means, ok = the paired per-scenario difference auto − baseline "
           "is at most one standard error.", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r, cell in zip(v["rows"], d["cells"]):
        lam = f"{r['arrival_rate']:g} | {r['arrivals']} | " if has_lam else ""
        choices = [c.split(": ", 1)[-1].split(" + ")[0] for c in cell.get("auto_choice", [])]
        common = max(set(choices), key=lambda c: (choices.count(c), c)) if choices else "–"
        cols = " | ".join(f"{_p(r['vs'][b]['reduction'])} ({'ok' if r['vs'][b]['ok'] else '**no**'})" for b in bases)
        out.append(f"| {lam}{r['J']} | {r['eta']} | {_s(r['auto'])} ± {_s(r['auto_std'])} | {cols} | {common} |")
    out += ["", f"Grid average of 1 − auto/Proposed (c*): **{_p(v['grid_avg_gain'])}** (target ≥ {_p(v['target_gain'])}: "
            f"{'met' if v['avg_target_met'] else '**missed**'}); auto no worse than every baseline in every cell: "
            f"{'yes' if v['never_worse'] else '**no**'}."]
    if v["missed"]:
        out += ["", f"Cells where a target is missed ({len(v['missed'])} of {len(v['rows'])}):", ""]
        out += [f"* {_where(r)}: {_reason(r, v.get('exhaustive', []), v['target_gain'])}." for r in v["missed"]]
    for e in v.get("exhaustive", []):
        lam = e["arrival_rate"]
        out += ["", f"Exhaustive search, reduced instance of J = {e['J']}, η = {e['eta']}, λ = {lam:g} (servers "
                f"{', '.join(e['servers'])}, L = {e['blocks']}): {e['placements']} placements with a chain, exact CTMC "
                f"mean response: optimum {_s(e['optimum'], 3)} s with spans {e['optimum_spans']}; auto "
                f"{_s(e['auto'], 3)} s; GBP-CR(c*) {_s(e['proposed (c*)'], 3)} s."]
    return out
