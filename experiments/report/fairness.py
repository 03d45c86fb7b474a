"""The fairness section of the simulation report (``sections/fairness.md``), from a ``fairness.json`` document.

:func:`write_section` assembles the run and setup paragraphs, the results and claims tables
(:mod:`experiments.report.fairness_tables`) and the reading of the results (:func:`discussion_text`).
Every number and every verdict in the reading is computed from the document at report time, and
the explanations of why a claim fails are worded for what the numbers show, so re-rendering the
section after a re-run re-checks it.  The workload quantities it quotes (offered load per client,
the hit rate of an unbounded cache) follow from the configuration the document records.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments.report.fairness_tables import (
    KIND_NAMES,
    PAPER_D2LPM_VS_VTC,
    claims_text,
    fmt,
    headline_text,
    ratio,
    results_table,
    run_text,
    setup_text,
    slot_ratio,
    span,
)
from experiments.sim.fairness_metrics_sim import (
    FAIR_LOCAL,
    PREFIX_HEAVY,
    STARVE,
    TPUT_ABOVE,
    TPUT_KEY,
    m0_share,
    mean_of,
    worst_gap,
)
from experiments.sim.fairness_suite import Config, demand_shares, ideal_hit_rate, scenario_load, split_scenario

JAIN_LOW = 0.9  # a fair policy's Jain's index below this is discussed
SAME_KEYS = ("jain_actual", TPUT_KEY, "wb_latency_p99", "max_gap")  # swarm = dlpm when all of these agree


def write_section(doc: dict, out: Path, command: str) -> Path:
    sec = out / "sections"
    sec.mkdir(parents=True, exist_ok=True)
    path = sec / "fairness.md"
    headline = headline_text(doc)
    lines = ["## Fair, locality-aware scheduling (simulation)", ""]
    lines += run_text(doc, command) + [""] + setup_text(doc) + [""]
    lines += results_table(doc) + [""]
    lines += headline + [""] if headline else []
    lines += claims_text(doc) + [""]
    lines += discussion_text(doc) + [""]
    lines.append("Plots: `fairness_plane.png` (common-window throughput vs Jain, ±1 sd, with DLPM's Q^u sweep), "
                 "`fairness_latency.png` (P50/P99 of well-behaved clients), `fairness_service_<scenario>.png` "
                 "(per-client service over time, seed 0).")
    lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def discussion_text(doc: dict) -> list:
    """Why results depart from the claims and the papers' headline numbers (numbers from this run)."""
    lines = ["### Reading the results, and departures from the papers", ""]
    for part in (vs_vtc_text, window_text, s2_text, jain_text, bound_text, same_text, censoring_text, limits_text):
        lines += part(doc)
    return lines


def _pct(x) -> str:
    return f"{100 * x:.0f} %"


def _x(x) -> str:
    return f"{x:.2f}x"


def _mean_run(entry, policy, get) -> float:
    return float(np.mean([get(r) for r in entry["policies"][policy]["runs"]]))


def _wb_mean(entry, key) -> float:
    """Mean over the well-behaved clients of a workload statistic (``mean_prompt``, ``mean_output``)."""
    w = entry["workload"]
    return float(np.mean([v[key] for c, v in w["clients"].items() if c != w["misbehaving"]]))


def _fair_share(entry) -> float:
    return 1.0 / len(entry["workload"]["clients"])


def _demand(doc, s) -> dict:
    e = doc["scenarios"][s]
    return demand_shares(s, e["workload"].get("load") or scenario_load(s, Config(load=doc["config"]["load"])))


# ----------------------------------------------------------------- throughput against VTC
def _ceiling(doc, s) -> float:
    """How much an unbounded cache could cut VTC's slot time per unit of work."""
    e = doc["scenarios"][s]
    c, v = mean_of(e, "vtc", "cold_prefill_share"), mean_of(e, "vtc", "prefill_share")
    h = ideal_hit_rate(s, doc["config"])
    return (1 / (1 - v)) / (1 + c * (1 - h) / (1 - c))


def vs_vtc_text(doc: dict) -> list:
    sc = doc["scenarios"]
    ratios = {s: r for s, r in ((s, ratio(e, "dlpm", "vtc")) for s, e in sc.items()) if r is not None}
    if not ratios:
        return []
    best = max(ratios, key=ratios.get)
    lines = [
        f"* **Throughput vs VTC.** DLPM reaches {_x(ratios[best])} VTC's throughput on {best} (range "
        f"{min(ratios.values()):.2f}x-{max(ratios.values()):.2f}x over the scenarios; the papers report up to "
        f"{PAPER_D2LPM_VS_VTC}x for D2LPM). The slot time a better cache can save is bounded by how much of it "
        "prefill takes, which the simulation measures (prefill share of busy slot time, and the share had nothing "
        "been cached):"]
    heavy = [s for s in sc if split_scenario(s)[0] in PREFIX_HEAVY and s in ratios]
    ceil, ideal = {}, {}
    for s in heavy:
        e = sc[s]
        ceil[s], ideal[s] = _ceiling(doc, s), ideal_hit_rate(s, doc["config"])
        lines.append(
            f"  * {s}: prefill is {_pct(mean_of(e, 'vtc', 'cold_prefill_share'))} of slot time with no cache; VTC "
            f"{_pct(mean_of(e, 'vtc', 'prefill_share'))} (hit {mean_of(e, 'vtc', 'hit_rate'):.2f}), DLPM "
            f"{_pct(mean_of(e, 'dlpm', 'prefill_share'))} (hit {mean_of(e, 'dlpm', 'hit_rate'):.2f}); an unbounded "
            f"cache would hit {ideal[s]:.2f}, which would cut VTC's slot time per unit of work by at most "
            f"{_x(ceil[s])}; measured DLPM/VTC throughput {_x(ratios[s])} (m0's share of actual service: VTC "
            f"{m0_share(e, 'vtc'):.2f}, DLPM {m0_share(e, 'dlpm'):.2f}); the claim's {TPUT_ABOVE}x is "
            + ("within this ceiling." if ceil[s] >= TPUT_ABOVE else "above this ceiling."))
    if not heavy:
        return lines
    notes = []
    above = [s for s in heavy if ratios[s] > ceil[s]]
    if above:
        less = [s for s in above if m0_share(sc[s], "vtc") < m0_share(sc[s], "dlpm")]
        notes.append(
            f"Client-view throughput also depends on whose work is served: DLPM/VTC exceeds the slot-time ceiling on "
            f"{', '.join(above)}"
            + (f", where VTC, which charges the full prompt, serves less of m0's work than DLPM does "
               f"({', '.join(less)}); in S2 m0's calls have the longest, mostly cached prompts and so carry the most "
               "client-view su per slot-second." if less else
               "; m0's share of actual service is not lower under VTC there, so this run does not explain it."))
    ldqa = [s for s in heavy if s.startswith("ldqa-")]
    if ldqa:
        cold = [mean_of(sc[s], "vtc", "cold_prefill_share") for s in ldqa]
        notes.append(f"On long-document QA prefill is {span(cold, _pct)} of slot time with no cache"
                     + (", so the hit rate decides throughput." if min(cold) >= 0.9 else "."))
    small = [s for s in heavy if s.split("-")[0] in ("tot", "judge")]
    if small:
        first = sc[small[0]]["swarm"]
        out = span([_wb_mean(sc[s], "mean_output") for s in small], lambda v: f"{v:.0f}")
        vtc_of_ideal = span([mean_of(sc[s], "vtc", "hit_rate") / ideal[s] for s in small], _pct)
        vtc_pre = span([mean_of(sc[s], "vtc", "prefill_share") for s in small], _pct)
        text = (f"In tree-of-thought and judge a call emits {out} tokens on average at tdec while a prompt token "
                f"costs tdec/{slot_ratio(first['chains']):.0f}; with each chain's KV pool ("
                f"{first['chains'][0]['capacity']} slots x {first['context_tokens'] // 1024}k tokens) VTC's hit rate "
                f"is {vtc_of_ideal} of an unbounded cache's and its prefill {vtc_pre} of slot time.")
        low = [s for s in small if ceil[s] < TPUT_ABOVE]
        room = [s for s in small if ceil[s] >= TPUT_ABOVE and ratios[s] < TPUT_ABOVE]
        if low:
            text += f" On {', '.join(low)} no ordering can reach the claim's {TPUT_ABOVE}x over VTC."
        if room:
            text += (f" On {', '.join(room)} the ceiling leaves room for {TPUT_ABOVE}x and DLPM falls short of it: "
                     f"its hit rate reaches {span([mean_of(sc[s], 'dlpm', 'hit_rate') / ideal[s] for s in room], _pct)} "
                     "of an unbounded cache's.")
        notes.append(text)
    notes.append(f"The papers' {PAPER_D2LPM_VS_VTC}x also counts RR+LPM-style scattering over up to 8 GPUs, which a "
                 "central queue never does.")
    lines.append("  " + " ".join(notes))
    return lines


# ----------------------------------------------------------------- own window vs common window
def window_text(doc: dict) -> list:
    sc = doc["scenarios"]
    lq = [s for s in sc if s.startswith("ldqa-") and {"lpm", "dlpm"} <= set(sc[s]["policies"])]
    if not lq:
        return []
    own = {s: ratio(sc[s], "dlpm", "lpm", "throughput_su_s") for s in lq}
    com = {s: ratio(sc[s], "dlpm", "lpm") for s in lq}
    art = [s for s in lq if own[s] > 1 >= com[s]]
    end = {s: {p: _mean_run(sc[s], p, lambda r: r["window_s"][1]) for p in ("lpm", "dlpm")} for s in lq}
    parts = []
    for s in lq:
        e = sc[s]
        parts.append(
            f"{s}: own windows LPM {fmt(mean_of(e, 'lpm', 'throughput_su_s'), 0)} vs DLPM "
            f"{fmt(mean_of(e, 'dlpm', 'throughput_su_s'), 0)} su/s ({_x(own[s])}), common window "
            f"{fmt(mean_of(e, 'lpm', TPUT_KEY), 0)} vs {fmt(mean_of(e, 'dlpm', TPUT_KEY), 0)} ({_x(com[s])}); actual "
            f"service {fmt(mean_of(e, 'lpm', 'throughput_common_actual_su_s'), 0)} vs "
            f"{fmt(mean_of(e, 'dlpm', 'throughput_common_actual_su_s'), 0)} su/s; all-active window ends at "
            f"{fmt(end[s]['lpm'], 0)} s (LPM) and {fmt(end[s]['dlpm'], 0)} s (DLPM) for a "
            f"{int(e['workload']['horizon_s'])} s arrival horizon")

    def spread(s, pols):
        v = [mean_of(sc[s], p, "throughput_common_actual_su_s") for p in pols]
        return (max(v) - min(v)) / float(np.mean(v))

    allp = max(spread(s, list(sc[s]["policies"])) for s in lq)
    pair = max(spread(s, ["lpm", "dlpm"]) for s in lq)
    cold = span([mean_of(sc[s], "lpm", "cold_prefill_share") for s in lq], _pct)
    title = (f"* **DLPM above LPM on long-document QA is a window artefact** ({', '.join(art)}: above LPM over its own "
             "all-active window, not over the common one)." if art else
             "* **DLPM against LPM on long-document QA, own and common windows.**")
    lines = [
        title + " A policy's own window ends when the first client has finished its last program. Where DLPM's ends "
        "soon after the arrival horizon and LPM's runs deep into the drain phase, LPM is measured there serving the "
        "cold requests it deferred (the well-behaved clients' evicted documents), at a low client-view rate. "
        + "; ".join(parts) + f". Over the common window the actual-service rate (extend + 2 x output per second) of "
        f"LPM and DLPM differs by at most {100 * pair:.1f} % and that of all policies by at most {100 * allp:.1f} %: "
        f"prefill is {cold} of the work with no cache, at 1 su per token, so the swarm's actual service is much the "
        "same under every policy and client-view throughput differs through the hit rate of the requests granted "
        f"in the window. Claims use the common window; over it DLPM is at {span(list(com.values()), _pct)} of LPM"
        + (", not above it." if max(com.values()) <= 1 else
           f", above it on {', '.join(s for s in lq if com[s] > 1)}.")]
    return lines


# ----------------------------------------------------------------- starvation in S2
def s2_text(doc: dict) -> list:
    sc, cfg = doc["scenarios"], doc["config"]
    s2 = [s for s in sc if split_scenario(s)[1] == "s2" and {"lpm", "dlpm"} <= set(sc[s]["policies"])]
    if not s2:
        return []
    cases = [(s, p, sc[s]["claims"][f"{p}_starves"]) for s in s2 for p in ("lpm", "fcfs")
             if f"{p}_starves" in sc[s]["claims"]]
    held = [f"{p.upper()} on {s}" for s, p, c in cases if c["holds"]]
    demand = {s: _demand(doc, s) for s in s2}
    parts = []
    for s in s2:
        e, c, d = sc[s], sc[s]["claims"], demand[s]
        ends = [_mean_run(e, p, lambda r: r["end_time_s"]) for p in e["policies"]]
        st = ", ".join(f"{p.upper()} {c[f'{p}_starves']['ratio']:.1f}x ({c[f'{p}_starves']['seeds'][0]}/"
                       f"{c[f'{p}_starves']['seeds'][1]} seeds ≥ {STARVE:g}x)"
                       for p in ("lpm", "fcfs") if f"{p}_starves" in c)
        parts.append(f"{s}: m0 asks {d['m0']:.2f} and each well-behaved client {d['wb']:.2f} of capacity; m0 gets "
                     f"{m0_share(e, 'lpm'):.2f} of the actual service under LPM and {m0_share(e, 'dlpm'):.2f} under "
                     f"DLPM; well-behaved P50 LPM {fmt(mean_of(e, 'lpm', 'wb_latency_p50'), 0)} s vs DLPM "
                     f"{fmt(mean_of(e, 'dlpm', 'wb_latency_p50'), 0)} s; P99 vs DLPM's: {st}; last call done at "
                     f"{fmt(min(ends), 0)}-{fmt(max(ends), 0)} s (policy means) for a {int(e['workload']['horizon_s'])} s "
                     "arrival horizon")
    extra = sorted({split_scenario(s)[2] for s in s2 if split_scenario(s)[2] is not None})
    lines = [
        f"* **Starvation in S2** (P99 ≥ {STARVE:g}x DLPM's holds in {len(held)} of {len(cases)} S2 cases"
        + (f": {', '.join(held)}" if held else "") + "). §10 gives S2 the same program rate for every client and "
        f"leaves the load open, so S2 runs at {cfg['load']['s2']}x"
        + (f", with the first run's {'/'.join(f'{x:g}' for x in extra)}x kept as the "
           f"{', '.join(f'`@{x:g}`' for x in extra)} rows" if extra else "")
        + ". Offered load per client (warm), m0's share of actual service over the all-active window, and latency: "
        + "; ".join(parts) + ". " + _s2_reading(doc, s2, demand, cases)]
    return lines


def _s2_reading(doc, s2, demand, cases) -> str:
    sc = doc["scenarios"]
    fair = _fair_share(sc[s2[0]])
    n = len(sc[s2[0]]["workload"]["clients"])
    over = {s: m0_share(sc[s], "lpm") / fair for s in s2}
    top = max(over, key=over.get)
    lpm_p99 = max((c["ratio"] for s, p, c in cases if p == "lpm"), default=0.0)
    out = [f"LPM gives m0 more than its 1/{n} share in {sum(1 for v in over.values() if v > 1)} of {len(s2)} S2 "
           f"scenarios (up to {over[top]:.1f}x it, on {top}), "
           + (f"but the well-behaved clients' P99 under LPM stays below {STARVE:g}x DLPM's (at most {lpm_p99:.1f}x)."
              if lpm_p99 < STARVE else f"and the well-behaved clients' P99 under LPM reaches {lpm_p99:.1f}x DLPM's.")]
    cost = {s: demand[s]["m0"] / demand[s]["wb"] for s in s2}
    alike = [s for s in s2 if split_scenario(s)[0] in ("tot", "judge")]
    if alike:
        out.append(f"With prefixes cached m0's programs cost {span([cost[s] for s in alike], lambda v: f'{v:.2f}')}x "
                   "the others' in tree-of-thought and judge (the long question is shared by all the calls of a "
                   "tree, the preamble by all of m0's articles).")
    busy = [s for s in s2 if demand[s]["wb"] > fair]
    if busy:
        ends = []
        for s in busy:
            v = [_mean_run(sc[s], p, lambda r: r["end_time_s"]) for p in sc[s]["policies"]]
            ends.append((max(v) - min(v)) / max(v))
        out.append(f"Where every client, well-behaved ones included, asks for more than 1/{n} of the swarm "
                   f"({', '.join(busy)}), their backlog grows under every policy, DLPM included, until arrivals stop, "
                   "and the P99 (the programs that arrive last) is set by when the swarm has drained the total "
                   f"backlog: the policies' last calls finish within {100 * max(ends):.0f} % of each other there.")
    # well-behaved clients under their share while m0 is over it: loads (n - 1 + r)/(n r) < L < (n - 1 + r)/n
    kinds: dict = {}
    for s in s2:
        kinds.setdefault(split_scenario(s)[0], cost[s])
    window = {k: (max(1.0, (n - 1 + r) / (n * r)), (n - 1 + r) / n) for k, r in kinds.items()}
    out.append("Starvation 'many times' needs the well-behaved clients under their share while m0 is over it; with "
               "equal program rates and more load than the swarm serves, that holds at loads of "
               + "; ".join(f"{KIND_NAMES[k]} " + (f"{lo:.2f}x-{hi:.2f}x" if round(hi, 2) > round(lo, 2) else "no load above 1.0x")
                           + f" (m0's programs cost {kinds[k]:.2f}x the others')" for k, (lo, hi) in window.items())
               + ".")
    low = [s for s in s2 if split_scenario(s)[2] is not None and split_scenario(s)[0] == "ldqa"]
    for s in low:
        c = sc[s]["claims"]
        if "fcfs_starves" in c and "lpm_starves" in c:
            f, lp = c["fcfs_starves"], c["lpm_starves"]
            out.append(f"On {s} FCFS's P99 is {f['ratio']:.1f}x DLPM's and LPM's {lp['ratio']:.1f}x"
                       + (", LPM's lower because the well-behaved clients' documents are cached too (each client asks "
                          "a run of questions about one document), so only their first question per document waits "
                          "behind m0." if lp["ratio"] < f["ratio"] else "."))
    return " ".join(out)


# ----------------------------------------------------------------- Jain's index of the fair policies
def jain_text(doc: dict) -> list:
    sc = doc["scenarios"]
    both = [s for s, e in sc.items() if {"vtc", "dlpm"} <= set(e["policies"])]
    low = [s for s in both if max(mean_of(sc[s], p, "jain_actual") for p in ("vtc", "dlpm")) < JAIN_LOW]
    if not low:
        return []
    parts = []
    for s in low:
        d, fair = _demand(doc, s), _fair_share(sc[s])
        parts.append(f"{s}: each well-behaved client asks {d['wb']:.2f} of capacity (warm), "
                     + (f"less than its 1/{round(1 / fair)} share" if d["wb"] < fair else
                        f"not less than its 1/{round(1 / fair)} share, so this reading does not apply")
                     + f"; m0 gets {m0_share(sc[s], 'vtc'):.3f} of the actual service under VTC and "
                     f"{m0_share(sc[s], 'dlpm'):.3f} under DLPM")
    diff = {s: mean_of(sc[s], "dlpm", "jain_actual") - mean_of(sc[s], "vtc", "jain_actual") for s in both}
    less = sum(1 for s in low if m0_share(sc[s], "vtc") < m0_share(sc[s], "dlpm"))
    return [
        f"* **Jain's index below {JAIN_LOW} for VTC and DLPM** ({', '.join(low)}). Where well-behaved clients ask "
        "for less than their fair share, max-min fairness gives the flooding client the remainder, and the index "
        "measures that, not unfairness. VTC charges full input and DLPM charges only extend tokens, so on cached "
        "workloads the two give the misbehaving client different actual service: " + "; ".join(parts)
        + f" (less under VTC in {less} of {len(low)}). Over all scenarios DLPM's index is above VTC's in "
        f"{sum(1 for v in diff.values() if v > 0)} and below it in {sum(1 for v in diff.values() if v < 0)} of "
        f"{len(diff)}, by at most {max(abs(v) for v in diff.values()):.3f}."]


# ----------------------------------------------------------------- the §14.8 bound
def bound_text(doc: dict) -> list:
    sc = doc["scenarios"]
    worst = [(g / b, s, p) for s, e in sc.items() for p in FAIR_LOCAL if p in e["policies"]
             for g, b in [worst_gap(e, p)]]
    if not worst:
        return []
    r, s, p = max(worst)
    runs = [run for e in sc.values() for q in FAIR_LOCAL if q in e["policies"] for run in e["policies"][q]["runs"]]
    base = [run["max_gap"] / run["bound"] for e in sc.values() for q in ("fcfs", "lpm", "vtc") if q in e["policies"]
            for run in e["policies"][q]["runs"]]
    text = (f"* **Bound.** {sum(1 for run in runs if run['within_bound'])} of {len(runs)} DLPM/swarm/bfio runs stay "
            f"inside the §14.8 bound 2(U_sw + Q^u); the largest ratio is {r:.2f} ({p}, {s}).")
    if "ldqa-s1" in sc and "dlpm" in sc["ldqa-s1"]["policies"]:
        doc_tokens = _wb_mean(sc["ldqa-s1"], "mean_prompt")
        bnd = worst_gap(sc["ldqa-s1"], "dlpm")[1]
        text += (f" On long-document QA one cold admission of a well-behaved client's prompt (mean "
                 f"{fmt(doc_tokens, 0)} tokens) moves a deficit by as many su, {_pct(doc_tokens / bnd)} of the bound "
                 f"({fmt(bnd, 0)} on ldqa-s1).")
    if base:
        text += (f" FCFS, LPM and VTC are not bounded on actual service (VTC is bounded on its own full-input "
                 f"counters): {sum(1 for v in base if v > 1)} of their {len(base)} runs exceed the value, by up to "
                 f"{max(base):.0f}x.")
    return [text]


# ----------------------------------------------------------------- swarm = dlpm
def same_text(doc: dict) -> list:
    sc = doc["scenarios"]
    same = [s for s, e in sc.items() if {"swarm", "dlpm"} <= set(e["policies"])
            and all(a[k] == b[k] for a, b in zip(e["policies"]["swarm"]["runs"], e["policies"]["dlpm"]["runs"])
                    for k in SAME_KEYS)]
    swept = [s for s, e in sc.items() if e.get("quantum_sweep")]
    lines = []
    if same:
        why: dict = {}  # reason -> scenarios
        for s in same:
            sw = sc[s]["swarm"]
            if all(c["capacity"] == 1 for c in sw["chains"]):
                why.setdefault(f"the {sw['context_tokens'] // 1024}k-context plan has one slot per chain, so every "
                               "dispatch round has a single free chain and the chain selector has no choice to make",
                               []).append(s)
            else:
                why.setdefault(f"hit rate {mean_of(sc[s], 'dlpm', 'hit_rate'):.2f}: little prefix to reuse, so placing "
                               "by expected time and by longest match agree", []).append(s)
        lines.append(f"* **swarm = dlpm on {', '.join(same)}** (the same numbers in every seed). "
                     + "; ".join(f"{', '.join(ss)}: {reason}" for reason, ss in why.items()) + ".")
    if swept:
        lines.append(f"* **Q^u sweep** (plane plot, ±1 sd over seeds): runs on {', '.join(swept)}.")
    return lines


# ----------------------------------------------------------------- censoring and model limits
def censoring_text(doc: dict) -> list:
    sc, cfg = doc["scenarios"], doc["config"]
    cens = {s: {p: mean_of(e, p, "wb_censored") for p in e["policies"]} for s, e in sc.items()}
    heavy = [s for s, c in cens.items() if any((v or 0) > 0 for v in c.values())]
    if not heavy:
        return []
    return [f"* **Censoring.** The simulation stops at {cfg['drain_factor']:g}x the arrival horizon. Unfinished "
            "well-behaved programs count with their elapsed time, so those P99s are lower bounds (mean unfinished per "
            "seed): " + "; ".join(f"{s}: " + ", ".join(f"{p} {v:.0f}" for p, v in cens[s].items() if v) for s in heavy)
            + "."]


def limits_text(doc: dict) -> list:
    first = next(iter(doc["scenarios"].values()))
    return [f"* **Model limits.** Sessions run at their chain's per-session speed whatever the load, with no batching "
            "interference. Prefill of a reused prefix is taken as instant once it is inserted at grant time. "
            f"tpre = tdec/{slot_ratio(first['swarm']['chains']):.0f} is the §14.3 placeholder, not a measured profile; "
            "in a WAN swarm dominated by round trips decode weighs even more, which would shrink every locality gain "
            "further."]
