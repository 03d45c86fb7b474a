"""``chainswarm convert-gguf``: turn a GGUF file (llama.cpp's format; llama/Mistral, qwen2, qwen3, gemma3) into a
checkpoint folder that Chainswarm's LocalModel, petals and transformers load."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE.gguf", help="a GGUF file of a supported architecture (llama for Llama 1/2/3.x and Mistral, qwen2, qwen3, gemma3; F32/F16/Q8_0/Q4_x/K-quants)")
    parser.add_argument("--out", required=True, help="output checkpoint directory (created if needed)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                        help="dtype of the written weights (default float32)")


def run(args: argparse.Namespace) -> int:
    from swarm.model.gguf import GGUFConversionError, convert_gguf

    try:
        result = convert_gguf(args.file, args.out, args.dtype)
    except GGUFConversionError as exc:
        print(f"chainswarm convert-gguf: error: {exc}", file=sys.stderr)
        return 2
    s = result.shape
    types = ", ".join(f"{n} {k}" for k, n in result.tensor_types.items())
    print(f"converted {args.file} ({s.arch} -> {s.model_type}, {s.layers} blocks, hidden {s.hidden}, {s.heads} heads / {s.kv_heads} kv, "
          f"vocab {s.vocab}, {result.parameters:,} parameters; tensors {types}) to {result.path} "
          f"as {result.dtype} in {result.seconds:.1f} s")
    return 0
