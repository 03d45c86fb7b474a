"""Rebuild a Hugging Face fast tokenizer from the vocabulary stored in a GGUF file.

A llama.cpp GGUF carries its tokenizer as metadata: ``tokenizer.ggml.model`` (``gpt2`` = byte-level BPE),
``tokenizer.ggml.pre`` (the name of the pre-tokenizer, i.e. how text is cut into words before BPE),
``tokenizer.ggml.tokens`` / ``merges`` / ``token_type`` and the special token ids. This module turns those
into a :class:`transformers.PreTrainedTokenizerFast` assembled from ``tokenizers``' own building blocks.

Only what can be reproduced exactly is accepted:

* tokenizer model ``gpt2`` (byte-level BPE). SentencePiece (``llama``) and the others are refused.
* pre-tokenizers whose llama.cpp definition is the GPT-2 split, optionally preceded by cutting every number
  character into its own piece (``smollm`` and the names llama.cpp treats identically). Llama-3-style
  ``llama-bpe`` is refused: it relies on BPE "ignore merges", which tokenizers 0.14 cannot express, so some
  words would encode differently from llama.cpp.

Token types follow llama.cpp's numbering: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
Control and unknown tokens become *special* added tokens (so ``<|im_start|>`` in text encodes to its id and
``skip_special_tokens`` drops it); user-defined tokens become ordinary added tokens.
"""
from __future__ import annotations

from typing import Any, Callable

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


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


# tokenizer.ggml.pre -> builder of the pre-tokenizer steps. The groups mirror the names llama.cpp maps to the
# same splitting rules, so each GGUF tokenizes here as llama.cpp tokenizes it.
PRE_TOKENIZERS: dict[str, Callable[[], list]] = {
    **{name: _digits_then_gpt2_split for name in
       ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{name: _gpt2_split for name in ("gpt-2", "mpt", "olmo", "jais")},
}

# Pre-tokenizer names we recognise but refuse, with the reason (anything else is refused as unknown).
_REFUSED_PRE = {
    name: "it needs BPE 'ignore merges', which tokenizers 0.14 lacks"
    for name in ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral")
}


def check_tokenizer_supported(meta: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedTokenizer` unless ``build_tokenizer`` can rebuild this GGUF's tokenizer."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise UnsupportedTokenizer("the GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    if model != "gpt2":
        kind = {"llama": "SentencePiece", "bert": "WordPiece", "t5": "Unigram", "rwkv": "RWKV"}.get(model, "other")
        raise UnsupportedTokenizer(
            f"unsupported tokenizer model {model!r} ({kind}); only 'gpt2' (byte-level BPE) is supported"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        reason = _REFUSED_PRE.get(pre, "unknown splitting rules")
        raise UnsupportedTokenizer(
            f"unsupported pre-tokenizer {pre!r} ({reason}); supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    if "tokenizer.ggml.merges" not in meta:
        raise UnsupportedTokenizer("the GGUF's byte-level BPE tokenizer has no merges (tokenizer.ggml.merges)")


def _token(tokens: list[str], meta: dict[str, Any], key: str) -> str | None:
    """The text of the special token whose id is stored under ``tokenizer.ggml.<key>_token_id``, if any."""
    token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]


def build_tokenizer(meta: dict[str, Any], model_max_length: int | None = None):
    """A ``PreTrainedTokenizerFast`` equivalent to the GGUF's tokenizer (``meta``: the GGUF key/values)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    check_tokenizer_supported(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise UnsupportedTokenizer(f"{len(tokens)} tokens but {len(types)} token types in the GGUF")

    vocab: dict[str, int] = {}
    for token_id, text in enumerate(tokens):
        vocab.setdefault(text, token_id)  # a duplicated string keeps its first id, as a dict-based vocab must
    merges = []
    for line in meta["tokenizer.ggml.merges"]:
        left, sep, right = line.partition(" ")
        if not sep or not left or not right:
            raise UnsupportedTokenizer(f"malformed BPE merge {line!r} in the GGUF")
        merges.append((left, right))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "default")]())
    tok.decoder = decoders.ByteLevel()

    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, kind in enumerate(types) if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(types) if kind == TOKEN_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    bos, eos = _token(tokens, meta, "bos"), _token(tokens, meta, "eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        head, tail = ([f"{bos}"] if add_bos else []), ([f"{eos}"] if add_eos else [])
        used = {t: vocab[t] for t in head + tail}
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(head + ["$A"] + tail),
            pair=" ".join(head + ["$A"] + tail + [f"{t}:1" for t in head] + ["$B:1"] + [f"{t}:1" for t in tail]),
            special_tokens=list(used.items()),
        )

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=_token(tokens, meta, "unknown"),
        pad_token=_token(tokens, meta, "padding"),
        clean_up_tokenization_spaces=False,
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=model_max_length or int(1e30),
    )
