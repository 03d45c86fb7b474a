"""Which drafted tokens a verification pass accepts (speculative decoding; the drafts: :mod:`planner.drafting`).

The chain runs the last token plus ``k`` drafted tokens in one pass and returns the model's distribution at
each of the ``k + 1`` positions. Position ``i``'s distribution ``p_i`` is the one the model gives after the
sequence plus ``draft[:i]``; so:

* **greedy**: accept ``draft[i]`` while it is the argmax of ``p_i``; the token after the accepted prefix is the
  argmax at the first position that disagreed (or at position ``k``): exactly the tokens greedy decoding gives.
* **sampled**: position ``i``'s token is drawn from ``p_i`` exactly as without a draft (the request's own draw for
  that position), and ``draft[i]`` is accepted when it is that token; the first token that differs is emitted and
  the step stops there. This is speculative sampling (Leviathan et al., Chen et al.) with a draft that puts all its
  probability on one token, ``q = δ_x``: ``x`` is accepted with probability ``p_i(x) = min(1, p_i(x) / q(x))``
  and every emitted token is distributed as ``p_i``, since it *is* the draw from ``p_i``. Coupling the accept
  test to that draw adds one property: a seeded request, whose draws depend on its seed and positions alone
  (:meth:`swarm.engine.sampling.TokenChooser.choose`), emits the very tokens it emits without speculation,
  whatever was drafted.

Rows are the *chooser's* distributions (penalties, temperature, top-p, grammar masks already applied).
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

from planner.drafting import AdaptiveK, Drafter, OwnNgrams, SuffixIndex


class SessionDrafts:
    """One sequence's drafting: proposals for its tokens so far, and ``k`` adapted to its acceptance."""

    def __init__(self, speculation: "Speculation", client: str):
        self.speculation, self.client = speculation, client
        self.adaptive = AdaptiveK(k_max=speculation.k_max, k=speculation.k_max)
        self.own = speculation.drafter.own()  # this sequence's own n-grams, indexed as it grows
        self.drafted = self.accepted = 0  # this sequence's drafted tokens and the ones its steps verified

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` drafted tokens to follow ``tokens``."""
        return self.speculation.propose(self.client, tokens, min(self.adaptive.next_k(), limit), self.own)

    def update(self, proposed: int, accepted: int) -> None:
        self.adaptive.update(proposed, accepted)
        self.speculation.count(proposed, accepted)
        self.drafted += proposed
        self.accepted += accepted


class Speculation:
    """The orchestrator's speculative decoding (``--speculative ngram``): drafts from :class:`Drafter` (the
    request's own tokens, then the swarm's recent outputs in the client's scope), ``k`` per sequence from
    :class:`AdaptiveK`, at most ``k_max`` (a verification step's extra positions). Thread-safe."""

    def __init__(self, drafter: Drafter, *, k_max: int = 8):
        if k_max < 1:
            raise ValueError("k_max must be >= 1")
        self.drafter, self.k_max = drafter, int(k_max)
        self._lock = threading.Lock()
        self.proposed = self.accepted = self.verifications = 0

    def session(self, client: str) -> SessionDrafts:
        return SessionDrafts(self, client)

    def propose(self, client: str, tokens: Sequence[int], k: int, own: Optional[OwnNgrams] = None) -> list[int]:
        """Up to ``k`` drafted tokens to follow ``tokens`` in ``client``'s scope (``own``: the sequence's own
        n-gram index; the shared index of outputs guards itself)."""
        if k <= 0:
            return []
        return self.drafter.propose(client, tokens, k, own)[:k]

    def learn(self, client: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Index a finished output for later drafts (in the client's scope)."""
        if output:
            self.drafter.learn(client, output, prompt)

    def count(self, proposed: int, accepted: int) -> None:
        if proposed:
            with self._lock:
                self.proposed += proposed
                self.accepted += accepted
                self.verifications += 1

    def stats(self) -> dict:
        """Drafted and accepted tokens, verification steps, the acceptance rate and mean accepted length."""
        with self._lock:
            return {"proposed": self.proposed, "accepted": self.accepted, "verifications": self.verifications,
                    "acceptance": self.accepted / self.proposed if self.proposed else 0.0,
                    "mean_accepted": self.accepted / self.verifications if self.verifications else 0.0}


def _ngram(options) -> Speculation:
    index = SuffixIndex(max_tokens=options.speculative_index_tokens)
    return Speculation(Drafter(index, shared=options.speculative_shared), k_max=options.speculative_k)


SPECULATORS = {"off": lambda options: None, "ngram": _ngram}  # --speculative


def from_options(options) -> Optional[Speculation]:
    """The orchestrator's :class:`Speculation` for its options (``--speculative``), or None."""
    return SPECULATORS[options.speculative](options)
