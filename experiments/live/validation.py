"""Model validation (chain-composition spec §11.2): measured service times against the planner's model.

Reads the Table 1 replay (``live_table1.json``; run ``chainswarm experiment table1`` first) and, for every
request served by an orchestrated method, predicts its service time with the planner's model at the
request's own lengths:

    T = Σ_{j ∈ chain} [ l_O·(RTT_j + 18 ms)  +  m_j·(t_o + prefill_j·l_I + decode_j·(l_O − 1)) ]

(communication per server: one relayed round trip per generated token; computation linear in blocks m_j
and tokens; RTT_j the configured WAN RTT orchestrator–server j, prefill/decode the per-block per-token times
the servers report: their measured CPU time plus, in emulated runs, the emulated GPU time). Reports measured/predicted ratios, the measured per-token slope of each chain
(least squares of service time on output tokens) against the model's Σ_j (RTT_j + 18 ms), and the same
split by concurrency (how many requests were in service on the whole swarm when the request started).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from experiments.live import common as lc
from experiments.paths import RESULTS

DEFAULT_OUT = RESULTS
HOP_OVERHEAD_S = 0.018
BLOCK_OVERHEAD_S = 0.001


def predictions(table1: dict, config_name: str = "relay") -> list[dict]:
    from wan import WanConfig

    wan = WanConfig.from_dict(table1["wan"])
    rows = []
    for method, run in table1["runs"].get(config_name, {}).items():
        if "profiles" not in run:
            continue
        prof = run["profiles"]
        chains = run["chain_ids"]
        recs = [r for r in run["records"] if r["error"] is None and (r.get("servers") or r["chain"] in chains)]
        starts = np.array([r["started"] for r in recs])
        ends = np.array([r["completed"] for r in recs])
        for r in recs:
            servers = r.get("servers") or chains[r["chain"]]
            l_in, l_out = r["input_tokens"], max(1, r["generated"])
            comm = sum(l_out * (wan.rtt(wan.client, s) / 1e3 + HOP_OVERHEAD_S) for s in servers)
            # blocks per hop: each server runs from where the previous hop stopped to the end of its range
            starts_at = [0] + [prof[s]["end"] for s in servers[:-1]]
            comp = sum((prof[s]["end"] - a) * (BLOCK_OVERHEAD_S + prof[s]["prefill_s"] * l_in
                                               + prof[s]["decode_s"] * (l_out - 1))
                       for s, a in zip(servers, starts_at))
            busy = int(((starts <= r["started"]) & (ends > r["started"])).sum())
            rows.append({"method": method, "chain": "→".join(servers), "servers": list(servers),
                         "blocks": [prof[s]["end"] - a for s, a in zip(servers, starts_at)],
                         "started": r["started"], "completed": r["completed"], "hops": len(servers), "input": l_in,
                         "output": l_out, "measured": r["completed"] - r["started"], "predicted": comm + comp,
                         "comm": comm, "comp": comp, "concurrent": busy,
                         "per_token_model": sum(wan.rtt(wan.client, s) / 1e3 + HOP_OVERHEAD_S
                                                + (prof[s]["end"] - a) * prof[s]["decode_s"]
                                                for s, a in zip(servers, starts_at))})
    return rows


def chain_fits(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["method"], r["chain"]) for r in rows}):
        sel = [r for r in rows if (r["method"], r["chain"]) == key]
        if len(sel) < 4 or len({r["output"] for r in sel}) < 2:
            continue
        x = np.array([r["output"] for r in sel], float)
        y = np.array([r["measured"] for r in sel], float)
        slope, intercept = np.polyfit(x, y, 1)
        out.append({"method": key[0], "chain": key[1], "n": len(sel), "slope_ms": 1e3 * slope,
                    "model_ms": 1e3 * sel[0]["per_token_model"], "intercept_s": float(intercept),
                    "ratio_median": float(np.median(y / np.array([r["predicted"] for r in sel])))})
    return out


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for method in sorted({r["method"] for r in rows}):
        sel = [r for r in rows if r["method"] == method]
        ax.scatter([r["predicted"] for r in sel], [r["measured"] for r in sel], s=8, alpha=0.6, label=method)
    hi = max([r["measured"] for r in rows] + [r["predicted"] for r in rows] + [1])
    ax.plot([0, hi], [0, hi], "k--", lw=1, label="measured = model")
    ax.set_xlabel("planner model (s)")
    ax.set_ylabel("measured service (s)")
    ax.set_title("service time: measured vs model (relay)")
    ax.legend(fontsize=8)
    ax = axes[1]
    conc = np.array([r["concurrent"] for r in rows])
    ratio = np.array([r["measured"] / r["predicted"] for r in rows])
    ax.scatter(conc, ratio, s=8, alpha=0.5)
    ax.axhline(1.0, color="k", ls="--", lw=1)
    ax.set_xlabel("requests in service on the swarm at start")
    ax.set_ylabel("measured / model")
    ax.set_title("model error against load on the machine")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _batch_term(table1: dict, rows: list[dict], out: Path) -> dict:
    """The batch term of the service model on Table 1 (adds ``predicted_batch`` to ``rows``) and on the
    batching benchmark's committed results (:mod:`experiments.live.batch_validation`)."""
    from experiments.live import batch_validation as bv

    cpu = (table1.get("settings", {}).get("measured_compute") or {}).get("decode_s")
    if cpu:
        bv.table1_with_batch(rows, float(cpu))
    bench_path = out / "bench_batching.json"
    bench = bv.bench_check(json.loads(bench_path.read_text())) if bench_path.is_file() else []
    return {"cpu_decode_s": cpu, "bench_source": bench_path.name if bench else None, "bench": bench,
            "summary": bv.summary(rows, bench)}


def _batch_lines(batch: dict) -> list[str]:
    s = batch["summary"]
    lines = ["", "**The batch term** (step time as a function of the sessions a server holds, "
             "`planner/service_model.py`; computed by `experiments/live/batch_validation.py`):", ""]
    if "table1" in s:
        t = s["table1"]
        lines.append(f"* Table 1 (the CPU part of the decode steps, {1e3 * batch['cpu_decode_s']:.2f} ms per block and "
                     f"token, taken as sequential, g(n) = n: the most it can add, whether or not the run's servers "
                     f"batch; the emulated GPU time does not batch; occupancy from the run's own records): "
                     f"measured / model median "
                     f"{t['ratio_median_no_batch']:.2f} without the batch term, {t['ratio_median_batch']:.2f} with it "
                     f"(the term adds a median {100 * (t['batch_term_median'] - 1):.1f}% to the prediction; {t['n']} "
                     "requests). What is left is CPU contention between the processes on 2 shared cores, which the "
                     "model does not have.")
    for kind, label in (("vanilla_petals", "vanilla petals servers (sequential steps)"),
                        ("chainswarm_batched", "batched Chainswarm servers (bound 8), one petals session per client"),
                        ("chainswarm_multi", "batched Chainswarm servers, all sessions in one ChainGenerator "
                         "(multi-session streams)")):
        key = f"bench {kind}"
        if key in s:
            lines.append(f"* `{batch['bench_source']}`, {label}: per-token latency at 2–16 concurrent sessions, "
                         f"measured / model median {s[key]['ratio_median']:.2f} with the batch term, "
                         f"{s[key]['ratio_median_no_batch']:.2f} without (L(1) measured, the step term from the "
                         "in-process step profile).")
    if batch["bench"]:
        lines += ["", "| servers | client | sessions | measured ms/token | model with batch term | without | "
                  "measured / model |", "|---|---|---|---|---|---|---|"]
        for b in batch["bench"]:
            lines.append(f"| {b['servers']} | {b['client']} | {b['sessions']} | {b['measured_ms']:.1f} | "
                         f"{b['model_ms']:.1f} | {b['model_no_batch_ms']:.1f} | {b['ratio']:.2f} |")
        lines.append("\nWith one petals session per client, the measured latency on batched servers grows faster than "
                     "the in-process step predicts: each session still pays its own RPC, serialisation and handler "
                     "work on the same 2 cores (and, with `generate`, the client's LM head), and steps arriving one "
                     "by one make the server's batches smaller than the number of sessions. With multi-session "
                     "streams those costs are paid once per step, so the step profile predicts the latency.")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="read live_table1_quick.json")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--source", type=Path, default=None, help="Table 1 JSON (default <out>/live_table1.json)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    name = "live_validation" + ("_quick" if args.quick else "")
    source = args.source or out / ("live_table1_quick.json" if args.quick else "live_table1.json")
    if not source.is_file():
        print(f"chainswarm experiment validation: error: no Table 1 results at {source}: run `chainswarm experiment "
              "table1` first", file=sys.stderr)
        return 2
    table1 = json.loads(source.read_text())
    rows = predictions(table1)
    if not rows:
        print("no orchestrated relay runs in", source)
        return 2
    fits = chain_fits(rows)
    batch = _batch_term(table1, rows, out)
    ratio = np.array([r["measured"] / r["predicted"] for r in rows])
    conc = np.array([r["concurrent"] for r in rows])
    low = ratio[conc <= np.percentile(conc, 25)]
    summary = {"n": len(rows), "ratio_median": float(np.median(ratio)), "ratio_p10": float(np.percentile(ratio, 10)),
               "ratio_p90": float(np.percentile(ratio, 90)), "ratio_median_low_concurrency": float(np.median(low)),
               "low_concurrency_max": int(np.percentile(conc, 25)),
               "corr_ratio_concurrency": float(np.corrcoef(conc, ratio)[0, 1]) if len(set(conc)) > 1 else math.nan}
    # CPU contention: the measured time per generated token against the number of requests in service on the
    # whole (2-core) machine; the planner's model has no such term (a server's service time does not depend on
    # the load of the others, nor on its own concurrent sessions).
    per_token = np.array([r["measured"] / max(1, r["output"]) for r in rows])
    model_tok = np.array([r["predicted"] / max(1, r["output"]) for r in rows])
    if len(set(conc)) > 1:
        b, a = np.polyfit(conc, per_token, 1)
        summary.update({"per_token_vs_concurrency_intercept_ms": 1e3 * float(a),
                        "per_token_vs_concurrency_slope_ms": 1e3 * float(b),
                        "corr_per_token_concurrency": float(np.corrcoef(conc, per_token)[0, 1]),
                        "model_per_token_median_ms": 1e3 * float(np.median(model_tok)),
                        "concurrency_mean": float(conc.mean())})
    data = {"source": str(source.name), "summary": summary, "fits": fits, "batch": batch, "rows": rows}
    (out / "sections").mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    _plot(rows, out / f"{name}.png")
    lines = [f"## Live swarm — model validation{' (quick)' if args.quick else ''}\n",
             f"`chainswarm experiment validation{' --quick' if args.quick else ''}` — from `{source.name}` "
             f"(relay runs of BPRR, JFFC only, Proposed; {len(rows)} requests).\n",
             "Model per request: Σ over the chain's servers of l_O·(RTT_j + 18 ms) + m_j·(1 ms + prefill_j·l_I + "
             "decode_j·(l_O − 1)), with the configured WAN RTTs and the per-block times the servers report (measured "
             "CPU time, plus the emulated GPU time when the run emulates one).\n",
             f"* measured / model: median {summary['ratio_median']:.2f} (P10 {summary['ratio_p10']:.2f}, P90 "
             f"{summary['ratio_p90']:.2f}); at low concurrency (≤ {summary['low_concurrency_max']} requests in service) "
             f"median {summary['ratio_median_low_concurrency']:.2f}; correlation of the ratio with concurrency "
             f"{lc.fmt(summary['corr_ratio_concurrency'])}.",
             *([f"* measured time per generated token = {summary['per_token_vs_concurrency_intercept_ms']:.0f} ms + "
                f"{summary['per_token_vs_concurrency_slope_ms']:.1f} ms × (requests in service on the machine) "
                f"(least squares, correlation {summary['corr_per_token_concurrency']:.2f}; mean concurrency "
                f"{summary['concurrency_mean']:.1f}); the model's per-token time (median over requests) is "
                f"{summary['model_per_token_median_ms']:.0f} ms and has no load term (the planner assumes a "
                f"server's sessions do not slow each other; on 2 shared CPU cores they do, by the slope above)."]
               if "per_token_vs_concurrency_slope_ms" in summary else []),
             "", "| method | chain | n | measured per-token slope (ms) | model per token Σ(RTT + 18 ms + m_j·decode_j) (ms) | median measured/model |",
             "|---|---|---|---|---|---|"]
    for f in fits:
        lines.append(f"| {f['method']} | {f['chain']} | {f['n']} | {f['slope_ms']:.1f} | {f['model_ms']:.1f} | "
                     f"{f['ratio_median']:.2f} |")
    lines += _batch_lines(batch)
    lines.append(f"\n![model validation]({name}.png)\n")
    (out / "sections" / f"{name}.md").write_text("\n".join(lines) + "\n")
    if not args.quick:
        from experiments.report import report

        report.assemble(out)
    print("\n".join(lines))
    return 0
