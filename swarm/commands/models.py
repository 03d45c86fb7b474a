"""``chainswarm models``: list the converted checkpoints in the model cache (and the models that can be fetched)."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--known", action="store_true", help="also list the models fetch-model knows")


def run(args: argparse.Namespace) -> int:
    from swarm.model.store import cache_root, describe_known_models, list_cached_models

    cached = list_cached_models()
    if cached:
        rows = [("NAME", "DTYPE", "SIZE", "SOURCE SHA256", "PATH")] + [
            (m.name, m.dtype, f"{m.size_bytes / 1e6:.0f} MB", m.source_sha256[:12], str(m.path)) for m in cached]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for row in rows:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4])
    else:
        print(f"no models cached in {cache_root()}; fetch one with `chainswarm fetch-model NAME`")
    if args.known or not cached:
        print("known models:")
        for line in describe_known_models():
            print(f"  {line}")
    return 0
