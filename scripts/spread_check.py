"""Honest spreads of a span's output between serving dtypes and devices: the data behind the spot checks'
tolerance (``swarm.trust.verification``).

A spot check re-executes one server's span of blocks on another server from the same input hidden states and
compares the two outputs per position by relative L2 distance ``‖y − y_ref‖ / ‖y_ref‖``. Two honest servers
differ by their arithmetic only (dtype, device, kernels); this script measures how much, on the real models'
own blocks with real inputs (a chat prompt's hidden states):

* ``--cpu``: every span length (1 … all blocks) on this machine's CPU in float32, bfloat16 and float16, each
  against CPU float32 — writes ``experiments/results/verification_spread.json``;
* ``--make-bundle DIR``: the first blocks of each real model (weights rounded to bfloat16, stored as such so
  the bundle fits the device tool's 64 MiB), one prompt's input hidden states and the CPU float32 reference
  outputs of those weights;
* ``--bundle DIR`` (on a CUDA machine, needs only torch + safetensors): the bundle's spans on CUDA in each
  dtype against the CPU float32 reference — writes ``$OUT/verification_spread_cuda.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.model.arch import arch_from_config  # noqa: E402
from swarm.model.block import DecoderBlock  # noqa: E402
from swarm.model.local_model import blocks_from_state  # noqa: E402

MODELS = {"smollm2-135m": "smollm2-135m-instruct-float32", "gemma3-270m": "gemma-3-270m-float32"}
BUNDLE_BLOCKS = {"smollm2-135m": 2, "gemma3-270m": 1}  # what fits the device tool's carry limit
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPT = ("You are a helpful assistant. Summarise the following paragraph in two sentences, then list three "
          "questions a careful reader would ask about it.\n\n")


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-position ‖out − ref‖ / ‖ref‖ (float32)."""
    out, ref = out.float().reshape(-1, ref.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    return (out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)


def summary(errors: torch.Tensor) -> dict:
    """Max / P99 / median; ``None`` where the output was not finite (Gemma 3 overflows float16)."""
    if not torch.isfinite(errors).all():
        return {"max": None, "p99": None, "median": None, "finite": False}
    return {"max": float(errors.max()), "p99": float(errors.quantile(0.99)), "median": float(errors.median()),
            "finite": True}


def build_blocks(cfg: dict, state: dict, indices: list[int], dtype: torch.dtype, device: str) -> list[DecoderBlock]:
    """Blocks ``indices`` from a whole checkpoint's ``state`` (``model.layers.<i>.*`` names)."""
    return [blocks_from_state(cfg, {k[len(f"model.layers.{i}."):]: v for k, v in state.items()
                                    if k.startswith(f"model.layers.{i}.")}, i, dtype, device) for i in indices]


@torch.inference_mode()
def run_span(blocks: list[DecoderBlock], hidden: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        hidden, _ = block.run(hidden)
    return hidden


def prompt_hidden(model_dir: Path, state: dict, cfg: dict) -> torch.Tensor:
    """The embedded prompt (chat paragraph), float32 ``(1, t, H)``."""
    from tokenizers import Tokenizer

    text = PROMPT + (ROOT / "tests" / "data" / "english_paragraph.txt").read_text()
    ids = torch.tensor([Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids])
    spec = arch_from_config(cfg)
    hidden = torch.nn.functional.embedding(ids, state["model.embed_tokens.weight"].float())
    return hidden * spec.embed_scale


def cpu_spreads(cache: Path) -> dict:
    from swarm.model.local_model import load_state_dict, read_config

    out = {}
    for name, folder in MODELS.items():
        model_dir = cache / folder
        cfg, state = read_config(model_dir), load_state_dict(model_dir)
        layers = cfg["num_hidden_layers"]
        hidden = prompt_hidden(model_dir, state, cfg)
        ref_blocks = build_blocks(cfg, state, list(range(layers)), torch.float32, "cpu")
        inputs = [hidden]  # the honest float32 input of every block
        for block in ref_blocks:
            inputs.append(run_span([block], inputs[-1]))
        rows = []
        for dtype_name, dtype in DTYPES.items():
            blocks = build_blocks(cfg, state, list(range(layers)), dtype, "cpu")
            for length in sorted({1, 2, 4, 8, layers // 2, layers}):
                starts = range(0, layers - length + 1, max(1, length))
                worst = None
                for start in starts:  # every disjoint span of this length: a server's span, from honest inputs
                    got = run_span(blocks[start:start + length], inputs[start].to(dtype))
                    errors = relative_errors(got, inputs[start + length])
                    worst = errors if worst is None else torch.maximum(worst[:errors.numel()], errors)
                rows.append({"dtype": dtype_name, "device": "cpu", "blocks": length, **summary(worst)})
                print(f"{name:13s} cpu {dtype_name:8s} span {length:2d}: max {rows[-1]['max']}")
        out[name] = {"tokens": int(hidden.shape[1]), "layers": layers, "spans": rows}
    return out


def make_bundle(cache: Path, bundle: Path) -> None:
    from safetensors.torch import save_file

    from swarm.model.local_model import load_state_dict, read_config

    bundle.mkdir(parents=True, exist_ok=True)
    for name, folder in MODELS.items():
        model_dir = cache / folder
        cfg, state = read_config(model_dir), load_state_dict(model_dir)
        n = BUNDLE_BLOCKS[name]
        kept = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()
                if any(k.startswith(f"model.layers.{i}.") for i in range(n))}
        hidden = prompt_hidden(model_dir, state, cfg)
        rounded = {k: v.float() for k, v in kept.items()}
        refs = {"input": hidden[0].contiguous()}
        for length in range(1, n + 1):
            refs[f"output.{length}"] = run_span(build_blocks(cfg, rounded, list(range(length)), torch.float32, "cpu"),
                                                hidden)[0].contiguous()
        save_file(kept, str(bundle / f"{name}.weights.safetensors"))
        save_file(refs, str(bundle / f"{name}.reference.safetensors"))
        (bundle / f"{name}.config.json").write_text(json.dumps({**cfg, "bundle_blocks": n}))
        print(f"{name}: {n} blocks, {hidden.shape[1]} tokens")


def bundle_spreads(bundle: Path, device: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in MODELS:
        cfg = json.loads((bundle / f"{name}.config.json").read_text())
        weights = {k: v.float() for k, v in load_file(str(bundle / f"{name}.weights.safetensors")).items()}
        refs = load_file(str(bundle / f"{name}.reference.safetensors"))
        n, rows = cfg["bundle_blocks"], []
        variants = list(DTYPES.items()) + ([("float32-tf32", torch.float32)] if device == "cuda" else [])
        for dtype_name, dtype in variants:  # tf32: float32 with TensorFloat-32 matmuls, a volunteer's possible setting
            torch.backends.cuda.matmul.allow_tf32 = dtype_name.endswith("tf32")
            torch.backends.cudnn.allow_tf32 = dtype_name.endswith("tf32")
            blocks = build_blocks(cfg, weights, list(range(n)), dtype, device)
            for length in range(1, n + 1):
                got = run_span(blocks[:length], refs["input"][None].to(device=device, dtype=dtype)).cpu()
                rows.append({"dtype": dtype_name, "device": device, "blocks": length,
                             **summary(relative_errors(got, refs[f"output.{length}"]))})
                print(f"{name:13s} {device} {dtype_name:8s} span {length}: max {rows[-1]['max']}")
        out[name] = {"tokens": int(refs["input"].shape[0]), "spans": rows}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "chainswarm" / "models")
    parser.add_argument("--cpu", action="store_true", help="measure every span length on this CPU")
    parser.add_argument("--make-bundle", type=Path, help="write the device bundle here")
    parser.add_argument("--bundle", type=Path, help="measure the bundle's spans on CUDA (or CPU without one)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.cpu:
        result = {"device": "cpu", "torch": torch.__version__, "models": cpu_spreads(args.cache)}
        path = ROOT / "experiments" / "results" / "verification_spread.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    if args.make_bundle:
        make_bundle(args.cache, args.make_bundle)
    if args.bundle:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
        result = {"device": name, "torch": torch.__version__, "models": bundle_spreads(args.bundle, device)}
        out = Path(os.environ.get("OUT", ".")) / "verification_spread_cuda.json"
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
