"""``chainswarm make-model``: write a random checkpoint of a supported family with a real tokenizer (no hub needed)."""
from __future__ import annotations

import argparse
import sys

from swarm.model.checkpoint import FAMILY_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--family", choices=FAMILY_NAMES, default="llama",
                        help="model family (default llama; the others are written in a current transformers' "
                             "config format and built from Chainswarm's block code)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads for GQA (default = heads)")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="dimension of a head (default hidden / heads; not for llama)")
    parser.add_argument("--window", type=int, default=None,
                        help="sliding window in tokens (mistral, qwen2, qwen3: every layer; gemma3: its local "
                             "layers, default max-length / 4)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    parser.add_argument("--max-length", type=int, default=1024, help="max positions (default 1024)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")


def run(args: argparse.Namespace) -> int:
    from swarm.model.checkpoint import TinyModelSpec, make_random_model

    try:
        spec = TinyModelSpec(
            family=args.family, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
            head_dim=args.head_dim, window=args.window, vocab=args.vocab, max_length=args.max_length,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"chainswarm make-model: error: {exc}", file=sys.stderr)
        return 2
    out = make_random_model(args.out, spec)
    print(f"wrote a random {spec.family} checkpoint ({spec.layers} blocks, hidden {spec.hidden}) to {out}")
    return 0
