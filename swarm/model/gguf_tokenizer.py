"""Rebuild a Hugging Face fast tokenizer from the vocabulary stored in a GGUF file.

A llama.cpp GGUF carries its tokenizer as metadata: ``tokenizer.ggml.model`` (``gpt2`` = byte-level BPE,
``llama`` = SentencePiece), ``tokenizer.ggml.pre`` (the name of the pre-tokenizer, i.e. how text is cut into
words before BPE), ``tokenizer.ggml.tokens`` / ``merges`` / ``scores`` / ``token_type`` and the special token
ids. This module turns those into a :class:`transformers.PreTrainedTokenizerFast` assembled from
``tokenizers``' own building blocks (tokenizers 0.14.1, the version transformers 4.34 requires).

* ``gpt2`` (byte-level BPE) with the pre-tokenizers whose llama.cpp definition it can reproduce exactly:
  the GPT-2 split, optionally preceded by cutting every number character into its own piece (``smollm`` and
  the names llama.cpp treats identically); Llama 3's ``llama-bpe`` split (numbers in runs of up to 3); and
  Qwen2's (``qwen2``: numbers one by one). Llama 3 also uses BPE "ignore merges": a word that is itself in the
  vocabulary is one token. tokenizers 0.14 has no such switch, so the written ``tokenizer.json`` carries
  ``"ignore_merges": true`` (honoured by tokenizers >= 0.19) and :mod:`swarm.model.tokenizer` applies it on
  0.14 when it loads the folder; :func:`ignore_merges_words` lists the words where it matters (vocabulary
  words that plain BPE splits and that the pre-tokenizer emits whole; 588 of Llama 3's 128,000), recorded in
  ``chainswarm_model.json``.
* ``llama`` (SentencePiece BPE, e.g. Gemma 3, Llama 2, Mistral v0.x) with byte fallback: BPE merges are derived
  from the scores (a pair merges into a piece with the piece's score, highest first — llama.cpp's order),
  spaces become ``▁`` (with a leading ``▁`` when ``add_space_prefix``), unknown characters fall back to the
  ``<0xXX>`` byte tokens, and decoding reverses each step.

Token types follow llama.cpp's numbering: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
Control and unknown tokens become *special* added tokens (so ``<|im_start|>`` in text encodes to its id and
``skip_special_tokens`` drops it); user-defined tokens (Gemma's runs of spaces and newlines, HTML tags)
become ordinary added tokens, matched in the raw text first as llama.cpp does.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's regular expressions for the pre-tokenizers (llama-vocab.cpp), as Oniguruma patterns
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class UnsupportedTokenizer(ValueError):
    """The GGUF's tokenizer cannot be rebuilt exactly (the message is one line naming what is unsupported)."""


def _gpt2_split():
    """The GPT-2 word split, applied together with the byte-to-unicode mapping of byte-level BPE."""
    from tokenizers import pre_tokenizers

    return [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)]


def _digits_then_gpt2_split():
    """Every number character on its own (llama.cpp's ``\\p{N}`` split), then the GPT-2 split."""
    from tokenizers import pre_tokenizers

    return [pre_tokenizers.Digits(individual_digits=True), *_gpt2_split()]


def _regex_split(pattern: str) -> Callable[[], list]:
    def build():
        from tokenizers import Regex, pre_tokenizers

        return [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    return build


LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3")
# tokenizer.ggml.pre -> builder of the pre-tokenizer steps. The groups mirror the names llama.cpp maps to the
# same splitting rules, so each GGUF tokenizes here as llama.cpp tokenizes it.
PRE_TOKENIZERS: dict[str, Callable[[], list]] = {
    **{name: _digits_then_gpt2_split for name in
       ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{name: _gpt2_split for name in ("gpt-2", "mpt", "olmo", "jais")},
    **{name: _regex_split(LLAMA3_SPLIT) for name in LLAMA3_NAMES},
    **{name: _regex_split(QWEN2_SPLIT) for name in ("qwen2", "deepseek-r1-qwen")},
}
IGNORE_MERGES = frozenset(LLAMA3_NAMES)  # llama.cpp applies "ignore merges" for these

_KINDS = {"llama": "SentencePiece", "bert": "WordPiece", "t5": "Unigram", "rwkv": "RWKV"}


def check_tokenizer_supported(meta: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedTokenizer` unless ``build_tokenizer`` can rebuild this GGUF's tokenizer."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise UnsupportedTokenizer("the GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    if model == "llama":
        if "tokenizer.ggml.scores" not in meta:
            raise UnsupportedTokenizer("the GGUF's SentencePiece tokenizer has no scores (tokenizer.ggml.scores)")
        return
    if model != "gpt2":
        raise UnsupportedTokenizer(f"unsupported tokenizer model {model!r} ({_KINDS.get(model, 'other')}); "
                                   f"supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizer(
            f"unsupported pre-tokenizer {pre!r} (unknown splitting rules); supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    if "tokenizer.ggml.merges" not in meta:
        raise UnsupportedTokenizer("the GGUF's byte-level BPE tokenizer has no merges (tokenizer.ggml.merges)")


def _token(tokens: list[str], meta: dict[str, Any], key: str) -> str | None:
    """The text of the special token whose id is stored under ``tokenizer.ggml.<key>_token_id``, if any."""
    token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, text in enumerate(tokens):
        vocab.setdefault(text, token_id)  # a duplicated string keeps its first id, as a dict-based vocab must
    return vocab


def _gpt2_merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for line in meta["tokenizer.ggml.merges"]:
        left, sep, right = line.partition(" ")
        if not sep or not left or not right:
            raise UnsupportedTokenizer(f"malformed BPE merge {line!r} in the GGUF")
        merges.append((left, right))
    return merges


def spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven BPE: every split ``(a, b)`` of a normal piece into
    two pieces, ordered by the piece's score (highest first), so the pair forming the best-scoring piece merges
    first, as in llama.cpp's ``llm_tokenizer_spm``."""
    vocab = _vocab(tokens)
    normal = {t for t, kind in zip(tokens, types) if kind == TOKEN_NORMAL}
    ranked = []
    for token_id, (piece, kind) in enumerate(zip(tokens, types)):
        if kind != TOKEN_NORMAL or len(piece) < 2 or vocab[piece] != token_id:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _added_tokens(tok, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, kind in enumerate(types) if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(types) if kind == TOKEN_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _backend(meta: dict[str, Any], tokens: list[str], types: list[int]):
    """The ``tokenizers.Tokenizer`` (model, normalizer, pre-tokenizer, decoder) of the GGUF's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = _vocab(tokens)
    if meta["tokenizer.ggml.model"] == "gpt2":
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_gpt2_merges(meta), fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "default")]())
        tok.decoder = decoders.ByteLevel()
        return tok
    scores = list(meta["tokenizer.ggml.scores"])
    if len(scores) != len(tokens):
        raise UnsupportedTokenizer(f"{len(tokens)} tokens but {len(scores)} scores in the GGUF")
    unk = _token(tokens, meta, "unknown")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, types, scores), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def build_tokenizer(meta: dict[str, Any], model_max_length: int | None = None, *,
                    chat_template: str | None = None, with_info: bool = False):
    """A ``PreTrainedTokenizerFast`` equivalent to the GGUF's tokenizer (``meta``: the GGUF key/values).

    ``chat_template`` defaults to the file's ``tokenizer.chat_template``. With ``with_info`` also returns a
    dict for ``chainswarm_model.json`` (the words where Llama 3's ignore-merges rule matters)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    check_tokenizer_supported(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise UnsupportedTokenizer(f"{len(tokens)} tokens but {len(types)} token types in the GGUF")
    tok = _backend(meta, tokens, types)
    _added_tokens(tok, tokens, types)

    bos, eos = _token(tokens, meta, "bos"), _token(tokens, meta, "eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        head, tail = ([f"{bos}"] if add_bos else []), ([f"{eos}"] if add_eos else [])
        vocab = _vocab(tokens)
        used = {t: vocab[t] for t in head + tail}
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(head + ["$A"] + tail),
            pair=" ".join(head + ["$A"] + tail + [f"{t}:1" for t in head] + ["$B:1"] + [f"{t}:1" for t in tail]),
            special_tokens=list(used.items()),
        )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=_token(tokens, meta, "unknown"),
        pad_token=_token(tokens, meta, "padding"),
        clean_up_tokenization_spaces=False,
        chat_template=chat_template if chat_template is not None else meta.get("tokenizer.chat_template"),
        model_max_length=model_max_length or int(1e30),
    )
    if not with_info:
        return tokenizer
    info: dict[str, Any] = {}
    if meta.get("tokenizer.ggml.pre") in IGNORE_MERGES:
        words = ignore_merges_words(meta)
        info = {"tokenizer_ignore_merges": True, "tokenizer_ignore_merges_words": len(words),
                "tokenizer_ignore_merges_examples": words[:10]}
    return tokenizer, info


def ignore_merges_words(meta: dict[str, Any]) -> list[str]:
    """The words (as text) where BPE "ignore merges" changes the result: normal vocabulary entries that plain
    BPE merges would split and that the pre-tokenizer can emit whole. Everywhere else plain BPE and
    ignore-merges BPE agree, so these are the only words plain BPE encodes differently from llama.cpp."""
    from tokenizers import decoders, models, pre_tokenizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    bpe = models.BPE(vocab=_vocab(tokens), merges=_gpt2_merges(meta), fuse_unk=False)
    splitter = pre_tokenizers.Sequence(PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "default")]()[:-1])
    decoder = decoders.ByteLevel()
    words = []
    for token, kind in zip(tokens, types):
        if kind != TOKEN_NORMAL or len(bpe.tokenize(token)) == 1:
            continue
        text = decoder.decode([token])
        if "\ufffd" not in text and [piece for piece, _ in splitter.pre_tokenize_str(text)] == [text]:
            words.append(text)
    return words


def finish_tokenizer_files(out: str | Path, meta: dict[str, Any]) -> None:
    """What tokenizers 0.14 cannot write: ``"ignore_merges": true`` for Llama 3's pre-tokenizer (a newer
    tokenizers honours it; on 0.14 :func:`swarm.model.tokenizer.load_tokenizer` applies it)."""
    if meta.get("tokenizer.ggml.pre") in IGNORE_MERGES and meta.get("tokenizer.ggml.model") == "gpt2":
        path = Path(out) / "tokenizer.json"
        doc = json.loads(path.read_text(encoding="utf-8"))
        doc["model"]["ignore_merges"] = True
        path.write_text(json.dumps(doc, ensure_ascii=False, indent=2), encoding="utf-8")
