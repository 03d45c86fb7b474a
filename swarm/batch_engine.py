"""Continuous batching over one chain: many generations share every server message and one LM-head pass.

:class:`ChainGenerator` owns a :class:`swarm.multi_client.ChainBatch` (one multi-session stream per server of
a route) and a driver thread. Generations are submitted from any thread; at every step the driver admits
waiting ones (up to ``max_sessions`` running; their prompts' prefills travel in the same messages as the
running sessions' one-token decode steps), runs one step through the chain for all of them, computes the
final norm and LM head for all their last positions at once (one matrix product: the head's weights are read
once per step, not once per session), picks each session's next token greedily, reports it, and retires the
sessions that finished (end-of-sequence token, ``max_new_tokens``, or their callback stopped them).

This is the client half of the batching that makes a swarm server serve many sessions for nearly the price
of one (vLLM's scheduler loop, over a chain of remote servers): per step, each server gets one message and
runs one batched pass, and the client runs one head. The same greedy tokens as petals' own ``generate``.
"""
from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from swarm.kernels import linear
from swarm.multi_client import ChainBatch, ChainBatchError
from swarm.routing import RouteSpan

logger = logging.getLogger(__name__)


class StopSequence(Exception):
    """Raised by an ``on_token`` callback: this sequence is complete (not a failure)."""


class SequenceFailed(RuntimeError):
    """A sequence could not be completed; ``produced`` holds the tokens it generated before (to resume from)."""

    def __init__(self, reason: str, produced: list[int]):
        super().__init__(reason)
        self.produced = list(produced)


@dataclass
class _Sequence:
    sid: str
    input_ids: list[int]
    max_new_tokens: int
    eos_token_id: Optional[int]
    on_token: Optional[Callable[[int], None]]
    ticket: Optional[bytes]
    future: Future
    produced: list[int] = field(default_factory=list)


class ChainGenerator:
    """Greedy generation for many sequences over one route (see the module doc). Thread-safe ``submit``.

    ``model`` is a petals distributed causal LM (its embeddings, final norm and LM head run here; its sequence
    manager supplies the p2p connection and block uids); ``route`` the chain ``(peer id, start, end)``."""

    def __init__(self, model, route: Sequence[RouteSpan], *, max_sessions: int = 16, step_timeout: float = 30.0,
                 alloc_timeout: float = 5.0):
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        manager = model.transformer.h.sequence_manager
        self.model, self.max_sessions = model, int(max_sessions)
        self.batch = ChainBatch(manager.state.p2p, route, manager.block_uids, step_timeout=step_timeout,
                                alloc_timeout=alloc_timeout)
        self.steps = 0  # chain steps run
        self.stepped_sequences = 0  # sequence-steps run (÷ steps: the mean batch)
        self._ids = itertools.count()
        self._waiting: list[_Sequence] = []
        self._running: dict[str, _Sequence] = {}
        self._cv = threading.Condition()
        self._broken: Optional[BaseException] = None
        self._closed = False
        self._thread = threading.Thread(target=self._drive, name="chain-generator", daemon=True)
        self._thread.start()

    @property
    def route(self) -> tuple:
        return self.batch.route

    def submit(self, input_ids: Sequence[int], max_new_tokens: int, *, eos_token_id: Optional[int] = None,
               on_token: Optional[Callable[[int], None]] = None, ticket: Optional[bytes] = None) -> Future:
        """Queue one generation; the future's result is its generated token ids (:class:`SequenceFailed`)."""
        if not input_ids or max_new_tokens < 1:
            raise ValueError("a generation needs at least one input token and max_new_tokens >= 1")
        future: Future = Future()
        with self._cv:
            if self._closed or self._broken is not None:
                raise RuntimeError(f"the chain generator is closed{f': {self._broken}' if self._broken else ''}")
            self._waiting.append(_Sequence(f"s{next(self._ids)}", list(input_ids), int(max_new_tokens),
                                           eos_token_id, on_token, ticket, future))
            self._cv.notify()
        return future

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 eos_token_id: Optional[int] = None, timeout: Optional[float] = None) -> list[list[int]]:
        """Generate for every prompt at once (blocking); the token lists in the prompts' order."""
        futures = [self.submit(p, max_new_tokens, eos_token_id=eos_token_id) for p in prompts]
        return [f.result(timeout=timeout) for f in futures]

    def _drive(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not self._running:
                    self._cv.wait()
                if self._closed:
                    break
                room = self.max_sessions - len(self._running)
                admitted, self._waiting = self._waiting[:room], self._waiting[room:]
            try:
                self._step(admitted)
            except BaseException as exc:  # the chain is unusable: fail everything it holds or waits for
                self._fail_all(exc)
                return
        self._fail_all(RuntimeError("the chain generator was closed"))

    @torch.inference_mode()
    def _step(self, admitted: list[_Sequence]) -> None:
        embed = self.model.transformer.word_embeddings
        inputs = {s.sid: embed(torch.tensor([s.input_ids])) for s in admitted}
        for s in self._running.values():
            inputs[s.sid] = embed(torch.tensor([[s.produced[-1]]]))
        opens = {s.sid: len(s.input_ids) + s.max_new_tokens for s in admitted}
        tickets = {s.sid: s.ticket for s in admitted if s.ticket is not None}
        self._running.update((s.sid, s) for s in admitted)
        outputs, failed = self.batch.step(inputs, opens, tickets)
        self.steps += 1
        self.stepped_sequences += len(inputs)
        for sid, reason in failed.items():
            seq = self._running.pop(sid)
            seq.future.set_exception(SequenceFailed(reason, seq.produced))
        if not outputs:
            return
        sids = list(outputs)
        head = self.model.lm_head.weight
        last = torch.cat([outputs[sid][:, -1] for sid in sids], dim=0).to(head.dtype)
        logits = linear(self.model.transformer.ln_f(last), head)  # one head pass for every sequence
        finished = []
        for sid, token in zip(sids, logits.argmax(dim=-1).tolist()):
            seq = self._running[sid]
            seq.produced.append(int(token))
            done = len(seq.produced) >= seq.max_new_tokens or token == seq.eos_token_id
            if seq.on_token is not None:
                try:
                    seq.on_token(int(token))
                except StopSequence:
                    done = True
                except Exception as exc:  # a broken callback ends its own sequence only
                    finished.append(sid)
                    self._running.pop(sid)
                    seq.future.set_exception(SequenceFailed(f"on_token failed: {exc!r}", seq.produced))
                    continue
            if done:
                finished.append(sid)
                self._running.pop(sid).future.set_result(list(seq.produced))
        self.batch.close_sessions(finished)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            self._broken = self._broken or exc
            victims = list(self._running.values()) + self._waiting
            self._running, self._waiting = {}, []
        reason = str(exc) if isinstance(exc, ChainBatchError) else repr(exc)
        for seq in victims:
            if not seq.future.done():
                seq.future.set_exception(SequenceFailed(reason, seq.produced))

    def close(self) -> None:
        """Fail whatever is still queued or running, close the streams (bounded)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)
        self.batch.close()

    def __enter__(self) -> "ChainGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
