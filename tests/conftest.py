"""Shared fixtures: a tiny random Llama checkpoint and its local transformers reference."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `chainswarm orchestrator` keeps state in the user's state directory by default: the tests' own, never the user's
os.environ["CHAINSWARM_STATE"] = __import__("tempfile").mkdtemp(prefix="chainswarm-test-state-")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 4-block random Llama (hidden 64) with a trained BPE tokenizer, written once per test session."""
    from swarm.model.checkpoint import TinyLlamaSpec, make_random_llama

    return str(make_random_llama(tmp_path_factory.mktemp("models") / "tiny", TinyLlamaSpec(seed=1)))


@pytest.fixture(scope="session")
def reference_generate(tiny_model):
    """Greedy generation with the same checkpoint run locally in transformers (the ground truth)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()

    def generate(input_ids, max_new_tokens: int):
        with torch.inference_mode():
            return model.generate(
                input_ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )

    return generate


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct as a float32 checkpoint from the model cache (see tests/real_model.py)."""
    from real_model import smollm2_checkpoint

    return smollm2_checkpoint("float32")


# -- the browser tests (tests/test_browser.py): never a silent skip -------------------------------------------
def pytest_terminal_summary(terminalreporter):
    from browser import missing

    if not any(getattr(item, "get_closest_marker", lambda _: None)("browser")
               for item in getattr(terminalreporter.config, "_chainswarm_items", ())):
        return
    reason = missing()
    if reason:
        terminalreporter.write_sep("!", f"BROWSER TESTS NOT RUN: {reason}", red=True, bold=True)
    else:
        terminalreporter.write_line("browser tests ran in headless Chromium (tests/test_browser.py)", green=True)


def pytest_collection_modifyitems(config, items):
    config._chainswarm_items = list(items)
