"""Prompt log-probabilities: what the model gives each token of a prompt after the tokens before it.

``POST /v1/completions`` with ``echo`` and ``logprobs`` (OpenAI's legacy scoring request, what evaluation
harnesses such as lm-evaluation-harness send for log-likelihoods, usually with ``max_tokens`` 0 or 1) needs, for
every prompt position t ≥ 1, log p(x_t | x_<t) and the top alternatives there. That is one prefill of the prompt
through the chain whose outputs are kept at *every* position (a generation keeps only the last one), followed by
the final norm and the LM head here, a few rows at a time: the logits of a whole prompt at once would be
``T × V`` floats (a 2,048-token prompt and SmolLM2's 49,152-token vocabulary: 400 MB).

The prefill runs as one petals inference session on the request's lease (:func:`swarm.engine.routing.use_lease`),
so a server that fails under it is replaced as in any session (petals' failover, routed by the orchestrator) and
any route works, vanilla petals servers included. It computes every position: the prefix store's pages hold keys
and values, not the hidden states a score needs. It stores no pages either: a server stores a prefill's pages only
after the step's answer, and the probe of an answer generated right after the scores in the same request (``echo``
with ``max_tokens`` ≥ 1: lm-evaluation-harness asks for one token) raced that store and found nothing; that answer
prefills the prompt again, reusing pages that earlier requests left. It is not recorded for spot checks.

The last position's output is kept too (:class:`PromptScores`): it is the distribution of the token after the
prompt, so a request that asks for one token with its scores (lm-evaluation-harness's: ``echo``, ``logprobs`` 1,
``max_tokens`` 1) gets its answer from the same prefill (:meth:`swarm.engine.generation.GenerationEngine.answer_scored`)
instead of prefilling the prompt a second time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from swarm.engine.batching import head_logits
from swarm.engine.routing import Lease, LeaseProvider, SessionControl, use_lease
from swarm.engine.sampling import TokenLogprob

HEAD_ROWS = 64  # positions per LM-head pass: 64 × 49,152 float32 logits are 12.6 MB


@torch.inference_mode()
def logprobs_of(model, hidden: torch.Tensor, targets: Sequence[int], top: int,
                rows: int = HEAD_ROWS) -> list[TokenLogprob]:
    """``targets[i]``'s log-probability after position i of ``hidden`` ``(n, H)`` (the last block's outputs), with
    the ``top`` most likely tokens there, most likely first; the model's own distribution (log-softmax of the raw
    logits, as :class:`swarm.engine.sampling.TokenChooser` reports a generated token's)."""
    if hidden.shape[0] != len(targets):
        raise ValueError(f"{hidden.shape[0]} positions for {len(targets)} targets")
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), rows):
        logp = torch.log_softmax(head_logits(model, hidden[start:start + rows]).float(), dim=-1)
        chosen = torch.tensor(targets[start:start + rows])
        values = logp.gather(1, chosen[:, None])[:, 0].tolist()
        if top > 0:
            best, ids = logp.topk(top, dim=-1)
            alternatives = [list(zip(i.tolist(), v.tolist())) for i, v in zip(ids, best)]
        else:
            alternatives = [[] for _ in values]
        out.extend(TokenLogprob(int(t), float(v), a) for t, v, a in zip(chosen.tolist(), values, alternatives))
    return out


@dataclass
class PromptScores:
    """A prompt's scores: ``records[t − 1]`` is token t's log-probability after the ones before it (t ≥ 1), and
    ``last`` the last block's output at the prompt's last position ``(H,)``: the next token's distribution (None
    for a one-token prompt, which has nothing to score and is not prefilled)."""

    records: list[TokenLogprob]
    last: Optional[torch.Tensor] = None


@torch.inference_mode()
def score_prompt(model, lease: Lease, provider: LeaseProvider | None, input_ids: Sequence[int], top: int,
                 control: SessionControl | None = None) -> PromptScores:
    """The log-probability of every prompt token after the ones before it (``len(input_ids) − 1`` records: the
    first token has none), computed by one prefill of ``input_ids`` through ``lease``'s chain (``model``: the
    engine's petals distributed causal LM), and the last position's output."""
    ids = list(input_ids)
    if len(ids) < 2:
        return PromptScores([])
    embed = model.transformer.word_embeddings
    with use_lease(lease, provider, control):
        with model.transformer.h.inference_session(max_length=len(ids)) as session:
            hidden = session.step(embed(torch.tensor([ids])))
    if control is not None:
        control.progress()
    return PromptScores(logprobs_of(model, hidden[0, :-1], ids[1:], top), hidden[0, -1].clone())
