"""Speculative decoding across the swarm (``--speculative ngram``) under emulated WAN latency, against the same swarm
without it and against vanilla petals' client, measured in one run.

One orchestrator and three Chainswarm nodes of SmolLM2-135M-Instruct (float32), each node on a WAN host of the
paper's RIPE Atlas EU RTTs (:meth:`wan.WanConfig.from_ripe_atlas`, 3 servers, seed 0) and sized to hold a third of
the blocks, so every token crosses a 3-server chain. The orchestrator runs with ``--speculative ngram`` and otherwise
default serving options; every point runs on the same swarm with ``speculative: false`` (one token per step) and
with drafts, alternated ``--repeats`` times (off, on, on, off: a drift of the shared machine's speed cancels in
pairs; a point's ratios are the medians of the pairs' ratios), through ``POST /v1/completions`` (streamed, greedy,
``--tokens`` tokens; ``--temperature T``: sampled, session ``i`` seeded ``--seed + i`` in both modes), so the
product's HTTP path with its defaults is what is measured. Four workloads: ``code_edit`` (a
function restated with a rename: the output copies the input), ``summarise`` (an article summarised in its own
words), ``chat`` (a multi-turn conversation whose answer repeats what was said) and ``free`` (a story: drafts
rarely match). Each request has a client id of its own, so only the request's own tokens draft (prompt lookup):
the swarm-wide index of earlier outputs, which would make repeated prompts look better, is not measured here.

Per point: per-token latency (a session's last-minus-first token time over its tokens − 1; median over sessions),
TTFT (median), aggregate tokens/s, the drafted and accepted tokens (the orchestrator's metrics), tokens per chain
step (where the time goes: a step costs the chain's round trips whatever it carries), and whether the two modes gave
the same text. Vanilla petals (its own ``generate`` on the same servers, opened to it) runs the 1-session point.

Writes ``experiments/results/bench_speculative.json`` and ``.png``.

    python -m experiments.bench.speculative [--sessions 1,4,16] [--tokens 48] [--prefix-cache-tokens N]
                                            [--batch-sessions N] [--repeats 2] [--temperature T] [--replot]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from experiments.bench.http_throughput import together
from experiments.bench.cli import add_common, model_dir, replotted

DTYPE = "float32"
OUT = Path("experiments/results/bench_speculative.json")
MAX_LENGTH = 512

_CODE = [
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / len(values)\n",
    "def count_words(text):\n    total = 0\n    for line in text.splitlines():\n        total += len(line.split())\n"
    "    return total\n",
    "def largest(items):\n    total = items[0]\n    for item in items[1:]:\n        if item > total:\n            total = item\n"
    "    return total\n",
    "def squares(limit):\n    total = []\n    for number in range(limit):\n        total.append(number * number)\n"
    "    return total\n",
]
_ARTICLES = [
    "The city council approved a plan on Monday to build a new library in the old market square. The library will "
    "have three floors, a reading garden on the roof and a room for children. Construction starts in spring and "
    "should take two years. The council said the project costs twelve million euros.",
    "A team of researchers found that bees can recognise human faces. In the experiment, bees were trained with "
    "photographs and a sugar reward. After training, most bees chose the right face even without the reward. The "
    "researchers say the result helps to understand how small brains process images.",
    "The river festival returns this weekend with boat races, music and food stalls along the water. The races start "
    "at ten in the morning on Saturday. On Sunday evening there will be fireworks over the bridge. Entry is free, "
    "and the organisers ask visitors to come by bicycle or by train.",
    "A local bakery won the national bread prize for its rye loaf. The bakery was opened forty years ago by two "
    "brothers and is now run by their daughters. The winning loaf is baked in a wood oven and rests for a full day "
    "before baking. The prize comes with a year of free flour.",
]
_CHATS = [
    ("Alice", "Lyon", "two cats, Tom and Felix"), ("Marco", "Turin", "a dog called Rocky"),
    ("Sofia", "Porto", "three goldfish and a parrot"), ("Jonas", "Bergen", "a rabbit named Snow"),
]
_FREE = ["Write a short story about a dragon who is afraid of the dark.", "Describe a walk through a forest in autumn.",
         "Write a poem about the sea at night.", "Tell a story about a robot who learns to cook."]


def prompts(workload: str) -> list[str]:
    """The workload's prompt variants (sessions cycle through them)."""
    if workload == "code_edit":
        return [f"Here is a Python function:\n```python\n{c}```\nThe same function, unchanged except that the variable "
                f"`total` is renamed to `result`:\n```python\n{c.splitlines()[0]}\n" for c in _CODE]
    if workload == "summarise":
        return [f"Article: {a}\n\nSummary of the article, using its own sentences: " for a in _ARTICLES]
    if workload == "chat":
        return [f"User: Hello! My name is {n}, I live in {c} and I have {p}.\nAssistant: Nice to meet you, {n}! {c} "
                f"is a lovely place.\nUser: Can you repeat what I told you about myself, in full sentences?\n"
                f"Assistant: Of course. Your name is {n}," for n, c, p in _CHATS]
    if workload == "free":
        return [f"{p}\n\n" for p in _FREE]
    raise ValueError(workload)


WORKLOADS = ("code_edit", "summarise", "chat", "free")


def _stream(url: str, prompt: str, tokens: int, speculative: bool, client: str, temperature: float = 0.0,
            seed: int = 0) -> dict:
    import httpx

    body = {"prompt": prompt, "max_tokens": tokens, "temperature": temperature, "stream": True,
            "speculative": speculative, **({"seed": seed} if temperature > 0 else {})}
    start, stamps, pieces = time.monotonic(), [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Client-Id": client},
                      timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                pieces.append(event["choices"][0]["text"])
                stamps.append(time.monotonic() - start)
    return {"text": "".join(pieces), "stamps": stamps}


def _metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def run_point(url: str, workload: str, sessions: int, tokens: int, speculative: bool, tag: str,
              temperature: float = 0.0, seed: int = 0) -> dict:
    """``sessions`` concurrent streamed completions of ``workload``, all started together (sampled at
    ``temperature`` > 0 with seed ``seed + i`` for session ``i``, the same in every run: the same text)."""
    variants = prompts(workload)
    names = ("chainswarm_speculative_drafted_tokens_total", "chainswarm_speculative_accepted_tokens_total",
             "chainswarm_batched_session_steps_total")
    before = [_metric(url, n) for n in names]
    results: list = [None] * sessions
    errors: list = []
    barrier = threading.Barrier(sessions + 1)

    def one(i: int) -> None:
        barrier.wait()
        try:
            results[i] = _stream(url, variants[i % len(variants)], tokens, speculative, f"{tag}-{i}", temperature,
                                 seed + i)
        except Exception as exc:  # noqa: BLE001 - reported in the results
            errors.append(repr(exc))

    _, wall = together(sessions, one, barrier)
    drafted, accepted, steps = (_metric(url, n) - b for n, b in zip(names, before))
    done = [r for r in results if r is not None]
    emitted = sum(len(r["stamps"]) for r in done)  # streamed chunks: one per token (stop strings aside)
    per_token = [(r["stamps"][-1] - r["stamps"][0]) / (len(r["stamps"]) - 1) for r in done if len(r["stamps"]) > 1]
    return {"sessions": sessions, "speculative": speculative, "wall_s": wall, "tokens": emitted,
            "tokens_per_s": emitted / wall, "per_token_s": statistics.median(per_token) if per_token else None,
            "ttft_s": statistics.median(r["stamps"][0] for r in done) if done else None,
            "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0,
            "chain_steps": steps, "tokens_per_step": emitted / steps if steps else None,
            "texts": [r["text"] for r in results if r is not None], "errors": errors}


def run_vanilla(model, tokenizer, workload: str, tokens: int) -> dict:
    """Vanilla petals' greedy ``generate`` (one session, its own client) on the same servers."""
    import torch

    ids = tokenizer(prompts(workload)[0], return_tensors="pt").input_ids
    stamps: list = []

    class Sink:
        first = True

        def put(self, value):
            if self.first:
                self.first = False
                return
            stamps.append(time.monotonic() - start)

        def end(self):
            pass

    start = time.monotonic()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             streamer=Sink())
    return {"per_token_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1), "ttft_s": stamps[0],
            "tokens_per_s": len(stamps) / (time.monotonic() - start),
            "text": tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}


def _node_gb(path: str) -> float:
    """13.5 blocks' worth of memory: two nodes cannot hold the 30 blocks, so every chain has three servers, and a
    node of 10 blocks keeps 3.5 blocks' worth for KV (about 16 sessions of 200 tokens)."""
    import torch

    from swarm.model.compat import petals
    from petals.server.block_utils import get_block_size

    config = petals.AutoDistributedConfig.from_pretrained(path)
    return 0.45 * config.num_hidden_layers * get_block_size(config, "memory", dtype=torch.float32) / 1e9


def _median_run(runs: list[dict]) -> dict:
    """One mode's repeats of a point as one: the median of every timing and count, the texts and errors of all."""
    merged = dict(runs[0])
    for key in ("wall_s", "tokens", "tokens_per_s", "per_token_s", "ttft_s", "drafted", "accepted", "chain_steps"):
        values = [r[key] for r in runs if r[key] is not None]
        merged[key] = statistics.median(values) if values else None
    merged["acceptance"] = merged["accepted"] / merged["drafted"] if merged["drafted"] else 0.0
    merged["tokens_per_step"] = merged["tokens"] / merged["chain_steps"] if merged["chain_steps"] else None
    merged["runs"] = [{k: r[k] for k in ("wall_s", "tokens_per_s", "per_token_s", "ttft_s", "drafted", "accepted",
                                        "chain_steps")} for r in runs]
    merged["errors"] = [e for r in runs for e in r["errors"]]
    return merged


def pair_point(workload: str, sessions: int, offs: list[dict], ons: list[dict]) -> dict:
    """A point from its repeated (off, on) runs: ratios are the medians of the paired repeats' ratios, and the
    text must be the same in every run of both modes."""
    texts = [r["texts"] for r in offs + ons]
    return {"workload": workload, "sessions": sessions, "repeats": len(offs),
            "off": _median_run(offs), "on": _median_run(ons),
            "same_text": all(t == texts[0] for t in texts) and not any(r["errors"] for r in offs + ons),
            "per_token_ratio": statistics.median(b["per_token_s"] / a["per_token_s"] for a, b in zip(offs, ons)),
            "throughput_ratio": statistics.median(b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(offs, ons))}


def bench(path: str, counts: list[int], tokens: int, seed: int, progress, prefix_cache_tokens: int = 0,
          batch_sessions: int = 16, speculative_k: int = 8, repeats: int = 2, temperature: float = 0.0,
          max_batch: int = 16, workloads: Sequence[str] = WORKLOADS,
          on_point: Optional[Callable[[list], None]] = None) -> dict:
    """The benchmark's swarm and its points; ``on_point(points)`` after each point (a partial report is written
    there, so a run cut short by a time limit keeps what it measured)."""
    import httpx
    import torch
    from swarm.model.tokenizer import load_tokenizer

    import wan
    from server.local_swarm import LocalSwarm
    from swarm.engine.petals_client import open_distributed_model

    config = wan.WanConfig.from_ripe_atlas(num_servers=3, seed=seed)
    gb = _node_gb(path)
    with LocalSwarm(path, wan=config, open_sessions=True) as swarm:
        swarm.add_orchestrator(torch_dtype=DTYPE, speculative="ngram", max_length=MAX_LENGTH,
                               expected_input_tokens=160, expected_output_tokens=tokens,
                               prefix_cache_tokens=prefix_cache_tokens, batch_sessions=batch_sessions,
                               speculative_k=speculative_k)
        nodes = [swarm.add_node(node_id=h, wan_host=h, memory_gb=gb, wait=False, torch_dtype=DTYPE,
                                max_batch=max_batch) for h in config.servers]
        for node in nodes:
            swarm.wait_profiled(node, timeout=300)
        status = swarm.wait_chains_ready(timeout=300)
        url = swarm.orchestrator.info["url"]
        run_point(url, "free", 2, 4, True, "warmup")
        points = []
        for workload in workloads:
            for n in counts:
                progress.set_postfix_str(f"{workload} × {n}")
                runs: dict = {False: [], True: []}
                for r in range(repeats):  # off, on, on, off, ...: a drift of the machine's speed cancels in pairs
                    for mode in ((False, True) if r % 2 == 0 else (True, False)):
                        runs[mode].append(run_point(url, workload, n, tokens, mode, f"{workload}-{n}-{mode}-{r}",
                                                    temperature, seed))
                points.append(pair_point(workload, n, runs[False], runs[True]))
                progress.update()
                if on_point is not None:
                    on_point(points)
        tokenizer = load_tokenizer(path)
        vanilla = {}
        with open_distributed_model(path, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                    torch_dtype=torch.float32) as model:
            for workload in workloads if temperature == 0 else ():  # petals' generate: greedy runs only
                progress.set_postfix_str(f"vanilla petals {workload}")
                vanilla[workload] = run_vanilla(model, tokenizer, workload, tokens)
                progress.update()
        final = httpx.get(f"{url}/v1/swarm", timeout=30).json()
    return {"wan": {"servers": list(config.servers), "rtt_ms": {s["node_id"]: s["rtt_s"] * 1e3 for s in
                                                                 final["servers"] if s.get("rtt_s")}},
            "chains": [{"servers": c["servers"], "spans": c["spans"]} for c in status["chains"]],
            "points": points, "vanilla_petals": vanilla}


def targets(report: dict) -> dict:
    """The issue's targets: ≤ 0.5× per-token latency on the copy-heavy workloads at 1 session, ≥ 1.3× aggregate
    tokens/s at 16 sessions (judged only where 16 sessions were measured), ≤ 1.05× per-token latency on free
    generation."""
    by = {(p["workload"], p["sessions"]): p for p in report["points"]}
    copy = [by[(w, 1)]["per_token_ratio"] for w in ("code_edit", "summarise", "chat") if (w, 1) in by]
    crowd = [by[(w, 16)]["throughput_ratio"] for w in WORKLOADS if (w, 16) in by]
    free = [p["per_token_ratio"] for p in report["points"] if p["workload"] == "free"]
    throughput = ({"throughput_at_16_sessions": crowd, "throughput_at_least_1_3x": min(crowd) >= 1.3}
                  if crowd else {})
    return {"copy_heavy_per_token_at_1_session": copy, "copy_heavy_at_most_half": bool(copy) and max(copy) <= 0.5,
            **throughput, "free_per_token": free, "free_at_most_1_05x": bool(free) and max(free) <= 1.05,
            "same_text_everywhere": all(p["same_text"] for p in report["points"])}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for workload in dict.fromkeys(p["workload"] for p in report["points"]):
        rows = [p for p in report["points"] if p["workload"] == workload]
        x = [p["sessions"] for p in rows]
        axes[0].plot(x, [p["per_token_ratio"] for p in rows], marker="o", label=workload)
        axes[1].plot(x, [p["throughput_ratio"] for p in rows], marker="o", label=workload)
    for ax, title in zip(axes, ("per-token latency, speculative ÷ one token per step",
                                "aggregate tokens/s, speculative ÷ one token per step")):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    how = (f"tokens per request, sampled at T = {report['temperature']} (seeded)" if report.get("temperature")
           else "greedy tokens per request")
    fig.suptitle(f"{report['model']} on a 3-server chain, RIPE Atlas RTTs (WAN emulator), {report['tokens']} {how}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(parser, OUT)
    parser.add_argument("--sessions", default="1,4,16", help="concurrent sessions per point")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated workloads to run (default: all of {', '.join(WORKLOADS)})")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per request")
    parser.add_argument("--prefix-cache-tokens", type=int, default=0,
                        help="the orchestrator's --prefix-cache-tokens (default 0, its default: no prefix reuse); "
                        "with reuse on, sessions whose prompt pages are stored load them and still speculate")
    parser.add_argument("--batch-sessions", type=int, default=16,
                        help="the orchestrator's --batch-sessions (default 16, its default); 0: every request runs as "
                        "one petals session, which speculates on petals' per-session path")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each mode per point, alternated (off, on, on, off, ...); a point's ratios are "
                        "the medians of the paired runs' ratios (default 2: on this shared 2-core machine one run of "
                        "each is ±5%%, which decided the free-text target by noise)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request (default 0: greedy); above 0 session i's requests "
                        "carry seed --seed + i in both modes, so the text must be the same with and without drafts "
                        "(vanilla petals, greedy only, is not run)")
    parser.add_argument("--speculative-k", type=int, default=8,
                        help="the orchestrator's --speculative-k (default 8, its default): most drafted tokens a "
                        "session verifies per step")
    parser.add_argument("--max-batch", type=int, default=16,
                        help="the servers' --max-batch (default 16, their default): their batch bound, which is also "
                        "how many decode positions a chain step fills with drafts")
    args = parser.parse_args(argv)
    if not 1 <= args.max_batch <= 4096:
        parser.error(f"--max-batch must be between 1 and 4096, got {args.max_batch}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if not 0 <= args.temperature <= 2:
        parser.error(f"--temperature must be between 0 and 2, got {args.temperature}")
    if not 1 <= args.speculative_k <= 64:
        parser.error(f"--speculative-k must be between 1 and 64, got {args.speculative_k}")
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown or not workloads:
        parser.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(WORKLOADS)}")
    if replotted(args, plot):
        return 0
    from tqdm import tqdm

    path = model_dir(args, DTYPE)
    counts = [int(s) for s in args.sessions.split(",")]
    progress = tqdm(total=len(workloads) * (len(counts) + (args.temperature == 0)), desc="bench_speculative")
    began = time.monotonic()
    report = {"command": "python -m experiments.bench.speculative", "model": Path(path).name, "dtype": DTYPE,
              "tokens": args.tokens, "seed": args.seed, "prefix_cache_tokens": args.prefix_cache_tokens,
              "batch_sessions": args.batch_sessions, "speculative_k": args.speculative_k, "repeats": args.repeats,
              "max_batch": args.max_batch,
              "temperature": args.temperature}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def partial(points: list) -> None:  # what is measured so far, marked partial until the run completes
        args.out.write_text(json.dumps({**report, "partial": True, "points": points,
                                        "wall_s": time.monotonic() - began}, indent=2))

    report.update(bench(path, counts, args.tokens, args.seed, progress, args.prefix_cache_tokens, args.batch_sessions,
                        args.speculative_k, args.repeats, args.temperature, args.max_batch, workloads, partial))
    progress.close()
    report["wall_s"] = time.monotonic() - began
    report["targets"] = targets(report)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    for p in report["points"]:
        print(f"{p['workload']:>10} × {p['sessions']:>2}: per-token {p['off']['per_token_s'] * 1e3:7.1f} → "
              f"{p['on']['per_token_s'] * 1e3:7.1f} ms ({p['per_token_ratio']:.2f}×), tokens/s "
              f"{p['off']['tokens_per_s']:6.1f} → {p['on']['tokens_per_s']:6.1f} ({p['throughput_ratio']:.2f}×), "
              f"acceptance {p['on']['acceptance']:.2f}, same text {p['same_text']}")
    print(json.dumps(report["targets"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
