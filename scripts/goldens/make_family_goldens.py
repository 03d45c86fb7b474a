#!/usr/bin/env python3
"""Build golden references for the plain-torch transformer blocks.

Run it with a CURRENT transformers (>= 4.50), not the project's .venv (which pins 4.34.1):
    bash scripts/goldens/make_family_goldens.sh

For every case it builds a tiny random-weight checkpoint from a config (no hub access needed),
saves it the way the installed transformers writes it (config.json + model.safetensors), and records,
in float32 with eager attention:
  hidden.0           [T, hidden]  input to decoder layer 0 (embeddings, after any embedding scale)
  hidden.{i+1}       [T, hidden]  output of decoder layer i (before the final norm)
  logits             [T, vocab]   logits of the prompt (one forward pass, no cache)
  prompt_ids         [T]          int64
  generated_ids      [N]          int64, greedy, KV cache, N = 16
  step_logits        [N, vocab]   raw logits of each generation step (before any logits processor)
  margins            [N]          top1 - top2 of each step's logits
  inv_freq*          rotary inverse frequencies in force after the prompt forward
It also writes a small byte-level BPE tokenizer golden (tokenizer_pairs/).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

import safetensors
import tokenizers
import transformers
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

PROMPT_LEN = 24
NEW_TOKENS = 16
VOCAB = 512
# Ids the prompt never uses (pad/bos/eos-ish ids of every config below live in 0..7).
FIRST_PROMPT_ID = 8
WEIGHT_STD = 0.15
BIAS_STD = 0.1
NORM_STD = 0.1

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "data" / "goldens"

# Special ids: none of them is ever emitted on purpose; eos is disabled for generation anyway.
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    **SPECIAL,
)


def llama3_config():
    return LlamaConfig(
        **COMMON,
        head_dim=16,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # 64 (not 16) so all three llama3 regimes appear with head_dim 16 / theta 5e5: wavelength 2*pi
            # < 64/4 stays, 32.6 lies in the smoothed band [16, 64], the other six are divided by 8.
            "original_max_position_embeddings": 64,
        },
    )


def llama_linear_config():
    return LlamaConfig(
        **COMMON,
        head_dim=16,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    )


def llama_dynamic_config():
    kw = dict(COMMON, max_position_embeddings=16)
    return LlamaConfig(
        **kw,
        head_dim=16,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )


def mistral_config():
    return MistralConfig(
        **COMMON,
        head_dim=16,
        sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def qwen2_config():
    return Qwen2Config(
        **COMMON,
        use_sliding_window=False,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def qwen3_config():
    return Qwen3Config(
        **COMMON,
        head_dim=32,
        use_sliding_window=False,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


GEMMA_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def gemma3_config(scaled: bool):
    kw = dict(COMMON, num_hidden_layers=6)
    full = {"rope_type": "default", "rope_theta": 1000000.0}
    if scaled:
        full = {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}
    return Gemma3TextConfig(
        **kw,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=list(GEMMA_LAYER_TYPES),
        sliding_window_pattern=3,  # only kept as "_sliding_window_pattern"; layer_types is what the model uses
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )


# name -> (config factory, weight seed, one-line description)
CASES = {
    "llama3": (
        llama3_config,
        1001,
        "Llama: GQA 4q/2kv heads, explicit head_dim 16, rope_theta 5e5 with llama3 rope scaling "
        "(factor 8, low 1, high 4, original_max_position_embeddings 64: one unscaled, one smoothed and six scaled frequencies), tied embeddings",
    ),
    "llama-linear": (
        llama_linear_config,
        1002,
        "Llama: GQA, head_dim 16, rope_theta 1e4 with linear rope scaling factor 2 (positions / 2), untied",
    ),
    "llama-dynamic": (
        llama_dynamic_config,
        1003,
        "Llama: GQA, head_dim 16, dynamic NTK rope scaling factor 2 with max_position_embeddings 16 "
        "(prompt 24 + 16 new tokens exceed it), untied",
    ),
    "mistral": (
        mistral_config,
        1004,
        "Mistral: GQA, head_dim 16, sliding_window 8 on every layer (shorter than the 24-token prompt), "
        "rope_theta 1e6, untied",
    ),
    "qwen2": (
        qwen2_config,
        1005,
        "Qwen2: q/k/v projection biases, GQA, head_dim 16 (derived), no sliding window, rope_theta 1e6, untied",
    ),
    "qwen3": (
        qwen3_config,
        1006,
        "Qwen3: per-head RMSNorm on q and k (q_norm/k_norm), head_dim 32 with hidden 64 and 4 heads "
        "(heads*head_dim=128 != hidden), GQA 2 kv heads, no biases, untied",
    ),
    "gemma3": (
        lambda: gemma3_config(scaled=False),
        2007,
        "Gemma3 text: 6 layers [local,local,global]x2 via layer_types, sliding_window 8 on local layers, "
        "rope_theta 1e6 global / 1e4 local, head_dim 32, query_pre_attn_scalar 24, GELU-tanh MLP, "
        "(1+w) RMSNorms incl. q/k norms, pre+post attention/FFN norms, embeddings * sqrt(hidden), GQA, tied",
    ),
    "gemma3-scaled": (
        lambda: gemma3_config(scaled=True),
        2007,
        "Gemma3 text as 'gemma3' (same weights and prompt) but with linear rope scaling factor 4 on the global (full_attention) layers "
        "only, as Gemma 3 4B+ ships",
    ),
}

DYNAMIC_NOTE = (
    "Dynamic NTK as transformers {v} applies it: the rotary module starts with inv_freq for "
    "max_position_embeddings (=16, i.e. plain rope_theta). On every forward it takes seq_len = max(position_ids)+1; "
    "if seq_len exceeds the largest seq_len seen so far (initially 16) it recomputes inv_freq with "
    "base = rope_theta * ((factor*seq_len/max_position_embeddings) - (factor-1)) ** (dim/(dim-2)) and uses it "
    "for ALL positions of that forward. Keys already in the KV cache are NOT re-rotated. So: the prompt forward "
    "(positions 0..23) uses seq_len 24; generation step k (k=0..15) is: step 0 = prefill of the prompt with "
    "seq_len 24 (same as 'logits'), step k>=1 feeds the token at position 23+k with inv_freq computed for "
    "seq_len 24+k, attending to cached keys rotated with the older inv_freqs. (If seq_len drops below 16 "
    "after having grown, inv_freq resets to the original.) The state is per model instance, so goldens were "
    "computed on freshly loaded models: 'logits' and the hidden states on one, generation on another."
)


def reinit_weights(model: torch.nn.Module, seed: int, embed_std: float = WEIGHT_STD) -> None:
    """Overwrite every parameter with seeded values large enough that logits are far from tied."""
    gen = torch.Generator().manual_seed(seed)
    done = set()
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                if id(p) in done:  # tied weights: initialize once
                    continue
                done.add(id(p))
                cls = type(module).__name__
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                if "Norm" in cls:
                    if "Gemma" in cls:  # Gemma RMSNorm computes x * (1 + w): neutral value 0
                        p.copy_(NORM_STD * noise)
                    else:  # x * w: neutral value 1
                        p.copy_(1.0 + NORM_STD * noise)
                elif p_name == "bias":
                    p.copy_(BIAS_STD * noise)
                elif isinstance(module, torch.nn.Embedding):
                    p.copy_(embed_std * noise)
                elif isinstance(module, torch.nn.Linear):
                    p.copy_(WEIGHT_STD * noise)
                else:
                    raise RuntimeError(f"unexpected parameter {mod_name}.{p_name} in {cls}")


def prompt_ids_for(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PROMPT_ID, VOCAB, (PROMPT_LEN,), generator=gen, dtype=torch.int64)


def load(case_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(
        case_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model


def rotary_buffers(model) -> dict[str, torch.Tensor]:
    rot = model.model.rotary_emb
    out = {}
    for name, buf in rot.named_buffers(recurse=False):
        if name.endswith("inv_freq") and "original" not in name:
            key = "inv_freq" if name == "inv_freq" else "inv_freq." + name[: -len("_inv_freq")]
            out[key] = buf.detach().float().clone()
    return out


def forward_with_hooks(model, prompt: torch.Tensor):
    layers = model.model.layers
    captured: dict[str, torch.Tensor] = {}

    def pre_hook(module, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        captured["hidden.0"] = hs.detach()[0].clone()

    def make_hook(i):
        def hook(module, args, output):
            hs = output[0] if isinstance(output, (tuple, list)) else output
            captured[f"hidden.{i + 1}"] = hs.detach()[0].clone()

        return hook

    handles = [layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True)]
    handles += [layer.register_forward_hook(make_hook(i)) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            out = model(input_ids=prompt[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    captured["logits"] = out.logits.detach()[0].float().clone()
    captured.update(rotary_buffers(model))
    return captured


def generate(model, prompt: torch.Tensor):
    gc = model.generation_config
    gc.eos_token_id = None  # never stop early; 16 tokens exactly
    gc.pad_token_id = SPECIAL["pad_token_id"]
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt[None],
            attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.int64),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            use_cache=True,
            output_logits=True,
            output_scores=True,
            return_dict_in_generate=True,
            generation_config=gc,
        )
    generated = out.sequences[0, PROMPT_LEN:].clone()
    step_logits = torch.stack([s[0] for s in out.logits]).float()
    return generated, step_logits


def margins_of(step_logits: torch.Tensor) -> torch.Tensor:
    top2 = step_logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def build_case(name: str, out_root: Path) -> dict:
    factory, seed, description = CASES[name]
    config = factory()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    # Gemma multiplies embeddings by sqrt(hidden) = 8: with the common std the (tied) embedding dominates the
    # residual stream and greedy decoding locks onto one token, so its table gets std / sqrt(hidden): the
    # scaled embeddings then have the same std as every other family's.
    if config.model_type.startswith("gemma"):
        embed_std = WEIGHT_STD / math.sqrt(config.hidden_size)
    else:
        embed_std = WEIGHT_STD
    reinit_weights(model, seed, embed_std)
    model.eval()

    case_dir = out_root / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    model.save_pretrained(case_dir, safe_serialization=True)
    for extra in case_dir.iterdir():  # keep exactly config.json + model.safetensors (+ golden files)
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()
    del model

    prompt = prompt_ids_for(seed + 500)

    # Two independent runs on freshly loaded models: the second measures run-to-run drift.
    runs = []
    for _ in range(2):
        fwd = forward_with_hooks(load(case_dir), prompt)
        gen_ids, step_logits = generate(load(case_dir), prompt)
        runs.append((fwd, gen_ids, step_logits))
    fwd, gen_ids, step_logits = runs[0]
    fwd2, gen_ids2, step_logits2 = runs[1]
    assert torch.equal(gen_ids, gen_ids2), "greedy output differs between two runs"
    drift = {
        k: float((fwd[k] - fwd2[k]).abs().max()) for k in fwd if k.startswith("hidden") or k == "logits"
    }
    drift["step_logits"] = float((step_logits - step_logits2).abs().max())

    # One no-cache forward over prompt + generated[:-1] on a fresh model: equals step_logits up to float noise
    # for every case except llama-dynamic, where cached keys keep the rotation they were written with.
    refeed = torch.cat([prompt, gen_ids[:-1]])
    with torch.no_grad():
        refeed_logits = load(case_dir)(input_ids=refeed[None], use_cache=False).logits[0, PROMPT_LEN - 1 :]
    refeed_diff = float((refeed_logits - step_logits).abs().max())

    n_hidden = len([k for k in fwd if k.startswith("hidden.")])
    assert n_hidden == config.num_hidden_layers + 1
    margins = margins_of(step_logits)
    prefill_vs_logits = float((step_logits[0] - fwd["logits"][-1]).abs().max())
    # Greedy consistency: each generated token is the argmax of its step's logits.
    assert torch.equal(step_logits.argmax(-1), gen_ids)

    tensors = {k: v.contiguous() for k, v in fwd.items()}
    tensors["prompt_ids"] = prompt.clone()
    tensors["generated_ids"] = gen_ids.to(torch.int64).contiguous()
    tensors["step_logits"] = step_logits.contiguous()
    tensors["margins"] = margins.contiguous()
    save_file(tensors, str(case_dir / "golden.safetensors"), metadata={"case": name})

    cfg_json = json.loads((case_dir / "config.json").read_text())
    info = {
        "case": name,
        "model_type": cfg_json.get("model_type"),
        "architectures": cfg_json.get("architectures"),
        "description": description,
        "weight_seed": seed,
        "weight_init": {
            "linear_std": WEIGHT_STD,
            "embedding_std": embed_std,
            "bias_std": BIAS_STD,
            "norm": f"w = 1 + {NORM_STD}*randn for x*w RMSNorms; w = {NORM_STD}*randn for Gemma's x*(1+w) RMSNorms",
        },
        "prompt_seed": seed + 500,
        "prompt_ids": prompt.tolist(),
        "generated_ids": gen_ids.tolist(),
        "distinct_generated": len(set(gen_ids.tolist())),
        "margins": [round(float(m), 6) for m in margins],
        "min_margin": float(margins.min()),
        "prompt_logit_margin_min": float(margins_of(fwd["logits"]).min()),
        "dtype": "float32",
        "attn_implementation": "eager",
        "generation": "greedy, KV cache, 16 new tokens, eos disabled; step_logits are the raw logits "
        "(generate(output_logits=True)), step_logits[0] is the prefill's last position",
        "prefill_step0_vs_prompt_logits_last_maxabs": prefill_vs_logits,
        "nocache_refeed_vs_step_logits_maxabs": refeed_diff,
        "tolerances_observed": {
            "two_fresh_runs_maxabs": drift,
            "note": "max |difference| between two independent loads+runs on the same machine/threads",
        },
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in tensors.items()},
        "hidden_states": "hidden.0 = input to layer 0 (embeddings incl. any embedding scale); hidden.{i+1} = "
        "output of model.model.layers[i] (residual stream, before the final norm)",
        "versions": versions(),
    }
    if name == "llama-dynamic":
        info["dynamic_rope_note"] = DYNAMIC_NOTE.format(v=transformers.__version__)
    if cfg_json.get("model_type", "").startswith("gemma"):
        info["layer_types"] = cfg_json.get("layer_types")
        info["embed_scale"] = (
            f"embeddings * torch.tensor(hidden_size**0.5) (a float32 buffer = {math.sqrt(config.hidden_size)}), "
            "cast to the weight dtype before multiplying"
        )
    (case_dir / "golden.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def versions() -> dict:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }


# ---------------------------------------------------------------- tokenizer golden

TOKENIZER_TEXT = """\
The swarm is a loose federation of machines that each hold a few consecutive blocks of a language model.
A client sends hidden states from one server to the next, and the last server returns them for sampling.
When a server leaves, the client finds another route through the remaining peers and replays its cache.
Latency matters more than throughput for a single chat session, but batching many sessions raises both.
Numbers appear too: 12 layers, 4096 hidden units, 32 heads, 128 tokens per second, version 3.14 and 2025.
Unicode text like café, naïve, Zürich, 東京, and emoji such as 🚀 should survive a round trip unchanged.
   Leading spaces, double  spaces, tabs\tand newlines
are all kept by a byte-level tokenizer, which never needs an unknown token.
Every peer announces the blocks it serves, its throughput, and how much memory is still free on its GPU.
Load balancing picks the servers with the best ratio of speed to queue length, and re-plans on failure.
"""

TOKENIZER_SAMPLES = [
    "Hello, swarm! The client sends hidden states to the next server.",
    "  two leading spaces and trailing  ",
    "Digits: 0 7 42 1234567 3.14159 and 2025-06-01",
    "Unicode: café naïve Zürich 東京 🚀 ñ",
    "tabs\tand\nnewlines\n\nmixed  with   spaces",
]


def build_tokenizer(out_root: Path) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TOKENIZER_TEXT] * 3, trainer=trainer)

    tdir = out_root / "tokenizer_pairs"
    if tdir.exists():
        shutil.rmtree(tdir)
    tdir.mkdir(parents=True)
    tok.save(str(tdir / "tokenizer.json"))

    reloaded = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    pairs = []
    for s in TOKENIZER_SAMPLES:
        enc = reloaded.encode(s)
        assert enc.ids == tok.encode(s).ids
        decoded = reloaded.decode(enc.ids)
        pairs.append({"text": s, "ids": enc.ids, "tokens": enc.tokens, "decoded": decoded, "roundtrip": decoded == s})
    saved = json.loads((tdir / "tokenizer.json").read_text())
    merges = saved["model"]["merges"]
    info = {
        "description": "Byte-level BPE trained with the tokenizers library on the fixed text in "
        "scripts/goldens/make_family_goldens.py (ByteLevel pre-tokenizer add_prefix_space=False, "
        "ByteLevel decoder and post-processor, one special token <|endoftext|>)",
        "vocab_size": reloaded.get_vocab_size(),
        "num_merges": len(merges),
        "merges_format": "list of [a, b] pairs" if merges and isinstance(merges[0], list) else "'a b' strings",
        "samples": pairs,
        "versions": versions(),
    }
    (tdir / "golden.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n")
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--skip-tokenizer", action="store_true")
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(int(os.environ.get("GOLDENS_THREADS", "1")))
    print("versions:", json.dumps(versions()))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in args.cases:
        info = build_case(name, args.out)
        summary[name] = info
        print(
            f"{name:14s} model_type={info['model_type']:12s} min_margin={info['min_margin']:.4f} "
            f"distinct={info['distinct_generated']:2d} gen={info['generated_ids']} "
            f"drift={max(info['tolerances_observed']['two_fresh_runs_maxabs'].values()):.2e} "
            f"prefill_vs_logits={info['prefill_step0_vs_prompt_logits_last_maxabs']:.2e} "
            f"refeed_vs_cache={info['nocache_refeed_vs_step_logits_maxabs']:.2e}"
        )
        if info["min_margin"] <= 1e-3 or info["distinct_generated"] < 2:
            print(f"WARNING: {name}: weak golden (min margin {info['min_margin']}, "
                  f"{info['distinct_generated']} distinct tokens)", file=sys.stderr)
    if not args.skip_tokenizer:
        tinfo = build_tokenizer(args.out)
        print(f"tokenizer_pairs vocab={tinfo['vocab_size']} merges={tinfo['num_merges']} ({tinfo['merges_format']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
