"""One completion, from the central queue to its last token: the piece every completion endpoint shares.

:meth:`CompletionRunner.run` is an async generator. It queues the request with the orchestrator (fairness
queue, JFFC grant), runs the session on the granted chain in the engine's worker thread, and yields the
generated token ids as they appear, then one :class:`Finished`. It owns the session's liveness:

* **Client gone.** While queued, the client's connection is checked every ``poll_s``; a client that left is
  taken out of the queue at once. While generating, the session stops at its next token and its slot is
  returned once its servers are released.
* **No progress.** A session that makes no progress (no server step, no token) for longer than its stall
  limit is aborted (:class:`swarm.engine.routing.SessionControl`): its running step is cancelled, its servers are
  released, its slot is returned. The stall limit is ``stall_timeout_s`` if set, else ``stall_factor`` × the
  planned time of the step in progress (:func:`swarm.control.planning.planned_step_s`), clamped to
  [``stall_floor_s``, ``stall_cap_s``] — seconds, never minutes. A stuck petals call never holds a slot: if
  the session thread does not let go within ``release_wait_s`` the slot is returned anyway.
* **Continuation.** A session that failed or stalled — before or after streaming tokens — goes back to its
  place at the head of its client's queue (:meth:`Orchestrator.resume`, the tokens already generated stay
  charged) and waits up to ``route_wait_s`` for a chain with room; the next session runs on the prompt plus the
  tokens delivered so far, its sampler replayed to that point, so the client's answer goes on where it stopped
  (greedy: the same text as without the failure). ``max_attempts`` sessions in a row that deliver no token, or
  no chain within ``route_wait_s``, end the request with :class:`CompletionFailed` / ``QueueTimeout`` (503).
* **Preemption.** An answer without max_tokens reserves KV a part at a time. When its chain has no room for the
  next part but some chain of the plan could hold it, the session is preempted (:class:`Preempted`): it ends, its
  servers free its KV, and the rest queues again as a continuation does (recomputed from the prompt and the tokens
  so far, not charged again). If no chain takes it within ``route_wait_s``, the answer ends where it stopped with
  finish_reason ``length`` (what it would have got without preemption), not an error. Where no chain can ever
  hold more, it ends at once with ``length`` (:class:`ReservationFull`).

Every abort is counted by reason in ``SwarmMetrics.aborted``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from planner.fairness.types import Grant
from swarm.engine.generation import (
    GenerationEngine, GenerationResult, Preempted, Progress, ReservationFull, StopGeneration,
)
from swarm.engine.routing import Lease, NoRouteError, SessionControl, splice
from swarm.engine.sampling import SamplingParams, StopMatcher, TokenLogprob

logger = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client disconnected; its request has left the queue or its session has been stopped."""


class CompletionFailed(Exception):
    """The swarm could not finish the request (after retries where nothing had been generated yet)."""


@dataclass
class Finished:
    """The end of a completion: what was generated and how it was served."""

    token_ids: list[int]
    finish_reason: str
    chain_id: str
    servers: list[str]
    route: list
    waiting_s: float
    service_s: float
    prefix: dict[str, Any] = field(default_factory=dict)
    attempts: int = 1
    logprobs: list[TokenLogprob] = field(default_factory=list)
    request_id: str = ""
    verified: str | None = None  # spot checks: "pending", "true" or "false" (None: checks are off)
    prompt_logprobs: list[TokenLogprob] | None = None  # SamplingParams.prompt_logprobs: each prompt token's but the 1st


class _LoopProvider:
    """Lets a session thread ask the orchestrator (on the event loop) for a replacement route."""

    def __init__(self, orchestrator, loop: asyncio.AbstractEventLoop):
        self.orchestrator, self.loop = orchestrator, loop

    def acquire(self, *, max_length: int) -> Lease:  # proxied sessions always start with a lease
        raise NoRouteError("proxied sessions are granted before they start")

    def reroute(self, lease: Lease, start: int, end: int, failed_peers) -> tuple:
        async def ask():
            route = await self.orchestrator.reroute(lease.chain_id, start, end, failed_peers,
                                                   request_id=lease.lease_id)
            # the servers opened from now on get a ticket for the route as it will be (no prefix writes)
            lease.ticket = self.orchestrator.ticket(lease.lease_id, lease.chain_id, splice(lease.route, route))
            return route
        return asyncio.run_coroutine_threadsafe(ask(), self.loop).result(timeout=30)

    def renew_ticket(self, lease: Lease) -> None:
        async def ask():
            lease.ticket = self.orchestrator.ticket(lease.lease_id, lease.chain_id, lease.route)
        asyncio.run_coroutine_threadsafe(ask(), self.loop).result(timeout=30)

    def release(self, lease: Lease, *, processed_tokens: int) -> None:
        pass  # the runner finishes the request itself


class DualExecutionUnavailable(ValueError):
    """Dual execution cannot run here (no second server holds one of the granted chain's spans): a 400, as a
    request the swarm cannot take."""


class _Stopped(Exception):
    """The runner stopped a session (``reason``: ``stalled`` or ``client_gone``); its request still runs."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Preempted(Exception):
    """The session was preempted (:class:`Preempted`): it stopped on ``servers``/``route``; its request still runs."""

    def __init__(self, servers: list, route: list, kv_freed: tuple = ()):
        super().__init__("preempted")
        self.servers, self.route, self.kv_freed = servers, route, kv_freed


@dataclass
class CompletionRunner:
    orchestrator: Any
    engine: GenerationEngine
    metrics: Any
    stall_timeout_s: float | None = None  # None: stall_factor x the planned step time, clamped
    stall_factor: float = 4.0
    # The floor covers a server's wait for KV memory after a failover: the replacement chain may be full, and
    # a rerouted session waits there for a session to end (10 s was measured to be too short on 2 CPU cores).
    stall_floor_s: float = 30.0
    stall_cap_s: float = 60.0
    max_attempts: int = 3  # sessions in a row that may fail without delivering a token
    # How long a session whose server failed waits in its place in the queue for a chain with room for the
    # rest (the orchestrator's QueueTimeout after that): it outlasts a re-plan and a block load on 2 CPU cores.
    route_wait_s: float = 120.0
    poll_s: float = 0.5
    release_wait_s: float = 8.0  # how long a stopped session may take to release its servers
    # An answer without max_tokens (SamplingParams.grows) reserves KV for this many output tokens at a time
    grow_tokens: int = 256
    grow_wait_s: float = 10.0  # the most a session thread waits for the event loop to answer a growth

    def reserve(self, params: SamplingParams, delivered: int) -> int:
        """Output tokens a session's KV reservation covers when it starts after ``delivered`` tokens: the rest of
        ``max_new_tokens``, or for an answer without max_tokens at most ``grow_tokens`` (it grows later)."""
        rest = params.max_new_tokens - delivered
        return min(rest, self.grow_tokens) if params.grows else rest

    def stall_limit(self, chain_id: str, tokens: int) -> float:
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
        planned = self.orchestrator.planned_step_s(chain_id, tokens)
        return min(self.stall_cap_s, max(self.stall_floor_s, self.stall_factor * planned))

    async def run(self, client: str, input_ids: list[int], params: SamplingParams,
                  is_disconnected: Callable[[], Awaitable[bool]], *, dual: bool = False
                  ) -> AsyncIterator[int | Finished]:
        """Yield generated token ids, then a :class:`Finished`. Raises ``ValueError`` (too long for the swarm),
        the orchestrator's ``NoChainsError``/``QueueFull``/``QueueTimeout``, :class:`ClientGone` or
        :class:`CompletionFailed`.

        ``dual`` (dual execution): every span of the session is re-executed on another server before anything
        is sent (:meth:`swarm.control.spot_checks.SpotChecker.verify_now`); the tokens come only when all agree.
        A disagreement is settled and struck as any spot check, and the request runs again, up to
        ``max_attempts`` times; then :class:`CompletionFailed`."""
        if not dual:
            async for item in self._run(client, input_ids, params, is_disconnected, False):
                yield item
            return
        for attempt in range(1, self.max_attempts + 1):
            items = []
            async for item in self._run(client, input_ids, params, is_disconnected, True):
                items.append(item)
            if items[-1].verified == "true":
                for item in items:
                    yield item
                return
            logger.warning("dual execution of a request of %s: the servers disagreed (attempt %d)", client, attempt)
        raise CompletionFailed(f"dual execution: the servers disagreed on all {self.max_attempts} attempts; the "
                               "answer was withheld")

    async def _run(self, client: str, input_ids: list[int], params: SamplingParams,
                   is_disconnected: Callable[[], Awaitable[bool]], dual: bool) -> AsyncIterator[int | Finished]:
        page_hashes = self.orchestrator.prompt_hashes(input_ids)
        submitted = time.monotonic()
        last_token: float | None = None
        prior = Progress([])  # the tokens delivered so far, over every session of this request
        grant, stale, attempt, preempted = None, 0, 0, None
        while True:
            attempt += 1
            try:
                grant = await (self._wait(self.orchestrator.acquire(
                    client, len(input_ids), params.max_new_tokens, page_hashes=page_hashes,
                    reserve=self.reserve(params, 0)), client, is_disconnected)
                    if grant is None else self._continue(grant, client, input_ids, params, prior, page_hashes,
                                                         is_disconnected, refused=preempted is None,
                                                         kv_freed=preempted.kv_freed if preempted else ()))
            except ClientGone:
                raise
            except Exception as exc:
                if preempted is None:
                    raise
                # a preempted answer whose rest found no chain (within route_wait_s, or the plan is gone) ends where
                # it stopped, as it would have without preemption
                logger.warning("preempted request of %s ends at %d tokens: %s", client, len(prior.tokens), exc)
                self.metrics.observe(client, "ok", time.monotonic() - submitted, 0.0)
                yield Finished(list(prior.tokens), "length", grant.chain_id, preempted.servers, preempted.route,
                               time.monotonic() - submitted, 0.0, attempts=attempt - 1, logprobs=prior.logprobs,
                               request_id=grant.request_id)
                return
            preempted = None
            started = time.monotonic()
            produced: list[int] = []
            control = SessionControl()
            session = self._session(grant, client, input_ids, params, page_hashes, is_disconnected, control,
                                    prior if prior.tokens else None, dual)
            try:
                async with contextlib.aclosing(session):
                    async for item in session:
                        if isinstance(item, Finished):
                            item.waiting_s, item.service_s = started - submitted, time.monotonic() - started
                            item.attempts = attempt
                            self.metrics.observe(client, "ok", item.waiting_s, item.service_s)
                            logger.info("completion client=%s chain=%s tokens=%d waiting=%.3fs service=%.3fs "
                                        "attempts=%d finish=%s", client, item.chain_id, len(item.token_ids),
                                        item.waiting_s, item.service_s, attempt, item.finish_reason)
                            yield item
                            return
                        now = time.monotonic()
                        if last_token is None:
                            self.metrics.ttft.labels(self.metrics.client_label(client)).observe(now - submitted)
                        else:
                            self.metrics.itl.labels(self.metrics.client_label(client)).observe(now - last_token)
                        last_token = now
                        produced.append(item)
                        yield item
            except (GeneratorExit, asyncio.CancelledError):  # the consumer went away mid-stream (streamed client left)
                self.metrics.observe(client, "disconnected", started - submitted, time.monotonic() - started)
                raise
            except DualExecutionUnavailable:
                self.orchestrator.abort(grant.request_id)
                raise
            except _Preempted as stop:  # not a failure: the rest queues again below
                self.metrics.aborted.labels("preempted").inc()
                preempted, failure = stop, stop
            except _Stopped as stop:
                if stop.reason == "client_gone":
                    self.metrics.observe(client, "disconnected", started - submitted, time.monotonic() - started)
                    self.orchestrator.abort(grant.request_id)
                    raise ClientGone("the client disconnected during generation") from None
                failure: BaseException = stop
            except Exception as exc:  # the session failed on the swarm
                self.metrics.aborted.labels("failed").inc()
                failure = exc
            chooser = control.chooser
            logprobs = chooser.logprobs[len(prior.tokens):len(prior.tokens) + len(produced)] if chooser else []
            prior = Progress(prior.tokens + produced, prior.logprobs + list(logprobs))
            stale = 0 if produced else stale + 1
            detail = ("no progress" if isinstance(failure, _Stopped) else
                      "preemption (its chain had no KV room for the answer to grow)" if preempted else repr(failure))
            if stale >= self.max_attempts:
                self.orchestrator.abort(grant.request_id)
                self.metrics.observe(client, "error", started - submitted, time.monotonic() - started)
                raise CompletionFailed(f"the session failed on the swarm after {len(prior.tokens)} tokens and "
                                       f"{attempt} attempt(s), the last {stale} without a token: {detail}")
            logger.warning("request of %s goes on from %d tokens (attempt %d) after %s", client,
                           len(prior.tokens), attempt + 1, detail)

    async def _continue(self, grant, client, input_ids, params, prior: Progress, page_hashes, is_disconnected,
                        refused: bool = True, kv_freed: tuple = ()):
        """The session of ``grant`` failed (or was preempted: not ``refused``, its timeout ends the answer without
        a refusal) after delivering ``prior``: its continuation waits in its old place in the queue
        (:meth:`Orchestrator.resume`) for up to ``route_wait_s`` (with the prompt's page hashes only when nothing
        was delivered: a continuation runs without prefix reuse)."""
        waiting = self.orchestrator.resume(
            grant.request_id, client, len(input_ids) + len(prior.tokens), params.max_new_tokens - len(prior.tokens),
            timeout=self.route_wait_s, page_hashes=() if prior.tokens else page_hashes,
            reserve=self.reserve(params, len(prior.tokens)), refused=refused, kv_freed=kv_freed)
        return await self._wait(waiting, client, is_disconnected)

    async def _wait(self, waiting: Awaitable[Grant], client: str, is_disconnected) -> Grant:
        """Wait for a chain slot; a client that disconnects while queued leaves the queue at once. A wait given up
        (the client left, or the request's other runs were refused: a batch, ``n``) gives back a grant that comes
        anyway: Python 3.11's ``asyncio.wait_for`` returns a result that arrives in the step its task is
        cancelled, so a cancelled ``acquire()`` can still end with a grant (a chain slot that stayed taken for good
        under a burst of 4x the capacity: the swarm was never idle again)."""
        waiting, granted = asyncio.ensure_future(waiting), False
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=self.poll_s)
                if waiting in done:
                    granted = True
                    return waiting.result()
                if await is_disconnected():
                    waiting.cancel()  # acquire() takes the request out of the scheduler's queue
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await waiting
                    self.metrics.requests.labels(self.metrics.client_label(client), "left_queue").inc()
                    raise ClientGone("the client disconnected while queued")
        finally:
            if not granted:
                waiting.cancel()  # nothing if it is done already
                waiting.add_done_callback(self._give_back)

    def _give_back(self, waiting: asyncio.Future) -> None:
        """A wait given up: the grant it ended with, if any, is finished at once (its slot free again)."""
        if not waiting.cancelled() and waiting.exception() is None:
            self.orchestrator.finish(waiting.result().request_id, 0)

    async def _session(self, grant, client, input_ids, params, page_hashes, is_disconnected,
                       control: SessionControl, prior: Progress | None, dual: bool = False):
        """Run the granted session; yields its new tokens, then :class:`Finished` (with every token of the
        request). On a failure it raises (:class:`_Stopped` for a stall or a client that left) and leaves the
        request running in the orchestrator: the caller resumes or aborts it."""
        orchestrator, engine = self.orchestrator, self.engine
        chain = orchestrator.chain(grant.chain_id)
        lease = Lease(grant.request_id, grant.chain_id, chain.route, orchestrator.session_tokens(grant.request_id),
                      ticket=orchestrator.ticket(grant.request_id, grant.chain_id, chain.route, page_hashes or ()))
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        prefix: dict[str, Any] = {"expected": grant.matched_tokens}

        matcher = StopMatcher(params.stop) if params.stop else None
        generated: list[int] = list(prior.tokens) if prior is not None else []  # for the stop strings
        reserved = len(generated) + self.reserve(params, len(generated))  # output tokens the KV reservation covers

        def grow() -> None:  # session thread: the reservation is used up; more, a preemption, or the answer ends
            nonlocal reserved
            rest = params.max_new_tokens - len(generated)
            more, so_far = min(self.grow_tokens, rest), len(input_ids) + len(generated)

            async def ask() -> str:
                if orchestrator.grow(grant.request_id, more):
                    return "grown"
                # no room on this chain now: wait for room (preempted) if some chain of the plan can hold the rest
                return "preempt" if not dual and orchestrator.can_hold(so_far, rest, more) else "full"

            answer = asyncio.run_coroutine_threadsafe(ask(), loop).result(self.grow_wait_s)
            if answer == "preempt":
                raise Preempted()
            if answer == "full":
                raise ReservationFull()
            reserved += more

        def on_token(token: int) -> None:  # session thread -> event loop
            control.check()  # stopped from outside: end the session at this token
            control.progress()
            loop.call_soon_threadsafe(tokens.put_nowait, token)
            generated.append(token)
            if matcher is not None and len(generated) >= params.min_tokens:  # min_tokens: no stop before (vLLM)
                after = len(engine.decode(generated[:params.min_tokens - 1])) if params.min_tokens > 1 else 0
                if matcher.check(engine.decode(generated), after)[1]:
                    raise StopGeneration()  # a stop string is complete: the request is done
            if params.grows and reserved <= len(generated) < params.max_new_tokens:
                grow()  # before the next token: the reservation must cover it

        def on_prefix(reused: int) -> None:  # session thread, after the probe and before the prefill
            loop.call_soon_threadsafe(orchestrator.prefilled, grant.request_id, reused, len(input_ids),
                                      grant.matched_tokens)

        checks = getattr(orchestrator, "checks", None)  # spot checks: is this session drawn (swarm.control.spot_checks)
        if dual and checks is None:
            raise DualExecutionUnavailable("dual execution needs the orchestrator's spot checker (a generation engine)")
        if dual and (params.prompt_logprobs is not None or params.max_new_tokens == 0):
            raise DualExecutionUnavailable("dual execution re-executes generated tokens; a prompt's scores are not "
                                           "re-executed")
        # one token with the prompt's scores: chosen from the scoring prefill's last position (not prefilled again)
        from_scores = params.prompt_logprobs is not None and params.max_new_tokens == 1 and len(input_ids) > 1
        try:
            recorder = (checks.recorder(chain.route, dual=dual) if checks is not None and params.max_new_tokens > 0
                        and not from_scores else None)  # a prompt's scoring is not recorded (swarm.engine.scoring)
        except RuntimeError as exc:  # a span no other server holds
            raise DualExecutionUnavailable(str(exc)) from None

        scored: list[TokenLogprob] | None = None

        def generate():
            nonlocal scored
            provider = _LoopProvider(orchestrator, loop)
            reused = 0
            if params.prompt_logprobs is not None and scored is None:  # echo with logprobs (swarm.engine.scoring)
                scores = engine.score(lease, provider, input_ids, params.prompt_logprobs, control, page_hashes)
                scored, reused = scores.records, scores.reused
                if from_scores and prior is None and scores.last is not None:
                    return engine.answer_scored(input_ids, scores.last, params, on_token, client, reused)
            if params.max_new_tokens == 0:  # a prompt scored or echoed, nothing generated
                return GenerationResult([], "length", reused, len(input_ids) - reused if scored is not None else 0)
            return engine.generate(lease, provider, input_ids, params, on_token,
                                   page_hashes=page_hashes or None, on_prefix=on_prefix if page_hashes else None,
                                   control=control, prior=prior, recorder=recorder, client=client)

        # token callbacks are queued on the loop before the executor future resolves, so once the task is done
        # every token is already in the queue
        task = asyncio.ensure_future(loop.run_in_executor(engine.executor, generate))
        settled = False
        orchestrator.running[grant.request_id] = control
        try:
            count, checked = 0, time.monotonic()
            while not task.done() or not tokens.empty():
                getter = asyncio.ensure_future(tokens.get())
                done, _ = await asyncio.wait({getter, task}, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    count += 1
                    orchestrator.tokens(grant.request_id, 1)
                    self.metrics.tokens.labels(self.metrics.client_label(client)).inc()
                    yield getter.result()
                else:
                    getter.cancel()
                if task.done():
                    continue
                if time.monotonic() - checked >= self.poll_s:
                    checked = time.monotonic()
                    if await is_disconnected():  # (settled only once stopped: a response cancelled while the
                        await self._stop(task, control, grant, "client_gone")  # stop waits is released below)
                        settled = True
                        raise _Stopped("client_gone")
                limit = self.stall_limit(grant.chain_id, len(input_ids) if count == 0 else 1)
                if time.monotonic() - control.last_progress > limit:
                    logger.warning("session %s on chain %s made no progress for %.1f s: aborting",
                                   grant.request_id, grant.chain_id, limit)
                    await self._stop(task, control, grant, "stalled")
                    settled = True
                    raise _Stopped("stalled")
            settled = True
            result = task.result()
            if result.finish_reason == Preempted.finish_reason:
                raise _Preempted(list(chain.servers), list(chain.route), result.kv_freed)
            if dual:  # the second execution is charged to the client as the first one's tokens again
                orchestrator.tokens(grant.request_id, len(result.token_ids))
            # its KV stays counted until the servers have freed it (the close travels with the chain's next step)
            orchestrator.finish(grant.request_id, len(result.token_ids), kv_freed=result.kv_freed)
            prefix.update(reused=result.reused_tokens, prefill=result.prefill_tokens, restarts=result.restarts)
            verified, tokens = None, list(input_ids) + result.token_ids
            if dual:
                agreed = await loop.run_in_executor(engine.executor, checks.verify_now, grant.request_id,
                                                    lease.route, tokens, recorder, len(input_ids), result.drafted,
                                                    result.accepted)
                verified = "true" if agreed else "false"
            elif checks is not None:
                checks.finished(grant.request_id, lease.route, tokens, recorder, len(input_ids), result.drafted,
                                result.accepted, greedy=params.decided_by_argmax)
                verified = orchestrator.ledger.verdict(grant.request_id)
            yield Finished(result.token_ids, result.finish_reason, grant.chain_id, list(chain.servers),
                           list(chain.route), 0.0, 0.0, prefix, logprobs=result.logprobs,
                           request_id=grant.request_id, verified=verified, prompt_logprobs=scored)
        finally:
            orchestrator.running.pop(grant.request_id, None)
            if not settled:  # the consumer went away mid-stream (cancelled / closed): stop in the background
                asyncio.ensure_future(self._stop(task, control, grant, "client_gone", release=True))

    async def _stop(self, task: asyncio.Future, control: SessionControl, grant, reason: str, *,
                    release: bool = False) -> None:
        """Abort a running session and give its servers ``release_wait_s`` to be released; then its slot can be
        returned (here with ``release``) whatever the session thread is doing. A session is counted aborted once,
        under its first reason (a stop cancelled midway is stopped again, releasing)."""
        if control.aborted is None:
            self.metrics.aborted.labels(reason).inc()
        control.abort(reason)
        await asyncio.wait({task}, timeout=self.release_wait_s)
        if task.done():
            with contextlib.suppress(BaseException):
                task.result()  # retrieved: SessionAborted / ClientGone is the expected outcome
        else:
            logger.warning("session %s did not stop within %.0f s; returning its slot anyway", grant.request_id,
                           self.release_wait_s)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        if release:
            self.orchestrator.abort(grant.request_id)
