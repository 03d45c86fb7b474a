"""Multi-session inference streams on the server: one message, many sessions' steps, one batched pass.

:class:`MultiSessionHandler` is the orchestrated node's handler (the ticket gate, the prefix store and the push
fix of its bases) plus ``rpc_multi_inference`` (wire format: :mod:`swarm.engine.multi_wire`). A stream holds many
sessions over the same span, each with its own KV cache (allocated, counted and freed exactly as petals'
``rpc_inference`` does, behind the same ticket check). Per message, the one-token decode steps of its sessions
and its prefills (up to petals' 128-token short-inference bound) go to the batching pool as
:class:`server.batching.Cohort` tasks of up to ``--max-batch`` sessions each — one hand-off to the runtime and one
batched forward pass per cohort instead of one per session — longer prefills as petals tasks, all concurrently;
the reply carries every output at once. A session that fails fails alone.

What this saves over petals' one-stream-per-session path is the per-request cost that batching the forward
pass alone cannot touch: per session and token, one message through p2pd, one deserialization and one
inter-process task hand-off on every server.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable, Optional

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
import torch  # noqa: E402
from hivemind import MSGPackSerializer, deserialize_torch_tensor, serialize_torch_tensor  # noqa: E402
from hivemind.p2p import P2PContext  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402
from hivemind.utils.asyncio import anext  # noqa: E402
from hivemind.utils.nested import nested_flatten  # noqa: E402
from petals.data_structures import InferenceMetadata  # noqa: E402
from petals.server.block_functions import MAX_SHORT_INFERENCE_TOKENS  # noqa: E402
from petals.utils.misc import DUMMY_INT64  # noqa: E402

from server import failpoints, tickets as server_tickets  # noqa: E402
from server.batching import BatchingTaskPool, Cohort  # noqa: E402
from server.ends import HeadTask  # noqa: E402
from server.kv_pool import flat_handles  # noqa: E402
from swarm.engine import multi_wire  # noqa: E402
from swarm.engine.sampling import TokenChooser, choose_step, logprob_to_wire, sampling_from_wire  # noqa: E402
from swarm.trust.prefix import PAGE_TOKENS  # noqa: E402
from swarm.trust import tickets  # noqa: E402

logger = logging.getLogger(__name__)

COHORT_TOKENS = 512  # new tokens per batched pass (a cohort of prefills is split beyond it)
MULTI_INFO = "chainswarm_multi"  # rpc_info key: {"streams", "sessions", ..., "embedded", "chosen"}
# embedded: session steps whose token ids this server embedded; chosen: session steps whose tokens it chose
_COUNTERS = ("streams", "sessions", "messages", "cohorts", "failed", "embedded", "chosen")
_counts = None  # mp.Array made by install() in the server process, shared with the handler processes it forks


def _count(name: str, n: int = 1) -> None:
    if _counts is not None:
        with _counts.get_lock():
            _counts[_COUNTERS.index(name)] += n


def multi_stats() -> dict:
    """Multi-session streams this server answered: streams, sessions opened, messages, cohorts, failed sessions."""
    if _counts is None:
        return dict.fromkeys(_COUNTERS, 0)
    with _counts.get_lock():
        return dict(zip(_COUNTERS, _counts[:]))


@dataclass
class _Session:
    """One session of a stream: its KV cache (held by ``stack``), length and position, and how many positions its
    last step wrote (the most a rollback may take back)."""

    stack: contextlib.AsyncExitStack
    handles: tuple
    max_length: int
    position: int = 0
    last_step: int = 0
    opened: float = field(default_factory=time.monotonic)
    save: Optional[multi_wire.Prefix] = None  # the prompt's pages, stored after the first step (when allowed)
    # the chain's last server choosing this session's tokens (server.ends): its chooser (None: greedy), the
    # repetition penalty's prompt and the token that ends it
    chooser: Optional[TokenChooser] = None
    context: list = field(default_factory=list)
    eos: Optional[int] = None

    def rollback(self, positions: int, pool) -> None:
        """Forget the last ``positions`` positions (drafted tokens a verification pass rejected): attention reads only
        ``[0, position)``, and the pages past the new length go back to the server's pool (``pool``, a
        :class:`~server.kv_pool.PagedKvPool`). Bounded: a rollback past the positions of the previous step is
        refused, so a client can only take back what it just sent, never a loaded prefix or an earlier step's
        tokens."""
        multi_wire.checked_rollback(positions, self.last_step)
        pool.rollback(flat_handles(self.handles), positions)
        self.position -= positions
        self.last_step -= positions

    async def grow(self, positions: int, pool) -> None:
        """Take the pages ``positions`` more positions need from the server's pool (before the step runs); the pool
        refuses a step past the session's ``max_length``."""
        await pool.extend(flat_handles(self.handles), positions)


class _Span:
    """The stream's blocks: uids, backends and what the batching pool can take."""

    def __init__(self, handler: "MultiSessionHandler", uid: str):
        self.uid = uid
        self.uids = handler._check_uids(uid)
        self.backends = tuple(handler.module_backends[u] for u in self.uids)
        self.pool = self.backends[0].memory_cache  # the server's PagedKvPool, shared by all its blocks
        pool = self.backends[0].inference_pool
        supports = getattr(pool.process_func, "supports", None)
        self.cohort_size = (pool.max_batch if isinstance(pool, BatchingTaskPool) and supports is not None
                            and supports(self.uids) else 0)
        self.proto = next(iter(nested_flatten(self.backends[-1].outputs_schema)))
        self.hidden_size = int(self.backends[0].config.hidden_size)
        self.ends = getattr(pool.process_func, "ends", None)  # server.ends.ChainEnds at block 0 / the last block

    def embed(self, sid: str, ids: torch.Tensor, tokens: int) -> torch.Tensor:
        if self.ends is None or self.ends.embedding is None:
            raise ValueError("this server does not embed token ids (it holds no block 0 with the chain's ends)")
        if tuple(ids.shape) != (1, tokens):
            raise ValueError(f"session {sid!r}: expected token ids (1, {tokens}), got {tuple(ids.shape)}")
        return self.ends.embed(ids)

    @property
    def vocab_size(self) -> int:
        if self.ends is None or self.ends.head is None:
            raise ValueError("this server does not choose tokens (it holds no last block with the LM head)")
        return self.ends.vocab_size


class MultiSessionHandler(server_tickets.TicketHandler):
    """The orchestrated node's handler with ``rpc_multi_inference`` (see the module doc)."""

    _rpc_handlers = None  # hivemind caches the RPC table per class: collect ours

    async def rpc_multi_inference(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                  context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Steps of many sessions over one span per message (:mod:`swarm.engine.multi_wire`)."""
        sessions: dict[str, _Session] = {}
        span: Optional[_Span] = None
        try:
            while True:  # a stream lives while messages come within step_timeout; each session session_timeout
                try:
                    request = await asyncio.wait_for(anext(requests), self.step_timeout)
                except (StopAsyncIteration, asyncio.TimeoutError):
                    return
                if span is None:
                    span = _Span(self, request.uid)
                    _count("streams")
                    self._log_request("rpc_multi_inference.open", span.uids, context)
                elif request.uid and request.uid != span.uid:
                    raise multi_wire.MultiWireError("the blocks of a multi-session stream cannot change")
                metadata = MSGPackSerializer.loads(request.metadata) if request.metadata else {}
                message = multi_wire.decode(metadata, len(request.tensors))
                _count("messages")
                yield await self._multi_step(span, sessions, message, request.tensors)
                await self._save_prefixes(span, sessions)  # after the reply: off the sessions' critical path
                if failpoints.armed() and any(session.position for session in sessions.values()):
                    failpoints.hit("between_steps")
        finally:
            for sid in list(sessions):  # each alone: one that cannot close must not keep the others' KV
                with contextlib.suppress(Exception):
                    await _close(sessions, [sid])
            if span is not None:
                self._log_request("rpc_multi_inference.close", span.uids, context)

    async def _multi_step(self, span: _Span, sessions: dict, message: multi_wire.Request,
                          tensors) -> runtime_pb2.ExpertResponse:
        await _close(sessions, message.closes)  # first: a new session may take the memory a finished one leaves
        now = time.monotonic()
        failed: dict[str, str] = {sid: f"TimeoutError: the session is older than {self.session_timeout:.0f} s"
                                  for sid, session in sessions.items() if now - session.opened > self.session_timeout}
        for entry in message.opens:
            try:
                if entry.sid in sessions:
                    raise ValueError(f"session {entry.sid!r} is already open in this stream")
                if len(sessions) >= multi_wire.MAX_SESSIONS:
                    raise ValueError(f"at most {multi_wire.MAX_SESSIONS} sessions per stream")
                sessions[entry.sid] = await self._open(span, entry)
                _count("sessions")
            except Exception as exc:  # refused ticket, no KV slot, too long: this session only
                failed[entry.sid] = _message(exc)
        for sid, spec in message.samples.items():
            if sid in failed:
                continue
            try:
                session = _open_session(sessions, sid)
                if spec.get("grammar") is not None:  # llguidance compiles it (the tokenizer once per process)
                    made = await asyncio.to_thread(sampling_from_wire, spec, span.vocab_size, span.ends.tokenizer)
                else:
                    made = sampling_from_wire(spec, span.vocab_size)
                session.chooser, session.context, session.eos = made
            except Exception as exc:
                failed[sid] = _message(exc)
        steps = []
        for (sid, tokens, rollback), tensor in zip(message.steps, tensors):
            if sid in failed:
                continue
            try:
                session = _open_session(sessions, sid)
                if rollback:
                    session.rollback(rollback, span.pool)
                hidden = deserialize_torch_tensor(tensor)
                if sid in message.ids:
                    hidden = span.embed(sid, hidden, tokens)
                    _count("embedded")
                elif tuple(hidden.shape) != (1, tokens, span.hidden_size):
                    raise ValueError(f"session {sid!r}: expected hidden states (1, {tokens}, {span.hidden_size}), "
                                     f"got {tuple(hidden.shape)}")
                await session.grow(tokens, span.pool)
                steps.append((sid, session, hidden.to(span.backends[0].dtype)))
            except Exception as exc:
                failed[sid] = _message(exc)
        if failpoints.armed():  # tests and drills only
            for phase in sorted({failpoints.step_phase(s.position, hidden.shape[1]) for _, s, hidden in steps}):
                failpoints.hit(phase)
        outputs = await self._run(span, steps, failed)
        chosen = (await self._choose(span, sessions, message.chooses, outputs, failed, message.keeps)
                  if message.chooses else {})
        if failed:
            _count("failed", len(failed))
        await _close(sessions, failed)
        serialized = [serialize_torch_tensor(outputs[sid].to(span.proto.dtype), span.proto.compression,
                                             allow_inplace=True) for sid, _, _ in steps if sid in outputs]
        answer = {"failed": failed, **({"chosen": chosen} if chosen else {})}
        return runtime_pb2.ExpertResponse(tensors=serialized, metadata=MSGPackSerializer.dumps(answer))

    async def _choose(self, span: _Span, sessions: dict, chooses: dict, outputs: dict, failed: dict,
                      keeps=frozenset()) -> dict:
        """The tokens of the sessions this message asks to choose (the chain's last server): one LM-head pass over
        their steps' last ``len(draft) + 1`` positions on the runtime, then each session's choice
        (:func:`swarm.engine.sampling.choose_step`); their hidden states are sent back only when kept."""
        picked = [(sid, draft, left) for sid, (draft, left) in chooses.items() if sid in outputs]
        if not picked:
            return {}
        hidden = [outputs[sid] if sid in keeps else outputs.pop(sid) for sid, _, _ in picked]
        rows = [len(draft) + 1 for _, draft, _ in picked]
        try:
            span.vocab_size  # noqa: B018  (holds the head, or says it does not)
            last = torch.cat([h[0, -n:] for h, n in zip(hidden, rows)], dim=0)
            full = [sessions[sid].chooser is not None for sid, _, _ in picked]  # greedy rows: their argmax only
            argmax, logits = await span.backends[0].inference_pool.submit_task(
                last[None], HeadTask([f for f, n in zip(full, rows) for _ in range(n)]), priority=self._priority(span))
        except Exception as exc:
            failed.update({sid: _message(exc) for sid, _, _ in picked})
            for sid in keeps:
                outputs.pop(sid, None)
            return {}

        def choose_all() -> dict:
            TokenChooser.prepare(sessions[sid].chooser for sid, _, _ in picked)  # grammar masks, all at once
            chosen = {}
            greedy = iter(argmax[0].split(rows))
            sampled = iter(logits[0].split([n for f, n in zip(full, rows) if f]))
            for (sid, draft, left), wants_logits in zip(picked, full):
                scores = next(sampled) if wants_logits else next(greedy)
                if wants_logits:
                    next(greedy)
                session = sessions[sid]
                try:
                    chooser = session.chooser
                    before = len(chooser.logprobs) if chooser is not None else 0
                    tokens = list(choose_step(chooser, session.context, scores, draft, left, session.eos))
                    asked = chooser is not None and chooser.params.logprobs is not None
                    chosen[sid] = [tokens, [logprob_to_wire(e) for e in chooser.logprobs[before:]] if asked else None]
                except Exception as exc:  # one session's choice fails alone
                    failed[sid] = _message(exc)
                    outputs.pop(sid, None)
            return chosen

        # a plain greedy step is a few argmax reads: chosen here; samplers and grammars off the stream's event loop
        light = all(sessions[sid].chooser is None for sid, _, _ in picked)
        chosen = choose_all() if light else await asyncio.to_thread(choose_all)
        _count("chosen", len(chosen))
        return chosen

    async def _open(self, span: _Span, entry: multi_wire.Open) -> _Session:
        ticket = server_tickets.check({tickets.META_KEY: entry.ticket} if entry.ticket is not None else {},
                                      span.uids)
        if entry.max_length > self.inference_max_length:
            raise ValueError(f"Cannot allocate KV cache for {entry.max_length} tokens, "
                             f"max = {self.inference_max_length}")
        stack = contextlib.AsyncExitStack()
        try:
            handles = await stack.enter_async_context(self._allocate_cache(
                span.backends, batch_size=1, max_length=entry.max_length, timeout=entry.alloc_timeout))
            session = _Session(stack, tuple(tuple(h) for h in handles), entry.max_length)
            prefix = entry.prefix
            if prefix is not None:
                if prefix.load:  # the stored pages into the new cache; the session starts after them
                    tokens = prefix.load * PAGE_TOKENS
                    await session.grow(tokens, span.pool)
                    await self._run_op(span.backends, session.handles, ("load", list(prefix.hashes[:prefix.load])))
                    await self._run_op(span.backends, session.handles, ("forget",))  # positions are explicit here
                    session.position = tokens
                if server_tickets.pages_allowed(ticket, prefix.hashes):
                    session.save = prefix
        except BaseException:
            await stack.aclose()
            raise
        return session

    async def _save_prefixes(self, span: _Span, sessions: dict) -> None:
        """Store the new full pages of the sessions whose first step (their prompt) just ran."""
        for session in list(sessions.values()):
            prefix = session.save
            if prefix is None or session.position <= prefix.load * PAGE_TOKENS:
                continue
            session.save = None
            try:
                await self._run_op(span.backends, session.handles,
                                   ("save", list(prefix.hashes), prefix.load, session.position,
                                    tuple(span.uids)))
            except Exception as exc:  # never fail a session because the cache could not take its pages
                logger.warning("could not store prefix pages: %s", exc)

    def _infos(self, span: _Span, session: _Session) -> tuple:
        return tuple(InferenceMetadata(uid, session.position, handles, None)
                     for uid, handles in zip(span.uids, session.handles))

    async def _run(self, span: _Span, steps: list, failed: dict) -> dict:
        """Every step of the message at once: cohorts and long prefills concurrently; outputs by sid."""
        jobs, cohort, tokens = [], [], 0
        for step in steps:
            length = step[2].shape[1]
            if not span.cohort_size or not 0 < length <= MAX_SHORT_INFERENCE_TOKENS:
                jobs.append(self._single(span, step))  # no batching pool, or a long prefill: petals' path
                continue
            if cohort and (len(cohort) == span.cohort_size or tokens + length > COHORT_TOKENS):
                jobs.append(self._cohort(span, cohort))
                cohort, tokens = [], 0
            cohort.append(step)
            tokens += length
        if cohort:
            jobs.append(self._cohort(span, cohort))
        outputs: dict = {}
        for result in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(result, BaseException):  # _cohort and _single report per session; this is a bug
                raise result
            outputs.update(result[0])
            failed.update(result[1])
        for sid, session, hidden in steps:
            if sid in outputs:
                session.position += hidden.shape[1]
                session.last_step = hidden.shape[1]
        return outputs

    async def _cohort(self, span: _Span, cohort: list) -> tuple[dict, dict]:
        """Steps of several sessions (decodes and short prefills) as one task: one batched pass."""
        _count("cohorts")
        lengths = [h.shape[1] for _, _, h in cohort]
        task = Cohort([self._infos(span, session) for _, session, _ in cohort], lengths)
        try:
            (out,) = await span.backends[0].inference_pool.submit_task(torch.cat([h for _, _, h in cohort], dim=1),
                                                                      task, priority=self._priority(span))
        except Exception as exc:
            return {}, {sid: _message(exc) for sid, _, _ in cohort}
        return {sid: part for (sid, _, _), part in zip(cohort, out.split(lengths, dim=1))}, {}

    async def _single(self, span: _Span, step) -> tuple[dict, dict]:
        """One session's step as petals runs it (the merged pool, or block by block for long prefills)."""
        sid, session, hidden = step
        try:
            if hidden.numel() == 0:
                return {sid: hidden}, {}
            priority = self._priority(span)
            if hidden.shape[1] <= MAX_SHORT_INFERENCE_TOKENS:
                (hidden,) = await span.backends[0].inference_pool.submit_task(
                    hidden, DUMMY_INT64, self._infos(span, session), *[None] * len(span.backends), priority=priority)
            else:
                for info, backend in zip(self._infos(span, session), span.backends):
                    (hidden,) = await backend.inference_pool.submit_task(hidden, DUMMY_INT64, (info,), None,
                                                                         priority=priority)
            return {sid: hidden}, {}
        except Exception as exc:
            return {}, {sid: _message(exc)}

    def _info_counters(self) -> dict:
        """The bases' counters in ``rpc_info``, plus this server's multi-session counters."""
        return dict(super()._info_counters(), **{MULTI_INFO: multi_stats()})

    def _priority(self, span: _Span) -> float:
        return self._prioritizer.prioritize(DUMMY_INT64, DUMMY_INT64, points=0.0, requested_uids=span.uids,
                                            type="inference")


def _open_session(sessions: dict, sid: str) -> _Session:
    session = sessions.get(sid)
    if session is None:
        raise ValueError(f"session {sid!r} is not open in this stream")
    return session


async def _close(sessions: dict, sids: Iterable[str]) -> None:
    """Close these sessions of a stream (free their KV caches); names that are not open are ignored."""
    for sid in sids:
        session = sessions.pop(sid, None)
        if session is not None:
            await session.stack.aclose()


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


MultiSessionHandler.__name__ = MultiSessionHandler.__qualname__ = "TransformerConnectionHandler"


def install(push_counter=None):
    """Install this handler and the prefix backend (server process, before ``Server.run()``)."""
    global _counts
    from server.handler import install as install_handler
    from server.prefix_cache import PrefixBackend

    _counts = mp.Array(ctypes.c_int64, len(_COUNTERS))

    return install_handler(MultiSessionHandler, PrefixBackend, push_counter=push_counter)
