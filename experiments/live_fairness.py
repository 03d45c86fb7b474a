"""Fairness on the live swarm: a misbehaving client against well-behaved ones, policies fcfs / vtc / dlpm.

A small WAN-emulated swarm (orchestrated nodes, GBP-CR + GCA + JFFC) planned for a low rate, so that the
offered load exceeds what it serves and every client stays backlogged. Clients ``good0..`` send Poisson
requests at ``rate`` each and ``flood`` at ``flood_factor × rate`` (same lengths). Service of a request
(fairness-locality spec §1.2, w_e = 1, w_q = 2) is credited at its start (prompt) and spread evenly over its
service period (output). Metrics (§9, ``planner.fairness_metrics``): Jain's index of the clients' service
over the window in which all of them are backlogged (have a request queued), per-client cumulative
service over time, P50/P99 response of the well-behaved clients, throughput (requests/s and tokens/s).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

from experiments import live_common as lc

POLICIES = ("fcfs", "vtc", "dlpm")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
W_EXTEND, W_OUTPUT = 1.0, 2.0


def settings(quick: bool) -> dict:
    if quick:
        return {"servers": 2, "duration_s": 14.0, "rate": 0.6, "flood_factor": 4.0, "good": 2,
                "input_tokens": 32, "output_tokens": 8, "expected_rate": 0.2}
    # Overloaded on purpose (every client backlogged), so the run is cut ``drain_s`` after the last arrival:
    # requests still queued then fail as "unfinished at cutoff" and are counted (bounded run length).
    return {"servers": 3, "duration_s": 60.0, "rate": 0.4, "flood_factor": 4.0, "good": 3,
            "input_tokens": 64, "output_tokens": 24, "expected_rate": 0.3, "drain_s": 45.0}


def workload(st: dict, seed: int = 0) -> list[lc.Record]:
    rng = np.random.default_rng(seed)
    clients = [(f"good{i}", st["rate"]) for i in range(st["good"])] + [("flood", st["rate"] * st["flood_factor"])]
    records = []
    for client, rate in clients:
        t = rng.exponential(1 / rate)
        while t < st["duration_s"]:
            records.append(lc.Record(0, client, float(t), st["input_tokens"], st["output_tokens"]))
            t += rng.exponential(1 / rate)
    records.sort(key=lambda r: r.arrival)
    for i, r in enumerate(records):
        r.index = i
    return records


def run_policy(policy: str, model_dir: str, config, memory_gb: float, st: dict, prompts, profile_dir: str, log) -> dict:
    import httpx

    from server.local_swarm import LocalSwarm

    records = workload(st)
    with LocalSwarm(model_dir, wan=config) as swarm:
        swarm.add_orchestrator(policy=policy, expected_rate=st["expected_rate"], max_length=lc.SESSION_TOKENS,
                               expected_input_tokens=st["input_tokens"], expected_output_tokens=st["output_tokens"],
                               refresh_s=1.0, quantum=200.0, use_server_to_server=False, queue_timeout_s=1800.0)
        # compute measured once on a quiet node and declared for all (as in live_table1); RTTs measured
        from experiments.live_table1 import _MEASURED

        hosts = list(config.servers)
        peers = []
        if not _MEASURED:
            first = swarm.add_node(node_id=hosts[0], wan_host=hosts[0], memory_gb=memory_gb, wait=True, timeout=180,
                                   profile_cache_dir=profile_dir, num_handlers=1)
            _MEASURED.update({k: float(first.info["profile"][k]) for k in ("prefill_s", "decode_s")})
            peers.append(first)
            hosts = hosts[1:]
        peers += [swarm.add_node(node_id=h, wan_host=h, memory_gb=memory_gb, wait=False, profile_cache_dir=profile_dir,
                                 num_handlers=1, declared_profile=dict(_MEASURED)) for h in hosts]
        for p in peers:
            swarm.wait_profiled(p, timeout=180)
        url = swarm.orchestrator.info["url"]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = httpx.get(f"{url}/v1/swarm", timeout=30).json()
            if status.get("chains") and all(c["ready"] for c in status["chains"]) and status["plan"] and \
                    {s["id"] for s in status["plan"]["servers"]} == set(config.servers):
                break
            time.sleep(0.5)
        else:
            raise TimeoutError("chains not ready")
        capacity = sum(c["capacity"] for c in status["chains"])
        log(f"  {policy}: chains " + "; ".join(f"{'→'.join(c['servers'])}×{c['capacity']}" for c in status["chains"]))
        cutoff = st["duration_s"] + st["drain_s"] if st.get("drain_s") else None
        driver = lc.OrchestratorDriver(url, prompts, cutoff_s=cutoff)
        try:
            t0 = time.monotonic()
            lc.replay(records, driver)
            elapsed = time.monotonic() - t0
        finally:
            driver.close()
    return {"records": records, "elapsed_s": elapsed, "capacity": capacity}


def metrics(records: list[lc.Record]) -> dict:
    from planner import fairness_metrics as fm

    ok = [r for r in records if r.error is None]
    clients = sorted({r.client for r in records})
    events = []
    for r in ok:
        events.append((r.started, r.client, W_EXTEND * r.input_tokens))
        n = max(1, r.generated)
        for k in range(1, n + 1):
            events.append((r.started + r.service * k / n, r.client, W_OUTPUT))
    events.sort(key=lambda e: e[0])
    backlog = {c: [(r.submitted, r.started) for r in ok if r.client == c and r.started > r.submitted + 1e-3]
               for c in clients}
    merged = {c: _merge(v) for c, v in backlog.items()}
    window = merged[clients[0]]
    for c in clients[1:]:
        window = fm.intersect_intervals(window, merged[c])
    total = sum(b - a for a, b in window)
    per_client = {c: sum(fm.service_in_interval(events, c, a, b) for a, b in window) for c in clients}
    jain = fm.jain_index(list(per_client.values())) if total > 0 else math.nan
    good = [r.response for r in ok if r.client != "flood"]
    end = max((r.completed for r in ok), default=math.nan)
    start = min((r.submitted for r in ok), default=math.nan)
    return {
        "jain_backlogged": jain, "backlogged_window_s": total, "service_in_window": per_client,
        "good_p50": float(np.percentile(good, 50)) if good else math.nan,
        "good_p99": float(np.percentile(good, 99)) if good else math.nan,
        "flood_p50": float(np.percentile([r.response for r in ok if r.client == "flood"], 50)),
        "throughput_rps": len(ok) / (end - start), "throughput_tokens_s": sum(r.generated for r in ok) / (end - start),
        "completed": len(ok), "failed": len(records) - len(ok),
        "cumulative": {c: sorted((t, a) for t, cl, a in events if cl == c) for c in clients},
    }


def _merge(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols = list(data["runs"])
    fig, axes = plt.subplots(1, len(pols) + 1, figsize=(5 * (len(pols) + 1), 4))
    for ax, pol in zip(axes, pols):
        for client, series in data["runs"][pol]["metrics"]["cumulative"].items():
            if series:
                t = [s[0] for s in series]
                ax.plot(t, np.cumsum([s[1] for s in series]), label=client, lw=2 if client == "flood" else 1)
        ax.set_title(f"{pol}: Jain {data['runs'][pol]['metrics']['jain_backlogged']:.3f}")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("cumulative service (w_e·prompt + w_q·output)")
        ax.legend(fontsize=8)
    ax = axes[-1]
    x = np.arange(len(pols))
    ax.bar(x - 0.2, [data["runs"][p]["metrics"]["good_p50"] for p in pols], 0.4, label="well-behaved P50")
    ax.bar(x + 0.2, [data["runs"][p]["metrics"]["good_p99"] for p in pols], 0.4, label="well-behaved P99")
    ax.set_xticks(x)
    ax.set_xticklabels(pols)
    ax.set_ylabel("response time (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section(data: dict) -> str:
    s = data["settings"]
    lines = [f"## Live swarm — fairness with a misbehaving client{' (quick)' if data['quick'] else ''}\n",
             f"`{data['command']}` — {lc.machine_note()}, total {data['elapsed_s'] / 60:.1f} min.\n",
             f"**Setup.** {s['servers']} orchestrated nodes behind the WAN emulator (RIPE Atlas RTTs), planned for "
             f"{s['expected_rate']} req/s (GBP-CR + GCA, JFFC), relay data path. {s['good']} well-behaved clients at "
             f"{s['rate']} req/s each and `flood` at {s['flood_factor']:g}× that, Poisson, for {s['duration_s']:g} s; every "
             f"request {s['input_tokens']} prompt + {s['output_tokens']} output tokens. Service = 1·prompt + 2·output tokens, "
             f"output spread over the request's service period. "
             + (f"The run is cut {s['drain_s']:g} s after the last arrival; requests still unanswered then count as "
                f"unfinished (they are in no statistic but the count). " if s.get("drain_s") else "")
             + f"Node compute: measured once on a node started alone and declared for all; RTTs measured.\n",
             "| Policy | Jain (all backlogged) | window (s) | well-behaved P50 / P99 (s) | flood P50 (s) | throughput (req/s, tok/s) | completed / unfinished |",
             "|---|---|---|---|---|---|---|"]
    for pol, run in data["runs"].items():
        m = run["metrics"]
        lines.append(f"| {pol} | {lc.fmt(m['jain_backlogged'], 3)} | {lc.fmt(m['backlogged_window_s'], 1)} | "
                     f"{lc.fmt(m['good_p50'])} / {lc.fmt(m['good_p99'])} | {lc.fmt(m['flood_p50'])} | "
                     f"{lc.fmt(m['throughput_rps'])}, {lc.fmt(m['throughput_tokens_s'], 1)} | {m['completed']} / {m['failed']} |")
    lines.append("")
    for pol, run in data["runs"].items():
        unfinished: dict[str, int] = {}
        for r in run["records"]:
            if r["error"]:
                unfinished[r["client"]] = unfinished.get(r["client"], 0) + 1
        offered: dict[str, int] = {}
        for r in run["records"]:
            offered[r["client"]] = offered.get(r["client"], 0) + 1
        lines.append(f"* {pol}: plan capacity {run['capacity']} concurrent session(s); unfinished / offered per client: "
                     + ", ".join(f"{c} {unfinished.get(c, 0)}/{n}" for c, n in sorted(offered.items()))
                     + "; service in the backlogged window: "
                     + ", ".join(f"{c} {v:.0f}" for c, v in sorted(run["metrics"]["service_in_window"].items())) + ".")
    lines.extend(f"* {f}" for f in data.get("findings", []))
    lines.append(f"\n![live fairness]({data['name']}.png)\n")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals per policy")


def run(args: argparse.Namespace) -> int:
    import tempfile

    st = settings(args.quick)
    if args.duration:
        st["duration_s"] = args.duration
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="chainswarm-fair-"))
    try:
        return _run(args, st, work, started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args, st: dict, work: Path, started: float) -> int:
    from experiments.live_table1 import wan_config

    model_dir = lc.experiment_model(work)
    sizes = lc.model_sizes(model_dir)
    config = wan_config(st["servers"], 1)
    memory_gb = 1.55 * sizes["block_bytes"] * sizes["num_blocks"] / 2**30
    prompts = lc.Prompts(model_dir)
    name = "live_fairness" + ("_quick" if args.quick else "")
    data = {"command": "chainswarm experiment fairness" + (" --quick" if args.quick else ""), "quick": args.quick,
            "settings": st, "wan": config.to_dict(), "runs": {}, "name": name}
    for pol in [p for p in args.policies.split(",") if p]:
        print(f"{pol} ...", flush=True)
        res = run_policy(pol, model_dir, config, memory_gb, st, prompts, str(work / "profiles"), print)
        m = metrics(res["records"])
        data["runs"][pol] = {"metrics": m, "capacity": res["capacity"], "elapsed_s": res["elapsed_s"],
                             "records": lc.records_to_json(res["records"])}
        print(f"{pol}: Jain {m['jain_backlogged']:.3f} over {m['backlogged_window_s']:.1f} s, good P50/P99 "
              f"{m['good_p50']:.2f}/{m['good_p99']:.2f}, {m['throughput_rps']:.2f} req/s", flush=True)
    data["findings"] = _findings(data)
    data["elapsed_s"] = time.monotonic() - started
    out = Path(args.out)
    (out / "sections").mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
    _plot(data, out / f"{name}.png")
    (out / "sections" / f"{name}.md").write_text(section(data))
    if not args.quick:
        from experiments import report

        report.assemble(out)
    print(f"wrote {out / (name + '.json')} ({data['elapsed_s'] / 60:.1f} min)")
    return 0


def _findings(data: dict) -> list[str]:
    runs = data["runs"]
    out = []
    if "fcfs" in runs:
        base = runs["fcfs"]["metrics"]
        for pol in ("vtc", "dlpm"):
            if pol in runs:
                m = runs[pol]["metrics"]
                out.append(f"{pol} vs fcfs: Jain {m['jain_backlogged']:.3f} vs {base['jain_backlogged']:.3f}; "
                           f"well-behaved P99 {m['good_p99']:.2f} s vs {base['good_p99']:.2f} s; throughput "
                           f"{m['throughput_rps']:.2f} vs {base['throughput_rps']:.2f} req/s.")
    return out
