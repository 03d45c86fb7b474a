"""Time to first token and per-token latency: vanilla petals vs the orchestrated swarm, same servers, one run.

For each split (the model's blocks over 2 and over 3 orchestrated server nodes, one chain), three clients
generate the same greedy tokens from the same servers:

* ``vanilla_petals`` — petals 2.2's own client and routing (``AutoDistributedModelForCausalLM.generate``);
* ``chainswarm_http`` — ``POST /v1/completions`` with ``stream: true`` through the orchestrator, which runs
  the session on its granted chain (the client sees SSE chunks);
* ``chainswarm_direct`` — ``client.DirectSwarmModel``: a lease from the orchestrator, the client drives the chain.

Every generated token is timestamped as it arrives (a transformers streamer for the petals models, SSE chunks
for HTTP): TTFT = request start → first token, per-token = mean gap between later tokens. Medians over
``--repeats`` runs after a warm-up; ratios are to vanilla petals measured in the same run on the same servers.
Writes ``experiments/results/bench_runtime.json`` (and the markdown table it prints).

    python -m experiments.bench.runtime [--model DIR] [--splits 2,3] [--tokens 32] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DTYPE = "float32"
PROMPT = "The history of the bicycle begins in the early nineteenth century, when"
SETUPS = ("vanilla_petals", "chainswarm_http", "chainswarm_direct")


class _Stamps:
    """A transformers streamer that records when each generated token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.extend([time.perf_counter()] * value.numel())

    def end(self) -> None:
        pass


def _latencies(start: float, stamps: list[float]) -> tuple[float, float]:
    """(TTFT, mean per-token gap after the first) in milliseconds."""
    ttft = stamps[0] - start
    gaps = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return 1000 * ttft, 1000 * gaps


def _measure(run_once, repeats: int) -> dict:
    run_once()  # warm-up: connections, first allocations
    ttfts, per_token = [], []
    for _ in range(repeats):
        ttft, gap = run_once()
        ttfts.append(ttft)
        per_token.append(gap)
    return {"ttft_ms": statistics.median(ttfts), "per_token_ms": statistics.median(per_token),
            "ttft_samples": ttfts, "per_token_samples": per_token}


def _petals_runner(model, ids, tokens: int):
    import torch

    def once():
        stamps = _Stamps()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                           streamer=stamps)
        return _latencies(start, stamps.times)
    return once


def _http_runner(http, tokens: int):
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}

    def once():
        stamps = []
        start = time.perf_counter()
        with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and '"text": ""' not in line:
                    stamps.append(time.perf_counter())
        return _latencies(start, stamps)
    return once


def _budgets(model_dir: str, servers: int, max_length: int) -> list[float]:
    """Memory budgets that fit 1/servers of the model plus a few sessions each: the plan is one chain."""
    import torch

    from swarm.model.compat import petals  # first: it patches petals before petals is imported
    from petals.server.block_utils import get_block_size
    from server.profiling import cache_bytes_per_token

    config = petals.AutoDistributedConfig.from_pretrained(model_dir)
    block = get_block_size(config, "memory", dtype=getattr(torch, DTYPE))
    per_token = cache_bytes_per_token(config, getattr(torch, DTYPE))
    share = -(-config.num_hidden_layers // servers)
    return [share * (block + 4 * per_token * max_length) / 1e9] * servers


def bench_split(model_dir: str, servers: int, tokens: int, repeats: int, progress) -> dict:
    import httpx
    from swarm.model.tokenizer import load_tokenizer

    from client.direct import DirectSwarmModel
    from server.local_swarm import LocalSwarm
    from swarm.engine.petals_client import open_distributed_model

    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    max_length = 256
    results = {}
    # open sessions: vanilla petals' client is measured on the same nodes (it carries no orchestrator ticket)
    with LocalSwarm(model_dir, open_sessions=True) as swarm:
        url = swarm.add_orchestrator(expected_rate=0.2, max_length=max_length, expected_input_tokens=32,
                                     expected_output_tokens=tokens, refresh_s=0.5, torch_dtype=DTYPE).info["url"]
        nodes = [swarm.add_node(node_id=f"n{i}", memory_gb=gb, wait=False, num_handlers=1, torch_dtype=DTYPE)
                 for i, gb in enumerate(_budgets(model_dir, servers, max_length))]
        for node in nodes:
            swarm.wait_profiled(node, timeout=180)
        status = swarm.wait_chains_ready(timeout=300)
        chains = [[list(span) for span in c["spans"]] for c in status["chains"]]
        import torch

        with open_distributed_model(model_dir, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                    torch_dtype=getattr(torch, DTYPE)) as model:
            results["vanilla_petals"] = _measure(_petals_runner(model, ids, tokens), repeats)
        progress.update()
        with httpx.Client(base_url=url, timeout=300) as http:
            results["chainswarm_http"] = _measure(_http_runner(http, tokens), repeats)
        progress.update()
        with DirectSwarmModel.from_pretrained(model_dir, orchestrator=url, torch_dtype=getattr(torch, DTYPE)) as model:
            results["chainswarm_direct"] = _measure(_petals_runner(model, ids, tokens), repeats)
        progress.update()
    base = results["vanilla_petals"]
    for name, r in results.items():
        r["ttft_ratio"] = r["ttft_ms"] / base["ttft_ms"]
        r["per_token_ratio"] = r["per_token_ms"] / base["per_token_ms"]
    return {"servers": servers, "chains": chains, "results": results}


def markdown(report: dict) -> str:
    lines = ["| split | client | TTFT ms | × vanilla | per-token ms | × vanilla |", "|---|---|---|---|---|---|"]
    for split in report["splits"]:
        for name in SETUPS:
            r = split["results"][name]
            lines.append(f"| {split['servers']} servers | {name} | {r['ttft_ms']:.0f} | {r['ttft_ratio']:.2f} | "
                         f"{r['per_token_ms']:.1f} | {r['per_token_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct, cached)")
    parser.add_argument("--splits", default="2,3", help="numbers of servers to split the model over (default 2,3)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="experiments/results/bench_runtime.json")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    from swarm.model.store import DEFAULT_MODEL, ensure_model

    model_dir = args.model or str(ensure_model(DEFAULT_MODEL, DTYPE))
    splits = [int(s) for s in args.splits.split(",")]
    progress = tqdm(total=3 * len(splits), desc="bench_runtime")
    report = {"model": Path(model_dir).name, "dtype": DTYPE, "prompt": PROMPT, "tokens": args.tokens,
              "repeats": args.repeats, "splits": [bench_split(model_dir, n, args.tokens, args.repeats, progress)
                                                  for n in splits]}
    progress.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
