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
from typing import Iterable

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
