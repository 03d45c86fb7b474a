"""What the orchestrator spends per generated token, with the token chosen on the chain's servers and on itself.

Random llama checkpoints with the same four blocks (hidden 512) and vocabularies from 1,024 to 131,072 (a
Llama-3-sized one), each served by an orchestrator and two servers on this machine, every option at its default
but ``--token-choice``: ``servers`` (the default: the first server embeds token ids, the last one runs the final
norm, the LM head and the sampler, and token ids come back) and ``orchestrator`` (the earlier design: the
orchestrator embeds, runs every token's head and chooses). N concurrent ``POST /v1/completions`` of ``--tokens``
greedy tokens each; per run:

* the orchestrator process's CPU time per generated token (its own process; its DHT child process reported apart)
  and its resident memory;
* the servers' CPU time per generated token (both server processes and their children) and the swarm's aggregate
  tokens/s.

Every process shares this machine's two cores, so aggregate tokens/s here measures the machine; the orchestrator's
CPU per token is what caps a swarm whose servers have cores (or GPUs) of their own.

Where the orchestrator's remaining time goes: ``--profile-only`` (after a run; it adds to the JSON) samples the
orchestrator process with py-spy (every thread, 200 Hz) while 16 sessions generate at the largest vocabulary with the
servers choosing, and ranks the functions by the samples in which they are on the stack and by those in which they
run (the leaf).

Writes ``experiments/results/bench_orchestrator.json`` and ``.png``.

    python -m experiments.bench.orchestrator [--vocabs 1024,131072] [--sessions 1,8,16,64] [--tokens 32]
    python -m experiments.bench.orchestrator --profile-only
"""
from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import uuid
from pathlib import Path

from experiments.bench.batching import _process_cpu_s
from experiments.bench.cli import host_cpu
from experiments.bench.http_throughput import together

OUT = Path(__file__).resolve().parents[1] / "results" / "bench_orchestrator.json"
MODES = ("orchestrator", "servers")
PROMPT = "The history of the bicycle begins in the early nineteenth century, when"


def _cpu_s(processes) -> float:
    import psutil

    total = 0.0
    for process in processes:
        try:
            total += _process_cpu_s(process)  # to the nanosecond (/proc's ticks are 10 ms)
        except psutil.Error:
            pass
    return total


def _tree(pid: int) -> list:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _run(url: str, sessions: int, tokens: int) -> tuple[int, float, list]:
    """``sessions`` concurrent greedy completions; (tokens generated, wall seconds, errors)."""
    import httpx

    counts, errors = [0] * sessions, []
    barrier = threading.Barrier(sessions + 1, timeout=600)
    run = uuid.uuid4().hex[:8]

    def one(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            barrier.wait()
            try:
                response = http.post(f"{url}/v1/completions", headers={"X-Client-Id": f"bench-{run}-{i}"},
                                     json={"prompt": f"{PROMPT} ({i})", "max_tokens": tokens, "temperature": 0,
                                           "ignore_eos": True})
                response.raise_for_status()
                counts[i] = response.json()["usage"]["completion_tokens"]
            except Exception as exc:  # noqa: BLE001 - reported in the results
                errors.append(repr(exc))

    _, wall = together(sessions, one, barrier)
    return sum(counts), wall, errors


def bench_one(model_dir: str, mode: str, sessions: list[int], tokens: int, progress, **options) -> dict:
    import psutil

    from server.local_swarm import LocalSwarm

    with LocalSwarm(model_dir) as swarm:
        swarm.add_orchestrator(token_choice=mode, **options)
        nodes = [swarm.add_node(node_id=f"s{i}", wait=False) for i in range(2)]
        for node in nodes:
            swarm.wait_profiled(node, timeout=300)
        status = swarm.wait_chains_ready(timeout=300)
        url = swarm.orchestrator.info["url"]
        orchestrator = psutil.Process(swarm.orchestrator.process.pid)
        _run(url, 2, 4)  # warm-up: streams open, first allocations made
        rows = []
        for n in sessions:
            progress.set_postfix_str(f"{mode} × {n}")
            children = orchestrator.children(recursive=True)
            servers = [p for node in nodes for p in _tree(node.process.pid)]
            before = (_cpu_s([orchestrator]), _cpu_s(children), _cpu_s(servers))
            generated, wall, errors = _run(url, n, tokens)
            after = (_cpu_s([orchestrator]), _cpu_s(children), _cpu_s(servers))
            per = [(b - a) / max(generated, 1) * 1e3 for a, b in zip(before, after)]
            rows.append({"sessions": n, "tokens": generated, "wall_s": wall, "tokens_per_s": generated / wall,
                         "orchestrator_cpu_ms_per_token": per[0], "orchestrator_dht_cpu_ms_per_token": per[1],
                         "servers_cpu_ms_per_token": per[2], "errors": errors,
                         "orchestrator_rss_mb": orchestrator.memory_info().rss / 2**20})
            progress.update()
        chains = [{"servers": c["servers"], "spans": c["spans"]} for c in status["chains"]]
        return {"mode": mode, "chains": chains, "rows": rows}


def profile(model_dir: str, sessions: int, tokens: int, seconds: float) -> dict:
    """py-spy's samples of the orchestrator process while ``sessions`` completions run again and again (the
    servers choosing): the top functions by inclusive and by own (leaf) samples, as shares of all samples."""
    import collections
    import shutil
    import subprocess
    import sys

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    from server.local_swarm import LocalSwarm

    with LocalSwarm(model_dir) as swarm, tempfile.TemporaryDirectory() as tmp:
        swarm.add_orchestrator(token_choice="servers")
        nodes = [swarm.add_node(node_id=f"s{i}", wait=False) for i in range(2)]
        for node in nodes:
            swarm.wait_profiled(node, timeout=300)
        swarm.wait_chains_ready(timeout=300)
        url = swarm.orchestrator.info["url"]
        _run(url, 2, 4)
        out = Path(tmp) / "profile.txt"
        recorder = subprocess.Popen([spy, "record", "--pid", str(swarm.orchestrator.process.pid), "--rate", "200",
                                     "--duration", str(int(seconds)), "--format", "raw", "--nonblocking",
                                     "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        generated, began = 0, time.monotonic()
        while recorder.poll() is None and time.monotonic() - began < seconds + 60:
            generated += _run(url, sessions, tokens)[0]
        recorder.wait(60)
        if not out.exists():
            raise RuntimeError(f"py-spy wrote no profile: {recorder.stderr.read().decode()[-500:]}")
        inclusive, leaf, total = collections.Counter(), collections.Counter(), 0
        for line in out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f
                      for f in stack.split(";")]
            total += int(count)
            leaf[frames[-1]] += int(count)
            for frame in set(frames):
                inclusive[frame] += int(count)
    top = lambda counter: [{"function": f, "share": n / total} for f, n in counter.most_common(15)]  # noqa: E731
    return {"sessions": sessions, "seconds": seconds, "samples": total, "tokens_generated": generated,
            "inclusive": top(inclusive), "leaf": top(leaf)}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in report["runs"]:
        xs = [r["sessions"] for r in run["rows"]]
        style = "-" if run["mode"] == "servers" else "--"
        label = f"vocab {run['vocab']:,}, token chosen on the {run['mode']}"
        axes[0].plot(xs, [r["orchestrator_cpu_ms_per_token"] for r in run["rows"]], style, marker="o", label=label)
        axes[1].plot(xs, [r["tokens_per_s"] for r in run["rows"]], style, marker="o", label=label)
        axes[2].plot(xs, [r["orchestrator_rss_mb"] for r in run["rows"]], style, marker="o", label=label)
    for ax, title in zip(axes, ("orchestrator CPU per generated token (ms)", "aggregate tokens/s (this machine)",
                                "orchestrator resident memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent /v1/completions")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Where the token is chosen: orchestrator vs the chain's servers ({report['host_cpu']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from tqdm import tqdm

    from swarm.model.checkpoint import TinyModelSpec, make_random_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", default="1024,131072")
    parser.add_argument("--sessions", default="1,8,16,64")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON at --out; run nothing")
    parser.add_argument("--profile-only", action="store_true",
                        help="profile the orchestrator at the largest vocabulary of --vocabs (py-spy) and add it to "
                        "the JSON at --out")
    parser.add_argument("--profile-seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    vocabs = [int(v) for v in args.vocabs.split(",")]
    sessions = [int(n) for n in args.sessions.split(",")]
    if args.profile_only:
        report = json.loads(args.out.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_random_model(Path(tmp) / "profiled", TinyModelSpec(
                layers=4, hidden=512, heads=8, vocab=max(vocabs), max_length=512, seed=1))
            report["profile"] = {"vocab": max(vocabs), **profile(str(model_dir), 16, args.tokens,
                                                                  args.profile_seconds)}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report["profile"], indent=1))
        return 0
    report = {"host_cpu": host_cpu(), "tokens": args.tokens, "hidden": 512, "layers": 4, "runs": []}
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=len(vocabs) * len(MODES) * len(sessions)) as progress:
        for vocab in vocabs:
            model_dir = make_random_model(Path(tmp) / f"vocab-{vocab}", TinyModelSpec(
                layers=4, hidden=512, heads=8, vocab=vocab, max_length=512, seed=1))
            for mode in MODES:
                report["runs"].append({"vocab": vocab, **bench_one(str(model_dir), mode, sessions, args.tokens,
                                                                   progress)})
    by = {(r["vocab"], r["mode"]): {row["sessions"]: row for row in r["rows"]} for r in report["runs"]}
    summary = {}
    for n in sessions:
        small, large = vocabs[0], vocabs[-1]
        after = by[(large, "servers")][n]["orchestrator_cpu_ms_per_token"]
        summary[str(n)] = {
            "orchestrator_cpu_growth_servers": after / by[(small, "servers")][n]["orchestrator_cpu_ms_per_token"],
            "orchestrator_cpu_growth_orchestrator": by[(large, "orchestrator")][n]["orchestrator_cpu_ms_per_token"]
            / by[(small, "orchestrator")][n]["orchestrator_cpu_ms_per_token"],
            "orchestrator_cpu_ms_per_token_largest_vocab": after,
            "tokens_per_s_ratio_largest_vocab": by[(large, "servers")][n]["tokens_per_s"]
            / by[(large, "orchestrator")][n]["tokens_per_s"]}
    report["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
