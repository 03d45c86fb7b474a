"""Drafts without a draft model: n-gram proposals for speculative decoding (prompt-lookup decoding, swarm-wide).

A draft is up to ``k`` tokens that probably follow a sequence; the chain then verifies them in one pass and
keeps the longest prefix the model agrees with. Two sources, tried in order:

* **the request's own tokens** (prompt + output so far): the longest suffix of ``n`` tokens
  (``max_n ≥ n ≥ min_n``) that occurred earlier in the sequence proposes what followed its latest earlier
  occurrence — outputs that copy from their inputs (code edits, summaries, quotes) draft themselves;
* **a bounded suffix index of recent outputs** (:class:`SuffixIndex`): every finished output of the model is
  indexed by its n-grams, under a *scope* (a client id, or one shared scope when the operator allows it), and
  a suffix that matches an earlier output proposes that output's continuation. Memory is bounded by the total
  number of indexed tokens; the least recently added outputs go first.

Pure Python, no I/O, no torch: the orchestrator owns the tokens and calls :meth:`Drafter.propose` per step.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence


def lookup_own(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """Up to ``k`` tokens following the latest earlier occurrence of the longest suffix n-gram of ``tokens``."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n:])
        for start in range(length - n - 1, -1, -1):  # latest earlier occurrence first
            if list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + k])
                if follow:
                    return follow
    return []


class OwnNgrams:
    """:func:`lookup_own` for one growing sequence, in time independent of its length.

    The sequence's n-grams (``min_n ≤ n ≤ max_n``) that have a following token map to their latest start, and the
    map grows with the tokens each call adds; the suffix itself has no follower yet, so the map holds exactly the
    earlier occurrences :func:`lookup_own` scans for. At 1,000 tokens a scan took ~1 ms of the orchestrator's
    step per session where no n-gram repeats, under the drafter's lock; this takes a few microseconds. A sequence
    that is not an extension of the last one seen (a caller that reuses the object) is indexed anew."""

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n
        self._tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}

    def _extend(self, tokens: Sequence[int]) -> None:
        seen = self._tokens
        if len(tokens) < len(seen) or list(tokens[:len(seen)]) != seen:
            seen, self._tokens, self._latest = [], [], {}
        for follower in range(len(seen), len(tokens)):  # n-grams that end right before a new token
            self._tokens.append(int(tokens[follower]))
            for n in range(self.min_n, self.max_n + 1):
                if follower >= n:
                    self._latest[tuple(self._tokens[follower - n:follower])] = follower - n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """What ``lookup_own(tokens, k, max_n, min_n)`` returns."""
        if k <= 0:
            return []
        self._extend(tokens)
        length = len(self._tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._latest.get(tuple(self._tokens[length - n:]))
            if start is not None:
                return self._tokens[start + n:start + n + k]
        return []


class SuffixIndex:
    """n-grams of recent outputs → where they continue, per scope, bounded by ``max_tokens`` in total.

    ``add(scope, tokens)`` indexes one output (its every ``n``-gram, ``n`` = ``key_n``); ``continuation(scope,
    context, k)`` proposes up to ``k`` tokens that followed the context's last ``key_n`` tokens in the most recent
    output of that scope containing them. A scope never sees another scope's outputs. Thread-safe: sessions draft
    from it while others finish and add theirs."""

    def __init__(self, max_tokens: int = 1_000_000, key_n: int = 3):
        if max_tokens < 1 or key_n < 1:
            raise ValueError("max_tokens and key_n must be >= 1")
        self.max_tokens, self.key_n = max_tokens, key_n
        self._lock = threading.Lock()
        self._docs: OrderedDict[int, tuple[str, tuple[int, ...]]] = OrderedDict()  # id -> (scope, tokens)
        self._keys: dict[tuple[str, tuple[int, ...]], list[tuple[int, int]]] = {}  # -> [(doc id, end of n-gram)]
        self._next_id, self.tokens = 0, 0

    def add(self, scope: str, tokens: Sequence[int]) -> None:
        tokens = tuple(int(t) for t in tokens)
        if len(tokens) <= self.key_n or len(tokens) > self.max_tokens:
            return
        with self._lock:
            doc, self._next_id = self._next_id, self._next_id + 1
            self._docs[doc] = (scope, tokens)
            self.tokens += len(tokens)
            for end in range(self.key_n, len(tokens)):
                self._keys.setdefault((scope, tokens[end - self.key_n:end]), []).append((doc, end))
            while self.tokens > self.max_tokens:
                self._evict()

    def _evict(self) -> None:
        doc, (scope, tokens) = self._docs.popitem(last=False)
        self.tokens -= len(tokens)
        for end in range(self.key_n, len(tokens)):
            key = (scope, tokens[end - self.key_n:end])
            entries = [e for e in self._keys.get(key, ()) if e[0] != doc]
            if entries:
                self._keys[key] = entries
            else:
                self._keys.pop(key, None)

    def continuation(self, scope: str, context: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(context) < self.key_n:
            return []
        key = (scope, tuple(int(t) for t in context[-self.key_n:]))
        with self._lock:
            entries = self._keys.get(key)
            if not entries:
                return []
            doc, end = entries[-1]  # the most recent output
            return list(self._docs[doc][1][end:end + k])

    def __len__(self) -> int:
        return len(self._docs)


@dataclass
class Drafter:
    """Proposes drafts for one model: the request's own tokens first, then the swarm's recent outputs in the
    request's scope (``shared``: every client drafts from every client's outputs; else each from its own)."""

    index: SuffixIndex
    shared: bool = False
    max_n: int = 4
    min_n: int = 2

    def scope(self, client: str) -> str:
        return "*" if self.shared else f"client:{client}"

    def own(self) -> OwnNgrams:
        """A sequence's incremental index of its own tokens, kept between its steps (:meth:`propose`'s ``own``)."""
        return OwnNgrams(self.max_n, self.min_n)

    def propose(self, client: str, tokens: Sequence[int], k: int, own: Optional[OwnNgrams] = None) -> list[int]:
        mine = own.propose(tokens, k) if own is not None else lookup_own(tokens, k, self.max_n, self.min_n)
        return mine or self.index.continuation(self.scope(client), tokens, k)

    def learn(self, client: str, output: Sequence[int], prompt_tail: Optional[Sequence[int]] = None) -> None:
        """Index a finished output (with the prompt's last tokens before it, so its start can be matched)."""
        self.index.add(self.scope(client), list(prompt_tail or ())[-self.index.key_n:] + list(output))


@dataclass
class AdaptiveK:
    """How many tokens a session drafts next, from how its last drafts fared.

    All accepted: one more (up to ``k_max``, the server's batch bound on a step's positions). Some accepted (at
    least ``keep_fraction`` of them, and at least one): the same — a draft cut short by an edit still copied from
    the right place, and one accepted token saves a whole chain step, which pays for up to ~15 drafted positions on
    the development CPU (a drafted position adds ~6% of a step, ``experiments/bench/drafting.py``'s cost model) and
    for far more on a GPU, whose step time is flat in its positions. None accepted: half as many, so drafts that
    keep failing reach 0 within ``log2(k_max)`` steps. At 0 the session probes with one token every
    ``probe_every`` steps, so speculation costs it almost nothing where outputs do not repeat (a probe is drafted
    only where the text so far has a match). Every 4, not 16: an answer that starts copying after early drafts
    failed (Gemma 3's chat in the benchmark) is found within 4 steps. The offline replay
    (``python -m experiments.bench.drafting``) compares these rules with the earlier ones: ``ngram-probe16``, and
    ``ngram-keep-half`` (``keep_fraction=0.5``: halve unless at least half the draft was accepted)."""

    k_max: int = 8
    k: int = 4
    probe_every: int = 4
    keep_fraction: float = 0.0
    _idle: int = 0

    def next_k(self) -> int:
        if self.k > 0:
            return self.k
        self._idle += 1
        if self._idle >= self.probe_every:
            self._idle = 0
            return 1
        return 0

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted {accepted} of {proposed} drafted tokens")
        if accepted == proposed:
            self.k = min(self.k_max, max(self.k, proposed) + 1)
        elif accepted == 0 or accepted < self.keep_fraction * proposed:
            self.k //= 2
