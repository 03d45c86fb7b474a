"""make-model writes a checkpoint of any supported family that transformers, petals and the block code load from a
local directory."""
import json
import logging

import pytest

from swarm.model.checkpoint import TinyModelSpec, dht_prefix_for


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
    from swarm.cli import main

    for name in ("a", "b"):
        assert main(["make-model", "--out", str(tmp_path / name), "--layers", "2", "--hidden", "32", "--heads", "2",
                     "--vocab", "400", "--seed", "7"]) == 0
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_hidden_layers"] == 2


def test_cli_rejects_bad_shapes(tmp_path, capsys):
    from swarm.cli import main

    assert main(["make-model", "--out", str(tmp_path / "x"), "--hidden", "30", "--heads", "4"]) == 2
    assert "not divisible" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "gemma3"])
def test_a_family_checkpoint_has_its_features_and_loads_strictly(tmp_path, caplog, family):
    """The families transformers 4.34 cannot build are written from the block code: the config reads back into
    the family's own features (biases, q/k norms, sandwich norms, windows, an explicit head_dim), the weights load
    strictly into :class:`LocalModel`, petals registers the config, the tokenizer is lossless, a seed is
    reproducible."""
    import torch
    from transformers import AutoTokenizer

    from swarm.model.arch import arch_from_config
    from swarm.model.checkpoint import make_random_model
    from swarm.model.compat import petals
    from swarm.model.local_model import LocalModel, read_config

    spec = TinyModelSpec(family=family, layers=3, hidden=48, heads=4, kv_heads=2, head_dim=16, vocab=400,
                         window=8 if family != "gemma3" else None, max_length=64, seed=3)
    path = make_random_model(tmp_path / "a", spec)
    arch = arch_from_config(read_config(path))
    assert (arch.family, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (family, 3, 4, 2, 16)
    assert arch.qkv_bias == (family == "qwen2") and arch.qk_norm == (family in ("qwen3", "gemma3"))
    assert arch.sandwich_norms == arch.tie_word_embeddings == (family == "gemma3")
    windows = [layer.window for layer in arch.layers]
    assert windows == ([16, 16, None] if family == "gemma3" else [8, 8, 8])  # Gemma: local, local, global
    if family == "gemma3":
        assert [layer.rope.theta for layer in arch.layers] == [1e4, 1e4, 1e6]
    model = LocalModel.from_pretrained(path)  # strict: every tensor under its checkpoint name, none missing
    if family == "qwen2":
        assert int(torch.count_nonzero(model.layers[0].self_attn.q_proj.bias.detach())) > 0  # a zero bias tests nothing
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "The orchestrator collects what every server can offer."
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text and max(ids) < arch.vocab_size
    tokens, _ = model.greedy(torch.tensor(ids), 4)
    assert len(tokens) == 4
    records = []
    petals_logger = logging.getLogger("petals.models.llama.config")  # where petals logs Meta's LLaMA terms
    collect = logging.Handler()
    collect.emit = records.append
    petals_logger.addHandler(collect)
    level = petals_logger.level
    petals_logger.setLevel(logging.INFO)  # the suite runs hivemind's loggers at WARNING
    try:
        with caplog.at_level(logging.INFO, logger="swarm.model.families"):
            config = petals.AutoDistributedConfig.from_pretrained(str(path))
    finally:
        petals_logger.removeHandler(collect)
        petals_logger.setLevel(level)
    assert type(config).__name__.lower() == f"distributed{family}config"
    assert not [r for r in records if "LLaMA" in str(r.msg)]  # a Qwen or a Gemma is not under Meta's terms
    assert ("Gemma Terms of Use" if family == "gemma3" else "this checkpoint's license") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="swarm.model.families"):  # an orchestrator reads it three times
        petals.AutoDistributedConfig.from_pretrained(str(path))
    assert "Make sure you follow" not in caplog.text  # once a checkpoint is enough
    again = make_random_model(tmp_path / "b", spec)
    assert (path / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


@pytest.mark.parametrize("args, message", [
    (["--family", "llama", "--head-dim", "32"], "leave it out"),
    (["--family", "llama", "--window", "8"], "only mistral"),
    (["--family", "qwen3", "--head-dim", "15"], "must be even"),
    (["--family", "phi3"], "invalid choice"),
])
def test_cli_refuses_options_a_family_does_not_have(tmp_path, capsys, args, message):
    from swarm.cli import main

    try:
        code = main(["make-model", "--out", str(tmp_path / "x"), *args])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.strip().splitlines()[-1].startswith("chainswarm make-model: error:"), err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("bad", [dict(vocab=100), dict(layers=0), dict(heads=4, kv_heads=3), dict(family="phi3"),
                                 dict(hidden=12, heads=4), dict(family="mistral", window=0)])
def test_spec_validation(bad):
    with pytest.raises(ValueError):
        TinyModelSpec(**bad)


def test_dht_prefix_is_stable(tmp_path):
    assert dht_prefix_for(tmp_path / "Llama-2-7b-hf") == "Llama-2-7b-hf-cs"
    assert dht_prefix_for(tmp_path / "a b.c") == "a-b-c-cs"


def test_a_checkpoint_of_pytorch_bin_shards_loads_like_its_safetensors(tmp_path):
    """Older checkpoints ship ``pytorch_model-*.bin`` shards (petals' servers load them): the block code, the
    orchestrator's local spot-check opinion and the demo's reference read them too, to the same tensors."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from swarm.model.checkpoint import make_random_model
    from swarm.model.local_model import LocalModel, load_blocks

    source = make_random_model(tmp_path / "st", TinyModelSpec(family="qwen2", layers=2, hidden=32, heads=2, vocab=300))
    binary = tmp_path / "bin"
    shutil.copytree(source, binary)
    state = load_file(str(binary / "model.safetensors"))
    (binary / "model.safetensors").unlink()
    names = sorted(state)
    weight_map = {}
    for i, half in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        torch.save({n: state[n] for n in half}, binary / f"pytorch_model-0000{i + 1}-of-00002.bin")
        weight_map.update({n: f"pytorch_model-0000{i + 1}-of-00002.bin" for n in half})
    (binary / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = torch.tensor([5, 17, 42, 99, 3])
    expected, binary_model = LocalModel.from_pretrained(source), LocalModel.from_pretrained(binary)
    torch.testing.assert_close(binary_model.hidden_states(ids)[-1], expected.hidden_states(ids)[-1], rtol=0, atol=0)
    block = load_blocks(binary, [1])[0]
    assert all(torch.equal(t, expected.layers[1].state_dict()[n]) for n, t in block.state_dict().items())
    (binary / "pytorch_model-00001-of-00002.bin").unlink()
    (binary / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(FileNotFoundError, match="no model\\*.safetensors or pytorch_model\\*.bin"):
        LocalModel.from_pretrained(binary)
