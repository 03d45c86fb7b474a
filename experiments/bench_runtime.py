"""Per-token latency of the orchestrated swarm vs vanilla petals, same model, same machine, one run.

Both swarms split the model over two servers ([0, L/2) and [L/2, L)). Measured:
* vanilla petals: petals' own routing, `model.generate` (client relays between the servers);
* Chainswarm, HTTP: `POST /v1/completions` through the orchestrator (the orchestrator runs the session);
* Chainswarm, direct: `DirectSwarmModel` (a lease from the orchestrator, the client drives the chain).
Prints ms/token (median of --repeats) and the ratios to vanilla; writes experiments/results/bench_runtime.json.

    python -m experiments.bench_runtime [--model DIR] [--tokens 64] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _median_ms_per_token(fn, tokens: int, repeats: int) -> float:
    fn()  # warm-up (opens connections, first allocation)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        produced = fn()
        samples.append(1000 * (time.perf_counter() - t0) / produced)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="experiments/results/bench_runtime.json")
    args = parser.parse_args(argv)

    import httpx
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    from client.direct import DirectSwarmModel
    from server.local_swarm import LocalSwarm
    from swarm.checkpoint import TinyLlamaSpec, make_random_llama
    from swarm.petals_client import open_distributed_model

    model_dir = args.model or str(make_random_llama(Path("runs/bench-model"), TinyLlamaSpec(seed=0)))
    layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    half = layers // 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    gen = dict(max_new_tokens=args.tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    results = {}
    progress = tqdm(total=3, desc="setups")

    with LocalSwarm(model_dir) as swarm:
        swarm.add_server((0, half), num_handlers=1)
        swarm.add_server((half, layers), num_handlers=1)
        with open_distributed_model(model_dir, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix) as m:
            results["vanilla_petals"] = _median_ms_per_token(lambda: m.generate(ids, **gen).shape[1] - ids.shape[1],
                                                             args.tokens, args.repeats)
    progress.update()

    with LocalSwarm(model_dir) as swarm:
        orchestrator = swarm.add_orchestrator(expected_rate=1.0, max_length=256, expected_input_tokens=64,
                                              expected_output_tokens=args.tokens, refresh_s=0.5)
        url = orchestrator.info["url"]
        # budgets that fit half of the model with a few sessions each: the plan is one 2-server chain
        nodes = [swarm.add_node(node_id=f"n{i}", memory_gb=0.0012, wait=False, num_handlers=1) for i in range(2)]
        for node in nodes:
            swarm.wait_profiled(node)
        status = swarm.wait_chains_ready()
        chain = [c["spans"] for c in status["chains"]]
        body = {"prompt": prompt, "max_tokens": args.tokens, "temperature": 0}
        with httpx.Client(base_url=url, timeout=120) as http:
            def via_http():
                return http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"]
            results["chainswarm_http"] = _median_ms_per_token(via_http, args.tokens, args.repeats)
        progress.update()
        with DirectSwarmModel.from_pretrained(model_dir, orchestrator=url) as model:
            results["chainswarm_direct"] = _median_ms_per_token(
                lambda: model.generate(ids, **gen).shape[1] - ids.shape[1], args.tokens, args.repeats)
        progress.update()
    progress.close()

    base = results["vanilla_petals"]
    report = {"model": model_dir, "tokens": args.tokens, "repeats": args.repeats, "chains": chain,
              "ms_per_token": results, "ratio_to_vanilla": {k: v / base for k, v in results.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'setup':<20} {'ms/token':>9} {'x vanilla':>10}")
    for name, value in results.items():
        print(f"{name:<20} {value:9.1f} {value / base:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
