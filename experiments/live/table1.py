"""Table 1 on the live swarm: the Azure code trace replayed against PETALS, BPRR, JFFC only and Proposed.

Every run starts a fresh swarm of the same 9 servers (3 "fast", 6 "slow", by memory budget) on their own
loopback addresses behind the WAN emulator (RIPE Atlas EU RTTs, chain-composition spec §13.3), replays the
same scaled trace from 127.0.0.1, and stops the swarm. Methods:

* **PETALS** — vanilla petals servers; each chooses ``num_blocks`` with petals' own formula (blocks plus a
  fixed cache of 2 sessions per block, petals' default ``attn_cache_tokens`` = 2 × the session length) and
  its blocks with petals' ``choose_best_blocks`` (servers join one by one, in a seeded random order;
  rebalancing off, as the authors did). The client is petals' own: min-latency routing, one concurrent
  inference session per request, cache-allocation failures retried with petals' back-off. There is no
  queue: a request waits only through petals' retries.
* **BPRR** — orchestrated nodes, ``placement="bprr"`` (CG-BP with the §12.2 R heuristic) and BPRR's own
  router: every request is routed on arrival by WS-RR (``router="ws-rr"``, :mod:`swarm.control.ws_rr`) and waits for
  the KV slots of its path; servers keep KV for all the sessions their memory holds.
* **JFFC only** — ``placement="whole-model"``: the whole model on every server that fits it, JFFC.
* **Proposed** — ``placement="gbp-cr"`` (c tuned by the Theorem 3.7 lower bound), GCA, JFFC.
* **Auto** — ``placement="auto"`` (:mod:`planner.auto`: the candidate placement with the lowest predicted mean
  response time), GCA, JFFC.

Two data-path configurations, the same for every method of a run: ``relay`` (no server-to-server push:
each hop's activations go back to the orchestrator / petals client — the paper's model) and ``push``
(petals' server-to-server push with Chainswarm's push fix; the client still waits for each hop).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from experiments.live import common as lc
from experiments.paths import RESULTS
from experiments.report.live_table1 import CONFIGS, METHODS, findings, write_outputs

PLACEMENT = {"bprr": "bprr", "jffc": "whole-model", "proposed": "gbp-cr", "auto": "auto"}
DEFAULT_OUT = RESULTS

# Memory budgets as multiples of the model's weights (L blocks): the paper's 40 GB / 20 GB MIG slices hold
# LLaMA-2-7B (13 GB in fp16) 3.1 / 1.55 times (chain-composition spec §11.1).
FAST_MODEL_MULTIPLE = 3.1
SLOW_MODEL_MULTIPLE = 1.55
NUM_SERVERS = 6
ETA = 1 / 3  # 2 fast servers of 6
# petals' client retries a failed cache allocation without limit (back-off up to 60 s), which made full runs
# unbounded. We bound it: after PETALS_MAX_RETRIES attempts the request fails and is counted as failed
# (waiting through the retries is counted for the requests that do get a session).
PETALS_MAX_RETRIES = 8  # 8 attempts, petals' back-offs 0, 1, 2, 4, 8, 16, 32 s between them: ~63 s of retrying
# The full replay: trace rows 700-799 (a comparatively steady stretch: 3.9 req/s, no 10-request burst above
# 12.3 req/s) stretched 1/0.12 in time, 0.47 req/s mean; the planner is given this window's mean rate. The rate
# keeps the 2 CPU cores below saturation (the emulated GPUs, not CPU contention, set the service times).
FULL_SCALING = dict(time_scale=0.12, offset=700, num_requests=100)


def settings(quick: bool) -> dict:
    if quick:
        return {"num_servers": 3, "scaling": lc.Scaling(time_scale=2.0, num_requests=12, max_output=6),
                "seed": 0}
    return {"num_servers": NUM_SERVERS, "scaling": lc.Scaling(**FULL_SCALING), "seed": 0}


def wan_config(num_servers: int, seed: int):
    from wan import WanConfig

    return WanConfig.from_ripe_atlas(num_servers=num_servers, seed=seed, eta=ETA if num_servers >= 3 else None)


def budgets(config, sizes: dict) -> dict[str, float]:
    """Memory budget (bytes) of every server host: fast ones (``meta["high_performance"]``) get more."""
    model = sizes["block_bytes"] * sizes["num_blocks"]
    fast = set(config.meta.get("high_performance", []))
    return {h: (FAST_MODEL_MULTIPLE if h in fast else SLOW_MODEL_MULTIPLE) * model for h in config.servers}


def gpu_emulation(config, sizes: dict, scaling: lc.Scaling) -> dict:
    """``{host: EmulatedCompute}``: the paper's high-performance GPU on the fast hosts, the low one elsewhere."""
    gpus = lc.emulated_gpus(sizes["num_blocks"], scaling.input_scale)
    fast = set(config.meta.get("high_performance", []))
    return {h: gpus["high" if h in fast else "low"] for h in config.servers}


def _emulation_text(gpus: dict, config) -> str:
    fast = set(config.meta.get("high_performance", []))
    per = {("high" if h in fast else "low"): e for h, e in gpus.items()}
    return ("servers emulate the paper's GPUs (`server.emulation`; §10.1 BLOOM-176B blocks, 70 folded into the "
            "model's blocks, prefill scaled with the prompts): "
            + ", ".join(f"{name} {e.prefill_s * 1e3:.2f} ms prefill per token and {e.decode_s * 1e3:.2f} ms decode "
                        f"per block" for name, e in sorted(per.items()))
            + "; steps of concurrent sessions overlap (a batching GPU), and petals servers announce the emulated "
              "speed to petals' routing. ")


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")


def run_orchestrated(method: str, push: bool, model_dir: str, config, memory: dict, trace: dict,
                     prompts: lc.Prompts, profile_dir: str, log, gpus: dict | None = None) -> dict:
    import httpx

    from server.local_swarm import LocalSwarm

    rate = len(trace["arrivals"]) / max(trace["arrivals"][-1], 1e-9)
    records = _records(trace)
    with LocalSwarm(model_dir, wan=config) as swarm:
        swarm.add_orchestrator(
            policy="fcfs", placement=PLACEMENT[method], expected_rate=rate, max_length=lc.SESSION_TOKENS,
            expected_input_tokens=float(np.mean(trace["input_tokens"])),
            expected_output_tokens=float(np.mean(trace["output_tokens"])), refresh_s=1.0,
            use_server_to_server=push, request_timeout_s=60.0, queue_timeout_s=1800.0,
            router="ws-rr" if method == "bprr" else "jffc",
            batch_sessions=0,  # one petals session per request (relay or push), as the committed runs measured
            kv_admission="slots",  # the papers' fixed-length KV slots, as the committed runs measured
            replan_tolerance=0.0)  # nodes join one by one: end on the planner's plan for all of them
        lc.start_nodes(swarm, config.servers, {h: memory[h] / 2**30 for h in config.servers}, gpus, log,
                       profile_cache_dir=profile_dir, num_handlers=1, rtt_period=20.0)
        url = swarm.orchestrator.info["url"]

        def ready(poll):
            status = poll.get(f"{url}/v1/swarm").json()
            plan = status.get("plan")
            ok = (plan and {s["id"] for s in plan["servers"]} == set(config.servers) and status["chains"]
                  and all(c["ready"] for c in status["chains"])
                  and all(s["rtt_s"] for s in status["servers"]))
            return status if ok else None

        with httpx.Client(timeout=30) as poll:  # one client for the polls (each httpx.get builds an SSL context)
            status = _wait(lambda: ready(poll), 300, f"{method}: every chain ready")
        log(f"  {method}: {len(status['chains'])} chains, c={status['plan'].get('c')}; "
            + "; ".join(f"{'→'.join(c['servers'])} cap {c['capacity']}" for c in status["chains"]))
        elapsed = _timed_replay(lc.OrchestratorDriver(url, prompts), records, prompts)
        final = httpx.get(f"{url}/v1/swarm", timeout=30).json()
    plan = status["plan"]
    return {
        "records": records, "elapsed_s": elapsed,
        "plan": {"c": plan.get("c"), "placement": plan.get("placement_method"),
                 "servers": [{"id": s["id"], "start": s["start"], "end": s["end"]} for s in plan["servers"]],
                 "chains": [{"servers": c["servers"], "spans": c["spans"], "capacity": c["capacity"],
                             "service_time": c["service_time"]} for c in status["chains"]],
                 "inputs": plan.get("inputs")},
        "rtt_ms": {s["node_id"]: s["rtt_s"] * 1e3 for s in final["servers"] if s.get("rtt_s")},
        "profiles": {s["node_id"]: {k: s.get(k) for k in ("prefill_s", "decode_s", "rtt_s", "start", "end")}
                     for s in final["servers"]},
        "chain_ids": {c["id"]: c["servers"] for c in status["chains"]},
    }


def run_petals(push: bool, model_dir: str, config, memory: dict, sizes: dict, trace: dict, prompts: lc.Prompts,
               seed: int, log, gpus: dict | None = None) -> dict:
    from server.local_swarm import LocalSwarm

    records = _records(trace)
    cache_tokens = 2 * lc.SESSION_TOKENS  # petals' default: 4096-token cache for 2048-token sessions
    order = list(config.servers)
    random.Random(seed).shuffle(order)  # servers join in a random order (spec §12.1)
    with LocalSwarm(model_dir, wan=config) as swarm:
        spans = {}
        for h in order:
            k = lc.petals_num_blocks(memory[h], sizes["block_bytes"], sizes["cache_bytes_per_token"], cache_tokens,
                                     sizes["num_blocks"])
            peer = swarm.add_server(num_blocks=k, wan_host=h, name=h, cache_tokens=cache_tokens,
                                    max_length=lc.SESSION_TOKENS, num_handlers=1, mean_balance_check_period=1e6,
                                    update_period=2.0, timeout=180,
                                    **({"emulated_compute": gpus[h].to_dict()} if gpus and h in gpus else {}))
            spans[h] = (peer.start, peer.end)
            time.sleep(2.5)  # one announcement period, so the next server's block choice sees this one
        log("  petals: " + "; ".join(f"{h} [{a},{b})" for h, (a, b) in spans.items()))
        driver = lc.PetalsDriver(model_dir, swarm.initial_peers, swarm.dht_prefix, prompts, use_server_to_server=push,
                                 max_retries=PETALS_MAX_RETRIES)
        elapsed = _timed_replay(driver, records, prompts, before=_petals_ready)
    return {"records": records, "elapsed_s": elapsed,
            "plan": {"servers": [{"id": h, "start": a, "end": b} for h, (a, b) in spans.items()],
                     "cache_tokens_per_block": cache_tokens}}


def _records(trace: dict) -> list[lc.Record]:
    return [lc.Record(i, "trace", float(a), int(n_in), int(n_out)) for i, (a, n_in, n_out) in
            enumerate(zip(trace["arrivals"], trace["input_tokens"], trace["output_tokens"]))]


def _petals_ready(driver) -> None:
    driver.wait_ready()
    time.sleep(3.0)
    driver.sequence_manager.update(wait=True)  # fresh pings after the first update


def _timed_replay(driver, records: list[lc.Record], prompts, before=None) -> float:
    """Warm ``driver`` up, replay ``records`` through it and close it; the replay's wall time (s)."""
    try:
        if before is not None:
            before(driver)
        _warm_up(driver, prompts)
        t0 = time.monotonic()
        lc.replay(records, driver)
        return time.monotonic() - t0
    finally:
        driver.close()


def _warm_up(driver, prompts) -> None:
    """Two short requests before the clock starts (connections, first-use allocations)."""
    for i in range(2):
        r = lc.Record(-1 - i, "warmup", 0.0, 16, 4)
        r.submitted = 0.0
        driver(r, time.monotonic())


# ---------------------------------------------------------------------------------------------- report


# ------------------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3 servers, 12 requests of at most 6 output tokens (the smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--requests", type=int, default=None, help="trace rows to replay (default 300)")
    parser.add_argument("--time-scale", type=float, default=None, help="arrival-rate multiplier (default 2)")
    parser.add_argument("--servers", type=int, default=None, help=f"servers (default {NUM_SERVERS}; a third fast)")
    parser.add_argument("--emulation", choices=["paper", "none"], default="paper",
                        help="paper (default): fast servers emulate the paper's high-performance GPU and the others "
                        "its low-performance GPU (server.emulation); none: every server runs at plain CPU speed")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other configurations' runs of an existing <out>/live_table1.json")
    parser.add_argument("--replot", action="store_true",
                        help="only rewrite the PNG, section and findings from <out>/live_table1[_quick].json")
    parser.add_argument("--notes", type=Path, default=None,
                        help="with --replot: a Markdown file of analysis notes to store and show in the section")


def replot(args: argparse.Namespace) -> int:
    out = Path(args.out)
    name = "live_table1" + ("_quick" if args.quick else "")
    data = json.loads((out / f"{name}.json").read_text())
    if args.notes:
        data["analysis"] = args.notes.read_text().strip()
    data["findings"] = findings(data)
    write_outputs(data, out, name)
    if not args.quick:
        from experiments.report import report

        report.assemble(out)
    return 0


def run(args: argparse.Namespace) -> int:
    import tempfile

    if getattr(args, "replot", False):
        return replot(args)

    methods = [m for m in args.methods.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    if set(methods) - set(METHODS) or set(configs) - set(CONFIGS) or not methods or not configs:
        print(f"chainswarm experiment table1: error: --methods from {', '.join(METHODS)}, --configs from "
              f"{', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    st = settings(args.quick)
    if args.servers:
        st["num_servers"] = args.servers
    scaling = st["scaling"]
    if args.requests:
        scaling = lc.Scaling(**{**asdict(scaling), "num_requests": args.requests})
    if args.time_scale:
        scaling = lc.Scaling(**{**asdict(scaling), "time_scale": args.time_scale})
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="chainswarm-live-"))
    try:
        return _run(args, st, scaling, work, started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args, st: dict, scaling: lc.Scaling, work: Path, started: float) -> int:
    methods = [m for m in args.methods.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    model_dir = lc.experiment_model(work)
    sizes = lc.model_sizes(model_dir)
    config = wan_config(st["num_servers"], st["seed"])
    memory = budgets(config, sizes)
    gpus = gpu_emulation(config, sizes, scaling) if args.emulation == "paper" else {}
    trace = lc.scaled_trace(scaling)
    prompts = lc.Prompts(model_dir)

    def log(msg: str) -> None:
        print(msg, flush=True)

    desc = (f"{st['num_servers']} servers on 127.0.0.2–{st['num_servers'] + 1} behind the user-space WAN emulator, RTTs "
            f"from RIPE Atlas EU (seed {st['seed']}, orchestrator/client anchor drawn at random; §13.3 model); "
            f"fast = {', '.join(config.meta.get('high_performance', []))} with {FAST_MODEL_MULTIPLE}× the model's "
            f"weights of memory, the others {SLOW_MODEL_MULTIPLE}× (the 40/20 GB MIG slices against LLaMA-2-7B); "
            + (_emulation_text(gpus, config) if gpus else
               "all servers have the same CPU compute (no accelerator emulation: `--emulation none`). ")
            + f"The orchestrated nodes declare the per-block CPU compute times measured once on a node started alone"
            f"{' (plus their emulated time)' if gpus else ''}; one handler each; "
            f"RTTs are measured by every node through the emulator. Model: random Llama, "
            f"{sizes['num_blocks']} blocks, hidden {lc.MODEL_HIDDEN}, fp32; session length {lc.SESSION_TOKENS} tokens "
            f"(one KV slot). Trace: Azure code 2023-11-16, rows {scaling.offset}–{scaling.offset + scaling.num_requests - 1}, "
            f"arrivals compressed ×{scaling.time_scale:g} ({len(trace['arrivals']) / trace['arrivals'][-1]:.2f} req/s), "
            f"prompt = ⌈ContextTokens/{scaling.input_scale:g}⌉ ≤ {scaling.max_input} "
            f"(mean {np.mean(trace['input_tokens']):.1f}), output = min(GeneratedTokens, {scaling.max_output}) "
            f"(mean {np.mean(trace['output_tokens']):.1f}); greedy decoding, identical prompts for every method. "
            f"PETALS: petals' own num_blocks (2-session cache per block), block choice, min-latency routing and "
            f"retries with petals' back-off, bounded at max_retries={PETALS_MAX_RETRIES} (a request that never "
            f"gets a session fails and is counted as failed), one concurrent session per request; the planners get "
            f"the window's mean arrival rate; BPRR: orchestrated nodes, CG-BP placement, WS-RR routing per request (FCFS); "
            f"JFFC only, Proposed and Auto: orchestrated nodes, GCA chains, FCFS queue, JFFC.")
    data = {"command": "chainswarm experiment table1" + (" --quick" if args.quick else ""),
            "machine": lc.machine_note(), "settings": {"quick": args.quick, "scaling": asdict(scaling),
                                                       "num_servers": st["num_servers"], "seed": st["seed"],
                                                       "description": desc, "memory_bytes": memory, "sizes": sizes,
                                                       "emulation": args.emulation,
                                                       "emulated_compute": {h: e.to_dict() for h, e in gpus.items()}},
            "wan": config.to_dict(), "runs": {}}
    log(desc)
    previous = Path(args.out) / ("live_table1" + ("_quick" if args.quick else "") + ".json")
    if getattr(args, "merge", False) and previous.is_file():  # the same declared compute as the merged runs
        measured = json.loads(previous.read_text())["settings"].get("measured_compute")
        if measured:
            lc.MEASURED_COMPUTE.update(measured)
            log(f"  reusing the measured compute of {previous.name}: {measured}")
    for cfg in configs:
        push = cfg == "push"
        data["runs"][cfg] = {}
        for method in methods:
            t = time.monotonic()
            log(f"[{cfg}] {method} ...")
            if method == "petals":
                result = run_petals(push, model_dir, config, memory, sizes, trace, prompts, st["seed"], log, gpus)
            else:
                result = run_orchestrated(method, push, model_dir, config, memory, trace, prompts,
                                          str(work / "profiles"), log, gpus)
            stats = lc.table_stats(result["records"])
            result["stats"] = stats
            result["records"] = lc.records_to_json(result["records"])
            result["wall_s"] = time.monotonic() - t
            data["runs"][cfg][method] = result
            r = stats["response"]
            log(f"[{cfg}] {method}: response mean {r['mean']:.2f} p95 {r['p95']:.2f}, waiting mean "
                f"{stats['waiting']['mean']:.2f}, service mean {stats['service']['mean']:.2f}, "
                f"failed {stats['failed']} ({result['wall_s']:.0f} s)")
    rtts = {}
    for cfg_runs in data["runs"].values():
        for res in cfg_runs.values():
            for h, v in (res.get("rtt_ms") or {}).items():
                rtts.setdefault(h, []).append(v)
    data["rtt"] = {h: {"configured": config.rtt(config.client, h), "achieved": float(np.median(v))}
                   for h, v in sorted(rtts.items())}
    data["elapsed_s"] = time.monotonic() - started
    if lc.MEASURED_COMPUTE:
        data["settings"]["measured_compute"] = dict(lc.MEASURED_COMPUTE)
    out = Path(args.out)
    name = "live_table1" + ("_quick" if args.quick else "")
    if getattr(args, "merge", False) and (out / f"{name}.json").is_file():
        old = json.loads((out / f"{name}.json").read_text())
        for cfg, cfg_runs in old.get("runs", {}).items():
            for method, res in cfg_runs.items():
                data["runs"].setdefault(cfg, {}).setdefault(method, res)
        data["elapsed_by_config_s"] = {**old.get("elapsed_by_config_s", {"+".join(old["runs"]): old["elapsed_s"]}),
                                       "+".join(configs): data["elapsed_s"]}
        data["elapsed_s"] += old.get("elapsed_s", 0.0)
        data["runs"] = {c: {m: data["runs"][c][m] for m in METHODS if m in data["runs"][c]}
                        for c in CONFIGS if c in data["runs"]}
    data["findings"] = findings(data)
    write_outputs(data, out, name)
    if not args.quick:
        from experiments.report import report

        report.assemble(out)
    log(f"wrote {out / (name + '.json')} ({data['elapsed_s'] / 60:.1f} min)")
    return 0
