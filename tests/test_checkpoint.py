"""make-model writes a checkpoint that transformers and petals load from a local directory."""
import json
import subprocess
import sys

import pytest

from swarm.model.checkpoint import TinyLlamaSpec, dht_prefix_for


def test_tiny_model_loads_with_auto_classes(tiny_model):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 4, 64)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = "The orchestrator collects what every server can offer."
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text  # a real, lossless byte-level BPE
    assert len(ids) < len(text) / 2  # merges were learned from the bundled corpus
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert next(model.parameters()).dtype == torch.float32
    assert len(tokenizer) <= config.vocab_size


def test_cli_is_deterministic_for_a_seed(tmp_path):
    for name in ("a", "b"):
        result = subprocess.run(
            [sys.executable, "-m", "swarm.cli", "make-model", "--out", str(tmp_path / name), "--layers", "2",
             "--hidden", "32", "--heads", "2", "--vocab", "400", "--seed", "7"],
            capture_output=True, text=True, timeout=180,
        )
        assert result.returncode == 0, result.stderr
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_hidden_layers"] == 2


def test_cli_rejects_bad_shapes(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "make-model", "--out", str(tmp_path / "x"), "--hidden", "30",
         "--heads", "4"], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "not divisible" in result.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("bad", [dict(vocab=100), dict(layers=0), dict(heads=4, kv_heads=3)])
def test_spec_validation(bad):
    with pytest.raises(ValueError):
        TinyLlamaSpec(**bad)


def test_dht_prefix_is_stable(tmp_path):
    assert dht_prefix_for(tmp_path / "Llama-2-7b-hf") == "Llama-2-7b-hf-cs"
    assert dht_prefix_for(tmp_path / "a b.c") == "a-b-c-cs"
