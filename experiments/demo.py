"""``chainswarm demo``: an orchestrated swarm on this machine, end to end.

1. builds a tiny random Llama once under ``runs/demo-model`` (or uses ``--model DIR``);
2. starts a DHT, the orchestrator and four server nodes with unequal memory budgets, so the planner
   (GBP-CR + GCA) composes chains of different speeds, and prints the plan;
3. generates through the client library (a completion and a stream) and checks the text against the same
   model run locally in transformers;
4. sends a burst of concurrent requests from two clients to show JFFC filling the fastest chain first,
   the central queue and per-client fairness;
5. shuts everything down.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import time
from pathlib import Path

DEFAULT_PROMPT = "The orchestrator collects what every server can offer"
# Memory budgets as multiples of "the whole model plus one session's KV cache": one server can host the
# whole model with a few sessions, two can only host it together, one is too small to matter much.
BUDGET_FACTORS = (1.85, 0.92, 0.92, 0.69)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local checkpoint directory (default: a tiny random Llama)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=256, help="tokens per session (default 256)")
    parser.add_argument("--burst", type=int, default=10, help="concurrent requests in the burst (default 10)")
    parser.add_argument("--workdir", default="runs", help="where the demo keeps its model (default runs/)")


def _ensure_model(args) -> str:
    if args.model:
        return args.model
    from swarm.checkpoint import TinyLlamaSpec, make_random_llama

    path = Path(args.workdir) / "demo-model"
    if not (path / "config.json").exists():
        print(f"[demo] writing a tiny random Llama checkpoint to {path}")
        make_random_llama(path, TinyLlamaSpec(layers=4, hidden=64, heads=4, seed=0))
    return str(path)


def _budgets_gb(model_dir: str, max_length: int) -> list[float]:
    from swarm.compat import petals
    import torch
    from petals.server.block_utils import get_block_size

    from server.profiling import cache_bytes_per_token

    config = petals.AutoDistributedConfig.from_pretrained(model_dir)
    block = get_block_size(config, "memory", dtype=torch.float32)
    per_token = cache_bytes_per_token(config, torch.float32)
    whole = config.num_hidden_layers * (block + per_token * max_length)
    return [round(factor * whole / 1e9, 6) for factor in BUDGET_FACTORS]


def _print_plan(status: dict) -> None:
    plan = status["plan"]
    print(f"[demo] plan {plan['plan_id']}: c = {plan['c']} ({plan['tuning']}), total capacity "
          f"{plan['total_capacity']} sessions, Theorem 3.7 bounds {plan['bounds']}")
    for s in plan["servers"]:
        blocks = "no blocks" if s["start"] is None else f"blocks [{s['start']}, {s['end']})"
        print(f"[demo]   server {s['id']:<6} {blocks:<16} KV slots allocated {s['slots_allocated']}")
    for i, c in enumerate(status["chains"]):
        hops = " -> ".join(f"{n}[{a},{b})" for n, (a, b) in zip(c["servers"], c["spans"]))
        print(f"[demo]   chain {i}: {hops:<32} capacity {c['capacity']}  mean service time "
              f"{c['service_time']:.3f} s")


def run(args: argparse.Namespace) -> int:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from client import SwarmClient
    from server.local_swarm import LocalSwarm, SwarmStartError

    model_dir = _ensure_model(args)
    budgets = _budgets_gb(model_dir, args.max_length)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    reference_model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        out = reference_model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    reference = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    started = time.perf_counter()
    with LocalSwarm(model_dir) as swarm:
        orchestrator = swarm.add_orchestrator(policy="dlpm", expected_rate=4.0, max_length=args.max_length,
                                              expected_input_tokens=args.max_length / 2, expected_output_tokens=28,
                                              refresh_s=0.5)
        url = orchestrator.info["url"]
        print(f"[demo] orchestrator at {url} (status page {url}/, API docs {url}/docs)")
        nodes = [swarm.add_node(node_id=f"node{i}", memory_gb=gb, wait=False) for i, gb in enumerate(budgets)]
        for node, gb in zip(nodes, budgets):
            swarm.wait_profiled(node)
            print(f"[demo] {node.name} joined with a {gb * 1e3:.2f} MB memory budget")
        try:
            status = swarm.wait_chains_ready(timeout=180)
        except SwarmStartError as exc:
            print(f"[demo] the swarm did not become ready: {exc}")
            return 1
        print(f"[demo] swarm ready in {time.perf_counter() - started:.1f} s")
        _print_plan(status)

        with SwarmClient(url, client_id="demo") as client:
            t0 = time.perf_counter()
            result = client.generate(args.prompt, args.max_new_tokens, temperature=0)
            elapsed = time.perf_counter() - t0
            print(f"[demo] prompt:    {args.prompt}")
            print(f"[demo] generated: {result.text}")
            print(f"[demo] {result.completion_tokens} tokens in {elapsed:.2f} s "
                  f"({1000 * elapsed / max(1, result.completion_tokens):.1f} ms/token) on chain {result.chain_id}")
            streamed = "".join(client.stream(args.prompt, args.max_new_tokens, temperature=0))
        same = result.text == reference and streamed == reference
        print(f"[demo] completion and stream equal local transformers output: {'yes' if same else 'NO'}")

        def one(i: int):
            who = "heavy" if i % 3 else "light"
            with SwarmClient(url, client_id=who) as c:
                r = c.generate(f"request {i}: {args.prompt}", 16, temperature=0)
            return who, r

        print(f"[demo] burst of {args.burst} concurrent requests from clients 'heavy' and 'light':")
        with cf.ThreadPoolExecutor(args.burst) as pool:
            results = list(pool.map(one, range(args.burst)))
        chain_index = {c["id"]: i for i, c in enumerate(status["chains"])}
        for who, r in sorted(results, key=lambda x: x[1].waiting_s):
            print(f"[demo]   {who:<5} chain {chain_index.get(r.chain_id, '?')}  waited {r.waiting_s:5.2f} s  "
                  f"served in {r.service_s:5.2f} s")
        final = httpx.get(f"{url}/v1/swarm").json()
        service = {c: round(v["service"]) for c, v in final["clients"].items()}
        print(f"[demo] service received per client (cost units: input + 2 x output tokens): {service}")
    print("[demo] swarm stopped")
    return 0 if same else 1
