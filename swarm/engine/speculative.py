"""Which drafted tokens a verification pass accepts (speculative decoding; the drafts: :mod:`planner.drafting`).

The chain runs the last token plus ``k`` drafted tokens in one pass and returns the model's distribution at
each of the ``k + 1`` positions. Position ``i``'s distribution ``p_i`` is the one the model gives after the
sequence plus ``draft[:i]``; so:

* **greedy**: accept ``draft[i]`` while it is the argmax of ``p_i``; the token after the accepted prefix is the
  argmax at the first position that disagreed (or at position ``k``): exactly the tokens greedy decoding gives.
* **sampled** (speculative sampling, Leviathan et al. / Chen et al., with a draft that puts all its probability
  on one token, ``q = δ_x``): accept ``x = draft[i]`` with probability ``min(1, p_i(x) / q(x)) = p_i(x)``; on the
  first rejection, sample from the residual ``max(0, p_i − q)`` normalised — ``p_i`` without ``x`` — and stop.
  Every emitted token is then distributed exactly as ``p_i``: P(x) = p_i(x), and P(y ≠ x) = (1 − p_i(x)) ·
  p_i(y) / (1 − p_i(x)) = p_i(y). The draws use the request's own generator, so a seeded request stays
  reproducible.

Rows are the *chooser's* distributions (penalties, temperature, top-p, grammar masks already applied).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def accept_greedy(scores: torch.Tensor, draft: Sequence[int]) -> tuple[int, int]:
    """(accepted drafted tokens, the token after them) for ``scores`` ``(k + 1, V)`` and ``k`` drafted tokens."""
    if scores.shape[0] != len(draft) + 1:
        raise ValueError(f"{scores.shape[0]} score rows for {len(draft)} drafted tokens (need k + 1)")
    best = scores.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and best[accepted] == int(draft[accepted]):
        accepted += 1
    return accepted, int(best[accepted])


def accept_sampled(probs: torch.Tensor, draft: Sequence[int],
                   generator: Optional[torch.Generator] = None) -> tuple[int, int]:
    """(accepted drafted tokens, the token after them) for distributions ``probs`` ``(k + 1, V)`` (rows sum to 1)."""
    if probs.shape[0] != len(draft) + 1:
        raise ValueError(f"{probs.shape[0]} probability rows for {len(draft)} drafted tokens (need k + 1)")
    probs = probs.float()
    for i, token in enumerate(int(t) for t in draft):
        if torch.rand((), generator=generator) < probs[i, token]:
            continue
        residual = probs[i].clone()
        residual[token] = 0.0
        total = residual.sum()
        if total <= 0:  # p_i was all on the drafted token: it cannot be rejected (rand < 1 always): unreachable
            return i + 1, token
        return i, int(torch.multinomial(residual / total, 1, generator=generator))
    return len(draft), int(torch.multinomial(probs[len(draft)], 1, generator=generator))
