"""Load a model folder's tokenizer, with what the pinned tokenizers release lacks.

Llama 3's byte-level BPE uses *ignore merges*: a pre-tokenized word that is itself in the vocabulary becomes
that one token, whatever the merges would do (llama.cpp and tokenizers >= 0.19 both apply it when
``tokenizer.json``'s model says ``"ignore_merges": true``). transformers 4.34 pins tokenizers 0.14, which
reads and ignores that key, so 588 of Llama 3's words would encode to several tokens instead of one. Here a
last pre-tokenizer step applies the rule on 0.14: it assigns each word its tokens itself, the word's own id
when the word is in the vocabulary, otherwise the BPE model's tokens for it (tokenizers then skips the model
for words that already have tokens). Offsets, added tokens and decoding are unchanged.

The step is a Python object, so a tokenizer carrying it cannot be saved or copied; load a fresh one from the
folder, and hand libraries that read the Rust tokenizer's JSON (llguidance) :func:`tokenizer_json` instead.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Callable, Sequence


def native_ignore_merges() -> bool:
    """Whether the installed tokenizers honours ``"ignore_merges"`` itself (0.19 and later)."""
    import tokenizers

    return tuple(int(x) for x in tokenizers.__version__.split(".")[:2]) >= (0, 19)


def wants_ignore_merges(model_dir: str | Path) -> bool:
    """Whether the folder's ``tokenizer.json`` asks for the ignore-merges rule."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return False
    raw = path.read_bytes()
    if b'"ignore_merges"' not in raw:  # most tokenizers: no JSON parse at load (Gemma 3's file is 18 MB, 0.4 s)
        return False
    return bool(json.loads(raw).get("model", {}).get("ignore_merges"))


class _WholeWords:
    """The ignore-merges rule as a pre-tokenizer step: every word gets its tokens here."""

    def __init__(self, backend):
        from tokenizers import Token

        self.vocab = backend.get_vocab(with_added_tokens=False)
        self.bpe, self.token = backend.model, Token

    def _word(self, word):  # once per word of every text encoded
        text = str(word)
        token_id = self.vocab.get(text)
        if token_id is not None:
            return [self.token(token_id, text, (0, len(text.encode("utf-8"))))]  # byte offsets, as the model gives
        return self.bpe.tokenize(text)

    def pre_tokenize(self, pretok) -> None:
        pretok.tokenize(self._word)


def apply_ignore_merges(tokenizer) -> None:
    """Make a fast tokenizer follow the ignore-merges rule (a no-op where tokenizers already does)."""
    from tokenizers import pre_tokenizers

    if native_ignore_merges():
        return
    backend = tokenizer.backend_tokenizer
    doc = json.loads(backend.to_str())
    doc["model"]["ignore_merges"] = True
    tokenizer.chainswarm_tokenizer_json = json.dumps(doc, ensure_ascii=False)
    steps = [backend.pre_tokenizer] if backend.pre_tokenizer is not None else []
    backend.pre_tokenizer = pre_tokenizers.Sequence([*steps, pre_tokenizers.PreTokenizer.custom(_WholeWords(backend))])


def tokenizer_json(tokenizer) -> str:
    """The fast tokenizer's ``tokenizer.json`` text, as a current tokenizers release would read it (with
    ``"ignore_merges": true`` where :func:`apply_ignore_merges` applied the rule)."""
    saved = getattr(tokenizer, "chainswarm_tokenizer_json", None)
    if saved is not None:
        return saved
    from copy import copy

    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _declared_added_tokens(model_dir: Path) -> dict:
    """``tokenizer_config.json``'s ``added_tokens_decoder`` (id -> token fields), where the folder also has a
    ``tokenizer.json`` (which holds the added tokens itself); else empty."""
    config = model_dir / "tokenizer_config.json"
    if not (config.is_file() and (model_dir / "tokenizer.json").is_file()):
        return {}
    declared = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
    return declared if isinstance(declared, dict) else {}


def load_tokenizer(model_dir: str | Path):
    """``AutoTokenizer.from_pretrained(model_dir)``, following the folder's ignore-merges rule.

    transformers 4.34 checks every added token that ``tokenizer_config.json`` lists against a dict it rebuilds from
    the Rust tokenizer for each one (quadratic): Gemma 3's 6,414 added tokens take 19 s to load that way, 1 s here.
    The tokenizer is built from ``tokenizer.json`` alone, which already holds them, and only a listed token it lacks
    is added afterwards, as transformers would (``tests/test_tokenizer_load.py``: same ids, texts and special tokens).
    """
    from transformers import AddedToken, AutoTokenizer

    model_dir = Path(model_dir)
    declared = _declared_added_tokens(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), **({"added_tokens_decoder": {}} if declared else {}))
    if declared:
        have = tokenizer.added_tokens_decoder  # one call: the property is rebuilt on every access
        missing = [AddedToken(**fields) for index, fields in sorted(declared.items(), key=lambda kv: int(kv[0]))
                   if getattr(have.get(int(index)), "content", None) != fields.get("content")]
        for special, run in itertools.groupby(missing, key=lambda token: bool(token.special)):  # in id order, as
            tokenizer.add_tokens(list(run), special_tokens=special)  # transformers adds runs of one kind
    if getattr(tokenizer, "is_fast", False) and wants_ignore_merges(model_dir):
        apply_ignore_merges(tokenizer)
    return tokenizer


def text_decoder(tokenizer) -> Callable[[Sequence[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``, through the Rust tokenizer where there is one.

    transformers 4.34's ``decode`` first walks the ids through ``to_py_obj`` one by one: 4.6 ms for 1,000 tokens
    on the development machine against 0.27 ms in the Rust decoder it then calls. Streams and stop strings decode an
    answer's whole text at every token, so that walk made a long answer's text cost O(tokens²) in Python. A fast
    tokenizer's ``_decode`` is the Rust decode plus, where the tokenizer asks for it, ``clean_up_tokenization``:
    this does the same (``tests/test_tokenizer_load.py`` compares them on both real models' tokenizers)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
    clean_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

    def decode(ids: Sequence[int]) -> str:
        text = backend.decode([int(i) for i in ids], skip_special_tokens=True)
        return tokenizer.clean_up_tokenization(text) if clean_up else text

    return decode
