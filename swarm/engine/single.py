"""Speculative decoding on petals' per-session path: one session, its drafts verified in its own steps.

The batched path (:mod:`swarm.engine.batching`) verifies drafts inside its multi-session steps. A session that runs
as a petals session — the rest of a batched session whose server failed, every session with ``--batch-sessions
0`` — steps through petals' ``InferenceSession`` (:class:`swarm.engine.routing.ChainswarmInferenceSession`, with
its failover) instead. :func:`generate` drives such a session: each step sends the last token plus the drafted
ones, ``(1, k + 1, H)``; :func:`swarm.engine.batching.emit_verified` keeps the verified prefix and the model's next
token (the batched path's rule: greedy tokens are those of one token per step, sampled ones keep their
distribution); the rejected drafts' positions are taken back (:meth:`ChainswarmInferenceSession.rollback`): at once
in the client's input history, which a failover replays on a replacement server, and on each server with the
next step.

Bounds. The session declares its own prompt + ``max_new_tokens`` as its ``max_length``: its servers' pages (and
the orchestrator's reservation) stay bounded by that. But petals' step loop on each server counts every position
it was sent, taken back or not, against ``max_length``: so the session also asks for as much room again for the
positions it will take back (``ROLLBACK_ROOM_KEY``), which each Chainswarm server grants within its longest
session, and a step drafts only as many tokens as leave room for the rest of the answer at one token per step,
even were every draft rejected. A step also drafts no more than the tokens left after it.

A server that does not confirm a rollback (a vanilla petals server on the route) still holds the rejected
positions: the step's outputs are discarded and :class:`RollbackUnconfirmed` ends the session with the tokens so
far, which the engine continues without drafts.
"""
from __future__ import annotations

import torch

from swarm.engine.batching import Decoding, emit_verified, head_logits


class RollbackUnconfirmed(RuntimeError):
    """A server of the chain did not confirm a rollback: its cache still holds rejected drafts (``peers``)."""

    def __init__(self, peers: list[str]):
        super().__init__(f"servers {peers} did not confirm a rollback (vanilla petals?): continuing without drafts")
        self.peers = peers


@torch.inference_mode()
def generate(model, seq: Decoding) -> None:
    """Run ``seq`` (with its ``drafts``, or one token per step without) to completion on one petals session of
    ``model`` (a petals distributed causal LM), opened here in the caller's lease context
    (:func:`swarm.engine.routing.use_lease`). Tokens are reported through ``seq.on_token``; an exception a callback
    raises ends the session and propagates."""
    embed = model.transformer.word_embeddings
    max_length = len(seq.input_ids) + seq.max_new_tokens
    with model.transformer.h.inference_session(max_length=max_length, rollback_room=max_length) as session:
        hidden = session.step(embed(torch.tensor([seq.input_ids])))
        done = emit_verified(seq, head_logits(model, hidden[0, -1:]))
        while not done:
            left = seq.max_new_tokens - len(seq.produced)  # each needs at most one more position sent
            sendable = max_length + session.rollback_room - session.sent_positions
            room = min(sendable - left, left - 1)
            seq.draft = seq.drafts.propose(seq.input_ids + seq.produced, room) if seq.drafts is not None else []
            hidden = session.step(embed(torch.tensor([[seq.produced[-1], *seq.draft]])))
            unconfirmed = session.unconfirmed_peers()
            if unconfirmed:
                raise RollbackUnconfirmed(unconfirmed)
            try:
                done = emit_verified(seq, head_logits(model, hidden[0]))
            finally:
                if seq.rollback:  # also when the sequence ended here: its spot-check recording holds its positions
                    session.rollback(seq.rollback)
                    seq.rollback = 0
