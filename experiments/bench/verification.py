"""Spot checks on the real model: how fast hostile volunteers are banned, what the checks cost, and that honest
volunteers are never struck.

Two parts, both on SmolLM2-135M-Instruct in float32 through the orchestrator's HTTP API with the default
check rates (``--spot-check-rate 0.05``, ``--spot-check-new-rate 0.25``, two strikes ban):

* **honest**: ``--honest`` greedy sessions (``--concurrency`` at a time) on ``--servers`` honest nodes at
  ``--memory-gb`` each (two-hop chains: every span is held by two servers); counts the checks, any strike, and
  the overhead two ways: the *compute overhead* (the target), the servers' compute time spent on checks per
  compute time serving, where a check is one prefill and a session is its prompt's prefill plus one decode step
  per further token, timed by the nodes' profile — one block of the model measured on this machine before the run
  (:func:`server.profiling.measure_block_times`, prefills of 32 tokens, about a session's length), which the nodes
  declare; and the *block-position overhead*, block-positions re-executed per block-position served (a prefill
  position counted like a decode position: an upper bound that ignores how much cheaper a prefill is);
* **adversaries**: for each kind of ``experiments.live.adversaries`` and each of ``--trials`` trials, a fresh
  hostile node (new node id, new key) joins two honest nodes (every node holds the whole model) and announces
  itself as the fastest, so JFFC sends it the sessions; sessions go one at a time until it is banned or has
  served ``--max-sessions``. ``late`` counts from its first dishonest session.

Target (issue 31): every adversary banned within 50 of its sessions, ≤ 5% overhead, zero false strikes.
Writes ``experiments/results/bench_verification.json`` and ``.png``.

    python -m experiments.bench.verification [--honest 1000] [--trials 3] [--max-sessions 200]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import time
from pathlib import Path

from experiments.bench.cli import add_common, model_dir as checkpoint, replotted
from experiments.bench.soak import percentile
from experiments.paths import RESULTS

DTYPE = "float32"
HONEST = {"prefill_s": 2e-4, "decode_s": 2e-3, "rtt_s": 0.002}
TOPICS = ("a colour", "a river", "a planet", "a tree", "a city", "an insect", "a metal", "a poem")


def prompt(rng: random.Random, i: int) -> str:
    return f"Request {i}. In a few words, name {rng.choice(TOPICS)} and say one thing about it."


def complete(http, rng: random.Random, i: int, max_tokens: int) -> dict:
    r = http.post("/v1/completions", json={"prompt": prompt(rng, i), "max_tokens": max_tokens, "temperature": 0,
                                          "ignore_eos": True})  # every session has max_tokens - 1 decode steps
    r.raise_for_status()
    return r.json()["chainswarm"]


def honest_part(model_dir: str, args, tqdm) -> dict:
    import httpx

    from server.local_swarm import LocalSwarm

    from swarm.model.compat import petals
    from server.profiling import measure_block_times

    times = measure_block_times(petals.AutoDistributedConfig.from_pretrained(model_dir), torch_dtype=DTYPE,
                                prefill_tokens=32)
    measured = {"prefill_s": times.prefill_s, "decode_s": times.decode_s, "rtt_s": HONEST["rtt_s"]}
    with LocalSwarm(model_dir) as swarm:
        nodes = [swarm.add_node(node_id=f"h{i}", memory_gb=args.memory_gb, wait=False, declared_profile=measured,
                                torch_dtype=DTYPE) for i in range(args.servers)]
        for node in nodes:
            swarm.wait_profiled(node, timeout=300)
        url = swarm.add_orchestrator(expected_rate=50.0, max_length=256, expected_input_tokens=32,
                                     expected_output_tokens=args.tokens, refresh_s=0.5,
                                     torch_dtype=DTYPE).info["url"]
        status = swarm.wait_chains_ready(timeout=300)
        rng, began = random.Random(args.seed), time.monotonic()
        with httpx.Client(base_url=url, timeout=300) as http, cf.ThreadPoolExecutor(args.concurrency) as pool, \
                tqdm(total=args.honest, desc="honest sessions") as bar:
            futures = [pool.submit(complete, http, random.Random(rng.random()), i, args.tokens)
                       for i in range(args.honest)]
            for future in cf.as_completed(futures):
                future.result()
                bar.update()
            time.sleep(2.0)
            verification = _settled(http)
        return {"servers": args.servers, "memory_gb": args.memory_gb, "sessions": args.honest,
                "chains": [c["servers"] for c in status["chains"]], "wall_s": time.monotonic() - began,
                "profile": measured, "counts": verification["counts"], "overhead": verification["overhead"],
                "compute_overhead": verification["compute_overhead"],
                "strikes": {n: s["strikes"] for n, s in verification["servers"].items()},
                "passed": {n: s["passed"] for n, s in verification["servers"].items()},
                "banned": sorted(verification["banned"])}


def _settled(http, timeout: float = 120.0) -> dict:
    """The verification status once the check queue has drained (no new checks for a few seconds)."""
    last, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = http.get("/v1/swarm").json()["verification"]
        done = doc["counts"]["checks"] + doc["counts"]["skipped"]
        if done == last:
            return doc
        last = done
        time.sleep(3.0)
    return doc


def adversary_part(model_dir: str, args, tqdm) -> dict:
    import httpx

    from experiments.live import adversaries
    from server.local_swarm import LocalSwarm

    out: dict[str, list] = {kind: [] for kind in args.kinds}
    strikes_on_honest = 0
    with LocalSwarm(model_dir) as swarm:
        honest = [swarm.add_node(node_id=f"h{i}", memory_gb=0.7, wait=False, declared_profile=HONEST,
                                 torch_dtype=DTYPE) for i in range(2)]
        for node in honest:
            swarm.wait_profiled(node, timeout=300)
        url = swarm.add_orchestrator(expected_rate=50.0, max_length=256, expected_input_tokens=32,
                                     expected_output_tokens=args.tokens, refresh_s=0.5,
                                     torch_dtype=DTYPE).info["url"]
        swarm.wait_chains_ready(nodes=["h0", "h1"], timeout=300)
        rng = random.Random(args.seed)
        with httpx.Client(base_url=url, timeout=300) as http, \
                tqdm(total=len(args.kinds) * args.trials, desc="adversaries") as bar:
            for kind in args.kinds:
                for trial in range(args.trials):
                    name = f"{kind}{trial}"
                    adversary = adversaries.Adversary(kind, scale=args.scale, after=args.late_after, seed=trial)
                    peer = swarm.add_node(node_id=name, memory_gb=0.7, wait=True, torch_dtype=DTYPE,
                                          declared_profile={**HONEST, "decode_s": 5e-4},
                                          process_main=adversaries.main(adversary))
                    swarm.wait_chains_ready(nodes=["h0", "h1", name], timeout=300)
                    served, banned, began = 0, False, time.monotonic()
                    for i in range(args.max_sessions + (args.late_after if kind == "late" else 0) + 10):
                        info = complete(http, rng, i, args.tokens)
                        served += name in info["servers"]
                        doc = http.get("/v1/swarm").json()["verification"]
                        if name in doc["banned"]:
                            banned = True
                            break
                        if served - (args.late_after if kind == "late" else 0) >= args.max_sessions:
                            break
                    dishonest = max(0, served - (args.late_after if kind == "late" else 0))
                    out[kind].append({"node": name, "banned": banned, "sessions": served,
                                      "dishonest_sessions": dishonest, "wall_s": time.monotonic() - began})
                    swarm.kill(peer)
                    bar.update()
            verification = _settled(http)
            strikes_on_honest = sum(verification["servers"].get(f"h{i}", {"strikes": 0})["strikes"] for i in range(2))
            passed_honest = {f"h{i}": verification["servers"].get(f"h{i}", {"passed": 0})["passed"] for i in range(2)}
    kinds = {}
    for kind, trials in out.items():
        counts = [t["dishonest_sessions"] for t in trials]
        kinds[kind] = {"trials": trials, "detected": sum(t["banned"] for t in trials) / max(1, len(trials)),
                       "median_sessions": percentile(counts, 50), "p95_sessions": percentile(counts, 95),
                       "max_sessions": max(counts, default=0)}
    return {"kinds": kinds, "strikes_on_honest": strikes_on_honest, "passed_honest": passed_honest,
            "scale": args.scale, "late_after": args.late_after}


def targets(report: dict) -> dict:
    adv = report["adversaries"]["kinds"]
    return {
        "every_adversary_banned": all(k["detected"] == 1.0 for k in adv.values()),
        "banned_within_50_sessions": all(k["max_sessions"] <= 50 for k in adv.values()),
        "overhead_at_most_5pct": report["honest"]["compute_overhead"] <= 0.05,
        "zero_false_strikes": (sum(report["honest"]["strikes"].values()) == 0
                               and report["adversaries"]["strikes_on_honest"] == 0),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = report["adversaries"]["kinds"]
    names = list(kinds)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for i, name in enumerate(names):
        counts = [t["dishonest_sessions"] for t in kinds[name]["trials"]]
        ax.scatter([i] * len(counts), counts, color="tab:red", alpha=0.6, zorder=3)
        ax.bar(i, kinds[name]["median_sessions"], color="tab:gray", alpha=0.5)
    ax.axhline(50, color="k", ls="--", lw=1, label="target: banned within 50 sessions")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("dishonest sessions served before the ban")
    honest = report["honest"]
    ax.set_title(f"spot checks, SmolLM2 float32: compute overhead {honest['compute_overhead']:.1%} (block-positions "
                 f"{honest['overhead']:.1%}) over {honest['sessions']} honest sessions, "
                 f"{sum(honest['strikes'].values())} false strikes", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from experiments.live.adversaries import KINDS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(parser, RESULTS / "bench_verification.json")
    parser.add_argument("--honest", type=int, default=1000, help="honest sessions (default 1000)")
    parser.add_argument("--servers", type=int, default=4, help="honest nodes of the honest part (default 4)")
    parser.add_argument("--memory-gb", type=float, default=0.24,
                        help="their memory (default 0.24: half the model and a few sessions: two two-hop chains)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens of every session (default 8)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--trials", type=int, default=3, help="hostile nodes per kind (default 3)")
    parser.add_argument("--max-sessions", type=int, default=200, help="dishonest sessions before giving up")
    parser.add_argument("--scale", type=float, default=0.05, help="noise / weight perturbation (default 0.05)")
    parser.add_argument("--late-after", type=int, default=20, help="late: honest sessions first (default 20)")
    args = parser.parse_args(argv)
    if replotted(args, plot):
        return 0
    from tqdm import tqdm

    model_dir = checkpoint(args, DTYPE)
    wall = time.monotonic()
    report = {"command": "python -m experiments.bench.verification", "model": Path(model_dir).name, "dtype": DTYPE,
              "tokens": args.tokens, "rates": {"base": 0.05, "new": 0.25, "strikes_to_ban": 2}}
    report["adversaries"] = adversary_part(model_dir, args, tqdm)
    report["honest"] = honest_part(model_dir, args, tqdm) if args.honest else None
    report["wall_s"] = time.monotonic() - wall
    report["targets"] = targets(report) if report["honest"] else {}
    report["all_targets_met"] = bool(report["targets"]) and all(report["targets"].values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if report["honest"]:
        plot(report, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "adversaries"}, indent=1))
    for kind, row in report["adversaries"]["kinds"].items():
        print(f"{kind:9s} detected {row['detected']:.0%}  sessions before ban median {row['median_sessions']} "
              f"P95 {row['p95_sessions']} max {row['max_sessions']}")
    return 0 if report["all_targets_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
