"""Continuous batching over one chain: many generations share every server message and one LM-head pass.

:class:`ChainGenerator` owns a :class:`swarm.engine.multi_client.ChainBatch` (one multi-session stream per server of
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
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from swarm.model.kernels import linear
from swarm.engine import multi_wire
from swarm.engine.multi_client import ChainBatch, ChainBatchError
from swarm.engine.routing import RouteSpan
from swarm.engine.sampling import TokenChooser, choose_step, logprob_from_wire, sampling_to_wire
from swarm.trust.prefix import PAGE_TOKENS

logger = logging.getLogger(__name__)


class StopSequence(Exception):
    """Raised by an ``on_token`` callback: this sequence is complete (not a failure)."""


class SequenceFailed(RuntimeError):
    """A sequence could not be completed; ``produced`` holds the tokens it generated before (to resume from),
    ``peer_id`` the server that failed, when one did."""

    def __init__(self, reason: str, produced: list[int], peer_id: Optional[str] = None, unsupported: bool = False):
        super().__init__(reason)
        self.produced, self.peer_id, self.unsupported = list(produced), peer_id, unsupported


@dataclass
class Decoding:
    """One sequence's decoding: its tokens so far, how it chooses and reports them, its drafts and rollback (the
    batched path's sequences, and a speculating session on petals' per-session path: :mod:`swarm.engine.single`)."""

    sid: str
    input_ids: list[int]
    max_new_tokens: int
    eos_token_id: Optional[int]
    on_token: Optional[Callable[[int], None]]
    processor: Optional[Callable]
    ticket: Optional[bytes] = None
    future: Optional[Future] = None
    produced: list[int] = field(default_factory=list)
    recorder: Optional[object] = None  # swarm.engine.recording.SpanRecorder
    drafts: Optional[object] = None  # swarm.engine.speculative.SessionDrafts: speculative decoding
    draft: list[int] = field(default_factory=list)  # the drafted tokens of the step in flight
    rollback: int = 0  # positions the servers forget before the next step (the last step's rejected drafts)
    prefix: Optional[multi_wire.Prefix] = None  # prompt-prefix reuse: the pages its servers load and store
    ends: bool = False  # the chain's servers embed its ids and choose its tokens (server.ends)
    sample: Optional[dict] = None  # its sampling spec, sent to the last server with its first step


class ChainGenerator:
    """Greedy generation for many sequences over one route (see the module doc). Thread-safe ``submit``.

    ``model`` is a petals distributed causal LM (its embeddings, final norm and LM head run here; its sequence
    manager supplies the p2p connection and block uids); ``route`` the chain ``(peer id, start, end)``."""

    STEP_POSITIONS = 16  # decode positions a step fills with drafts where the chain's servers publish no batch
    # bound (else their smallest: GenerationEngine.batch_bound); 16 is chainswarm server's default --max-batch

    def __init__(self, model, route: Sequence[RouteSpan], *, max_sessions: int = 16, step_timeout: float = 30.0,
                 alloc_timeout: float = 5.0, idle_close_s: float = 5.0, step_positions: int = STEP_POSITIONS,
                 ends: bool = False):
        """``step_positions``: speculative decoding's drafts fill a step's decode positions up to this many, shared
        by the drafting sequences: a lone session drafts up to its own ``k``, 8 running sessions 1 each, 16 none —
        an extra position is nearly free while a server's batch has room, and takes compute from the other
        sessions' decode steps once it is full."""
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.step_positions = int(step_positions)
        self.ends = bool(ends)  # the route's first and last servers embed ids and choose tokens (server.ends)
        manager = model.transformer.h.sequence_manager
        self.model, self.max_sessions, self.idle_close_s = model, int(max_sessions), idle_close_s
        self._route = tuple(route)
        self._open_batch = lambda: ChainBatch(manager.state.p2p, self._route, manager.block_uids,
                                              step_timeout=step_timeout, alloc_timeout=alloc_timeout,
                                              on_freed=self._on_freed)
        self._freeing: dict[str, Future] = {}  # sid -> the caller's kv_freed future (dict ops only: any thread)
        self.batch: Optional[ChainBatch] = None  # open while there is work (and idle_close_s after)
        self.steps = 0  # chain steps run
        self.stepped_sequences = 0  # sequence-steps run (÷ steps: the mean batch)
        self.chosen_steps = 0  # sequence-steps whose tokens the chain's last server chose (server.ends)
        self.reopened = 0  # steps retried on new streams (the old ones broke before any session had KV there)
        self._ids = itertools.count()
        self._waiting: list[Decoding] = []
        self._running: dict[str, Decoding] = {}
        self._cancelled: set[Future] = set()
        self._cv = threading.Condition()
        self._broken: Optional[BaseException] = None
        self._failed_peer: Optional[str] = None
        self._closed = False
        self._last_used = time.monotonic()
        self._thread = threading.Thread(target=self._drive, name="chain-generator", daemon=True)
        self._thread.start()

    @property
    def route(self) -> tuple:
        return self._route

    @property
    def usable(self) -> bool:
        """False once closed or broken (a server of its route failed): make a new one."""
        return not self._closed and self._broken is None

    def submit(self, input_ids: Sequence[int], max_new_tokens: int, *, eos_token_id: Optional[int] = None,
               on_token: Optional[Callable[[int], None]] = None, processor: Optional[Callable] = None,
               ticket: Optional[bytes] = None, recorder=None, drafts=None,
               prefix: Optional[multi_wire.Prefix] = None, kv_freed: Optional[Future] = None) -> Future:
        """Queue one generation; the future's result is its generated token ids.

        ``on_token(token)`` is called for every token; if it raises :class:`StopSequence` the sequence is complete,
        any other exception ends the sequence with that exception. ``processor(input_ids (1, n), scores (1, V))``
        (a transformers logits processor, e.g. :class:`swarm.engine.sampling.TokenChooser`) adjusts the scores before the
        greedy pick. ``recorder`` (:class:`swarm.engine.recording.SpanRecorder`) keeps its spans' hidden states for
        a spot check. With ``drafts`` (:class:`swarm.engine.speculative.SessionDrafts`) each decode step also carries
        the tokens it drafts; the chain verifies them in the same pass (:func:`emit_verified`). With ``prefix``
        (:class:`swarm.engine.multi_wire.Prefix`) every server loads the prompt's first ``prefix.load`` pages from its
        prefix store and the prefill sends only the positions after them; the servers store the prompt's new full
        pages after it. A sequence the swarm could not complete fails with :class:`SequenceFailed`. ``kv_freed`` is
        resolved once no server of the route holds the sequence's KV any more (the future resolves first: the
        close travels with the next step)."""
        if not input_ids or max_new_tokens < 1:
            raise ValueError("a generation needs at least one input token and max_new_tokens >= 1")
        if prefix is not None and prefix.load * PAGE_TOKENS >= len(input_ids):
            raise ValueError("a reused prefix must leave at least one prompt position to compute")
        vocab = self.model.transformer.word_embeddings.num_embeddings
        if not all(isinstance(t, int) and 0 <= t < vocab for t in input_ids):
            raise ValueError(f"token ids must be integers in [0, {vocab})")
        future: Future = Future()
        self._last_used = time.monotonic()
        with self._cv:
            if self._closed or self._broken is not None:
                raise RuntimeError(f"the chain generator is closed{f': {self._broken}' if self._broken else ''}")
            sid = f"s{next(self._ids)}"
            if kv_freed is not None:
                self._freeing[sid] = kv_freed
            seq = Decoding(sid, list(input_ids), int(max_new_tokens), eos_token_id, on_token, processor, ticket,
                           future, recorder=recorder, drafts=drafts, prefix=prefix)
            seq.sample = self._sample_spec(seq)
            seq.ends = seq.sample is not None
            self._waiting.append(seq)
            self._cv.notify()
        return future

    def _sample_spec(self, seq: Decoding) -> Optional[dict]:
        """The sampling spec the chain's last server chooses ``seq``'s tokens by, or None when they are chosen here:
        the route's ends are not on its servers, or its processor is not a
        :class:`TokenChooser`. (A session whose spans a spot check records is embedded here, and its last hidden
        states come back with its tokens; a grammar travels as its source and is compiled there.)"""
        if not self.ends:
            return None
        if seq.processor is None:
            return {"greedy": True, "eos": seq.eos_token_id}
        if not isinstance(seq.processor, TokenChooser):
            return None
        chooser = seq.processor
        seed = chooser.params.seed if chooser.params.seed is not None else secrets.randbits(63)
        return sampling_to_wire(chooser.params, seed, chooser.generated, seq.input_ids, seq.eos_token_id)

    def sessions(self) -> int:
        """Sequences running or waiting to be admitted."""
        with self._cv:
            return len(self._running) + len(self._waiting)

    def idle_s(self) -> float:
        """Seconds since the last submission while nothing runs or waits (0 while busy)."""
        return 0.0 if self.sessions() else time.monotonic() - self._last_used

    def cancel(self, future: Future) -> None:
        """End a submitted sequence at the next step (its future fails with :class:`SequenceFailed`)."""
        with self._cv:
            self._cancelled.add(future)
            self._cv.notify()

    def peer_failed(self, peer_id: str) -> None:
        """``peer_id`` is known to have failed: if it serves this route, stop waiting for the running step (every
        running sequence fails with :class:`SequenceFailed` naming it; the generator closes)."""
        if any(peer == peer_id for peer, _, _ in self.route):
            self._failed_peer = peer_id
            batch = self.batch
            if batch is not None:
                batch.abort(peer_id)

    def _has_work(self) -> bool:
        return bool(self._closed or self._waiting or self._running)

    def _drive(self) -> None:
        while True:
            with self._cv:
                idle = not self._has_work()
            if idle:
                # idle: the finished sessions' KV is freed now (a server can drain), the streams after a while
                # (before the servers' own step timeout ends them); both are network round trips, made outside
                # the lock, so that submit() and close() never wait behind them
                self._flush()
                with self._cv:
                    timed_out = not self._cv.wait_for(self._has_work, timeout=self.idle_close_s)
                if timed_out:
                    self._close_batch()
                    with self._cv:
                        self._cv.wait_for(self._has_work)
            with self._cv:
                if self._closed:
                    break
                self._drop_cancelled()
                room = self.max_sessions - len(self._running)
                admitted, self._waiting = self._waiting[:room], self._waiting[room:]
                if not admitted and not self._running:
                    continue
            try:
                if self._failed_peer is not None:
                    raise ChainBatchError(self._failed_peer, "the server is known to have failed")
                if self.batch is None:
                    self.batch = self._open_batch()
                self._step(admitted)
            except BaseException as exc:  # the chain is unusable: fail everything it holds or waits for
                self._close_batch()  # first: the surviving servers free the sessions before they fail over
                self._fail_all(exc)
                return
        self._fail_all(RuntimeError("the chain generator was closed"))
        self._close_batch()

    def _flush(self) -> None:
        """Send the pending closes of finished sessions (an idle batch has no next step to carry them)."""
        if self.batch is not None and self.batch.pending_closes:
            try:
                self.batch.step({})
            except Exception as exc:  # the streams are gone: the servers free the sessions with them
                logger.debug("could not flush closes: %r", exc)
                self._close_batch()

    def _close_batch(self) -> None:
        batch, self.batch = self.batch, None
        if batch is not None:
            batch.close()

    def _drop_cancelled(self) -> None:
        """(under the lock) Retire the cancelled sequences: waiting ones at once, running ones on the servers."""
        if not self._cancelled:
            return
        gone = [s for s in [*self._waiting, *self._running.values()] if s.future in self._cancelled]
        self._cancelled.clear()
        self._waiting = [s for s in self._waiting if s not in gone]
        for seq in gone:
            if self._running.pop(seq.sid, None) is None:  # never sent: no server holds anything of it
                self._on_freed([seq.sid])
            seq.future.set_exception(SequenceFailed("cancelled", seq.produced))
        if self.batch is not None:
            self.batch.close_sessions([s.sid for s in gone])

    @torch.inference_mode()
    def _step(self, admitted: list[Decoding]) -> None:
        embed = self.model.transformer.word_embeddings

        def tokens_in(seq: Decoding, ids: list[int]) -> torch.Tensor:  # ids to the first server, or embedded here
            ids = torch.tensor([ids], dtype=torch.long)  # (a recorded session's first span input is hidden states)
            return ids if seq.ends and seq.recorder is None else embed(ids)

        inputs = {}
        for s in admitted:  # a prefill: the prompt after the pages its servers load
            skip = s.prefix.load * PAGE_TOKENS if s.prefix is not None else 0
            if skip and s.recorder is not None:
                s.recorder.skip_prefix(skip)
            inputs[s.sid] = tokens_in(s, s.input_ids[skip:])
        rollbacks = {}
        drafting = sum(s.drafts is not None for s in self._running.values())
        room = max(0, self.step_positions - len(self._running) - len(admitted))
        share = room // drafting if drafting else 0
        for s in self._running.values():
            s.draft = (s.drafts.propose(s.input_ids + s.produced, min(share, s.max_new_tokens - len(s.produced) - 1))
                       if s.drafts is not None else [])
            inputs[s.sid] = tokens_in(s, [s.produced[-1], *s.draft])
            if s.rollback:
                rollbacks[s.sid], s.rollback = s.rollback, 0
        opens = {s.sid: len(s.input_ids) + s.max_new_tokens for s in admitted}
        tickets = {s.sid: s.ticket for s in admitted if s.ticket is not None}
        self._running.update((s.sid, s) for s in admitted)
        self.batch.recorders.update((s.sid, s.recorder) for s in admitted if s.recorder is not None)
        masks = TokenChooser.prepare_async(s.processor for s in self._running.values()  # grammar masks, meanwhile
                                           if not s.ends)  # (the last server computes the others' itself)
        ends = [s for s in self._running.values() if s.ends]
        chooses = {s.sid: (list(s.draft), s.max_new_tokens - len(s.produced)) for s in ends}
        samples = {s.sid: s.sample for s in admitted if s.ends}
        try:
            outputs, failed, chosen = self._send(inputs, opens, tickets, rollbacks,
                                                 {s.sid: s.prefix for s in admitted if s.prefix is not None},
                                                 ({s.sid for s in ends if s.recorder is None}, samples, chooses,
                                                  {s.sid for s in ends if s.recorder is not None}))
        finally:
            if masks is not None:
                masks.exception()  # wait: no chooser is used while its mask is being computed
        self.steps += 1
        self.stepped_sequences += len(inputs)
        for sid, failure in failed.items():
            seq = self._running.pop(sid)
            seq.future.set_exception(SequenceFailed(str(failure), seq.produced, failure.peer_id))
        missing = [sid for sid in chooses if sid not in chosen and sid not in failed and sid not in outputs]
        for sid in missing:  # neither tokens nor hidden states: the last server did not answer for it
            seq = self._running.pop(sid)
            seq.future.set_exception(SequenceFailed(f"{self._route[-1][0]}: no tokens for the session", seq.produced,
                                                    self._route[-1][0]))
        self.chosen_steps += len(chosen)
        steps = [(sid, self._emit_chosen, answer) for sid, answer in chosen.items()]
        sids = [sid for sid in outputs if sid not in chosen]  # (a recorded session's outputs come with its tokens)
        if sids:
            rows = [len(self._running[sid].draft) + 1 for sid in sids]  # a prefill's last position, or k + 1 drafts
            last = torch.cat([outputs[sid][0, -n:] for sid, n in zip(sids, rows)], dim=0)
            logits = head_logits(self.model, last)  # one head pass for every sequence and position
            steps += [(sid, emit_verified, scores) for sid, scores in zip(sids, logits.split(rows))]
        finished = []
        for sid, emit, answer in steps:
            seq = self._running[sid]
            try:
                done = emit(seq, answer)
            except Exception as exc:  # the caller's callback or processor ended its own sequence only
                finished.append(sid)
                self._running.pop(sid)
                seq.future.set_exception(exc)
                continue
            if done:
                finished.append(sid)
                self._running.pop(sid).future.set_result(list(seq.produced))
                if seq.rollback and seq.recorder is not None:
                    seq.recorder.rollback(seq.rollback)
        self.batch.close_sessions(finished)
        for sid in [sid for sid in self.batch.recorders if sid not in self._running]:
            del self.batch.recorders[sid]

    def _emit_chosen(self, seq: Decoding, answer) -> bool:
        """Emit the tokens the chain's last server chose for ``seq`` (``[ids, logprobs or None]``); True when it is
        complete. A malformed answer fails the sequence (:class:`SequenceFailed` naming that server)."""
        peer = self._route[-1][0]
        vocab = self.model.transformer.word_embeddings.num_embeddings
        try:
            tokens, logprobs = answer
            tokens = [int(t) for t in tokens]
            if not tokens or len(tokens) > len(seq.draft) + 1 or not all(0 <= t < vocab for t in tokens):
                raise ValueError(f"{len(tokens)} tokens for a step of {len(seq.draft) + 1} positions")
            ended = (len(seq.produced) + len(tokens) >= seq.max_new_tokens or tokens[-1] == seq.eos_token_id
                     or len(tokens) == len(seq.draft) + 1 or tokens[-1] != seq.draft[len(tokens) - 1])
            if not ended or tokens[:-1] != seq.draft[:len(tokens) - 1]:
                raise ValueError(f"the tokens {tokens} do not follow the step's drafts {seq.draft}")
            entries = None
            if logprobs is not None:
                entries = [logprob_from_wire(e, vocab) for e in logprobs]
                if len(entries) != len(tokens) or any(e.token_id != t for e, t in zip(entries, tokens)):
                    raise ValueError("the logprobs do not match the tokens")
        except (TypeError, ValueError) as exc:
            raise SequenceFailed(f"{peer}: a malformed choice ({exc})", seq.produced, peer) from None
        chooser = seq.processor if isinstance(seq.processor, TokenChooser) else None

        def observed():
            for i, token in enumerate(tokens):
                if chooser is not None:
                    chooser.observe(token, entries[i] if entries else None)
                yield token

        return _emit(seq, observed())

    def _send(self, inputs: dict, opens: dict, tickets: dict, rollbacks: dict, prefixes: dict,
              ends: tuple = (set(), {}, {}, set())) -> tuple[dict, dict, dict]:
        """One step through the chain (:meth:`ChainBatch.step`). The streams outlive their sessions (``idle_close_s``):
        a server that drained and reloaded its blocks meanwhile, or ended an idle stream, is alive and holds nothing
        of ours. So a step whose sessions all open in it, whose stream broke without an answer, is tried once more
        on new streams; if that fails too, the first failure stands (a dead server fails both)."""
        fresh = not self.batch.open_sessions  # no session of ours has KV on the servers yet: nothing to lose
        ids, samples, chooses, keeps = ends
        try:
            return self.batch.step_ends(inputs, opens, tickets, rollbacks, prefixes, ids=ids, samples=samples,
                                        chooses=chooses, keeps=keeps)
        except ChainBatchError as exc:
            if not (fresh and exc.stream_gone and self._failed_peer is None):
                raise
            logger.info("reopening the chain's streams once: %s", exc)
            recorders = self.batch.recorders
            for sid, recorder in recorders.items():
                recorder.rollback(inputs[sid].shape[1])  # what the first servers answered before the failure
            self.batch.on_freed = lambda sids: self._on_freed([sid for sid in sids if sid not in opens])  # (reopened)
            self._close_batch()
            self.batch = self._open_batch()
            self.batch.recorders.update(recorders)
            self.reopened += 1
            try:
                return self.batch.step_ends(inputs, opens, tickets, rollbacks, prefixes, ids=ids, samples=samples,
                                            chooses=chooses, keeps=keeps)
            except ChainBatchError:
                raise exc from None

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            self._broken = self._broken or exc
            victims = list(self._running.values()) + self._waiting
            self._running, self._waiting = {}, []
        reason = str(exc) if isinstance(exc, ChainBatchError) else repr(exc)
        unsupported = isinstance(exc, ChainBatchError) and exc.unsupported
        peer = exc.peer_id if isinstance(exc, ChainBatchError) and not exc.alive else None
        for seq in victims:
            if not seq.future.done():
                seq.future.set_exception(SequenceFailed(reason, seq.produced, peer, unsupported))
        if self.batch is None:  # (else its close reports what the servers held)
            self._on_freed(list(self._freeing))

    def _on_freed(self, sids) -> None:
        """No server of the route holds these sequences' KV any more (:class:`ChainBatch`'s ``on_freed``)."""
        for sid in sids:
            future = self._freeing.pop(sid, None)
            if future is not None and not future.done():
                future.set_result(None)

    def close(self) -> None:
        """Fail whatever is still queued or running, close the streams (bounded)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        batch = self.batch
        if batch is not None:  # a step in flight (the last sequences', or a flush of closes) ends now, not at
            batch.cancel()  # its timeout: a server that stopped answering cannot hold a shutdown for step_timeout
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)
        self._close_batch()
        self._on_freed(list(self._freeing))  # (sequences never sent)

    def __enter__(self) -> "ChainGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The final norm and LM head of ``model`` (a petals distributed causal LM) over ``hidden`` ``(n, H)``: the
    logits ``(n, V)``."""
    head = model.lm_head.weight
    return linear(model.transformer.ln_f(hidden.to(head.dtype)), head)


def emit_verified(seq: Decoding, scores: torch.Tensor) -> bool:
    """Choose and emit the sequence's tokens from its step's ``scores`` ``(k + 1, V)`` (``k`` drafted tokens; 0
    without speculation) by :func:`swarm.engine.sampling.choose_step`; True when it is complete."""
    context = seq.input_ids + seq.produced if seq.processor is not None else []
    return _emit(seq, choose_step(seq.processor, context, scores, seq.draft,
                                  seq.max_new_tokens - len(seq.produced), seq.eos_token_id))


def _emit(seq: Decoding, tokens) -> bool:
    """Emit a step's ``tokens`` (an iterator: each is chosen as it is taken); True when the sequence is complete.
    Token ``i`` follows the drafts before it: drafts are accepted while the tokens equal them (greedy: the argmax;
    sampled: the request's own draw, :mod:`swarm.engine.speculative`), and the first other token is emitted too, so
    the tokens are those of decoding one at a time. The rejected drafts' positions are rolled back on the servers
    with the next step."""
    draft, accepted = seq.draft, 0
    try:
        for i, token in enumerate(tokens):
            proposal = draft[i] if i < len(draft) else None
            seq.produced.append(token)
            if seq.on_token is not None:
                seq.on_token(token)
            if len(seq.produced) >= seq.max_new_tokens or token == seq.eos_token_id:
                return True
            if token != proposal:
                break
            accepted += 1
    except StopSequence:
        return True
    finally:
        # the positions of the drafts after the last one kept (also when the sequence ended here: its recording
        # must hold exactly its positions for a spot check)
        seq.rollback = len(draft) - accepted
        if seq.drafts is not None and draft:
            seq.drafts.update(len(draft), accepted)
    return False
