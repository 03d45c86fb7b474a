"""The churn experiment's PNG and report section (``sections/churn.md``), every number from ``churn.json``
(written by experiments/figures/churn.py, which is also the ``chainswarm simulate churn`` entry point)."""
from __future__ import annotations

from pathlib import Path

from experiments.sim.churn_strategies import STRATEGIES

COLORS = {"incremental": "tab:purple", "incremental + standby": "tab:blue", "incremental + reserve": "tab:cyan",
          "scratch (auto)": "tab:orange", "scratch (gbp-cr)": "tab:olive", "petals rebalancing": "tab:red"}


def _s(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def plot(data: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    agg = data["aggregate"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = [n for n in STRATEGIES if n in agg]
    for ax, key, label in ((axes[0], "blocks_loaded", "blocks loaded per run"),
                           (axes[1], "cost", "response-time cost of churn (s)")):
        ax.bar(range(len(names)), [agg[n][key]["mean"] or 0 for n in names],
               yerr=[agg[n][key]["std"] or 0 for n in names], color=[COLORS[n] for n in names], capsize=3)
        ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    ax = axes[2]
    run = data["runs"][0]
    for n in names:
        cap = run["strategies"][n]["capacity"]
        ax.step([c[0] / 60 for c in cap], [c[1] for c in cap], where="post", color=COLORS[n], label=n, linewidth=1)
    ax.axhline(data["config"]["arrival_rate"], color="k", linestyle=":", label="λ")
    ax.set_xlabel("time (min), run 0")
    ax.set_ylabel("total service rate ν of the chains in force (1/s)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    cfg = data["config"]
    fig.suptitle(f"Churn: J = {cfg['num_servers']}, {100 * cfg['churn_per_min']:g}% of servers leave and join per "
                 f"minute, {cfg['reload_s_per_block']:.1f} s per block reloaded, Azure-trace arrivals at λ = "
                 f"{cfg['arrival_rate']:g} ({data['config']['runs']} runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(data: dict) -> str:
    cfg, agg = data["config"], data["aggregate"]
    names = [n for n in STRATEGIES if n in agg]
    leaves = sum(r["leaves"] for r in data["runs"]) / len(data["runs"])
    joins = sum(r["joins"] for r in data["runs"]) / len(data["runs"])
    lines = ["## Re-planning under churn", "", "![churn](churn.png)", "",
             f"*Settings:* {cfg['runs']} runs of {cfg['horizon_s'] / 60:g} min; J = {cfg['num_servers']} servers drawn "
             f"from a Fig. 8 scenario of {2 * cfg['num_servers']} (η = {cfg['eta']}); each server leaves at "
             f"{100 * cfg['churn_per_min']:g}% per minute and servers join at the same rate (on average {leaves:.0f} "
             f"leaves and {joins:.0f} joins per run); Azure code-trace arrivals rescaled to "
             f"λ = {cfg['arrival_rate']:g} "
             f"req/s, Exp(1) sizes; a server whose span changes serves it only after loading it at "
             f"{cfg['reload_s_per_block']:.2f} s per block (the load path measured by experiments/bench/churn_load.py, "
             "scaled to a 1.32 GB BLOOM-176B block), and a job on a chain that breaks restarts; replanning "
             f"tolerance {100 * cfg['tolerance']:g}%; computed in {data['elapsed_s']:.0f} s at load average "
             f"{data['load_average'][0][0]:.1f} → {data['load_average'][1][0]:.1f} on 2 cores.", "",
             "Blocks loaded count every block of a span a server (re)loads (Chainswarm's and petals' servers reload "
             "the whole range when it changes); blocks new to the server leave out blocks it already held. The "
             "cost of churn is the mean response with churn minus the same strategy's static run (its initial "
             "placement, the same jobs, nobody leaves). Mean ± std over runs.", "",
             "| strategy | blocks loaded | blocks new to the server | servers reloading | decisions "
             "| mean response (s) | P95 (s) | static mean (s) | cost of churn (s) | jobs restarted "
             "| jobs never served | time with no chain (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        a = agg[n]
        dec = ", ".join(f"{k} {v}" for k, v in a["decisions"].items()) or "–"
        lines.append(f"| {n} | {_s(a['blocks_loaded']['mean'], 0)} ± {_s(a['blocks_loaded']['std'], 0)} | "
                     f"{_s(a['blocks_new']['mean'], 0)} | {_s(a['reloads']['mean'], 0)} | {dec} | "
                     f"{_s(a['mean']['mean'])} ± {_s(a['mean']['std'])} | {_s(a['p95']['mean'])} | "
                     f"{_s(a['static_mean']['mean'])} | {_s(a['cost']['mean'])} ± {_s(a['cost']['std'])} | "
                     f"{_s(a['restarted']['mean'], 0)} | {_s(a['unfinished']['mean'], 0)} | "
                     f"{_s(a['no_chain_s']['mean'], 0)} |")
    lines += ["", "**Findings (computed from the table):**", ""] + _findings(agg, names)
    lines += ["", "All numbers: [`churn.json`](churn.json); reload cost: [`churn_load.json`](churn_load.json).", ""]
    return "\n".join(lines)


def _findings(agg: dict, names: list[str]) -> list[str]:
    inc = agg.get("incremental")
    if inc is None:
        return []
    out = []
    for n in names:
        if n == "incremental":
            continue
        o = agg[n]
        bl, bo = inc["blocks_loaded"]["mean"], o["blocks_loaded"]["mean"]
        ci, co = inc["cost"]["mean"], o["cost"]["mean"]
        if not bo:
            ratio = "–"
        else:
            ratio = ("as many" if bl == bo else f"{100 * (1 - bl / bo):.0f}% fewer" if bl < bo
                     else f"{100 * (bl / bo - 1):.0f}% more")
        word = None if ci is None or co is None else "the same" if ci == co else "a lower" if ci < co else "a higher"
        cost = "–" if word is None else f"{word} response-time cost of churn ({_s(ci)} s against {_s(co)} s)"
        out.append(f"* incremental against {n}: {ratio} blocks loaded ({_s(bl, 0)} against {_s(bo, 0)}), {cost}.")
    return out
