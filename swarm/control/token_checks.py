"""The spot checks' check of the chain's last server's choice of token (:mod:`server.ends`).

A checked session's last server chose its tokens itself; when that server's blocks pass their check
(:mod:`swarm.control.spot_checks`), its tokens are checked against its own outputs too. Greedy sessions only (every
token its position's argmax). Two ways, the first where it can:

* the checker holds the last block as well and chooses tokens itself: it verifies the checked server's last tokens
  (:func:`tokens_to_verify`) as drafts in the check's prefill, and :func:`disagreement` looks only at where the two
  part — one LM-head row on the orchestrator, none for honest work;
* else :func:`head_mismatch` runs the orchestrator's LM head over the checked server's outputs at
  :data:`MAX_HEAD_ROWS` sampled generated positions.

Another device's kernels may order a near-tie the other way, so a token counts as wrong only when its logit is below
the argmax's by more than the server's dtype's tolerance (:data:`~swarm.trust.verification.EPSILON`) times the
largest logit's size (:func:`wrong_choice`).
"""
from __future__ import annotations

import random
from typing import Callable, Optional

import torch

from swarm.trust.verification import EPSILON

MAX_VERIFIED = 64  # the last generated tokens a last-block checker verifies as drafts (multi_wire.MAX_DRAFT)
# generated positions the orchestrator's own head recomputes (sampled, the last one always): each is one LM-head row
# on its CPU (a 131k-vocabulary head made the checks half its busy time at 32 rows; bench_orchestrator)
MAX_HEAD_ROWS = 8


def _generated_rows(job, offset: int, outputs: torch.Tensor) -> Optional[tuple[int, int]]:
    """(how many tokens the session generated, the row of the recorded ``outputs`` that predicts the first of them),
    or None when the check does not apply (not greedy, or the recording does not cover them)."""
    if not job.greedy or job.prompt_tokens < 1:
        return None
    generated = len(job.token_ids) - job.prompt_tokens
    first_row = job.prompt_tokens - 1 - offset
    if generated < 1 or first_row < 0 or first_row + generated > outputs.shape[0]:
        return None
    return generated, first_row


def wrong_choice(logits: torch.Tensor, got: int, position: int, dtype: str) -> Optional[str]:
    """Why token ``got`` at generated ``position`` is not the choice ``logits`` ``(V,)`` give (None: it is, within
    ``dtype``'s tolerance)."""
    if not 0 <= got < logits.numel():
        return f"chose token {got} at generated position {position}, outside the vocabulary"
    want = int(logits.argmax())
    margin = EPSILON.get(dtype, EPSILON["bfloat16"])
    if got != want and float(logits[want] - logits[got]) > margin * max(1.0, float(logits[want].abs())):
        return (f"chose token {got} at generated position {position} where the LM head over its own outputs "
                f"gives {want} (logits {float(logits[got]):.3g} < {float(logits[want]):.3g})")
    return None


def tokens_to_verify(job, offset: int, outputs: torch.Tensor) -> Optional[list[int]]:
    """A greedy session's last generated tokens (up to :data:`MAX_VERIFIED` + 1) that a last-block checker verifies,
    or None when the check does not apply."""
    rows = _generated_rows(job, offset, outputs)
    return None if rows is None else job.token_ids[-min(rows[0], MAX_VERIFIED + 1):]


@torch.inference_mode()
def disagreement(job, offset: int, outputs: torch.Tensor, dtype: str, verify: list[int], theirs: list[int],
                 head: Optional[Callable]) -> Optional[str]:
    """The checked server's tokens ``verify`` against the checker's own greedy choice ``theirs`` over the same
    positions: equal, no LM head runs here; where they part, ``head`` over the checked server's own ``outputs`` at
    that one position decides (None without a head: no opinion of our own, no strike)."""
    if theirs == verify:
        return None
    at = next((j for j, (a, b) in enumerate(zip(verify, theirs)) if a != b), min(len(theirs), len(verify)) - 1)
    position = len(job.token_ids) - len(verify) + at  # the token's index in token_ids
    row = position - 1 - offset
    if head is None or not 0 <= row < outputs.shape[0]:
        return None
    return wrong_choice(head(outputs[row][None]).float()[0], verify[at], position - job.prompt_tokens, dtype)


@torch.inference_mode()
def head_mismatch(job, offset: int, outputs: torch.Tensor, dtype: str, head: Callable,
                  rng: random.Random) -> Optional[str]:
    """``head`` (the orchestrator's LM head) over the checked server's own ``outputs`` at up to
    :data:`MAX_HEAD_ROWS` sampled generated positions (the last one always): the first token that is not their
    choice (None: all are)."""
    generated, first_row = _generated_rows(job, offset, outputs)
    picked = sorted(set(rng.sample(range(generated), min(generated, MAX_HEAD_ROWS - 1))) | {generated - 1})
    logits = head(outputs[torch.tensor([first_row + i for i in picked])]).float()
    for i, row in zip(picked, logits):
        wrong = wrong_choice(row, job.token_ids[job.prompt_tokens + i], i, dtype)
        if wrong is not None:
            return wrong
    return None
