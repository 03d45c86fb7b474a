"""Table 1's outputs: the JSON of the numbers, the plot, the Markdown section with its table and the findings
computed from the data (the runs themselves are :mod:`experiments.live.table1`)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from experiments.report.common import fmt

METHODS = ("petals", "bprr", "jffc", "proposed", "auto")
LABEL = {"petals": "PETALS", "bprr": "BPRR", "jffc": "JFFC only", "proposed": "Proposed", "auto": "Auto"}
COLOR = {"petals": "tab:blue", "bprr": "tab:orange", "jffc": "tab:green", "proposed": "tab:red",
         "auto": "tab:purple"}
CONFIGS = ("relay", "push")


def improvement(ours: float, petals: float) -> float:
    return 1.0 - ours / petals if petals and math.isfinite(petals) and math.isfinite(ours) else math.nan


def write_outputs(data: dict, out: Path, name: str = "live_table1") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sections").mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    _plot(data, out / f"{name}.png")
    (out / "sections" / f"{name}.md").write_text(section(data, name))


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(type(o))


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in CONFIGS if c in data["runs"]]
    fig, axes = plt.subplots(2, len(configs), figsize=(6.5 * len(configs), 8), squeeze=False)
    for col, cfg in enumerate(configs):
        runs = data["runs"][cfg]
        methods = [m for m in METHODS if m in runs]
        ax = axes[0][col]
        metrics = [("response", "mean"), ("response", "p95"), ("waiting", "mean"), ("service", "mean")]
        width = 0.8 / max(1, len(methods))
        x = np.arange(len(metrics))
        for i, m in enumerate(methods):
            vals = [runs[m]["stats"][a][b] for a, b in metrics]
            ax.bar(x + i * width, vals, width, label=LABEL[m], color=COLOR[m])
        ax.set_xticks(x + width * (len(methods) - 1) / 2)
        ax.set_xticklabels([f"{a} {b}" for a, b in metrics])
        ax.set_ylabel("seconds")
        ax.set_title(f"Table 1 live replay — {cfg}")
        ax.legend()
        ax = axes[1][col]
        for m in methods:
            resp = sorted(r["completed"] - r["submitted"] for r in runs[m]["records"]
                          if r["error"] is None and r["completed"] is not None)
            if resp:
                ax.plot(resp, np.arange(1, len(resp) + 1) / len(resp), label=LABEL[m], color=COLOR[m])
        ax.set_xscale("log")
        ax.set_xlabel("response time (s)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ROWS = [("Response mean", "response", "mean"), ("Response median", "response", "median"),
        ("Response P95", "response", "p95"), ("Response P99", "response", "p99"),
        ("Waiting mean", "waiting", "mean"), ("Waiting median", "waiting", "median"),
        ("Waiting P95", "waiting", "p95"), ("Waiting max", "waiting", "max"),
        ("Service mean", "service", "mean"), ("Service median", "service", "median"),
        ("Service P95", "service", "p95")]


def table_markdown(runs: dict) -> str:
    methods = [m for m in METHODS if m in runs]
    lines = ["| Metric | " + " | ".join(LABEL[m] for m in methods) + " |",
             "|---|" + "---|" * len(methods)]
    for label, a, b in ROWS:
        lines.append(f"| {label} | " + " | ".join(fmt(runs[m]["stats"][a][b]) for m in methods) + " |")
    lines.append("| Service min / max | " + " | ".join(
        f"{fmt(runs[m]['stats']['service']['min'])} / {fmt(runs[m]['stats']['service']['max'])}"
        for m in methods) + " |")
    if "petals" in runs:
        p = runs["petals"]["stats"]
        for label, a, b in (("mean response", "response", "mean"), ("mean waiting", "waiting", "mean"),
                            ("P95 response", "response", "p95")):
            cells = ["–" if m == "petals" else f"{100 * improvement(runs[m]['stats'][a][b], p[a][b]):.1f}%"
                     for m in methods]
            lines.append(f"| Improvement vs PETALS, {label} | " + " | ".join(cells) + " |")
    lines.append("| Completed / failed | " + " | ".join(
        f"{runs[m]['stats']['completed']} / {runs[m]['stats']['failed']}" for m in methods) + " |")
    return "\n".join(lines)


def section(data: dict, name: str) -> str:
    s = data["settings"]
    parts = [f"## Live swarm — Table 1 trace replay{' (quick)' if s.get('quick') else ''}\n",
             f"`{data['command']}` — {data['machine']}, total {data['elapsed_s'] / 60:.1f} min.\n",
             "**Setup.** " + s["description"] + "\n"]
    for cfg, runs in data["runs"].items():
        parts.append(f"### {cfg} ({'server-to-server push' if cfg == 'push' else 'relay through the orchestrator / client'})\n")
        parts.append("Seconds; improvement = 1 − method/PETALS.\n")
        parts.append(table_markdown(runs) + "\n")
        for m in METHODS:
            if m in runs and "plan" in runs[m]:
                line = f"* {LABEL[m]}: " + _plan_line(runs[m]["plan"])
                if m == "bprr":
                    line += " (GCA's chains, listed for reference: requests are routed one by one by WS-RR)"
                paths = _paths_used(runs[m])
                if paths:
                    line += f"; paths used (requests): {paths}"
                parts.append(line)
        parts.append("")
    if data.get("rtt"):
        parts.append("**Achieved RTTs** (servers' own probes of the orchestrator, `rtt_s`, vs configured, ms): "
                     + ", ".join(f"{h} {v['configured']:.1f}/{v['achieved']:.1f}" for h, v in data["rtt"].items()) + "\n")
    if data.get("findings"):
        parts.append("**Findings.**\n")
        parts.extend(f"* {f}" for f in data["findings"])
        parts.append("")
    if data.get("analysis"):
        parts.append("**Analysis.**\n")
        parts.append(data["analysis"] + "\n")
    parts.append(f"![live Table 1]({name}.png)\n")
    return "\n".join(parts) + "\n"


def _paths_used(run: dict) -> str:
    """How many requests each chain or WS-RR path served (runs that recorded the serving servers)."""
    from collections import Counter

    counts = Counter("→".join(r["servers"]) for r in run["records"] if r.get("servers"))
    return ", ".join(f"{path} {n}" for path, n in counts.most_common())


def _plan_line(plan: dict) -> str:
    spans = ", ".join(f"{s['id']}[{s['start']},{s['end']})" for s in plan["servers"] if s["start"] is not None
                      and s["start"] != s["end"])
    if "chains" in plan:
        chains = "; ".join(f"{'→'.join(c['servers'])}×{c['capacity']}" for c in plan["chains"])
        return f"c={plan.get('c')}, blocks {spans}; chains (servers×capacity) {chains}"
    return f"blocks {spans}; {plan.get('cache_tokens_per_block')} cache tokens per block"


def findings(data: dict) -> list[str]:
    out = []
    for cfg, runs in data["runs"].items():
        if "petals" in runs and "proposed" in runs:
            p, q = runs["petals"]["stats"], runs["proposed"]["stats"]
            mean = improvement(q["response"]["mean"], p["response"]["mean"])
            p95 = improvement(q["response"]["p95"], p["response"]["p95"])
            out.append(f"{cfg}: Proposed vs PETALS — mean response {100 * mean:+.1f}%, P95 {100 * p95:+.1f}% "
                       f"({'beats' if mean > 0 and p95 > 0 else 'does NOT beat'} PETALS on both).")
        if "auto" in runs and len(runs) > 1:
            out.append(f"{cfg}: " + _auto_versus_best(runs))
        for m in METHODS:
            if m in runs:
                out.append(f"{cfg}: {LABEL[m]} — " + _diagnostics(runs[m]))
    return out


def _auto_versus_best(runs: dict) -> str:
    """Auto against the best of the other methods, for the mean and the P95 response separately."""
    a = runs["auto"]["stats"]["response"]
    parts = []
    for stat in ("mean", "p95"):
        others = {m: runs[m]["stats"]["response"][stat] for m in METHODS if m in runs and m != "auto"
                  and runs[m]["stats"]["failed"] == 0}
        if not others:
            continue
        best = min(others, key=others.get)
        diff = improvement(a[stat], others[best])
        parts.append(f"{stat} {a[stat]:.2f} s vs the best other ({LABEL[best]}, {others[best]:.2f} s): "
                     f"{'at or below it' if diff >= 0 else 'above it'} by {100 * abs(diff):.1f}%")
    return "Auto — " + "; ".join(parts) + " (methods with failed requests are left out of the comparison)."


def _diagnostics(run: dict) -> str:
    """Why a method's times are what they are: hops, service per generated token, concurrency in service."""
    recs = [r for r in run["records"] if r["error"] is None and r["completed"] is not None and r["started"] is not None]
    if not recs:
        return "no completed request"
    per_token = [(r["completed"] - r["started"]) / max(1, r["generated"]) for r in recs]
    starts = np.array([r["started"] for r in recs])
    ends = np.array([r["completed"] for r in recs])
    conc = [int(((starts <= s) & (ends > s)).sum()) for s in starts]
    chains = run.get("chain_ids") or {}
    hops = [len(chains[r["chain"]]) for r in recs if r.get("chain") in chains]
    plan = run.get("plan", {})
    if not hops and plan.get("servers") and "chains" not in plan:
        hops = []
    errors = sorted({(r["error"] or "")[:60] for r in run["records"] if r["error"]})
    text = (f"service per generated token mean {1e3 * np.mean(per_token):.0f} ms (median "
            f"{1e3 * np.median(per_token):.0f}); requests in service at a start: mean {np.mean(conc):.1f}, max "
            f"{max(conc)}")
    if hops:
        text += f"; servers per chain used: mean {np.mean(hops):.2f}"
    if errors:
        text += f"; failures: {'; '.join(errors)}"
        gave_up = [r["failed_at"] - r["submitted"] for r in run["records"]
                   if r["error"] and r.get("failed_at") is not None and r.get("submitted") is not None]
        if gave_up:
            resp = [r["completed"] - r["submitted"] for r in recs] + gave_up
            text += (f"; failed requests gave up after {np.mean(gave_up):.1f} s on average; counting them at that "
                     f"time (a lower bound), mean response {np.mean(resp):.2f} s, P95 {np.percentile(resp, 95):.2f} s")
    return text + "."
