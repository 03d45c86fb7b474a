"""Tables and fixed-form paragraphs of the fairness report section, from a ``fairness.json`` document.

The run and setup paragraphs, the results table, the headline and the claims table, plus the
formatting helpers the discussion (:mod:`experiments.report.fairness`) shares.  Every number and
verdict is formatted from the document.
"""

from __future__ import annotations

import math

from experiments.sim.fairness_metrics_sim import (
    JAIN_CLOSE,
    STARVE,
    TPUT_ABOVE,
    TPUT_CLOSE,
    TPUT_KEY,
    mean_of,
    sd_of,
    worst_gap,
)
from experiments.sim.token_sim import REF_INPUT, REF_OUTPUT

KIND_NAMES = {"ldqa": "long-document QA", "tot": "tree-of-thought", "judge": "judge", "chat": "chat"}
PAPER_D2LPM_VS_VTC = 2.87  # the papers' largest D2LPM/VTC throughput ratio


def fmt(x, nd=2):
    """A number for the tables: '–' when missing, thousands separated above 1,000."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{nd}f}"


def pm(entry, policy, key, nd):
    """'mean ± sd' (sd over seeds; omitted for a single seed)."""
    m, sd = mean_of(entry, policy, key), sd_of(entry, policy, key)
    if m is None:
        return "–"
    if not sd or entry["policies"][policy]["summary"].get("runs", 1) < 2:
        return fmt(m, nd)
    return f"{fmt(m, nd)} ± {fmt(sd, nd)}"


def ratio(entry, a, b, key=TPUT_KEY):
    """mean(a) / mean(b) of ``key`` in a scenario entry; None if either policy is missing."""
    if not entry or a not in entry["policies"] or b not in entry["policies"]:
        return None
    return (mean_of(entry, a, key) or 0) / (mean_of(entry, b, key) or 1)


def span(values, fmt_one, sep="–"):
    """'a–b' of a list of numbers ('a' when they all format alike)."""
    lo, hi = fmt_one(min(values)), fmt_one(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def slot_ratio(chains) -> float:
    """tdec / tpre of the plan's chains (the same for every chain)."""
    return chains[0]["tdec_s"] / chains[0]["tpre_s"]


def run_text(doc: dict, command: str) -> list:
    cfg, wall = doc["config"], doc.get("wall_s")
    return [f"Command: `{command}` ({doc['runs']} seed(s) per point, {'quick' if cfg['quick'] else 'full'} horizons "
            f"{', '.join(f'{k} {int(v)} s' for k, v in cfg['horizons'].items())}"
            + (f"; {wall / 60:.0f} min on {doc.get('workers', 1)} worker process(es)" if wall else "") + "). "
            "Numbers are means ± one standard deviation over seeds (seed = arrivals and prompts); every "
            "number, per seed, is in `fairness.json`."]


def _plans(doc: dict) -> str:
    """'8k tokens (tree-of-thought, judge, chat): 6 chains x 6 slots; ...' from the plans in the document."""
    by_ctx: dict = {}
    for e in doc["scenarios"].values():
        sw = e["swarm"]
        kinds = by_ctx.setdefault(sw["context_tokens"], ({}, sw["chains"]))[0]
        kinds[e["workload"]["kind"]] = None
    parts = []
    for ctx in sorted(by_ctx):
        kinds, chains = by_ctx[ctx]
        caps = [c["capacity"] for c in chains]
        slots = span(caps, str)
        parts.append(f"{ctx // 1024}k tokens for {', '.join(KIND_NAMES[k] for k in kinds)}: {len(chains)} chains x "
                     f"{slots} slot{'' if slots == '1' else 's'}")
    return "; ".join(parts)


def setup_text(doc: dict) -> list:
    cfg, sc = doc["config"], doc["scenarios"]
    first = next(iter(sc.values()))
    clients = list(first["workload"]["clients"])
    mis = first["workload"]["misbehaving"]
    wb = [c for c in clients if c != mis]
    extra = [s for s in sc if "@" in s]
    extra_txt = ""
    if extra:
        loads = sorted({sc[s]["workload"]["load"] for s in extra})
        pols = sorted({p for s in extra for p in sc[s]["policies"]}, key=list(sc[extra[0]]["policies"]).index)
        extra_txt = (f"; the `@{'/'.join(f'{x:g}' for x in loads)}` rows repeat S2 at {'/'.join(f'{x:g}' for x in loads)}x "
                     f"({'/'.join(p.upper() for p in pols)} only)")
    ratio_txt = f"tpre = tdec/{slot_ratio(first['swarm']['chains']):.0f}"
    return [
        "Setup: a token-level discrete-event simulation (`experiments/sim/token_sim.py`) of the chains of a real "
        "GBP-CR + GCA plan of the LLaMA-2-7B 9-MIG swarm (chain-composition.md §9.7/§11, "
        f"`experiments/examples/{first['swarm']['swarm']}`), planned for the workload's context length "
        f"({_plans(doc)}). Per-token times follow from each chain's planned service time T_k for the "
        f"{REF_INPUT}-in/{REF_OUTPUT}-out reference job with {ratio_txt} (§14.3). Each chain has an LRU prefix cache "
        f"({cfg['page_size']}-token pages) as large as its KV pool. {len(clients)} clients: `{mis}` misbehaves, "
        f"`{wb[0]}..{wb[-1]}` are well-behaved; offered load = {cfg['load']['s1']} (S1) and {cfg['load']['s2']} (S2) "
        f"x capacity assuming every shared prefix is cached{extra_txt}. §10 fixes S2's shape (same program rate, "
        f"longer prefixes) but not its load. DLPM/swarm/bfio use Q^u = {int(cfg['quantum'])} su (swarm/bfio: Q^w = "
        f"{int(cfg['chain_quantum'])} su); DLPM is centralized (places on the longest match), swarm places by "
        "expected time (§14.4), bfio by BF-IO (§14.7).",
        "",
        "Metrics: Jain's index on actual service (extend + 2 x output) over each policy's all-active window (every "
        "client has started its first program and not finished its last, as [DLPM] does); throughput = client-view "
        "service (input + 2 x output) per second over the *common* window of the scenario and seed (latest start to "
        "earliest end of the policies' all-active windows, so every policy is measured over the same seconds; "
        "`throughput_su_s` in the JSON is the own-window value); well-behaved latency = TTFT for long-document QA, "
        "program end-to-end otherwise (unfinished programs count with their elapsed time); hit rate = reused / input "
        "tokens; max gap = largest |W_f - W_g| over intervals where both clients are backlogged, for the seed closest "
        "to its bound, against the §14.8 bound 2(U_sw + Q^u).",
    ]


def results_table(doc: dict) -> list:
    lines = ["| scenario | policy | Jain | throughput (su/s) | wb P50 (s) | wb P99 (s) | hit rate | prefill share "
             "| max gap / bound |", "|---|---|---|---|---|---|---|---|---|"]
    for s, entry in doc["scenarios"].items():
        for p in entry["policies"]:
            g, b = worst_gap(entry, p)
            lines.append(
                f"| {s} | {p} | {pm(entry, p, 'jain_actual', 3)} | {pm(entry, p, TPUT_KEY, 0)} | "
                f"{pm(entry, p, 'wb_latency_p50', 1)} | {pm(entry, p, 'wb_latency_p99', 1)} | "
                f"{pm(entry, p, 'hit_rate', 2)} | {fmt(mean_of(entry, p, 'prefill_share'), 2)} | {fmt(g, 0)} / {fmt(b, 0)} |")
    lines.append("")
    lines.append("Prefill share = fraction of busy slot time spent on prefill of non-cached prompt tokens (the rest is "
                 "decode).")
    return lines


def headline_text(doc: dict) -> list:
    """The long-document QA S1 headline (the README quotes it) and the DLPM/VTC range elsewhere."""
    sc = doc["scenarios"]
    e = sc.get("ldqa-s1")
    base = ("fcfs", "lpm", "vtc")
    if not e or not set(base) | {"dlpm"} <= set(e["policies"]):
        return []
    jain = " / ".join(f"{p.upper()} {fmt(mean_of(e, p, 'jain_actual'), 3)}" for p in (*base, "dlpm"))
    p99 = [mean_of(e, p, "wb_latency_p99") for p in base]
    runs = [r for s in sc.values() for p in ("dlpm", "swarm") if p in s["policies"] for r in s["policies"][p]["runs"]]
    inside = sum(1 for r in runs if r["within_bound"])
    text = (f"**Headline** (long-document QA, S1): Jain's index {jain}; throughput DLPM "
            f"{ratio(e, 'dlpm', 'vtc'):.2f}x VTC's and {ratio(e, 'dlpm', 'lpm'):.2f}x LPM's; P99 latency of "
            f"well-behaved clients DLPM {fmt(mean_of(e, 'dlpm', 'wb_latency_p99'), 1)} s vs "
            f"{span(p99, lambda v: fmt(v, 1))} s for FCFS/LPM/VTC; "
            + (f"every DLPM/swarm service gap inside the §14.8 bound ({inside}/{len(runs)} runs)." if inside == len(runs)
               else f"{inside} of {len(runs)} DLPM/swarm runs inside the §14.8 bound."))
    rest = {s: ratio(x, "dlpm", "vtc") for s, x in sc.items() if s.split("-")[0] in ("tot", "judge")}
    rest = {s: r for s, r in rest.items() if r is not None}
    if rest:
        held = sum(1 for r in rest.values() if r >= TPUT_ABOVE)
        text += (f" On tree-of-thought and judge DLPM reaches {span(list(rest.values()), lambda v: f'{v:.2f}')}x VTC's "
                 f"throughput (the papers: up to {PAPER_D2LPM_VS_VTC}x); the {TPUT_ABOVE}x claim holds in {held} of "
                 f"{len(rest)} of those scenarios.")
    return [text]


def claims_text(doc: dict) -> list:
    lines = ["### Claims (issue 6, \"Done when\")", ""]
    lines.append("Verdicts are on the means over seeds; the last column says in how many seeds the claim holds on "
                 "its own.")
    lines.append("")
    rows = ["| scenario | claim | numbers | holds | seeds |", "|---|---|---|---|---|"]
    tally: dict = {}

    def add(s, claim, nums, ok, seeds=None):
        if ok is None:
            return
        sd = f"{seeds[0]}/{seeds[1]}" if seeds else ""
        rows.append(f"| {s} | {claim} | {nums} | {'yes' if ok else '**no**'} | {sd} |")
        tally.setdefault(claim, [0, 0])
        tally[claim][0 if ok else 1] += 1

    for s, entry in doc["scenarios"].items():
        cl = entry["claims"]
        for p in ("dlpm", "swarm"):
            if p not in cl:
                continue
            c = cl[p]
            seeds = c.get("seeds", {})
            if "jain_close_to_vtc" in c:
                add(s, f"{p} Jain close to VTC's (≥ VTC − {JAIN_CLOSE})",
                    f"{c['jain']:.3f} vs {mean_of(entry, 'vtc', 'jain_actual'):.3f}", c["jain_close_to_vtc"],
                    seeds.get("jain_close_to_vtc"))
            if "throughput_close_to_lpm" in c:
                add(s, f"{p} throughput close to LPM's (≥ {int(TPUT_CLOSE * 100)} %)",
                    f"{c['throughput_vs_lpm']:.2f}x LPM", c["throughput_close_to_lpm"], seeds.get("throughput_close_to_lpm"))
            if c.get("throughput_well_above_vtc") is not None:
                add(s, f"{p} throughput well above VTC's (≥ {TPUT_ABOVE}x)",
                    f"{c['throughput_vs_vtc']:.2f}x VTC", c["throughput_well_above_vtc"],
                    seeds.get("throughput_well_above_vtc"))
            add(s, f"{p} max service gap within the §14.8 bound", f"{fmt(c['max_gap'], 0)} ≤ {fmt(c['bound'], 0)}",
                c["within_bound"], seeds.get("within_bound"))
        for p in ("lpm", "fcfs"):
            k = f"{p}_starves"
            if k in cl:
                add(s, f"{p.upper()} starves well-behaved clients (P99 ≥ {STARVE:g}x DLPM's)",
                    f"{fmt(cl[k]['p99'], 1)} s vs {fmt(cl[k]['dlpm_p99'], 1)} s ({cl[k]['ratio']:.1f}x)", cl[k]["holds"],
                    cl[k].get("seeds"))
    lines += rows
    lines.append("")
    lines.append("Tally (holds / fails): " + "; ".join(f"{k}: {v[0]}/{v[1]}" for k, v in tally.items()) + ".")
    return lines
