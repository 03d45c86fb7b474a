"""Prompt log-probabilities: what the model gives each token of a prompt after the tokens before it.

``POST /v1/completions`` with ``echo`` and ``logprobs`` (OpenAI's legacy scoring request, what evaluation
harnesses such as lm-evaluation-harness send for log-likelihoods, usually with ``max_tokens`` 0 or 1) needs, for
every prompt position t ≥ 1, log p(x_t | x_<t) and the top alternatives there. That is one prefill of the prompt
through the chain whose outputs are kept at *every* position (a generation keeps only the last one), followed by
the final norm and the LM head here, a few rows at a time: the logits of a whole prompt at once would be
``T × V`` floats (a 2,048-token prompt and SmolLM2's 49,152-token vocabulary: 400 MB).

The prefill runs as one petals inference session on the request's lease (:func:`swarm.engine.routing.use_lease`),
so a server that fails under it is replaced as in any session (petals' failover, routed by the orchestrator) and
any route works, vanilla petals servers included. It is not recorded for spot checks.

**Prompts that share a prefix** (an evaluation asks each question once per answer: the same context, a different
continuation) are not computed again from the start. A score of position t depends on tokens ≤ t only, so the
scores of a page-aligned prefix are the same in every prompt that starts with it; :class:`ScoreCache` keeps them
with the last block's output at the prefix's last position, under the page hash that ends the prefix (the hashes
of :mod:`swarm.trust.prefix` chain every earlier token). A prompt whose prefix is cached and whose chain's servers
hold that prefix's pages (the prefix store's KV, which every scoring prefill stores) loads those pages and
computes only the positions after them; the first new token's score comes from the cached output. A server that
fails in such a session, or pages evicted since the probe, make it score again from the full prompt.

The last position's output is kept too (:class:`PromptScores`): it is the distribution of the token after the
prompt, so a request that asks for one token with its scores (lm-evaluation-harness's: ``echo``, ``logprobs`` 1,
``max_tokens`` 1) gets its answer from the same prefill (:meth:`swarm.engine.generation.GenerationEngine.answer_scored`)
instead of prefilling the prompt a second time.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from swarm.engine.batching import head_logits
from swarm.engine.routing import Lease, LeaseProvider, PrefixPlan, SessionControl, probe_route, use_lease
from swarm.engine.sampling import TokenLogprob
from swarm.trust.prefix import PAGE_TOKENS, reusable_pages

HEAD_ROWS = 64  # positions per LM-head pass: 64 × 49,152 float32 logits are 12.6 MB
RECORD_BYTES = 256  # what ScoreCache counts for one record (a TokenLogprob and its few alternatives, roughly)


class CachedPrefix(NamedTuple):
    """``pages`` page-aligned prefix tokens' scores: ``records`` (targets 1 … pages·page − 1) and ``last``, the last
    block's output at the prefix's last position (the first token after it is scored from it)."""

    pages: int
    records: list[TokenLogprob]
    last: torch.Tensor


class _Entry(NamedTuple):
    records: list[TokenLogprob]  # the whole prompt's (shared by its entries)
    pages: int
    last: torch.Tensor
    top: int  # alternatives per record
    size: int  # bytes counted


class ScoreCache:
    """Scores of prompts' page-aligned prefixes (module doc), by the page hash that ends each: an entry per full page
    of every scored prompt, all sharing that prompt's records. Bounded by ``max_bytes``, least recently used first
    out; each entry is counted with its output vector and its own page's records (a prompt's entries together
    count its records once; an evicted short prefix's records stay while a longer one of the same prompt is kept,
    so the memory held is at most about twice the bound). Thread-safe."""

    def __init__(self, max_bytes: int = 64 << 20, page_tokens: int = PAGE_TOKENS):
        self.max_bytes, self.page_tokens = max_bytes, page_tokens
        self.bytes = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, hashes: Sequence[bytes], max_pages: int, top: int) -> CachedPrefix | None:
        """The longest cached prefix of at most ``max_pages`` pages whose records have ``top`` alternatives or more
        (cut to ``top``)."""
        with self._lock:
            for pages in range(min(max_pages, len(hashes)), 0, -1):
                entry = self._entries.get(hashes[pages - 1])
                if entry is not None and entry.pages == pages and entry.top >= top:
                    self._entries.move_to_end(hashes[pages - 1])
                    break
            else:
                return None
        kept = entry.records[:pages * self.page_tokens - 1]
        if entry.top > top:
            kept = [TokenLogprob(r.token_id, r.logprob, r.top[:top]) for r in kept]
        return CachedPrefix(pages, kept, entry.last)

    def store(self, hashes: Sequence[bytes], records: list[TokenLogprob], outputs: dict[int, torch.Tensor],
              top: int) -> None:
        """Keep ``records`` (a prompt's, targets 1 … n − 1) for each page count ``p`` of ``outputs`` (its output at
        position p·page − 1), under ``hashes[p − 1]``."""
        with self._lock:
            for pages, last in outputs.items():
                key, size = hashes[pages - 1], last.numel() * last.element_size() + self.page_tokens * RECORD_BYTES
                if size > self.max_bytes:
                    continue
                old = self._entries.pop(key, None)
                if old is not None:
                    self.bytes -= old.size
                self._entries[key] = _Entry(records, pages, last.detach().clone(), top, size)
                self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.size


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
    reused: int = 0  # leading prompt tokens whose KV came from the prefix stores and scores from the ScoreCache


@torch.inference_mode()
def score_prompt(model, lease: Lease, provider: LeaseProvider | None, input_ids: Sequence[int], top: int,
                 control: SessionControl | None = None, manager=None, hashes: Sequence[bytes] = (),
                 cache: ScoreCache | None = None) -> PromptScores:
    """The log-probability of every prompt token after the ones before it (``len(input_ids) − 1`` records: the
    first token has none), computed by one prefill of ``input_ids`` through ``lease``'s chain (``model``: the
    engine's petals distributed causal LM), and the last position's output. With the prompt's page ``hashes`` the
    servers store its pages; with a ``cache`` too, a prefix cached there and held by every server of the route
    (asked through ``manager``) is loaded, not computed (module doc; a failure in such a session raises
    :class:`swarm.engine.routing.PrefixSessionFailed`)."""
    ids = list(input_ids)
    if len(ids) < 2:
        return PromptScores([])
    hashes = list(hashes)
    known = cache.lookup(hashes, (len(ids) - 1) // PAGE_TOKENS, top) if cache is not None and hashes else None
    if known is not None and manager is not None:
        held = probe_route(manager, lease.route, hashes[:known.pages], page_tokens=PAGE_TOKENS, ticket=lease.ticket)
        pages = reusable_pages(held, len(ids))
        known = known if pages >= known.pages else cache.lookup(hashes, pages, top) if pages else None
    else:
        known = None
    skip = known.pages * PAGE_TOKENS if known is not None else 0
    embed = model.transformer.word_embeddings
    with use_lease(lease, provider, control) as context:
        context.prefix = PrefixPlan(hashes, known.pages if known is not None else 0, PAGE_TOKENS) if hashes else None
        with model.transformer.h.inference_session(max_length=len(ids)) as session:
            hidden = session.step(embed(torch.tensor([ids])))[0]
    if control is not None:
        control.progress()
    if known is None:
        records = logprobs_of(model, hidden[:-1], ids[1:], top)
    else:  # the first new token is scored from the prefix's cached output; the reused positions' outputs are zeros
        rows = torch.cat([known.last[None].to(hidden.dtype), hidden[skip:-1]])
        records = known.records + logprobs_of(model, rows, ids[skip:], top)
    if cache is not None and hashes:
        cache.store(hashes, records, {p: hidden[p * PAGE_TOKENS - 1] for p in range(skip // PAGE_TOKENS + 1,
                                                                                 len(hashes) + 1)}, top)
    return PromptScores(records, hidden[-1].clone(), skip)
