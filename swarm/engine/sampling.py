"""How the next token is chosen, and how generation stops: the OpenAI sampling surface, exactly.

The orchestrator runs the LM head of every proxied session itself, so everything that acts on logits is
applied here, on the real logits:

* :class:`TokenChooser` — a transformers ``LogitsProcessor`` that adds ``logit_bias``, subtracts OpenAI's
  presence and frequency penalties (``μ[j] − c[j]·α_frequency − [c[j] > 0]·α_presence`` over the tokens
  generated so far), then picks greedily (temperature 0) or samples with temperature and top-p from a
  per-request ``torch.Generator`` (same seed and prompt → same text, whatever else runs concurrently). It
  records the chosen token's log-probability and the ``top_logprobs`` alternatives from the model's own
  distribution (log-softmax of the raw logits), then returns logits that put all mass on its choice, so
  transformers' greedy loop emits exactly that token.
* :class:`StopMatcher` — ``stop`` strings matched across token boundaries on the decoded text; text that
  could still be the start of a stop string is held back, so a stop string is never part of what a client
  receives, streamed or not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


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

    @property
    def plain_greedy(self) -> bool:
        """Plain argmax decoding (what transformers' greedy search does by itself)."""
        return (self.temperature < MIN_TEMPERATURE and not self.logit_bias and not self.presence_penalty
                and not self.frequency_penalty and self.logprobs is None)


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
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        self._bias = None
        if params.logit_bias:
            self._bias = torch.zeros(vocab_size)
            for token, bias in params.logit_bias:
                if 0 <= token < vocab_size:
                    self._bias[token] = bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        raw = scores[0].float()
        logits = raw.clone()
        p = self.params
        if self._bias is not None:
            logits[: self._bias.numel()] += self._bias[: logits.numel()]
        if self.generated and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(self.generated).unique(return_counts=True)
            logits[ids] -= counts.float() * p.frequency_penalty + p.presence_penalty
        if p.temperature < MIN_TEMPERATURE:  # also 1e-300: logits / T would overflow; the limit is greedy
            choice = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / p.temperature, dim=-1)
            if p.top_p < 1.0:
                ordered, order = probs.sort(descending=True)
                keep = ordered.cumsum(-1) - ordered < p.top_p  # the smallest set whose mass reaches top_p
                probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
            if torch.isfinite(probs).all() and probs.sum() > 0:
                choice = int(torch.multinomial(probs, 1, generator=self.generator))
            else:  # degenerate distribution (non-finite logits): its mode
                choice = int(torch.argmax(logits))
        if p.logprobs is not None:
            logp = torch.log_softmax(raw, dim=-1)
            top = []
            if p.logprobs > 0:
                values, ids = logp.topk(p.logprobs)
                top = [(int(i), float(v)) for i, v in zip(ids, values)]
            self.logprobs.append(TokenLogprob(choice, float(logp[choice]), top))
        self.generated.append(choice)
        forced = torch.full_like(scores, -math.inf)
        forced[:, choice] = 0.0
        return forced


class StopMatcher:
    """Finds the earliest ``stop`` string in the decoded text and tells how much text is safe to send."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)

    def check(self, text: str) -> tuple[str, bool]:
        """``(text that may be sent, stopped)``: cut before the first stop string; without one, hold back a
        tail that is a prefix of some stop string (it may complete with the next token)."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            return text[:min(hits)], True
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return text[:len(text) - hold], False

    def final(self, text: str) -> str:
        """The text of a finished generation: cut before the first stop string, nothing held back."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return text[:min(hits)] if hits else text
