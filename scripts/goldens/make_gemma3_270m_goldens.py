#!/usr/bin/env python3
"""Goldens for the real Gemma 3 270M, made by a CURRENT transformers (>= 4.50, Gemma3ForCausalLM, eager).

Run it in the goldens venv (scripts/goldens/make_gemma3_270m_goldens.sh does both steps):
    .venv/bin/python -m swarm.cli fetch-model gemma-3-270m          # the converted float32 checkpoint
    /tmp/chainswarm-goldens-venv/bin/python scripts/goldens/make_gemma3_270m_goldens.py [--model-dir DIR]

It loads the checkpoint folder that `chainswarm fetch-model gemma-3-270m` wrote (float32) and writes
tests/data/goldens/gemma3-270m/golden.json (no weights), float32, one thread, no KV cache:
  chats[]      3 short user messages rendered through the checkpoint's chat template (which starts with
               <bos>, so the rendered text is encoded without adding special tokens): prompt_ids,
               generated_ids (greedy, 24 new tokens, end-of-sequence ignored), margins (top-1 minus top-2
               logit at each step) and the decoded text
  perplexity   exp(mean next-token NLL) of tests/data/english_paragraph.txt (stripped) tokenized with the
               converted tokenizer (BOS added, as the tokenizer does by default); token_count includes the BOS
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import tokenizers
import transformers
from transformers import Gemma3ForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "goldens" / "gemma3-270m" / "golden.json"
PARAGRAPH = ROOT / "tests" / "data" / "english_paragraph.txt"
NEW_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colours.",
]


def cache_root() -> Path:  # the same rule as swarm.model.store.cache_root
    if os.environ.get("CHAINSWARM_CACHE"):
        return Path(os.environ["CHAINSWARM_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "chainswarm"
    return Path.home() / ".cache" / "chainswarm"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(cache_root() / "models" / "gemma-3-270m-float32"))
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"no checkpoint at {model_dir}: run `chainswarm fetch-model gemma-3-270m` first", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    info = json.loads((model_dir / "chainswarm_model.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"),
                                        chat_template=tok_config["chat_template"], bos_token="<bos>",
                                        eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    model = Gemma3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    config = model.config

    chats = []
    with torch.inference_mode():
        for question in QUESTIONS:
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True)
            prompt = tokenizer(text, add_special_tokens=False).input_ids
            ids, generated, margins = list(prompt), [], []
            for _ in range(NEW_TOKENS):  # no cache: one full forward per step
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                top = torch.topk(logits, 2)
                margins.append(float(top.values[0] - top.values[1]))
                generated.append(int(top.indices[0]))
                ids.append(generated[-1])
            chats.append({"question": question, "rendered": text, "prompt_ids": prompt, "generated_ids": generated,
                          "margins": margins, "min_margin": min(margins),
                          "text": tokenizer.decode(generated, skip_special_tokens=False)})
            print(f"[gemma3-270m] {question!r} -> {chats[-1]['text']!r} (min margin {min(margins):.3f})")

        paragraph = PARAGRAPH.read_text(encoding="utf-8").strip()
        ids = tokenizer(paragraph).input_ids
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss
        ppl = math.exp(float(loss))
        print(f"[gemma3-270m] perplexity {ppl:.4f} over {len(ids)} tokens")

    golden = {
        "model": "gemma-3-270m",
        "source_sha256": info.get("source_sha256"),
        "checkpoint_dtype": info.get("dtype"),
        "made_with": {"python": sys.version.split()[0], "torch": torch.__version__,
                      "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                      "class": "Gemma3ForCausalLM", "attn_implementation": "eager", "dtype": "float32",
                      "threads": 1},
        "config_seen": {"layer_types": list(config.layer_types), "sliding_window": config.sliding_window,
                        "query_pre_attn_scalar": config.query_pre_attn_scalar,
                        "rope_parameters": getattr(config, "rope_parameters", None)},
        "new_tokens": NEW_TOKENS,
        "chats": chats,
        "perplexity": {"text": "tests/data/english_paragraph.txt (stripped)", "bos_added": True,
                       "token_count": len(ids), "value": ppl},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"[gemma3-270m] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
