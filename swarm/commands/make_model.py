"""``chainswarm make-model``: write a random Llama checkpoint with a real tokenizer (no hub needed)."""
from __future__ import annotations

import argparse
import sys



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads for GQA (default = heads)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    parser.add_argument("--max-length", type=int, default=1024, help="max positions (default 1024)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")


def run(args: argparse.Namespace) -> int:
    from swarm.model.checkpoint import TinyLlamaSpec, make_random_llama

    try:
        spec = TinyLlamaSpec(
            layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
            vocab=args.vocab, max_length=args.max_length, seed=args.seed,
        )
    except ValueError as exc:
        print(f"chainswarm make-model: error: {exc}", file=sys.stderr)
        return 2
    out = make_random_llama(args.out, spec)
    print(f"wrote a random Llama checkpoint ({spec.layers} blocks, hidden {spec.hidden}) to {out}")
    return 0
