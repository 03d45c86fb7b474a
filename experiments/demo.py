"""``chainswarm demo``: start a swarm on this machine, generate text through it, shut it down.

Uses a local checkpoint (``--model DIR``), or builds a tiny random Llama once under ``runs/demo-model``.
Prints the generated text, the time per token, and whether the swarm's tokens equal the same model run
locally in transformers.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

DEFAULT_PROMPT = "The orchestrator collects what every server can offer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local checkpoint directory (default: a tiny random Llama)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=32)
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


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from swarm.petals_client import open_distributed_model
    from server.local_swarm import LocalSwarm

    model_dir = _ensure_model(args)
    num_blocks = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    split = max(1, num_blocks // 2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    started = time.perf_counter()
    with LocalSwarm(model_dir) as swarm:
        print(f"[demo] DHT up at {swarm.initial_peers[0]}")
        for span in ((0, split), (split, num_blocks)):
            peer = swarm.add_server(span)
            print(f"[demo] {peer.name} ({peer.peer_id[-8:]}) serves blocks [{peer.start}, {peer.end})")
        print(f"[demo] swarm ready in {time.perf_counter() - started:.1f} s; generating {args.max_new_tokens} tokens")
        with open_distributed_model(model_dir, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix) as model:
            t0 = time.perf_counter()
            output = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
            elapsed = time.perf_counter() - t0
    reference = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).generate(
        input_ids, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    new_tokens = output[0, input_ids.shape[1]:]
    print("[demo] prompt:    " + args.prompt)
    print("[demo] generated: " + tokenizer.decode(new_tokens))
    print(f"[demo] {len(new_tokens)} tokens in {elapsed:.2f} s ({1000 * elapsed / len(new_tokens):.1f} ms/token)")
    same = torch.equal(output, reference)
    print(f"[demo] swarm output equals local transformers output: {'yes' if same else 'NO'}")
    return 0 if same else 1
