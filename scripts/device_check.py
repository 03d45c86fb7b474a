"""GPU check of Chainswarm's block code: the family goldens on CUDA in float32, float16 and bfloat16.

Run by ``scripts/device_check.sh`` on a machine with CUDA (only torch and safetensors are needed). For every
golden case under ``tests/data/goldens`` (made by a current transformers, ``scripts/goldens/``) it loads the
checkpoint with :class:`swarm.model.local_model.LocalModel` on the GPU and prints, per dtype:

* the largest per-block hidden-state error relative to the golden's scale,
* whether the greedy tokens equal the golden's up to the first step whose golden top-2 margin is below the
  dtype's rounding (random-weight models have near ties; past one, the continuation may legitimately differ),
* the batched path: a decode cohort + a prefill in one ``DecoderBlock.step`` against each sequence alone.

Then one Llama-3-8B-shaped block (random bf16 weights) times a batched decode step at 1, 8 and 32 sessions, and
both attention strategies (``swarm/model/attention.py``) on decode and verification steps.
Writes the numbers as JSON to ``$OUT/device_check.json`` when ``OUT`` is set. Exit status 1 if a float32 case
misses its golden.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.model.arch import ArchSpec, LayerSpec, RopeSpec  # noqa: E402
from swarm.model.attention import KERNELS, attention_for  # noqa: E402
from swarm.model.block import DecoderBlock, Segment  # noqa: E402
from swarm.model.local_model import LocalModel  # noqa: E402

GOLDENS = ROOT / "tests" / "data" / "goldens"
TIES = {torch.float32: 1e-3, torch.float16: 0.05, torch.bfloat16: 0.25}  # margins below these are near ties


def golden_cases() -> list[Path]:
    return sorted(p for p in GOLDENS.iterdir() if (p / "golden.safetensors").exists())


def tokens_agree(tokens: list[int], golden: list[int], margins: list[float], tie: float) -> tuple[bool, int]:
    """Equal up to the first near tie of the golden (returns the verdict and how many steps were compared)."""
    for i, (a, b) in enumerate(zip(tokens, golden)):
        if margins[i] < tie:
            return True, i
        if a != b:
            return False, i
    return True, len(golden)


def batched_vs_alone(model: LocalModel, ids: torch.Tensor) -> float:
    """Largest difference between a mixed step (3 decodes + 1 prefill) and each sequence run alone, block 0."""
    block, spec = model.layers[0], model.spec
    hidden = model.embed(ids[None])[0]
    caches, alone = [], []
    for n in (10, 14, 20):  # three sequences with different cached lengths, then one decode token each
        _, cache = block.run(hidden[None, :n])
        cap_k = hidden.new_zeros(1, spec.num_kv_heads, spec.head_dim, n + 1)
        cap_v = hidden.new_zeros(1, spec.num_kv_heads, n + 1, spec.head_dim)
        cap_k[..., :n], cap_v[:, :, :n] = cache
        caches.append((cap_k, cap_v, n))
        alone.append(block.run(hidden[None, n:n + 1], cache)[0][0])
    prefill_k = hidden.new_zeros(1, spec.num_kv_heads, spec.head_dim, 8)
    prefill_v = hidden.new_zeros(1, spec.num_kv_heads, 8, spec.head_dim)
    alone.append(block.run(hidden[None, :8])[0][0])
    segments = [Segment(k, v, n, 1, 1) for k, v, n in caches] + [Segment(prefill_k, prefill_v, 0, 1, 8)]
    rows = torch.cat([hidden[n:n + 1] for _, _, n in caches] + [hidden[:8]])
    mixed = block.step(rows, segments)
    return float((mixed - torch.cat(alone)).abs().max() / torch.cat(alone).abs().max())


def check_case(path: Path, dtype: torch.dtype, device: str) -> dict:
    from safetensors.torch import load_file

    golden = load_file(str(path / "golden.safetensors"))
    meta = json.loads((path / "golden.json").read_text())
    model = LocalModel.from_pretrained(path, dtype=dtype, device=device)
    ids = golden["prompt_ids"].to(device)
    with torch.inference_mode():
        states = model.hidden_states(ids)
        scale = max(float(golden[f"hidden.{i}"].abs().max()) for i in range(len(states)))
        hidden_err = max(float((s.float().cpu() - golden[f"hidden.{i}"]).abs().max()) for i, s in enumerate(states))
        tokens, _ = model.greedy(ids, len(golden["generated_ids"]))
        batched = batched_vs_alone(model, ids)
    ok, compared = tokens_agree(tokens, golden["generated_ids"].tolist(), golden["margins"].tolist(), TIES[dtype])
    return {"case": path.name, "family": meta.get("model_type", meta.get("family")), "dtype": str(dtype).split(".")[-1],
            "hidden_rel_err": hidden_err / scale, "tokens_agree": ok, "tokens_compared": compared,
            "batched_vs_alone_rel": batched}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_block(device: str, sessions: int, cached: int = 512, repeats: int = 20, positions: int = 1,
               attention: str | None = None) -> float:
    """ms per batched decode step of one Llama-3-8B-shaped block (bf16) with ``sessions`` sessions, each stepping
    ``positions`` new positions (1: a decode step; 1 + k: a speculative verification of k drafted tokens), with
    the device's attention strategy or the one named (swarm/model/attention.py)."""
    spec = ArchSpec(family="llama", model_type="llama", hidden_size=4096, intermediate_size=14336, num_layers=1,
                    num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
                    layers=(LayerSpec(window=None, rope=RopeSpec(theta=5e5, kind="llama3", factor=8.0,
                                                                 original_max=8192)),))
    block = DecoderBlock(spec, 0).to(device=device, dtype=torch.bfloat16)
    block.attention_kernel = attention_for(torch.device(device), attention)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    segments = [Segment(torch.randn(1, 8, 128, cached + positions, device=device, dtype=torch.bfloat16),
                        torch.randn(1, 8, cached + positions, 128, device=device, dtype=torch.bfloat16), cached, 1,
                        positions) for _ in range(sessions)]
    hidden = torch.randn(sessions * positions, 4096, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(3):
            block.step(hidden, segments)
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            block.step(hidden, segments)
        _sync(device)
    return (time.perf_counter() - start) / repeats * 1e3


def verification_steps(device: str) -> dict:
    """ms per step of the bf16 block at 1, 8 and 16 sessions when each session steps 1, 5 or 9 positions: what a
    speculative verification of 4 or 8 drafted tokens costs a GPU server over a plain decode step."""
    out = {}
    for sessions in (1, 8, 16):
        for positions in (1, 5, 9):
            out[f"{sessions}x{positions}"] = ms = time_block(device, sessions, positions=positions)
            print(f"llama-3-8b-shaped block, bf16, {sessions:2d} sessions x {positions} positions: {ms:.3f} ms/step")
    return out


def attention_timings(device: str) -> dict:
    """Both attention strategies on the same steps: decodes at 1, 8, 16 and 32 sessions (512 and 2,048 cached)
    and verifications of 4 and 8 drafts at 1, 8 and 16 (which one a CUDA server should use, measured)."""
    out = {}
    for name in KERNELS:
        rows = {f"{n}x1@{cached}": time_block(device, n, cached=cached, attention=name)
                for cached in (512, 2048) for n in (1, 8, 16, 32)}
        rows.update({f"{n}x{p}@512": time_block(device, n, positions=p, attention=name)
                     for n in (1, 8, 16) for p in (5, 9)})
        out[name] = rows
        print(f"attention {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in rows.items()) + " (ms per block step)")
    return out


def ends_check(device: str) -> dict:
    """The chain's ends on this device (server/ends.py): the embeddings and head of random llama and Gemma 3
    checkpoints against the whole-model reference in each dtype, and the LM head of a Llama-3-8B shape (4,096 x
    128,256) timed at 1 and 16 rows — a tail server's new per-token cost beside its blocks."""
    import tempfile

    from server.ends import ChainEnds
    from swarm.model.checkpoint import TinyModelSpec, make_random_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("llama", "gemma3"):
            model_dir = make_random_model(Path(tmp) / family, TinyModelSpec(seed=3, family=family))
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                reference = LocalModel.from_pretrained(model_dir, dtype=dtype, device=device)
                ends = ChainEnds(model_dir, first=True, last=True, dtype=dtype, device=device)
                ids = torch.tensor([[1, 5, 9, 33]])
                with torch.inference_mode():
                    embedded = ends.embed(ids).to(device)
                    same_embed = bool(torch.equal(embedded, reference.embed(ids.to(device))))
                    hidden = torch.randn(6, ends.hidden_size, device=device, dtype=dtype)
                    mine, theirs = ends.logits(hidden), reference.logits(hidden).float()
                    rel = float((mine - theirs).norm() / theirs.norm())
                rows.append({"family": family, "dtype": str(dtype).replace("torch.", ""), "embed_equal": same_embed,
                             "logits_rel_err": rel})
                print(f"ends {family:7s} {rows[-1]['dtype']:9s} embeddings {'equal' if same_embed else 'DIFFER'}  "
                      f"logits rel err {rel:.2e}")
    head_ms = {}
    if device == "cuda":
        weight = torch.randn(128256, 4096, device=device, dtype=torch.bfloat16)
        for n in (1, 16):
            hidden = torch.randn(n, 4096, device=device, dtype=torch.bfloat16)
            for _ in range(3):
                torch.nn.functional.linear(hidden, weight)
            _sync(device)
            began = time.perf_counter()
            for _ in range(20):
                torch.nn.functional.linear(hidden, weight).float()
            _sync(device)
            head_ms[n] = (time.perf_counter() - began) / 20 * 1e3
            print(f"llama-3-8b-shaped LM head, bf16, {n:2d} rows: {head_ms[n]:.3f} ms")
    return {"cases": rows, "llama3_8b_head_ms": head_ms}


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}")
    if "--verification-steps" in sys.argv:  # only the speculative-decoding timing (experiments/results/device_*.json)
        steps = verification_steps(device)
        by_attention = attention_timings(device) if device == "cuda" else {}
        out = os.environ.get("OUT")
        if out:
            Path(out, "device_verification_steps.json").write_text(json.dumps(
                {"device": name, "torch": torch.__version__, "cached": 512, "verify_step_ms": steps,
                 "attention": attention_for(torch.device(device)).name, "by_attention_ms": by_attention}, indent=1))
        return 0
    rows, failed = [], False
    for path in golden_cases():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            row = check_case(path, dtype, device)
            rows.append(row)
            if dtype == torch.float32 and (row["hidden_rel_err"] > 1e-4 or not row["tokens_agree"]):
                failed = True
            print(f"{row['case']:14s} {row['dtype']:9s} hidden rel err {row['hidden_rel_err']:.2e}  tokens "
                  f"{'agree' if row['tokens_agree'] else 'DIFFER'} ({row['tokens_compared']} compared)  "
                  f"batched vs alone {row['batched_vs_alone_rel']:.2e}")
    timings, by_attention = {}, {}
    if device == "cuda":
        for sessions in (1, 8, 32):
            timings[sessions] = time_block(device, sessions)
            print(f"llama-3-8b-shaped block, bf16, {sessions:2d} sessions x 512 cached: {timings[sessions]:.3f} ms/step")
        by_attention = attention_timings(device)
    ends = ends_check(device)
    failed = failed or not all(r["embed_equal"] and (r["dtype"] != "float32" or r["logits_rel_err"] < 1e-5)
                               for r in ends["cases"])
    out = os.environ.get("OUT")
    if out:
        Path(out, "device_check.json").write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "goldens": rows, "block_step_ms": timings, "ends": ends,
             "attention": attention_for(torch.device(device)).name, "by_attention_ms": by_attention}, indent=1))
    print("FAILED" if failed else "all float32 cases match their goldens")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
