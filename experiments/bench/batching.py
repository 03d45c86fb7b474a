"""Throughput and latency of batched Chainswarm servers vs vanilla petals servers, same machine, one run.

Two servers split SmolLM2-135M-Instruct (float32): two vanilla petals 2.2 servers, and two Chainswarm server
nodes (``--max-batch``, default 8; blocks assigned by an orchestrator; the vanilla servers get the same split).
Both swarms are up at once and every measurement alternates between them. The same client —
petals' own ``generate``, one thread per session, all sessions started together — runs 1, 2, 4, 8 and 16
concurrent sessions of ``--tokens`` greedy tokens (prompts of different lengths) against each. Chainswarm's own
client runs the same sessions a third way (``chainswarm_multi``): all of them submitted together to one
:class:`swarm.engine.batching.ChainGenerator` — what the orchestrator's engine does with the sessions it holds on a
chain — which steps them through one multi-session stream per server and computes one LM head per step. Every token is
timestamped as it arrives: aggregate tokens/s (all sessions' tokens / wall time), per-token latency (gaps
between a session's consecutive tokens: median and P95 over all sessions) and TTFT (median). Ratios are to
vanilla petals at the same concurrency, measured in the same run; the generated tokens are compared too.

Where the time goes: one decode step over the 15 blocks of a server, timed in-process for batch sizes
1..16 — batched (one pass) and sequential (petals' per-session path) — and a torch.profiler table of one
batched step of 8 sessions. And the servers' own CPU time (each server process with its p2pd daemon) per
generated token in every run: the client, the DHT and the other swarm share this machine's two cores, so
aggregate tokens/s measures the machine; vanilla ÷ batched server CPU per token is the throughput ratio
servers with cores of their own would reach while they are the bottleneck ("server-bound ×").

Every process (both servers, the client) runs ``--torch-threads`` intra-op threads (default 1): on this 2-core
machine two servers and the client share the cores, and more threads only spin. Both setups get the same.
Two clients: ``generate`` (petals' greedy generate; the client runs the 49k-vocabulary LM head for every
token, which on this machine costs about as much as a server's step) and ``blocks_only`` (sessions that step
the servers' blocks only, so the servers set the pace).

Writes ``experiments/results/bench_batching.json`` and ``.png``.

    python -m experiments.bench.batching [--model DIR] [--sessions 1,2,4,8,16] [--tokens 32] [--max-batch 8]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from experiments.bench.cli import host_cpu
from experiments.bench.http_throughput import HTTP_LAYOUTS, PROMPTS, store_http, together, bench_http
from experiments.bench.runtime import DTYPE, _Stamps

SETUPS = ("vanilla_petals", "chainswarm_batched")
MULTI = "chainswarm_multi"  # Chainswarm's ChainGenerator: multi-session streams + one LM head per step
MAX_LENGTH = 256


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _blocks_only(model, ids, tokens: int, stamps: "_Stamps") -> list:
    """A session through the servers' blocks only: the prompt's embeddings, then ``tokens - 1`` one-token steps
    (the last prompt token's embedding again). No LM head on the client, so the servers set the pace."""
    embeddings = model.transformer.word_embeddings(ids)
    with model.transformer.h.inference_session(max_length=ids.shape[1] + tokens) as session:
        stamps.put(ids)
        session.step(embeddings)
        stamps.put(ids[:, -1:])
        for _ in range(tokens - 1):
            session.step(embeddings[:, -1:])
            stamps.put(ids[:, -1:])
    return []


def run_sessions(model, tokenizer, sessions: int, tokens: int, blocks_only: bool = False) -> dict:
    """``sessions`` concurrent sessions through petals' client: greedy ``generate`` (the client runs the LM
    head), or with ``blocks_only`` sessions that step the servers' blocks only. Latencies and the tokens."""
    import torch

    barrier = threading.Barrier(sessions + 1)
    stamps = [_Stamps() for _ in range(sessions)]
    outputs: list = [None] * sessions
    errors: list = []

    def one(i: int) -> None:
        ids = tokenizer(PROMPTS[i % len(PROMPTS)], return_tensors="pt").input_ids
        barrier.wait()
        try:
            with torch.inference_mode():
                if blocks_only:
                    outputs[i] = _blocks_only(model, ids, tokens, stamps[i])
                    return
                out = model.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, streamer=stamps[i])
            outputs[i] = out[0, ids.shape[1]:].tolist()
        except Exception as exc:  # noqa: BLE001 - reported in the results
            errors.append(repr(exc))

    start, wall = together(sessions, one, barrier)
    return dict(_stats([st.times for st in stamps], start, wall), errors=errors, outputs=outputs)


def _stats(times: list[list[float]], start: float, wall: float) -> dict:
    """Throughput and latencies of concurrent sessions from each one's token arrival times (started at ``start``,
    all done ``wall`` seconds later)."""
    gaps = [1000 * (b - a) for t in times for a, b in zip(t, t[1:])]
    ttfts = [1000 * (t[0] - start) for t in times if t]
    total = sum(len(t) for t in times)
    return {"sessions": len(times), "tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "per_token_ms_median": statistics.median(gaps) if gaps else None,  # (none: every session failed)
            "per_token_ms_p95": _percentile(gaps, 0.95) if gaps else None,
            "ttft_ms_median": statistics.median(ttfts) if ttfts else None, "ttft_ms_sorted": sorted(ttfts)}


def run_chain_generator(generator, tokenizer, sessions: int, tokens: int) -> dict:
    """``sessions`` generations submitted together to a :class:`swarm.engine.batching.ChainGenerator` (one
    multi-session stream per server, one LM head per step); the same prompts, tokens and statistics as
    :func:`run_sessions`."""
    stamps: list[list[float]] = [[] for _ in range(sessions)]
    prompts = [tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(sessions)]
    errors: list = []
    steps, stepped = generator.steps, generator.stepped_sequences
    start = time.perf_counter()
    futures = [generator.submit(p, tokens, on_token=lambda _t, i=i: stamps[i].append(time.perf_counter()))
               for i, p in enumerate(prompts)]
    outputs: list = []
    for future in futures:
        try:
            outputs.append(future.result(timeout=600))
        except Exception as exc:  # noqa: BLE001 - reported in the results
            errors.append(repr(exc))
            outputs.append(None)
            print(f"[bench_batching] a ChainGenerator session failed: {exc!r}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - start
    return dict(_stats(stamps, start, wall), errors=errors, outputs=outputs,
                mean_batch=(generator.stepped_sequences - stepped) / max(1, generator.steps - steps))


def _paired(results: dict):
    """(Chainswarm client, vanilla row, Chainswarm row) for every Chainswarm point, each with vanilla petals'
    ``generate`` or blocks-only row at the same position (the multi-session client has ``generate`` rows only)."""
    for base, row in zip(results["vanilla_petals"], results["chainswarm_batched"]):
        yield f"petals {row['client']}", base, row
    for base, row in zip(results["vanilla_petals"], results[MULTI]):
        yield "ChainGenerator (multi-session)", base, row


def cpu_seconds(pids) -> float:
    """User + system CPU seconds used so far by the processes ``pids`` and all their descendants (a server's
    p2pd daemon is its child). Processes that are gone count 0."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += _process_cpu_s(proc)
        except psutil.NoSuchProcess:
            continue
    return total


def _process_cpu_s(proc) -> float:
    """A process's CPU time to the nanosecond: its CPU-time clock (Linux's ``clock_getcpuclockid``, the id
    ``(~pid << 3) | 2``). ``/proc``'s times, which psutil reads, count whole clock ticks (10 ms): a small run's
    servers (6 tokens of the test model: 1-4 ticks) could read 0."""
    import time

    try:
        return time.clock_gettime(((~proc.pid) << 3) | 2)
    except (OSError, OverflowError):  # not Linux, or the process is gone
        times = proc.cpu_times()
        return times.user + times.system


def _budget_gb(model_dir: str, sessions: int) -> float:
    import torch

    from swarm.model.compat import petals
    from petals.server.block_utils import get_block_size

    from server.profiling import cache_bytes_per_token

    config = petals.AutoDistributedConfig.from_pretrained(model_dir)
    share = -(-config.num_hidden_layers // 2)
    block = get_block_size(config, "memory", dtype=getattr(torch, DTYPE))
    return share * (block + sessions * cache_bytes_per_token(config, getattr(torch, DTYPE)) * MAX_LENGTH) / 1e9


def bench_servers(model_dir: str, counts, tokens: int, max_batch: int, repeats: int, progress) -> dict:
    """Both swarms up at once (separate DHTs, the same block split); every measurement alternates between
    them, ``repeats`` times, so both see the same neighbours on this shared machine; the best run (highest
    tokens/s) of each is kept — the one least disturbed by other processes. Each run also records the CPU
    time its two servers (with their p2pd daemons) spent per generated token: what the servers' throughput
    would be if they, not the shared cores, were the limit (as on volunteer machines of their own)."""
    import torch
    from swarm.model.tokenizer import load_tokenizer

    from server.local_swarm import LocalSwarm
    from swarm.engine.batching import ChainGenerator
    from swarm.engine.petals_client import open_distributed_model

    tokenizer = load_tokenizer(model_dir)
    with contextlib.ExitStack() as stack:
        chainswarm = stack.enter_context(LocalSwarm(model_dir, open_sessions=True))  # vanilla petals clients
        # The clients below drive the chain directly, past the orchestrator's admission, up to max(counts) sessions:
        # the plan reserves a max-length KV slot for each of them on every server (slots, c fixed), which the
        # nodes' memory is sized for. With c tuned for the low planning rate, placement packed up to 24 of the
        # 30 blocks onto one node, leaving its KV pool too small for 16 sessions (steps failed with a full pool).
        chainswarm.add_orchestrator(expected_rate=0.2, max_length=MAX_LENGTH, expected_input_tokens=32,
                                    expected_output_tokens=tokens, refresh_s=0.5, torch_dtype=DTYPE,
                                    kv_admission="slots", c=max(counts))
        nodes = [chainswarm.add_node(node_id=f"n{i}", memory_gb=_budget_gb(model_dir, max(counts) + 4), wait=False,
                                     num_handlers=2, torch_dtype=DTYPE, max_batch=max_batch) for i in range(2)]
        for node in nodes:
            chainswarm.wait_profiled(node, timeout=300)
        chain = chainswarm.wait_chains_ready(timeout=300)["chains"][0]
        vanilla = stack.enter_context(LocalSwarm(model_dir))
        for span in chain["spans"]:  # vanilla petals servers on the planner's split
            vanilla.add_server(tuple(span), torch_dtype=DTYPE, num_handlers=2, max_length=MAX_LENGTH,
                               cache_tokens=20 * MAX_LENGTH, wait=False)
        for server in vanilla.servers:
            vanilla.wait_ready(server, timeout=300)
        models = {name: stack.enter_context(open_distributed_model(
            model_dir, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
            torch_dtype=getattr(torch, DTYPE))) for name, swarm in zip(SETUPS, (vanilla, chainswarm))}
        server_pids = {"vanilla_petals": [s.process.pid for s in vanilla.servers],
                       "chainswarm_batched": [n.process.pid for n in nodes]}
        generator = stack.enter_context(ChainGenerator(models["chainswarm_batched"],
                                                       [tuple(r) for r in chain["route"]], max_sessions=max(counts)))
        server_pids[MULTI] = server_pids["chainswarm_batched"]
        for model in models.values():
            run_sessions(model, tokenizer, 2, 4)  # warm-up: connections, routes, first allocations
        run_chain_generator(generator, tokenizer, 2, 4)
        results = {name: [] for name in (*SETUPS, MULTI)}
        for blocks_only in (False, True):
            client = "blocks_only" if blocks_only else "generate"
            setups = SETUPS if blocks_only else (*SETUPS, MULTI)
            for n in counts:
                progress.set_postfix_str(f"{client} × {n}")
                runs = {name: [] for name in setups}
                for _ in range(repeats):
                    for name in setups:
                        before = cpu_seconds(server_pids[name])
                        run = (run_chain_generator(generator, tokenizer, n, tokens) if name == MULTI else
                               run_sessions(models[name], tokenizer, n, tokens, blocks_only))
                        run["server_cpu_ms_per_token"] = 1000 * (cpu_seconds(server_pids[name]) - before) / run["tokens"]
                        runs[name].append(run)
                for name in setups:
                    best = max(runs[name], key=lambda r: r["tokens_per_s"])
                    results[name].append(dict(best, client=client,
                                              tokens_per_s_all=[r["tokens_per_s"] for r in runs[name]]))
                progress.update()
        results["chainswarm_chain"] = chain
    for _, base, row in _paired(results):
        row["throughput_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["per_token_ratio"] = row["per_token_ms_median"] / base["per_token_ms_median"]
        row["p95_ratio"] = row["per_token_ms_p95"] / base["per_token_ms_p95"]
        row["ttft_ratio"] = row["ttft_ms_median"] / base["ttft_ms_median"]
        row["server_cpu_ratio"] = base["server_cpu_ms_per_token"] / row["server_cpu_ms_per_token"]
        row["same_tokens_as_vanilla"] = row["outputs"] == base["outputs"] if row["client"] == "generate" else None
    return results


def step_profile(model_dir: str, sizes=(1, 2, 4, 8, 16)) -> dict:
    """In-process decode step over 15 blocks: seconds per batch size (batched, sequential) and the top
    operators of one batched step of 8 sessions (torch.profiler, self CPU time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from server.batch_profile import Session, decode_step_times, load_backends, step_sessions
    from server.batching import BatchedInferenceStep

    backends = load_backends(model_dir, range(15))
    hidden = next(iter(backends.values())).config.hidden_size
    times = decode_step_times(backends, sizes, context=64, repeats=10)
    step = BatchedInferenceStep(backends)
    sessions = [Session(backends) for _ in range(8)]
    step_sessions(step, sessions, [torch.randn(1, 40, hidden) for _ in sessions], batched=False)
    step_sessions(step, sessions, [torch.randn(1, 1, hidden) for _ in sessions], batched=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_sessions(step, sessions, [torch.randn(1, 1, hidden) for _ in sessions], batched=True)
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    ops = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1000,
            "share": e.self_cpu_time_total / total} for e in top]
    return {"step_s": {str(b): t for b, t in times.items()}, "batched_step_of_8_top_ops": ops,
            "batched_step_of_8_total_ms": total / 1000}


def ceilings(step_s: dict, servers: int = 2, counts=(1, 2, 4, 8, 16)) -> dict:
    """Compute-only throughput ceilings (tokens/s) of ``servers`` equal servers, one core each, no RPC,
    serialization or client cost, from the in-process step times ``t(b)`` (``step_s[str(b)]``).

    petals runs one session-step at a time: every server is busy at best all the time, so the chain makes at most
    ``1 / t_seq(1)`` tokens/s whatever the concurrency. A batching server with ``n`` sessions split into ``k``
    cohorts of ``b = n/k`` (the cohorts pipelined through the S servers) makes ``n / (max(S, k) · t(b))``; the
    ceiling is the best k (interpolating ``t`` log-linearly between measured batch sizes)."""
    import numpy as np

    sizes = sorted(int(b) for b in step_s)

    def t(mode: str, b: float) -> float:
        return float(np.interp(np.log(b), np.log(sizes), [step_s[str(x)][mode] for x in sizes]))

    out = {}
    for n in counts:
        vanilla = 1 / t("sequential", 1) if n >= servers else n / (servers * t("sequential", 1))
        best = max(n / (max(servers, k) * t("batched", n / k)) for k in range(1, n + 1) if n % k == 0)
        out[str(n)] = {"vanilla_tokens_per_s": vanilla, "batched_tokens_per_s": best, "ratio": best / vanilla}
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in (*SETUPS, MULTI):
        for client, style in (("generate", "-"), ("blocks_only", ":")):
            rows = [r for r in report["results"][name] if r["client"] == client]
            if not rows:  # the multi-session client has generate rows only
                continue
            n = [r["sessions"] for r in rows]
            axes[0].plot(n, [r["tokens_per_s"] for r in rows], "o" + style, label=f"{name}, {client}")
            axes[1].plot(n, [r["per_token_ms_median"] for r in rows], "o" + style, label=f"{name}, {client} median")
            axes[1].plot(n, [r["per_token_ms_p95"] for r in rows], "x" + style, alpha=0.5,
                         label=f"{name}, {client} P95")
    # the product's path: /v1/completions through an orchestrator with default options, on each layout measured
    # (its own swarm, started after the two above: same machine, same model)
    for http in [report.get("http"), *report.get("http_layouts", {}).values()]:
        if http and http.get("rows"):
            rows = http["rows"]
            axes[0].plot([r["sessions"] for r in rows], [r["tokens_per_s"] for r in rows], "s--",
                         label="HTTP /v1/completions, defaults, "
                               + str(http.get("layout_text", http.get("layout"))).replace("`", ""))
    axes[0].set(xscale="log", xlabel="concurrent sessions", ylabel="aggregate tokens/s", title="throughput")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrent sessions", ylabel="ms between tokens",
                title="per-token latency")
    sizes = sorted(report["step_profile"]["step_s"], key=int)
    for mode in ("batched", "sequential"):
        axes[2].plot([int(b) for b in sizes], [1000 * report["step_profile"]["step_s"][b][mode] for b in sizes],
                     "o-", label=mode)
    axes[2].set(xscale="log", xlabel="sessions in the step", ylabel="ms per decode step (15 blocks)",
                title="one server's decode step, in-process")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper left", framealpha=0.7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(report: dict) -> str:
    lines = ["| Chainswarm client | sessions | vanilla tok/s | Chainswarm tok/s | × | per-token ms vanilla / Chainswarm "
             "(median) | × | P95 × | TTFT × | same tokens | server CPU ms/token vanilla / Chainswarm | server-bound × |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for client, base, row in _paired(report["results"]):
        lines.append(f"| {client} | {row['sessions']} | {base['tokens_per_s']:.1f} | {row['tokens_per_s']:.1f} | "
                     f"{row['throughput_ratio']:.2f} | {base['per_token_ms_median']:.0f} / "
                     f"{row['per_token_ms_median']:.0f} | {row['per_token_ratio']:.2f} | {row['p95_ratio']:.2f} | "
                     f"{row['ttft_ratio']:.2f} | {row['same_tokens_as_vanilla']} | "
                     f"{base['server_cpu_ms_per_token']:.1f} / {row['server_cpu_ms_per_token']:.1f} | "
                     f"{row['server_cpu_ratio']:.2f} |")
    for http in [report.get("http"), *report.get("http_layouts", {}).values()]:
        if not http:
            continue
        nodes = http.get("layout_text", HTTP_LAYOUTS[http.get("layout", "user")])
        lines += ["", f"HTTP API with default options (orchestrator defaults, {nodes}; "
                  "aggregate tokens/s of concurrent /v1/completions):", "",
                  "| sessions | tok/s | × one session | same text as local greedy |", "|---|---|---|---|"]
        for row in http["rows"]:
            ratio = row["vs_one_session"]
            lines.append(f"| {row['sessions']} | {row['tokens_per_s']:.1f} | "
                         f"{'' if ratio is None else f'{ratio:.2f}'} | {row['same_text_as_local_greedy']} |")
    ceiling = ceilings(report["step_profile"]["step_s"], report["servers"])
    lines += ["", "Compute-only ceiling (in-process step times, one core per server, no RPC or client cost): "
              + ", ".join(f"{n} sessions {c['ratio']:.2f}× ({c['vanilla_tokens_per_s']:.0f} → "
                          f"{c['batched_tokens_per_s']:.0f} tok/s)" for n, c in ceiling.items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct, cached)")
    parser.add_argument("--sessions", default="1,2,4,8,16", help="concurrent sessions to measure")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per session")
    parser.add_argument("--max-batch", type=int, default=8, help="the Chainswarm servers' --max-batch")
    parser.add_argument("--out", default="experiments/results/bench_batching.json")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per point; the best is kept")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads of every process (servers and client alike; default 1: two servers "
                        "and the client share this machine's cores, and idle OpenMP threads spin)")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG and print the table from --out")
    parser.add_argument("--http-layouts", default="user,demo",
                        help="server layouts of the HTTP measurement (user: two 0.3 GB nodes; demo: make demo's four)")
    parser.add_argument("--http-lanes", type=int, default=1, metavar="L",
                        help="the HTTP measurement's orchestrator --batch-lanes (default 1, its default; other values "
                        "are stored beside the default rows)")
    parser.add_argument("--only-http", default=None, metavar="LAYOUT",
                        help="measure only the HTTP path on LAYOUT and store it into --out's existing report")
    args = parser.parse_args(argv)
    if args.replot:
        report = json.loads(Path(args.out).read_text())
        plot(report, Path(args.out).with_suffix(".png"))
        print(markdown(report))
        return 0
    os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # inherited by every server process started below
    from tqdm import tqdm

    from swarm.model.store import DEFAULT_MODEL, ensure_model

    model_dir = args.model or str(ensure_model(DEFAULT_MODEL, DTYPE))
    counts = [int(s) for s in args.sessions.split(",")]
    layouts = args.http_layouts.split(",") if args.http_layouts else []
    if args.only_http:
        report = json.loads(Path(args.out).read_text())
        with tqdm(total=len(counts), desc=f"bench_batching http {args.only_http}") as progress:
            store_http(report, bench_http(model_dir, counts, args.tokens, args.repeats, progress, args.only_http,
                                          args.http_lanes))
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(markdown(report))
        return 0
    progress = tqdm(total=(2 + len(layouts)) * len(counts) + 1, desc="bench_batching")
    import torch

    torch.set_num_threads(args.torch_threads)
    report = {"model": Path(model_dir).name, "dtype": DTYPE, "tokens": args.tokens, "max_batch": args.max_batch,
              "server_device": "cuda" if torch.cuda.is_available() else "cpu",
              "torch_threads": args.torch_threads, "cpu": host_cpu(), "load_average_at_start": os.getloadavg(),
              "servers": 2, "client": "petals generate, one thread per session",
              "repeats": args.repeats,
              "results": bench_servers(model_dir, counts, args.tokens, args.max_batch, args.repeats, progress)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))  # each stage's figures kept as soon as they are measured
    for layout in layouts:
        store_http(report, bench_http(model_dir, counts, args.tokens, args.repeats, progress, layout, args.http_lanes))
        out.write_text(json.dumps(report, indent=2))
    progress.set_postfix_str("step profile")
    report["step_profile"] = step_profile(model_dir)
    progress.update()
    progress.close()
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
