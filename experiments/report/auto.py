"""Report lines for placement="auto" (Fig. 8's auto part and Fig. 9), every number and verdict from the JSON
that :func:`experiments.figures.auto.auto_verdict`, :func:`experiments.figures.auto.attach_service_bounds` and
:func:`experiments.figures.auto.attach_queue_bounds` wrote."""
from __future__ import annotations


def _s(v, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _p(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def _where(r: dict) -> str:
    extra = "" if "arrival_rate" not in r else f", λ = {r['arrival_rate']:g}, {r['arrivals']}"
    return f"J = {r['J']}, η = {r['eta']}{extra}"


def _same_cell(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("J", "eta", "arrival_rate", "arrivals"))


def _reason(r: dict, queue: list[dict], target: float) -> str:
    out = []
    for b, v in r["vs"].items():
        if not v["ok"]:
            out.append(f"slower than {b} by {_s(v['diff'])} s (paired standard error {_s(v['se'])} s)")
    if "10% vs c*" in r["missed"]:
        text = f"{_p(r['gain_vs_cstar'])} below Proposed (c*), short of {_p(target)}"
        share = r["cstar_wait_share"]
        if share is not None:
            text += f" (c* waits {_p(share)} of its response time)"
        if r.get("room") is not None:
            text += (f"; no placement can be more than {_p(r['room'])} below c* here: every job takes at least "
                     f"T_min = {_s(r['tmin'])} s × its size (bound {_s(r['bound'])} s against c*'s "
                     f"{_s(r['vs']['proposed (c*)']['mean'])} s), and auto is {_p(r['auto_over_bound'])} above "
                     "that bound")
            if r["room"] < target:
                text += f", so the {_p(target)} target is out of reach for any placement in this cell"
        out.append(text)
    q = next((q for q in queue if _same_cell(q, r)), None)
    if q and q["room"] is not None:
        out.append(f"the queue-aware bound (scenarios 0–{len(q['scenarios']) - 1}) is {_s(q['bound'])} s against "
                   f"c*'s predicted {_s(q['cstar_pred'])} s (auto {_s(q['auto_pred'])} s): at most {_p(q['room'])} "
                   f"below c* {'— below the target' if q['room'] < target else ''}".rstrip())
    return "; ".join(out)


def auto_lines(d: dict) -> list[str]:
    v = d["auto"]
    bases = list(v["rows"][0]["vs"]) if v["rows"] else []
    has_lam = bool(v["rows"]) and "arrival_rate" in v["rows"][0]
    has_bound = any(r.get("room") is not None for r in v["rows"])
    head = "| " + ("λ | arrivals | " if has_lam else "") + "J | η | auto (s) | " + " | ".join(
        f"vs {b}: reduction (ok?)" for b in bases) + (" | bound (s) | room below c* | auto above bound"
                                                      if has_bound else "") + " | auto's choice (most common) |"
    out = ["### placement=auto", "",
           "auto = GBP-CR for every c, hop-min chains, the exact fastest chain, PETALS-style and whole-model "
           "placements and local-search moves, scored by predicted mean response time (planner/auto.py). Per "
           "cell: mean response (s), reduction 1 − auto/baseline on the cell means, ok = the paired per-scenario "
           "difference auto − baseline is at most one standard error."]
    if d.get("auto_score"):
        out += ["", "auto's score: " + "; ".join(f"{k} cells: {v}" for k, v in d["auto_score"].items())
                + ". Proposed (c*), PETALS and BPRR plan the same way in both."]
    if has_bound:
        out += ["", "bound = T_min × the measured jobs' mean size, averaged over the cell's scenarios: T_min is the "
                "fastest chain any placement can form with cache for one job on every block it processes (exact DP, "
                "planner/fastest_chain.py), and a job of size r takes at least r·T_min on any chain, so no "
                "placement's mean response on these job samples is below it. room = 1 − bound/c*: the largest "
                "reduction below Proposed (c*) any placement could reach in the cell."]
    out += ["", head, "|" + "---|" * (head.count("|") - 1)]
    for r, cell in zip(v["rows"], d["cells"]):
        lam = f"{r['arrival_rate']:g} | {r['arrivals']} | " if has_lam else ""
        choices = [c.split(": ", 1)[-1].split(" + ")[0] for c in cell.get("auto_choice", [])]
        common = max(set(choices), key=lambda c: (choices.count(c), c)) if choices else "–"
        cols = " | ".join(f"{_p(r['vs'][b]['reduction'])} ({'ok' if r['vs'][b]['ok'] else '**no**'})" for b in bases)
        bound = f" | {_s(r.get('bound'))} | {_p(r.get('room'))} | {_p(r.get('auto_over_bound'))}" if has_bound else ""
        out.append(f"| {lam}{r['J']} | {r['eta']} | {_s(r['auto'])} ± {_s(r['auto_std'])} | {cols}{bound} | {common} |")
    out += ["", f"Grid average of 1 − auto/Proposed (c*): **{_p(v['grid_avg_gain'])}** (target ≥ {_p(v['target_gain'])}: "
            f"{'met' if v['avg_target_met'] else '**missed**'}); auto no worse than every baseline in every cell: "
            f"{'yes' if v['never_worse'] else '**no**'}."]
    room = v.get("grid_avg_room")
    if room is not None:
        out[-1] += (f" Grid average of the room any placement has below c* (service bound): **{_p(room)}**"
                    + (f" — below the {_p(v['target_gain'])} target, so no placement can meet it on this grid."
                       if room < v["target_gain"] else " — the bound does not rule the target out."))
    if v.get("load_average"):
        out[-1] += f" (Computed at load average {v['load_average'][0]:.1f} on 2 shared cores, at the end of the run.)"
    if v["missed"]:
        out += ["", f"Cells where a target is missed ({len(v['missed'])} of {len(v['rows'])}):", ""]
        out += [f"* {_where(r)}: {_reason(r, v.get('queue_bounds', []), v['target_gain'])}." for r in v["missed"]]
    qs = v.get("queue_bound_settings")
    if v.get("queue_bounds") and qs:
        out += ["", f"Queue-aware bound (experiments/sim/auto_bounds.py), on the first {qs['scenarios']} scenarios of the "
                f"{len(v['queue_bounds'])} missed cells whose service bound leaves the most room: a MILP bounds the "
                "largest total service rate ν*_n that n jobs running at once could have on any placement (servers "
                "hold their blocks plus every job's cache; block ranges need not be contiguous; rates on a "
                f"{100 * (qs['level_ratio'] - 1):.0f}% grid), for n up to min({qs.get('nmax', '∞')}, max({qs['n0']}, "
                "⌈2λT_min⌉)) "
                f"({qs['seconds_per_milp']:g} s per MILP, HiGHS' dual bound), and the birth–death process with those "
                "death rates bounds every placement's steady-state mean response under JFFC from below "
                "(Theorem 3.7's argument). c* and auto are the planner's predictions (exact CTMC when small, else "
                "bounds or simulation) on the same scenarios. A large MILP gap (the solve stopped at its time limit) "
                "makes the bound looser, never invalid.", "",
                "| cell | queue-aware bound (s) | T_min (s) | c* predicted (s) | auto predicted (s) | room below c* "
                "| largest MILP gap |", "|---|---|---|---|---|---|---|"]
        for q in v["queue_bounds"]:
            ok = q["scenarios"]
            tmin = sum(p["tmin"] for p in ok) / len(ok) if ok else None
            gap = max((p["max_gap"] for p in ok), default=None)
            out.append(f"| {_where(q)} | {_s(q['bound'])} | {_s(tmin)} | {_s(q['cstar_pred'])} | "
                       f"{_s(q['auto_pred'])} | {_p(q['room'])} | {_p(gap)} |")
    return out
