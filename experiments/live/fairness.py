"""Fairness on the live swarm: a misbehaving client against well-behaved ones, policies fcfs / vtc / dlpm.

A small WAN-emulated swarm (orchestrated nodes, GBP-CR + GCA + JFFC) planned for a low rate, so that the
offered load exceeds what it serves and every client stays backlogged. Clients ``good0..`` send Poisson
requests at ``rate`` each and ``flood`` at ``flood_factor × rate`` (same lengths). Service of a request
(fairness-locality spec §1.2, w_e = 1, w_q = 2) is credited at its start (prompt) and spread evenly over its
service period (output). Metrics (§9, ``planner.fairness_metrics``): Jain's index of the clients' service
over the window in which all of them are backlogged (have a request queued), per-client cumulative
service over time, P50/P99 response of the well-behaved clients, throughput (requests/s and tokens/s).

Servers emulate the paper's GPUs as in ``live_table1`` (the fast host the high-performance one). With
``--prefix-reuse`` every client's prompts start with that client's own system prompt (``prefix_tokens`` of the
``input_tokens``), the orchestrator keeps prefix KV on the servers (``prefix_cache_tokens`` per block) and the
policies are fcfs, vtc, dlpm and swarm (DLPM with locality-aware chain choice and the per-chain quantum Q^w);
the prefix hit rate and the prompt tokens served from cache are reported too.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

from experiments.live import common as lc
from experiments.paths import RESULTS

POLICIES = ("fcfs", "vtc", "dlpm")
PREFIX_POLICIES = ("fcfs", "vtc", "dlpm", "swarm")
DEFAULT_OUT = RESULTS
W_EXTEND, W_OUTPUT = 1.0, 2.0


def settings(quick: bool, prefix_reuse: bool = False) -> dict:
    if quick:
        st = {"servers": 2, "duration_s": 14.0, "rate": 0.6, "flood_factor": 4.0, "good": 2,
              "input_tokens": 32, "output_tokens": 8, "expected_rate": 0.2}
    else:
        # Overloaded on purpose (every client backlogged), so the run is cut ``drain_s`` after the last arrival:
        # requests still queued then fail as "unfinished at cutoff" and are counted (bounded run length).
        st = {"servers": 3, "duration_s": 60.0, "rate": 0.4, "flood_factor": 4.0, "good": 3,
              "input_tokens": 64, "output_tokens": 12, "expected_rate": 0.3, "drain_s": 45.0}
    if prefix_reuse:
        st.update(prefix_tokens=st["input_tokens"] * 7 // 8, prefix_cache_tokens=256, chain_quantum=256.0)
    return st


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


def run_policy(policy: str, model_dir: str, config, memory_gb: float, st: dict, prompts, profile_dir: str, log,
               gpus: dict | None = None) -> dict:
    import httpx

    from server.local_swarm import LocalSwarm

    records = workload(st)
    with LocalSwarm(model_dir, wan=config) as swarm:
        swarm.add_orchestrator(policy=policy, expected_rate=st["expected_rate"], max_length=lc.SESSION_TOKENS,
                               expected_input_tokens=st["input_tokens"], expected_output_tokens=st["output_tokens"],
                               refresh_s=1.0, quantum=200.0, use_server_to_server=False, queue_timeout_s=1800.0,
                               batch_sessions=0,  # one petals session per request, as the committed runs measured
                               kv_admission="slots",  # fixed-length KV slots, as the committed runs measured
                               prefix_cache_tokens=st.get("prefix_cache_tokens", 0),
                               chain_quantum=st.get("chain_quantum"))
        # compute measured once on a quiet node and declared for all (as in live_table1); RTTs measured
        lc.start_nodes(swarm, config.servers, {h: memory_gb for h in config.servers}, gpus,
                       profile_cache_dir=profile_dir, num_handlers=1)
        url = swarm.orchestrator.info["url"]
        status = swarm.wait_chains_ready(timeout=300)  # the plan covers every node (config.servers) and is served
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
        prefix = httpx.get(f"{url}/v1/swarm", timeout=30).json().get("prefix", {})
    return {"records": records, "elapsed_s": elapsed, "capacity": capacity,
            "prefix": {k: prefix.get(k) for k in ("enabled", "hit_rate", "token_hit_rate", "tokens_saved",
                                                  "requests", "prompt_tokens")}}


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
    lines = [f"## Live swarm — fairness with a misbehaving client{', prefix reuse' if data.get('prefix_reuse') else ''}"
             f"{' (quick)' if data['quick'] else ''}\n",
             f"`{data['command']}` — {lc.machine_note()}, total {data['elapsed_s'] / 60:.1f} min.\n",
             f"**Setup.** {s['servers']} orchestrated nodes behind the WAN emulator (RIPE Atlas RTTs), planned for "
             f"{s['expected_rate']} req/s (GBP-CR + GCA, JFFC), relay data path. {s['good']} well-behaved clients at "
             f"{s['rate']} req/s each and `flood` at {s['flood_factor']:g}× that, Poisson, for {s['duration_s']:g} s; every "
             f"request {s['input_tokens']} prompt + {s['output_tokens']} output tokens. Service = 1·prompt + 2·output tokens, "
             f"output spread over the request's service period. "
             + (f"The run is cut {s['drain_s']:g} s after the last arrival; requests still unanswered then count as "
                f"unfinished (they are in no statistic but the count). " if s.get("drain_s") else "")
             + f"Node compute: measured once on a node started alone and declared for all; RTTs measured. "
             + (_emulation_note(s) + " " if s.get("emulated_compute") else "")
             + (f"Prefix reuse: each client's prompts start with its own {s['prefix_tokens']}-token system prompt; "
                f"servers keep {s['prefix_cache_tokens']} prefix tokens per block; swarm policy per-chain quantum "
                f"Q^w = {s['chain_quantum']:g}." if data.get("prefix_reuse") else "") + "\n",
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


def _emulation_note(s: dict) -> str:
    gpus = s["emulated_compute"]
    return ("Servers emulate the paper's GPUs (as in Table 1): "
            + ", ".join(f"{h} {e['prefill_s'] * 1e3:.2f}/{e['decode_s'] * 1e3:.2f} ms" for h, e in sorted(gpus.items()))
            + " prefill per token / decode per block.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--policies", default=None,
                        help=f"default {','.join(POLICIES)}; with --prefix-reuse {','.join(PREFIX_POLICIES)}")
    parser.add_argument("--prefix-reuse", action="store_true",
                        help="per-client shared prompt prefixes with prefix KV reuse on the servers")
    parser.add_argument("--emulation", choices=["paper", "none"], default="paper",
                        help="servers emulate the paper's GPUs (default) or run at plain CPU speed")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals per policy")


def run(args: argparse.Namespace) -> int:
    import sys
    import tempfile

    from swarm.control.options import POLICIES as KNOWN

    # refused before a swarm is started (a negative duration was an IndexError after one)
    unknown = [p for p in (args.policies or "").split(",") if p and p not in KNOWN]
    problem = None
    if unknown:
        problem = f"unknown policy {unknown[0]!r}; expected some of {', '.join(KNOWN)}"
    elif args.duration is not None and not 0 < args.duration < float("inf"):
        problem = "--duration must be a positive number of seconds"
    if problem:
        print(f"chainswarm experiment fairness: error: {problem}", file=sys.stderr)
        return 2
    st = settings(args.quick, getattr(args, "prefix_reuse", False))
    if args.duration:
        st["duration_s"] = args.duration
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="chainswarm-fair-"))
    try:
        return _run(args, st, work, started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args, st: dict, work: Path, started: float) -> int:
    from experiments.live.table1 import gpu_emulation, wan_config

    prefix_reuse = getattr(args, "prefix_reuse", False)
    policies = [p for p in (args.policies or ",".join(PREFIX_POLICIES if prefix_reuse else POLICIES)).split(",") if p]
    model_dir = lc.experiment_model(work)
    sizes = lc.model_sizes(model_dir)
    config = wan_config(st["servers"], 1)
    memory_gb = 1.55 * sizes["block_bytes"] * sizes["num_blocks"] / 2**30
    prompts = lc.SharedPrefixPrompts(model_dir, st["prefix_tokens"]) if prefix_reuse else lc.Prompts(model_dir)
    gpus = gpu_emulation(config, sizes, lc.Scaling()) if getattr(args, "emulation", "paper") == "paper" else {}
    st = {**st, "emulated_compute": {h: e.to_dict() for h, e in gpus.items()}}
    name = "live_fairness" + ("_prefix" if prefix_reuse else "") + ("_quick" if args.quick else "")
    command = "chainswarm experiment fairness" + (" --prefix-reuse" if prefix_reuse else "") + \
        (" --quick" if args.quick else "")
    data = {"command": command, "quick": args.quick, "prefix_reuse": prefix_reuse,
            "settings": st, "wan": config.to_dict(), "runs": {}, "name": name}
    for pol in policies:
        print(f"{pol} ...", flush=True)
        res = run_policy(pol, model_dir, config, memory_gb, st, prompts, str(work / "profiles"), print, gpus)
        m = metrics(res["records"])
        data["runs"][pol] = {"metrics": m, "capacity": res["capacity"], "elapsed_s": res["elapsed_s"],
                             "prefix": res["prefix"], "records": lc.records_to_json(res["records"])}
        print(f"{pol}: Jain {m['jain_backlogged']:.3f} over {m['backlogged_window_s']:.1f} s, good P50/P99 "
              f"{m['good_p50']:.2f}/{m['good_p99']:.2f}, {m['throughput_rps']:.2f} req/s"
              + (f", prefix hit rate {res['prefix']['hit_rate']:.2f}" if prefix_reuse else ""), flush=True)
    data["findings"] = _findings(data)
    data["elapsed_s"] = time.monotonic() - started
    out = Path(args.out)
    (out / "sections").mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
    _plot(data, out / f"{name}.png")
    (out / "sections" / f"{name}.md").write_text(section(data))
    if not args.quick:
        from experiments.report import report

        report.assemble(out)
    print(f"wrote {out / (name + '.json')} ({data['elapsed_s'] / 60:.1f} min)")
    return 0


def _findings(data: dict) -> list[str]:
    runs = data["runs"]
    out = []
    if "fcfs" in runs:
        base = runs["fcfs"]["metrics"]
        for pol in ("vtc", "dlpm", "swarm"):
            if pol in runs:
                m = runs[pol]["metrics"]
                out.append(f"{pol} vs fcfs: Jain {m['jain_backlogged']:.3f} vs {base['jain_backlogged']:.3f}; "
                           f"well-behaved P99 {m['good_p99']:.2f} s vs {base['good_p99']:.2f} s; throughput "
                           f"{m['throughput_rps']:.2f} vs {base['throughput_rps']:.2f} req/s.")
    if data.get("prefix_reuse"):
        for pol, run in runs.items():
            p = run.get("prefix") or {}
            if p.get("requests"):
                out.append(f"{pol}: prefix hit rate {p['hit_rate']:.2f}, {100 * p['token_hit_rate']:.0f}% of prompt "
                           f"tokens served from cache ({p['tokens_saved']} of {p['prompt_tokens']}); throughput "
                           f"{run['metrics']['throughput_tokens_s']:.1f} tokens/s.")
    return out
