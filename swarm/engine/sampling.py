"""How the next token is chosen, and how generation stops: the OpenAI sampling surface, exactly.

The orchestrator runs the LM head of every proxied session itself, so everything that acts on logits is
applied here, on the real logits:

* :class:`TokenChooser` — a transformers ``LogitsProcessor`` that adds ``logit_bias``; blocks the
  end-of-sequence token until ``min_tokens`` tokens exist; applies vLLM's ``repetition_penalty`` (a logit
  ``μ[j] > 0`` of a token seen in the prompt or the output is divided by it, a negative one multiplied) and
  OpenAI's presence and frequency penalties (``μ[j] − c[j]·α_frequency − [c[j] > 0]·α_presence`` over the
  tokens generated so far); sets every token the request's grammar (``response_format``, tool calls:
  :mod:`swarm.engine.grammar`) forbids to −∞; then picks greedily (temperature 0) or samples with
  temperature, ``min_p`` (tokens below ``min_p`` × the most likely one's probability dropped), ``top_k`` and
  ``top_p`` (in that order, as vLLM) from a per-request ``torch.Generator``. A seeded request draws each token
  from its seed and the token's position alone (same seed and prompt → same text, whatever else runs concurrently
  and however many tokens a speculative step verified). It records the chosen token's log-probability and the
  ``top_logprobs`` alternatives from the model's own distribution (log-softmax of the raw logits), then returns logits that
  put all mass on its choice, so transformers' greedy loop emits exactly that token.
* :class:`StopMatcher` — ``stop`` strings matched across token boundaries on the decoded text; text that
  could still be the start of a stop string is held back, so a stop string is never part of what a client
  receives, streamed or not.

``ignore_eos`` (vLLM's meaning: the end-of-sequence token does not end the generation, ``max_new_tokens``
does) is :attr:`SamplingParams.stops_at_eos`, which the engine reads; a grammar's end still ends it.
"""
from __future__ import annotations

import logging
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from swarm.engine.grammar import Grammar, GrammarMatcher, fill_masks

logger = logging.getLogger(__name__)
_MASKS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="grammar-masks")  # TokenChooser.prepare_async

MIN_TEMPERATURE = 1e-5
"""Temperatures below this sample the argmax (the limit T -> 0), without dividing by T."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the top k alternatives
    stop: tuple[str, ...] = ()
    # the sampling extensions of serving tools (vLLM's meaning)
    ignore_eos: bool = False  # the end-of-sequence token does not end the generation
    min_tokens: int = 0  # the end-of-sequence tokens (and stop strings) cannot end it before this many tokens
    top_k: int = -1  # -1 or 0: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    eos_token_ids: tuple[int, ...] = ()  # the tokens min_tokens blocks
    grammar: Grammar | None = None  # constrained decoding (swarm.engine.grammar)
    speculative: bool = True  # the orchestrator may draft and verify several tokens per step (when it speculates)
    grows: bool = False  # no explicit max_tokens: KV is reserved a part at a time (CompletionRunner.grow_tokens)
    # echo with logprobs: the prompt tokens' logprobs and this many alternatives (swarm.engine.scoring); a request
    # with max_new_tokens 0 only scores its prompt
    prompt_logprobs: int | None = None

    @property
    def plain_greedy(self) -> bool:
        """Plain argmax decoding (what transformers' greedy search does by itself)."""
        return (self.temperature < MIN_TEMPERATURE and not self.logit_bias and not self.presence_penalty
                and not self.frequency_penalty and self.logprobs is None and self.grammar is None
                and not self.min_tokens and self.repetition_penalty == 1.0)

    @property
    def decided_by_argmax(self) -> bool:
        """Every token is its position's argmax (logprobs may be asked: they do not change the choice)."""
        return (self.temperature < MIN_TEMPERATURE and not self.logit_bias and not self.presence_penalty
                and not self.frequency_penalty and self.grammar is None and not self.min_tokens
                and self.repetition_penalty == 1.0)

    @property
    def stops_at_eos(self) -> bool:
        """The end-of-sequence token ends the generation (unless ``ignore_eos``; a grammar's end always does)."""
        return not self.ignore_eos or self.grammar is not None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


class TokenChooser:
    """Chooses each next token per :class:`SamplingParams` (see the module doc). One per request; it keeps
    the generated tokens it chose (for penalties) across a session restart."""

    def __init__(self, params: SamplingParams, vocab_size: int):
        self.params = params
        self.generated: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.grammar = GrammarMatcher(params.grammar) if params.grammar is not None else None
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        self._bias = None
        if params.logit_bias:
            self._bias = torch.zeros(vocab_size)
            for token, bias in params.logit_bias:
                if 0 <= token < vocab_size:
                    self._bias[token] = bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        choice, _ = self.choose(input_ids, scores)
        forced = torch.full_like(scores, -math.inf)
        forced[:, choice] = 0.0
        return forced

    def choose(self, input_ids: torch.LongTensor, scores: torch.FloatTensor,
               draft: int | None = None) -> tuple[int, bool]:
        """(the next token, whether it is ``draft``). The choice is the request's own, made exactly as without a
        draft: a drafted token (speculative decoding, :mod:`swarm.engine.speculative`) is accepted when it is the
        choice — the argmax for greedy requests; for sampled ones the token drawn from the request's distribution,
        which is the drafted one with exactly its probability. The choice is recorded (penalties, logprobs,
        grammar)."""
        raw = scores[0].float()
        logits, allowed = self._adjusted(input_ids, raw)
        if not torch.isfinite(logits).any():  # nothing left: the grammar ends here, min_tokens or not
            fallback = raw.masked_fill(~allowed, -math.inf) if allowed is not None else raw
            choice = int(torch.argmax(fallback))
        elif self.params.temperature < MIN_TEMPERATURE:  # also 1e-300: logits / T would overflow; the limit is greedy
            choice = int(torch.argmax(logits))
        else:
            probs = self._probs(logits)
            if not (torch.isfinite(probs).all() and probs.sum() > 0):  # degenerate (non-finite logits): its mode
                choice = int(torch.argmax(logits))
            else:
                choice = int(torch.multinomial(probs, 1, generator=self._draws()))
        self._record(choice, raw)
        return choice, choice == draft

    def _draws(self) -> torch.Generator:
        """The random stream of the next token's draw. A seeded request's is seeded from its seed and the token's
        position: its text does not depend on which tokens a step drafted or verified, on what ran beside it, or
        on a session restart. An unseeded request draws from one stream."""
        if self.params.seed is not None:
            self.generator.manual_seed(hash((self.params.seed, len(self.generated))) & 0x7FFF_FFFF_FFFF_FFFF)
        return self.generator

    def _adjusted(self, input_ids: torch.LongTensor, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits after bias, ``min_tokens``, penalties and the grammar's mask (and the mask)."""
        logits = raw.clone()
        p = self.params
        if self._bias is not None:
            logits[: self._bias.numel()] += self._bias[: logits.numel()]
        if len(self.generated) < p.min_tokens and p.eos_token_ids:
            logits[[t for t in p.eos_token_ids if 0 <= t < logits.numel()]] = -math.inf
        if p.repetition_penalty != 1.0:
            seen = torch.cat([input_ids[0].reshape(-1).to(torch.long), torch.tensor(self.generated, dtype=torch.long)])
            seen = seen[(seen >= 0) & (seen < logits.numel())].unique()
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if self.generated and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(self.generated).unique(return_counts=True)
            logits[ids] -= counts.float() * p.frequency_penalty + p.presence_penalty
        allowed = None
        if self.grammar is not None:
            if self.grammar.error:
                raise RuntimeError(f"constrained decoding failed: {self.grammar.error}")
            allowed = self.grammar.allowed(logits.numel())
            logits = torch.where(allowed, logits, -math.inf)
        return logits, allowed

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution (unnormalised after the cuts): temperature, ``min_p``, ``top_k``, ``top_p``."""
        p = self.params
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if 0 < p.top_k < probs.numel():
            probs = probs.masked_fill(probs < probs.topk(p.top_k).values[-1], 0.0)
        if p.top_p < 1.0:
            probs = probs / probs.sum()
            ordered, order = probs.sort(descending=True)
            keep = ordered.cumsum(-1) - ordered < p.top_p  # the smallest set whose mass reaches top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
        return probs

    def _record(self, choice: int, raw: torch.Tensor) -> None:
        """The chosen token: its logprob and alternatives (the model's own distribution), penalties, grammar."""
        if self.params.logprobs is not None:
            logp = torch.log_softmax(raw, dim=-1)
            top = []
            if self.params.logprobs > 0:
                values, ids = logp.topk(self.params.logprobs)
                top = [(int(i), float(v)) for i, v in zip(ids, values)]
            self.logprobs.append(TokenLogprob(choice, float(logp[choice]), top))
        self.generated.append(choice)
        if self.grammar is not None:
            self.grammar.consume(choice)

    def observe(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """Record a token that this request's chooser on the chain's last server chose (with its logprob, when the
        request asks for them): penalties, ``min_tokens`` and a later :meth:`replay` go on from it."""
        if self.params.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        self.generated.append(int(token))
        if self.grammar is not None:
            self.grammar.consume(int(token))

    def replay(self, tokens: Iterable[int], logprobs: Iterable[TokenLogprob] = ()) -> None:
        """Continue a request whose earlier session chose ``tokens`` (with ``logprobs``): penalties, ``min_tokens``
        and the grammar go on from them (a seeded request's draws depend on its seed and positions only, so the
        text is the one an unbroken session gives)."""
        self.generated = list(tokens)
        self.logprobs = list(logprobs)[:len(self.generated)]
        if self.grammar is not None:
            for token in self.generated:
                self.grammar.consume(token)

    def truncate(self, tokens: int) -> None:
        """Forget every choice after the first ``tokens`` (a session that restarts re-chooses them)."""
        extra = len(self.generated) - tokens
        if extra > 0:
            del self.generated[tokens:], self.logprobs[tokens:]
            if self.grammar is not None:
                self.grammar.rollback(extra)

    @staticmethod
    def prepare(processors: Iterable) -> None:
        """Compute the grammar masks of a batched step's constrained choosers at once, in parallel. Never
        raises: a chooser whose mask is not ready computes it itself (and fails on its own)."""
        try:
            fill_masks([p.grammar for p in processors if isinstance(p, TokenChooser) and p.grammar is not None])
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not compute a step's grammar masks together: %r", exc)

    @staticmethod
    def prepare_async(processors: Iterable) -> Future | None:
        """:meth:`prepare` in the background (None: no chooser has a grammar): the batched path runs it while
        the step's messages travel through the chain. Wait for it (``.exception()``) before choosing."""
        constrained = [p for p in processors if isinstance(p, TokenChooser) and p.grammar is not None]
        return _MASKS.submit(TokenChooser.prepare, constrained) if constrained else None


class StopMatcher:
    """Finds the earliest ``stop`` string in the decoded text and tells how much text is safe to send."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)

    def check(self, text: str, after: int = 0) -> tuple[str, bool]:
        """``(text that may be sent, stopped)``: cut before the first stop string; without one, hold back a
        tail that is a prefix of some stop string (it may complete with the next token). Only a stop string
        that ends past character ``after`` counts (``min_tokens``: the text of the first tokens cannot stop)."""
        hits = self._hits(text, after)
        if hits:
            return text[:min(hits)], True
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return text[:len(text) - hold], False

    def final(self, text: str, after: int = 0) -> str:
        """The text of a finished generation: cut before the first stop string, nothing held back."""
        hits = self._hits(text, after)
        return text[:min(hits)] if hits else text

    def _hits(self, text: str, after: int) -> list[int]:
        return [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in self.stop) if i >= 0]


def choose_step(chooser, context: list[int], scores: torch.Tensor, draft: Sequence[int], left: int,
                eos: int | None) -> Iterator[int]:
    """The tokens one step emits, chosen one at a time from ``scores`` ``(k + 1, V)`` (row ``i``: the model's
    prediction after the ``i`` drafted tokens before it; ``k = len(draft)``): drafts are accepted while the choice
    at their row equals them, then the choice at the first other row ends the step; so does the end-of-sequence
    token ``eos`` and the ``left``-th token. ``chooser``: None (argmax), a :class:`TokenChooser` (which records
    each choice) or a transformers logits processor (argmax of its scores). ``context`` is the sequence before the
    step (the repetition penalty's prompt). A generator: a caller that stops early (a stop string) chooses no more.

    The one definition of a step's choice: the orchestrator's own head (:func:`swarm.engine.batching.emit_verified`)
    and the chain's last server (:mod:`server.multi_session`) both run it. Without a chooser, ``scores`` may be the
    rows' argmax ids ``(k + 1,)`` instead (the last server's runtime reduces greedy rows there)."""
    ids = None
    for i in range(len(draft) + 1):
        proposal = draft[i] if i < len(draft) else None
        if chooser is None:
            token = int(scores[i]) if scores.dim() == 1 else int(scores[i].float().argmax())
        else:
            row = scores[i: i + 1].float()
            if ids is None or ids.shape[1] != len(context):
                ids = torch.tensor([list(context)], dtype=torch.long)
            if isinstance(chooser, TokenChooser):
                token, _ = chooser.choose(ids, row, proposal)
            else:
                token = int(chooser(ids, row)[0].argmax())
            context = [*context, token]
        yield token
        if i + 1 >= left or token == eos or token != proposal:
            return


# -- the request's sampling controls as they travel to the chain's last server (swarm.engine.multi_wire) ------
MAX_WIRE_BIAS = 300  # logit_bias entries (OpenAI's own bound)
MAX_WIRE_TOKENS = 1 << 20  # ids in a spec's prompt or history
MAX_WIRE_GRAMMAR = 1 << 20  # characters of a grammar's llguidance source


def sampling_to_wire(params: SamplingParams, seed: int, generated: Sequence[int] = (),
                     context: Sequence[int] = (), eos: int | None = None) -> dict:
    """What the chain's last server needs to choose a request's tokens as :class:`TokenChooser` does here: the
    controls and the grammar's llguidance source (the server compiles it for its own copy of the tokenizer), the
    draw ``seed`` (the request's own, or one the orchestrator drew for it, so a new last server continues the same
    stream), the tokens chosen so far (``generated``: penalties, ``min_tokens`` and the grammar's state go on from
    them), the prompt (``context``, only for the repetition penalty, which reads it) and the token that ends the
    sequence (``eos``; None with ``ignore_eos``)."""
    return {"grammar": None if params.grammar is None else params.grammar.source,
            "temperature": float(params.temperature), "top_p": float(params.top_p), "top_k": int(params.top_k),
            "min_p": float(params.min_p), "seed": int(seed), "presence": float(params.presence_penalty),
            "frequency": float(params.frequency_penalty), "repetition": float(params.repetition_penalty),
            "bias": [[int(t), float(b)] for t, b in params.logit_bias], "logprobs": params.logprobs,
            "min_tokens": int(params.min_tokens), "eos_ids": [int(t) for t in params.eos_token_ids],
            "generated": [int(t) for t in generated],
            "context": [int(t) for t in context] if params.repetition_penalty != 1.0 else [],
            "eos": None if eos is None else int(eos)}


def _ints(value, what: str, vocab: int, limit: int = MAX_WIRE_TOKENS) -> list[int]:
    if (not isinstance(value, list) or len(value) > limit
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value)):
        raise ValueError(f"{what} must be a list of at most {limit} token ids in [0, {vocab})")
    return list(value)


def _number(spec: dict, key: str, low: float, high: float) -> float:
    value = spec.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (low <= value <= high):
        raise ValueError(f"sampling {key} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def sampling_from_wire(spec, vocab: int, tokenizer=None) -> tuple[TokenChooser | None, list[int], int | None]:
    """(a chooser that continues the request, its prompt context, its end-of-sequence token) from
    :func:`sampling_to_wire`'s spec (``{"greedy": true, "eos": id}``: no chooser, argmax); ``ValueError`` naming
    the field for anything malformed. ``tokenizer()`` gives the model's Hugging Face tokenizer, which a spec with a
    grammar is compiled for."""
    if not isinstance(spec, dict):
        raise ValueError("a sampling spec must be a map")
    eos = spec.get("eos")
    if eos is not None and (not isinstance(eos, int) or isinstance(eos, bool)):
        raise ValueError("sampling eos must be null or a token id")
    if spec.get("greedy") is True:  # plain argmax: no chooser
        return None, [], eos
    seed = spec.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or not -2 ** 63 <= seed < 2 ** 63:
        raise ValueError("sampling seed must be a 64-bit integer")
    logprobs = spec.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                 or not 0 <= logprobs <= 20):
        raise ValueError("sampling logprobs must be null or an integer in [0, 20]")
    bias = spec.get("bias", [])
    if (not isinstance(bias, list) or len(bias) > MAX_WIRE_BIAS
            or not all(isinstance(b, list) and len(b) == 2 and isinstance(b[0], int) and 0 <= b[0] < vocab
                       and isinstance(b[1], (int, float)) and math.isfinite(b[1]) for b in bias)):
        raise ValueError(f"sampling bias must be at most {MAX_WIRE_BIAS} [token id, finite bias] pairs")
    top_k, min_tokens = spec.get("top_k"), spec.get("min_tokens")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < -1:
        raise ValueError("sampling top_k must be an integer >= -1")
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
        raise ValueError("sampling min_tokens must be a non-negative integer")
    grammar = spec.get("grammar")
    if grammar is not None:
        if not isinstance(grammar, str) or len(grammar) > MAX_WIRE_GRAMMAR:
            raise ValueError(f"sampling grammar must be an llguidance grammar of at most {MAX_WIRE_GRAMMAR} characters")
        if tokenizer is None:
            raise ValueError("sampling grammar: this server has no tokenizer to compile it for")
        from swarm.engine.grammar import compile_grammar

        grammar = compile_grammar(grammar, tokenizer())
    params = SamplingParams(
        max_new_tokens=1, temperature=_number(spec, "temperature", 0.0, 100.0), grammar=grammar,
        top_p=_number(spec, "top_p", 0.0, 1.0), seed=seed,
        presence_penalty=_number(spec, "presence", -2.0, 2.0), frequency_penalty=_number(spec, "frequency", -2.0, 2.0),
        logit_bias=tuple((int(t), float(b)) for t, b in bias), logprobs=logprobs, min_tokens=min_tokens,
        top_k=top_k, min_p=_number(spec, "min_p", 0.0, 1.0),
        repetition_penalty=_number(spec, "repetition", 1e-6, 1e6),
        eos_token_ids=tuple(_ints(spec.get("eos_ids", []), "sampling eos_ids", vocab, 64)))
    chooser = TokenChooser(params, vocab)
    chooser.replay(_ints(spec.get("generated", []), "sampling generated", vocab))
    return chooser, _ints(spec.get("context", []), "sampling context", vocab), eos


def logprob_to_wire(entry: TokenLogprob) -> list:
    return [entry.token_id, entry.logprob, [[t, lp] for t, lp in entry.top]]


def logprob_from_wire(value, vocab: int) -> TokenLogprob:
    try:
        token, logprob, top = value
        entry = TokenLogprob(int(token), float(logprob), [(int(t), float(lp)) for t, lp in top])
    except (TypeError, ValueError):
        raise ValueError(f"a logprob is [token, logprob, [[token, logprob], ...]], got {value!r}") from None
    if not all(0 <= t < vocab for t in [entry.token_id, *(t for t, _ in entry.top)]):
        raise ValueError(f"a logprob names a token outside [0, {vocab})")
    return entry
