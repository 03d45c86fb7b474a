"""GGUF conversion of every supported family, checked against the transformers 5.24 goldens.

For each golden case (``tests/data/goldens/<case>/``: a random-weight checkpoint plus the hidden states that
transformers computed for it) a GGUF is written the way llama.cpp's converter writes that family — q/k rows
permuted for ``llama`` (Llama 3 rope scaling as the ``rope_freqs`` tensor, Mistral's window as
``llama.attention.sliding_window``), biases for qwen2, q/k norms for qwen3, ``1 + w`` norms and the local/global
layer pattern for gemma3 — with a small tokenizer of the family's kind. It is converted back and
``LocalModel`` on the result must reproduce the golden per-layer hidden states. The tokenizer tests check
the pre-tokenizer splits against llama.cpp's regular expressions, SentencePiece-BPE against a reference of
llama.cpp's algorithm, exact round trips, and the words where Llama 3's ignore-merges rule matters.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from swarm.cli import main as cli_main
from swarm.model.gguf import convert_gguf, read_model_info

GOLDENS = Path(__file__).parent / "data" / "goldens"
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Numbers: 12345, 3.14159 and 2024-11-25. I'll say it's 1000000.",
    "  leading spaces,\ttabs\t\tand\n\nnew lines   ",
    "café, über, 中文, Ελληνικά, 👍🏽 and 🧑‍🚀",
    "",
]
CORPUS = ("The quick brown fox jumps over the lazy dog. Hello world, hello there! Numbers 12345 and 678. "
          "Tokenizers split words into pieces; pieces merge into tokens.\n\nA second paragraph, with tabs\tand "
          "spaces   here. Café über naïve. ") * 20
_BLOCK = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight"}
_NORMS = {"llama": {"post_attention_layernorm.weight": "ffn_norm.weight"},
          "gemma3": {"post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}}
ARCH = {"llama3": "llama", "llama-linear": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
        "gemma3": "gemma3", "gemma3-scaled": "gemma3"}
TOKENIZER_KIND = {"llama": ("gpt2", "llama-bpe"), "qwen2": ("gpt2", "qwen2"), "qwen3": ("gpt2", "qwen2"),
                  "gemma3": ("llama", None)}


# ------------------------------------------------------------------------------------------- tokenizers
def byte_level_tokenizer(vocab_size: int = 400) -> dict:
    """A byte-level BPE trained on CORPUS: tokens (specials first), merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for text, token_id in vocab.items():
        tokens[token_id] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"tokens": tokens, "merges": merges, "types": [3 if i < 4 else 1 for i in range(len(tokens))]}


def spm_vocabulary() -> dict:
    """A SentencePiece-style vocabulary: specials, <0xXX> byte tokens, user-defined runs, then pieces from a
    BPE trained on '▁'-escaped CORPUS with scores falling in merge order (as SentencePiece's BPE stores them)."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False)
    tok.train_from_iterator([CORPUS.replace(" ", "▁").replace("\n", "").replace("\t", "")], trainer)
    spec = json.loads(tok.to_str())
    pieces = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    chars = [p for p in pieces if len(p) == 1]
    merged = [a + b for a, b in (m.split(" ") if isinstance(m, str) else m for m in spec["model"]["merges"])]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "\t", "  ", "   "]
    tokens = specials + user + [f"<0x{b:02X}>" for b in range(256)] + merged + chars
    types = [3] * len(specials) + [4] * len(user) + [6] * 256 + [1] * (len(merged) + len(chars))
    scores = [-1000.0] * (len(specials) + len(user)) + [0.0] * 256 + [-float(i) for i in range(len(merged))] + [
        -float(len(merged) + i) for i in range(len(chars))]
    return {"tokens": tokens, "types": types, "scores": scores}


def spm_reference(vocab: dict, text: str) -> list[int]:
    """llama.cpp's SentencePiece BPE (llm_tokenizer_spm), written out plainly: user-defined and control
    tokens matched first (longest first), spaces -> '▁', then repeatedly merge the adjacent pair whose
    concatenation is a normal piece of the highest score (leftmost on ties); unknown characters -> bytes."""
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    normal = {t for t, k in zip(vocab["tokens"], vocab["types"]) if k == 1}
    specials = sorted((t for t, k in zip(vocab["tokens"], vocab["types"]) if k in (3, 4)), key=len, reverse=True)
    fragments = [text]
    for special in specials:
        out = []
        for fragment in fragments:
            if isinstance(fragment, int):
                out.append(fragment)
                continue
            parts = fragment.split(special)
            for i, part in enumerate(parts):
                if i:
                    out.append(ids[special])
                if part:
                    out.append(part)
        fragments = out
    result = []
    for fragment in fragments:
        if isinstance(fragment, int):
            result.append(fragment)
            continue
        symbols = list(fragment.replace(" ", "▁"))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                piece = symbols[i] + symbols[i + 1]
                if piece in normal and (best is None or vocab["scores"][ids[piece]] > best[0]):
                    best = (vocab["scores"][ids[piece]], i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        for symbol in symbols:
            if symbol in normal:
                result.append(ids[symbol])
            else:
                result.extend(ids[f"<0x{b:02X}>"] for b in symbol.encode("utf-8"))
    return result


# -------------------------------------------------------------------------------------- writing GGUFs
def llama_cpp_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """transformers' q/k row order -> llama.cpp's (the two rotary halves of each head interleaved)."""
    head_dim = weight.shape[0] // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, -1).transpose(0, 2, 1, 3).reshape(weight.shape)


def llama3_rope_factors(rope: dict, dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for a llama3 rope scaling (its converter's formula)."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    orig, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                               rope["high_freq_factor"], rope["factor"])
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_family_gguf(case: str, path: Path, *, qtype: str = "F32", arch: str | None = None) -> Path:
    """The golden checkpoint ``case`` as llama.cpp would write it (architecture keys, tensor layout, tokenizer)."""
    from safetensors.numpy import load_file

    cfg = json.loads((GOLDENS / case / "config.json").read_text())
    arch = arch or ARCH[case]
    weights = load_file(str(GOLDENS / case / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg["rope_parameters"]
    full_rope = rope.get("full_attention", rope)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(full_rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if full_rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full_rope["factor"]))
    if case == "mistral":
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3":
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        if cfg["query_pre_attn_scalar"] != head_dim:
            writer.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)

    model, pre = TOKENIZER_KIND[ARCH[case]]
    writer.add_tokenizer_model(model)
    if model == "gpt2":
        vocab = byte_level_tokenizer()
        writer.add_tokenizer_pre(pre)
        writer.add_token_merges(vocab["merges"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
    else:
        vocab = spm_vocabulary()
        writer.add_token_scores(vocab["scores"])
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])

    for name, array in weights.items():
        array = array.astype(np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            layer, suffix = name[len("model.layers."):].split(".", 1)
            table = {**_BLOCK, **_NORMS["gemma3" if arch == "gemma3" else "llama"]}
            gguf_name = f"blk.{layer}.{table[suffix]}"
        if arch == "llama" and gguf_name.endswith("attn_q.weight"):
            array = llama_cpp_rows(array, heads)
        elif arch == "llama" and gguf_name.endswith("attn_k.weight"):
            array = llama_cpp_rows(array, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp stores Gemma's (1 + w)
        if array.ndim == 1 or qtype == "F32":
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
        else:
            writer.add_tensor(gguf_name, array.astype(np.float16))
    if full_rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(full_rope, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def golden_hidden(case: str) -> tuple:
    from safetensors.torch import load_file

    golden = load_file(str(GOLDENS / case / "golden.safetensors"))
    layers = json.loads((GOLDENS / case / "config.json").read_text())["num_hidden_layers"]
    return golden["prompt_ids"], [golden[f"hidden.{i}"] for i in range(layers + 1)]


def max_relative_error(ours, theirs) -> float:
    return max(float((a.float() - b).norm() / b.norm()) for a, b in zip(ours, theirs))


# --------------------------------------------------------------------------------------------- models
@pytest.mark.parametrize("case", list(ARCH))
def test_converted_family_reproduces_golden_hidden_states(case, tmp_path):
    """GGUF written as llama.cpp would -> convert -> LocalModel hidden states == transformers 5.24's."""
    import torch

    from swarm.model.arch import arch_from_config
    from swarm.model.local_model import LocalModel

    src = write_family_gguf(case, tmp_path / f"{case}.gguf")
    result = convert_gguf(src, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    golden_cfg = json.loads((GOLDENS / case / "config.json").read_text())
    assert config["model_type"] == golden_cfg["model_type"] == result.shape.model_type
    ours, theirs = arch_from_config(config), arch_from_config(golden_cfg)
    assert ours.layers == theirs.layers and ours.scale == theirs.scale and ours.head_dim == theirs.head_dim
    assert config["tie_word_embeddings"] == golden_cfg.get("tie_word_embeddings", False)
    ids, hidden = golden_hidden(case)
    states = LocalModel.from_pretrained(tmp_path / "out", torch.float32).hidden_states(ids)
    error = max_relative_error(states, hidden)
    assert error < 1e-5, f"{case}: relative hidden-state error {error:.2e}"


@pytest.mark.parametrize("case, unpermuted_differs", [("llama3", True), ("qwen2", False), ("gemma3", False)])
def test_qk_permutation_only_where_llama_cpp_applied_it(case, unpermuted_differs, tmp_path):
    """``unpermute_qk=False`` changes a llama conversion (its q/k rows were permuted) but not qwen2/gemma3
    ones (llama.cpp writes them in transformers' order, so the converter leaves them alone)."""
    import torch

    from swarm.model.local_model import LocalModel

    src = write_family_gguf(case, tmp_path / f"{case}.gguf")
    convert_gguf(src, tmp_path / "raw", unpermute_qk=False)
    ids, hidden = golden_hidden(case)
    error = max_relative_error(LocalModel.from_pretrained(tmp_path / "raw").hidden_states(ids), hidden)
    assert (error > 0.05) if unpermuted_differs else (error < 1e-5), error


def test_gemma_norms_are_stored_plus_one(tmp_path):
    from safetensors.torch import load_file

    src = write_family_gguf("gemma3", tmp_path / "g.gguf")
    convert_gguf(src, tmp_path / "out")
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    golden = load_file(str(GOLDENS / "gemma3" / "model.safetensors"))
    for name in ("model.norm.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.2.pre_feedforward_layernorm.weight"):
        assert float((ours[name] - golden[name]).abs().max()) < 1e-6, name


def test_llama3_rope_is_recovered_from_rope_freqs(tmp_path):
    src = write_family_gguf("llama3", tmp_path / "l3.gguf")
    convert_gguf(src, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    want = json.loads((GOLDENS / "llama3" / "config.json").read_text())["rope_parameters"]
    got = config["rope_scaling"]
    assert got["rope_type"] == "llama3" and config["rope_theta"] == want["rope_theta"]
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert got[key] == want[key], key


@pytest.mark.parametrize("rope", [
    {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama 3.1
    {"rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama 3.2
])
def test_llama3_rope_parameters_of_real_llamas(rope):
    from swarm.model.gguf_families import llama3_rope_from_factors

    got = llama3_rope_from_factors([float(x) for x in llama3_rope_factors(rope, 128)], rope["rope_theta"], 128)
    assert {k: got[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings")} == {k: rope[k] for k in got if k in rope}


def test_converted_folders_load_through_petals_registration(tmp_path):
    """The written config.json is one the petals registration (families.py) reads for every family."""
    from swarm.model.families import register

    from petals import AutoDistributedConfig

    register()
    for case in ("llama3", "qwen3", "gemma3"):
        convert_gguf(write_family_gguf(case, tmp_path / f"{case}.gguf"), tmp_path / case)
        config = AutoDistributedConfig.from_pretrained(str(tmp_path / case))
        assert config.num_hidden_layers == json.loads((GOLDENS / case / "config.json").read_text())["num_hidden_layers"]


def test_unsupported_architecture_is_one_line(tmp_path, capsys):
    src = write_family_gguf("qwen2", tmp_path / "odd.gguf", arch="phi3")
    assert cli_main(["convert-gguf", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unsupported GGUF architecture 'phi3'" in err, err
    for name in ("llama", "qwen2", "qwen3", "gemma3", "Mistral"):
        assert name in err


# ------------------------------------------------------------------------------------------ tokenizers
def _regex_reference(pattern: str, text: str) -> list[tuple[int, int]]:
    import regex

    pieces, at = [], 0
    for match in regex.finditer(pattern, text):
        if match.start() > at:
            pieces.append((at, match.start()))
        pieces.append(match.span())
        at = match.end()
    if at < len(text):
        pieces.append((at, len(text)))
    return pieces


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2"])
def test_pre_tokenizers_split_as_llama_cpp(name):
    from tokenizers import pre_tokenizers

    from swarm.model.gguf_tokenizer import PRE_TOKENIZERS

    # llama.cpp's expressions (llama-vocab.cpp), in Python's `regex` syntax
    patterns = {
        "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen2": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
    splitter = pre_tokenizers.Sequence(PRE_TOKENIZERS[name]()[:-1])  # the split, before the byte mapping
    for text in TEXTS + ["don't  I'LL WE'VE\n\n\nx² ٣ Ⅻ ½ 1,000,000.50   end  ", "   ", "a\r\n\r\nb"]:
        got = [span for _, span in splitter.pre_tokenize_str(text)]
        assert got == _regex_reference(patterns[name], text), (name, text)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_converted_tokenizers_round_trip_exactly(arch, tmp_path):
    from transformers import AutoTokenizer

    case = {"llama": "llama3", "qwen2": "qwen2", "gemma3": "gemma3"}[arch]
    convert_gguf(write_family_gguf(case, tmp_path / "t.gguf"), tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in TEXTS + ["x  \n\n\n  y   ", " 1 22 333 4444 55555", "\u0000 control \U0010fffd"]:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text, (arch, text)


def test_sentencepiece_tokenizer_matches_llama_cpp_algorithm(tmp_path):
    """Gemma-style SentencePiece BPE with byte fallback: ids equal a plain reference of llama.cpp's algorithm."""
    from transformers import AutoTokenizer

    convert_gguf(write_family_gguf("gemma3", tmp_path / "g.gguf"), tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    vocab = spm_vocabulary()
    samples = TEXTS + [CORPUS[:300], "Quick quick QUICK fox-fox foxes 4242 über中文",
                       "<start_of_turn>user\nHello there<end_of_turn>\n", "tabs\t\tand   spaces  \n\nend"]
    for text in samples:
        ids = tokenizer(text).input_ids
        assert ids[0] == 2  # <bos> added, as the GGUF says
        assert ids[1:] == spm_reference(vocab, text), text
    assert tokenizer.convert_ids_to_tokens(tokenizer("ж").input_ids[1:]) == ["<0xD0>", "<0xB6>"]  # byte fallback


def test_llama3_ignore_merges_words(tmp_path):
    """A vocabulary word that plain BPE merges would split: llama.cpp (ignore merges) gives one token. The
    converter lists such words and marks tokenizer.json; the loaded tokenizer gives that one token on the
    pinned tokenizers 0.14 too (its own pre-tokenizer step), inside text and with the right offsets, while
    ordinary and unreachable words still use the merges; llguidance reads the same rule."""
    from transformers import PreTrainedTokenizerFast

    from swarm.engine.grammar import ll_tokenizer
    from swarm.model.gguf_tokenizer import build_tokenizer, finish_tokenizer_files, ignore_merges_words
    from swarm.model.tokenizer import load_tokenizer, native_ignore_merges

    vocab = byte_level_tokenizer()
    extra = "Ġzebrafox"  # in the vocabulary, but no merge forms it
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": vocab["tokens"] + [extra], "tokenizer.ggml.token_type": vocab["types"] + [1],
            "tokenizer.ggml.merges": vocab["merges"]}
    assert ignore_merges_words(meta) == [" zebrafox"]
    tokenizer, info = build_tokenizer(meta, with_info=True)
    assert info["tokenizer_ignore_merges_words"] == 1 and info["tokenizer_ignore_merges_examples"] == [" zebrafox"]
    word_id = len(vocab["tokens"])
    for text in (" quick", " hello"):  # reachable words: one token either way
        assert len(tokenizer(text).input_ids) == 1
    tokenizer.save_pretrained(tmp_path)
    finish_tokenizer_files(tmp_path, meta)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["ignore_merges"] is True
    plain = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded(" zebrafox").input_ids == [word_id]
    if not native_ignore_merges():  # what the pinned tokenizers gives without the added step
        assert len(plain(" zebrafox").input_ids) > 1
    text = "a zebrafox and zebrafoxes, quick hello 12345 zebrafox!"
    enc = loaded(text, return_offsets_mapping=True)
    assert enc.input_ids.count(word_id) == 2 and loaded.decode(enc.input_ids) == text
    pieces = [text[a:b] for a, b in enc.offset_mapping]
    assert "".join(pieces) == text and pieces[1] == " zebrafox" and pieces[-2] == " zebrafox"
    # everything but the two whole words is exactly what plain BPE gives
    assert loaded("zebrafoxes, quick hello 12345").input_ids == plain("zebrafoxes, quick hello 12345").input_ids
    for sample in TEXTS:
        ids = loaded(sample).input_ids
        assert loaded.decode(ids) == sample
    # llguidance (structured outputs) is handed the rule too
    ll = ll_tokenizer(loaded)
    assert ll.tokenize_str(" zebrafox") == [word_id]
