"""Constrained decoding: the grammar engine behind ``response_format`` and tool calls (llguidance).

The orchestrator computes every token's logits itself, so it can constrain decoding exactly: a
:class:`GrammarMatcher` per generation (an ``llguidance.LLMatcher``) tracks where the tokens chosen so far
are in the grammar and gives, before each choice, the set of tokens that keep the output inside the
grammar — a bitmask over the vocabulary (one bit per token). :class:`~swarm.engine.sampling.TokenChooser`
sets every other token's logit to −∞ before it samples, so greedy decoding, seeded sampling, top-k/top-p/
min-p, penalties and ``logit_bias`` all still apply, inside the mask; the end-of-sequence token is allowed
exactly when the output is complete.

* Grammars are llguidance grammars: JSON schemas (:func:`json_schema_grammar`) or Lark with inline JSON
  schemas (:func:`lark_grammar`, the tool-call grammars of :mod:`swarm.api.tools`). :func:`compile_grammar`
  checks one against the tokenizer and raises :class:`GrammarError` naming what is wrong or unsupported.
* Masks of a batched step are computed for all its constrained sessions in one call
  (:func:`fill_masks`: llguidance's thread pool, without the GIL) — the batched path runs it while the
  step's messages travel through the chain, so the masks are ready when the logits arrive.
* Speculative decoding: :meth:`GrammarMatcher.accepted_prefix` tells how many tokens of a draft the
  grammar accepts, :meth:`GrammarMatcher.rollback` undoes consumed tokens.

The JSON the grammars allow is written the way models write it: ``", "`` between items, ``": "`` after
keys, no other whitespace (a free-whitespace grammar lets small models loop on blanks forever).
"""
from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np
import torch

from swarm.model.tokenizer import tokenizer_json

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How the JSON of every grammar is spelled (llguidance's JSON options)."""


class GrammarError(ValueError):
    """A grammar (schema, tool definition) that cannot be compiled: invalid, unsupported or over a limit."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a requirement (requirements.txt)
        raise GrammarError(f"structured outputs need the llguidance package: {exc}") from exc
    return llguidance


_tokenizers: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def ll_tokenizer(hf_tokenizer):
    """The llguidance tokenizer of a Hugging Face fast tokenizer (built once per tokenizer: ~1 s)."""
    with _tokenizers_lock:
        found = _tokenizers.get(hf_tokenizer)
        if found is None:
            llg = _llguidance()
            try:
                if not getattr(hf_tokenizer, "is_fast", False):
                    raise ValueError("only fast tokenizers are supported")
                found = llg.LLTokenizer(tokenizer_json(hf_tokenizer), eos_token=hf_tokenizer.eos_token_id)
            except Exception as exc:
                raise GrammarError(f"this model's tokenizer cannot be used for constrained decoding: {exc}") from exc
            _tokenizers[hf_tokenizer] = found
        return found


def json_schema_grammar(schema: dict | bool) -> str:
    """The llguidance grammar of a JSON schema (the JSON spelled per :data:`JSON_STYLE`)."""
    llg = _llguidance()
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from exc


def lark_grammar(text: str) -> str:
    """The llguidance grammar of a Lark grammar (llguidance's dialect: inline ``%json {...}``, ``&``/``~``)."""
    return _llguidance().LLMatcher.grammar_from_lark(text)


def inline_json(schema: dict | bool) -> str:
    """A JSON schema as a Lark ``%json`` item, spelled per :data:`JSON_STYLE`."""
    if schema is True or schema == {}:
        schema = {}
    elif schema is False:
        raise GrammarError("a schema of `false` admits no value")
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


@dataclass(frozen=True)
class Grammar:
    """A checked grammar for one tokenizer: what :class:`GrammarMatcher` instances are made from."""

    source: str  # the llguidance grammar (JSON text)
    tokenizer: Any  # llguidance.LLTokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_token(self) -> int:
        return self.tokenizer.eos_token


def compile_grammar(source: str, hf_tokenizer) -> Grammar:
    """Check ``source`` (from :func:`json_schema_grammar` / :func:`lark_grammar`) against the tokenizer.
    Raises :class:`GrammarError` with llguidance's message (e.g. ``Unimplemented keys: ["if"]``)."""
    llg = _llguidance()
    tokenizer = ll_tokenizer(hf_tokenizer)
    try:
        error = llg.LLMatcher.validate_grammar(source, tokenizer)
    except Exception as exc:  # misuse-level errors (e.g. not a grammar at all)
        error = str(exc) or repr(exc)
    if error:
        raise GrammarError(error.strip())
    return Grammar(source, tokenizer)


class GrammarMatcher:
    """Where one generation is in its grammar; the mask of the next token (see the module doc)."""

    def __init__(self, grammar: Grammar):
        llg = _llguidance()
        self.grammar = grammar
        self.matcher = llg.LLMatcher(grammar.tokenizer, grammar.source, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.words = (grammar.vocab_size + 31) // 32
        self.bitmask = torch.full((1, self.words), -1, dtype=torch.int32)
        self.consumed = 0  # tokens consumed so far
        self._mask_at: Optional[int] = None  # self.consumed when the bitmask was computed (None: stale)

    # -- the mask --------------------------------------------------------------------------------------
    def fill(self) -> None:
        """Compute the next token's mask (if it is not already computed for the current state)."""
        if self._mask_at != self.consumed:
            self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.words * 4)
            self._mask_at = self.consumed

    def allowed(self, size: int) -> torch.Tensor:
        """A bool tensor of ``size`` entries: the tokens the grammar allows next (ids past the tokenizer's
        vocabulary never are)."""
        self.fill()
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")  # 0/1 bytes: bools
        n = min(size, bits.size, self.grammar.vocab_size)
        allowed = torch.from_numpy(bits[:n]).view(torch.bool)
        return allowed if n == size else torch.cat([allowed, torch.zeros(size - n, dtype=torch.bool)])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (one row) with every token the grammar forbids at −∞ (a new tensor)."""
        return torch.where(self.allowed(logits.shape[-1]), logits, -float("inf"))

    # -- the state -------------------------------------------------------------------------------------
    def consume(self, token: int) -> bool:
        """Advance by the chosen token; False if the grammar did not allow it (the matcher is then in error)."""
        ok = self.matcher.consume_token(int(token))
        self.consumed += 1
        return ok

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` consumed (a session restart re-chooses them; a rejected draft)."""
        if tokens > 0:
            self.matcher.rollback(tokens)
            self.consumed -= tokens
            self._mask_at = None

    def accepted_prefix(self, draft: list[int]) -> int:
        """How many leading tokens of a speculative ``draft`` the grammar accepts (nothing is consumed)."""
        return self.matcher.validate_tokens([int(t) for t in draft])

    @property
    def done(self) -> bool:
        """The output is complete: only the end-of-sequence token is allowed."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


_executor = None
_executor_lock = threading.Lock()


def fill_masks(matchers: Iterable[GrammarMatcher]) -> None:
    """Compute the next-token masks of many generations at once, in parallel (llguidance's thread pool,
    the GIL released): the constrained sessions of one batched step."""
    global _executor
    stale = [m for m in matchers if m is not None and m._mask_at != m.consumed]
    if len(stale) < 2:
        for m in stale:
            m.fill()
        return
    with _executor_lock:
        if _executor is None:
            _executor = _llguidance().LLExecutor()
    words = stale[0].words
    if any(m.words != words for m in stale):  # matchers of different tokenizers: one by one
        for m in stale:
            m.fill()
        return
    batch = torch.full((len(stale), words), -1, dtype=torch.int32)
    _executor.unsafe_compute_mask_ptr([(m.matcher, i) for i, m in enumerate(stale)], batch.data_ptr(), words * 4,
                                      len(stale))
    for i, m in enumerate(stale):
        m.bitmask.copy_(batch[i: i + 1])
        m._mask_at = m.consumed
