"""Matplotlib plots of the fairness simulations, drawn from a ``fairness.json`` document.

``fairness_service_<scenario>.png`` (per-client actual service over time, seed 0),
``fairness_plane.png`` (common-window throughput against Jain's index, ±1 sd, with
DLPM's Q^u sweep) and ``fairness_latency.png`` (P50/P99 of the well-behaved clients).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from experiments.sim.fairness_metrics_sim import LATENCY_METRIC, TPUT_KEY, mean_of


def write_plots(doc: dict, out: Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    scen = list(doc["scenarios"])
    colors = {"m0": "tab:red", "w1": "tab:blue", "w2": "tab:green", "w3": "tab:purple"}
    pcolors = {"fcfs": "tab:gray", "lpm": "tab:orange", "vtc": "tab:blue", "dlpm": "tab:green",
               "swarm": "tab:red", "bfio": "tab:purple", "lcf": "tab:brown"}
    # 1. per-client service over time, one figure per scenario
    for s in scen:
        entry = doc["scenarios"][s]
        pols = list(entry["policies"])
        fig, axes = plt.subplots(1, len(pols), figsize=(3.2 * len(pols), 3.0), sharey=True, squeeze=False)
        for ax, p in zip(axes[0], pols):
            run = entry["policies"][p]["runs"][0]
            ser = run["series_actual"]
            for c, ys in ser["rate"].items():
                ax.plot(ser["t"], ys, color=colors.get(c), label=c + (" (misbehaving)" if c == "m0" else ""), lw=1.2)
            t1, t2 = run["window_s"]
            ax.axvspan(t1, t2, color="0.92", zorder=0)
            ax.set_title(f"{p}  J={run['jain_actual']:.3f}", fontsize=9)
            ax.set_xlabel("time (s)")
        axes[0][0].set_ylabel("actual service rate (su/s)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{s}: per-client service over time (shaded: all-active window)", fontsize=10)
        fig.tight_layout()
        path = out / f"fairness_service_{s.replace('@', '_load')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    # 2. throughput-fairness plane
    n = len(scen)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    for ax, s in zip(axes.flat, scen):
        entry = doc["scenarios"][s]
        sw = entry.get("quantum_sweep") or {}
        if sw:
            qs = sorted(sw, key=float)
            xs = [sw[q]["summary"]["jain_actual"]["mean"] for q in qs]
            ys = [sw[q]["summary"][TPUT_KEY]["mean"] for q in qs]
            # sweep: means over seeds (seed-to-seed spread is mostly common to all policies: the
            # workloads differ); only the ends and the main Q^u are labelled
            ax.plot(xs, ys, "-", color="tab:green", alpha=0.6, lw=1)
            ax.scatter(xs, ys, s=[8 + 4 * math.log2(float(q) / 1024) for q in qs], color="tab:green", alpha=0.6,
                       zorder=2)
            for q, x, y in zip(qs, xs, ys):
                if q in (qs[0], qs[-1], str(int(doc["config"]["quantum"]))):
                    ax.annotate(f"Q={int(float(q)) // 1024}k", (x, y), fontsize=6, color="tab:green",
                                xytext=(3, 3), textcoords="offset points")
        for p, e in entry["policies"].items():
            x, y = e["summary"]["jain_actual"]["mean"], e["summary"][TPUT_KEY]["mean"]
            ax.errorbar([x], [y], xerr=[e["summary"]["jain_actual"]["std"]], yerr=[e["summary"][TPUT_KEY]["std"]],
                        fmt="o", color=pcolors.get(p), ms=5, zorder=3, label=p, capsize=2, lw=0.8)
        ax.set_title(s, fontsize=9)
        ax.set_xlabel("Jain's index (actual service)")
        ax.set_ylabel("throughput, common window (su/s)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    list(axes.flat)[0].legend(fontsize=7)
    fig.suptitle("Throughput-fairness plane (points: mean ± 1 sd over seeds; green line: DLPM over Q^u = 1k..256k, "
                 "mean)", fontsize=10)
    fig.tight_layout()
    path = out / "fairness_plane.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    # 3. latency bars of well-behaved clients
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    for ax, s in zip(axes.flat, scen):
        entry = doc["scenarios"][s]
        pols = list(entry["policies"])
        p50 = [mean_of(entry, p, "wb_latency_p50") or 0 for p in pols]
        p99 = [mean_of(entry, p, "wb_latency_p99") or 0 for p in pols]
        sd = lambda p, k: (entry["policies"][p]["summary"].get(k) or {}).get("std", 0.0)
        xs = np.arange(len(pols))
        ax.bar(xs - 0.2, p50, 0.4, yerr=[sd(p, "wb_latency_p50") for p in pols], label="P50", color="tab:blue",
               error_kw={"lw": 0.8, "capsize": 2})
        ax.bar(xs + 0.2, p99, 0.4, yerr=[sd(p, "wb_latency_p99") for p in pols], label="P99", color="tab:red",
               error_kw={"lw": 0.8, "capsize": 2})
        ax.set_xticks(xs, pols, rotation=45, fontsize=7)
        ax.set_yscale("log")
        metric = LATENCY_METRIC[s.split("-")[0]].replace("_", " ")
        ax.set_title(f"{s} ({metric}, ±1 sd)", fontsize=9)
        ax.set_ylabel("seconds (log)")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    list(axes.flat)[0].legend(fontsize=7)
    fig.suptitle("Latency of well-behaved clients", fontsize=10)
    fig.tight_layout()
    path = out / "fairness_latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths
