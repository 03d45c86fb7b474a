"""The orchestrator's generation engine: runs a granted session through its chain (the paper's proxy).

One petals distributed model (embeddings and LM head local, blocks remote) serves every session; each
session runs in its own worker thread and routes on its own lease (``swarm.engine.routing``), so many sessions
proceed concurrently on different chains. Generated tokens are reported as they appear, for streaming
and for per-token fairness charging.

Sessions on the same chain are batched (``batch_sessions`` > 0, the default): a session joins the chain's
:class:`swarm.engine.batching.ChainGenerator`, which steps all of that chain's sessions together — one
multi-session message per server and step, one batched pass on each server, one LM-head pass here — with the
same tokens (greedy, or the request's own sampling), its prompt's held pages loaded by the servers (prefix
reuse) and its decode steps carrying drafted tokens (speculative decoding). If the batched path fails (a server
that dies, pages evicted since the probe, a server without multi-session streams), the session goes on from the
tokens it has on petals' own per-session path, without reuse, failing over as every session does. It keeps
drafting there (:mod:`swarm.engine.single`: its steps carry the drafts, its servers take rejected ones back),
unless a server of its route cannot take positions back (a vanilla petals server).

With ``batch_lanes`` L > 1 a chain has up to L such generators (lanes) and a new session joins the one with the
fewest sessions: each lane steps through the chain on its own, so one lane's step on a server overlaps another's
on the next server, where a single lockstep cohort leaves every server idle while the others compute
(:mod:`swarm.engine.lanes`).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from swarm.engine import batching, scoring, single
from swarm.engine.batching import Decoding, SequenceFailed, StopSequence
from swarm.engine.lanes import ChainLanes
from swarm.engine.multi_client import ChainBatch
from swarm.engine.multi_wire import Prefix
from swarm.trust.prefix import MISSING_MESSAGE as PREFIX_MISSING, PAGE_TOKENS, reusable_pages
from swarm.engine.sampling import SamplingParams, TokenChooser, TokenLogprob
from swarm.engine.routing import (
    Lease, LeaseProvider, NoRouteError, PrefixPlan, PrefixSessionFailed, SessionControl, install, probe_route,
    splice, use_lease,
)

logger = logging.getLogger(__name__)


class StopGeneration(Exception):
    """Raised by a token callback when the request is complete (a stop string matched): not a failure."""

    finish_reason = "stop"


class ReservationFull(StopGeneration):
    """Raised by a token callback when an answer without max_tokens reached its KV reservation and no chain of
    the plan can hold it longer: the answer ends there, as at a length limit."""

    finish_reason = "length"


class Preempted(StopGeneration):
    """Raised by a token callback when an answer without max_tokens reached its KV reservation and its chain has
    no room for more now, though a chain of the plan can hold the rest: the session ends here (its servers free
    its KV) and the completion runner queues the rest again, to be recomputed from the prompt and the tokens so
    far when a chain has room (vLLM's recompute preemption)."""

    finish_reason = "preempted"


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence token or a stop string) or "length"
    reused_tokens: int = 0  # prompt positions whose KV came from the servers' prefix stores
    prefill_tokens: int = 0  # prompt positions actually computed (summed over restarts)
    restarts: int = 0  # prefix-reuse sessions restarted from the full tokens after a failure
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when requested
    drafted: int = 0  # speculative decoding: tokens drafted into this session's decode steps
    accepted: int = 0  # ... and verified (each saved a decode step)
    # batched sessions: resolved once no server holds their KV (the close travels with the chain's next step)
    kv_freed: tuple[concurrent.futures.Future, ...] = ()


@dataclass
class Progress:
    """What earlier sessions of a request delivered: :meth:`GenerationEngine.generate` continues from it (the
    prompt plus these tokens, the sampler's state replayed), so the client's answer goes on where it stopped."""

    tokens: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)


class _TokenSink:
    """A transformers streamer that forwards every newly generated token id."""

    def __init__(self, on_token: Callable[[int], None]):
        self.on_token = on_token
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.on_token(int(token))

    def end(self) -> None:
        pass


class GenerationEngine:
    """Generates through the swarm on leased chains. Thread-safe; ``generate`` blocks."""

    def __init__(self, model_dir: str, *, initial_peers: list[str], dht_prefix: str, max_workers: int = 64,
                 max_retries: int = 3, request_timeout: float = 30.0, torch_dtype: str = "float32",
                 batch_sessions: int = 16, batch_lanes: int = 1, speculation=None,
                 batch_bound: Callable[[tuple], int | None] | None = None, dht=None,
                 route_ends: Callable[[tuple], bool] | None = None):
        """``dht``: a running hivemind DHT of the swarm to reach the servers through (the orchestrator passes its
        own: one libp2p daemon for both); by default petals starts a client DHT, which :meth:`close` stops.
        ``route_ends(route)``: whether that chain's first and last servers embed token ids and choose the tokens
        (the orchestrator's ``route_ends``; default: never, every head runs here)."""
        from swarm.engine.petals_client import load_distributed_model
        from swarm.model.tokenizer import load_tokenizer, text_decoder

        self.tokenizer = load_tokenizer(model_dir)
        self._decode = text_decoder(self.tokenizer)  # tokenizer.decode(ids, skip_special_tokens=True), in Rust
        self.model = load_distributed_model(model_dir, initial_peers=initial_peers, dht_prefix=dht_prefix,
                                            max_retries=max_retries, torch_dtype=getattr(torch, torch_dtype),
                                            request_timeout=request_timeout, dht=dht)
        self._own_dht = dht is None
        self.model.eval()
        self.manager = install(self.model)
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="session")
        self.eos_token_id = self.tokenizer.eos_token_id
        self.batch_sessions, self.request_timeout = int(batch_sessions), request_timeout
        self.speculation = speculation  # swarm.engine.speculative.Speculation, or None: one token per step
        self.score_cache = scoring.ScoreCache()  # scored prompt prefixes, reused by prompts that share them
        self._unbatched: set[tuple] = set()  # routes with a server that has no multi-session streams
        self._no_rollback: set[str] = set()  # servers that did not confirm a rollback: no drafts on their routes
        self.fallbacks = 0  # batched sessions that went on on petals' per-session path
        # route -> the servers' smallest published batch bound (the orchestrator's route_batch_bound): how many
        # decode positions a step of that chain fills with drafts; None: batching.ChainGenerator.STEP_POSITIONS
        self.batch_bound = batch_bound or (lambda route: None)
        self.lanes = ChainLanes(self.model, lanes=batch_lanes, sessions=self.batch_sessions,
                                step_timeout=request_timeout, batch_bound=self.batch_bound,
                                route_ends=route_ends or (lambda route: False))
        self._closed = threading.Event()

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self._decode(token_ids)

    @torch.inference_mode()
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """The chain's input for ``token_ids``: ``(t, H)`` in the serving dtype."""
        return self.model.transformer.word_embeddings(torch.tensor([list(token_ids)]))[0]

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head over hidden rows ``(n, H)``: logits ``(n, V)`` (a spot check's head check)."""
        return batching.head_logits(self.model, hidden)

    @torch.inference_mode()
    def run_span(self, peer: str, start: int, end: int, hidden: torch.Tensor, ticket: bytes | None = None,
                 verify: list[int] | None = None):
        """One prefill of ``hidden`` ``(t, H)`` through blocks ``[start, end)`` of server ``peer`` (a spot check's
        re-execution: an ordinary multi-session stream with one session, as a chain's first prefill is); its
        outputs. With ``verify`` (token ids; the server holds the last block and its ends): the server also chooses
        greedily at the last ``len(verify)`` positions, ``verify[:-1]`` taken as drafts, and the answer is
        ``(outputs, its tokens)`` — up to its first disagreement, its own token there included."""
        manager = self.manager
        with ChainBatch(manager.state.p2p, [(peer, start, end)], manager.block_uids,
                        step_timeout=self.request_timeout) as batch:
            sid = "s0"
            ends = {} if verify is None else {
                "samples": {sid: {"greedy": True, "eos": None}}, "keeps": {sid},
                "chooses": {sid: (list(verify[:-1]), len(verify))}}
            outputs, failed, chosen = batch.step_ends({sid: hidden[None].to(self.model.dtype)},
                                                      {sid: hidden.shape[0]},
                                                      {sid: ticket} if ticket is not None else {}, **ends)
            if sid in failed:
                raise RuntimeError(f"the server refused the span: {failed[sid]}")
            if verify is None:
                return outputs[sid][0]
            if sid not in chosen:
                raise RuntimeError("the server chose no tokens for the verified positions")
            return outputs[sid][0], [int(t) for t in chosen[sid][0]]

    def score(self, lease: Lease, provider: LeaseProvider | None, input_ids: list[int], top: int,
              control: SessionControl | None = None, page_hashes: list[bytes] | None = None
              ) -> scoring.PromptScores:
        """Every prompt token's log-probability after the ones before it, with ``top`` alternatives, and the last
        position's output (blocking; one prefill on ``lease``'s chain, :mod:`swarm.engine.scoring`). With the
        prompt's ``page_hashes`` its pages are stored, and a prefix scored before and held by the chain is loaded
        (:class:`swarm.engine.scoring.ScoreCache`); where that fails, the prompt is scored again in full."""
        if self._closed.is_set():
            raise RuntimeError("the generation engine is closed")
        try:
            return scoring.score_prompt(self.model, lease, provider, input_ids, top, control, self.manager,
                                        page_hashes or (), self.score_cache)
        except PrefixSessionFailed as exc:
            logger.warning("scoring the full prompt again: %s", exc)
            self._after_prefix_failure(lease, provider, exc, control)
            return scoring.score_prompt(self.model, lease, provider, input_ids, top, control)

    def _after_prefix_failure(self, lease: Lease, provider, exc: PrefixSessionFailed,
                              control: SessionControl | None) -> None:
        """A session that loaded prefix pages failed: its route without the failed server, or (the pages were
        only gone) the same route with a fresh ticket, for a session from the full tokens."""
        if not exc.missing and exc.peer_id is not None and provider is not None:
            lease.route = tuple(provider.reroute(lease, 0, len(self.manager), [exc.peer_id]))
            if control is not None:
                control.progress()  # as in _reroute: the session moved off the failed server
        elif hasattr(provider, "renew_ticket"):  # same route, later: a fresh ticket for the reopen
            provider.renew_ticket(lease)

    @torch.inference_mode()
    def answer_scored(self, input_ids: list[int], last: torch.Tensor, params: SamplingParams,
                      on_token: Callable[[int], None] | None = None, client: str = "",
                      reused: int = 0) -> GenerationResult:
        """A one-token answer chosen from a scoring prefill's last output ``last`` (:meth:`score`), as a session's
        first step chooses it (the same head, chooser and end rules): the prompt is not prefilled again."""
        if params.max_new_tokens != 1:
            raise ValueError(f"a scored prompt answers one token, not {params.max_new_tokens}")
        produced: list[int] = []

        def sink(token: int) -> None:
            produced.append(token)
            if on_token is not None:
                on_token(token)

        chooser = None if params.plain_greedy else TokenChooser(params, self.model.config.vocab_size)
        eos = self.eos_token_id if params.stops_at_eos else None
        finish = "length"
        try:
            batching.emit_verified(Decoding("scored", list(input_ids), 1, eos, sink, chooser),
                                   batching.head_logits(self.model, last[None]))
        except StopGeneration as stop:  # a stop string
            finish = stop.finish_reason
        if produced and eos is not None and produced[-1] == eos:
            finish = "stop"
        if self.speculation is not None:
            self.speculation.learn(client, input_ids, produced)
        return GenerationResult(produced, finish, reused, len(input_ids) - reused,
                                logprobs=chooser.logprobs[:len(produced)] if chooser else [])

    def generate(self, lease: Lease, provider: LeaseProvider | None, input_ids: list[int], params: SamplingParams,
                 on_token: Callable[[int], None] | None = None, *, page_hashes: list[bytes] | None = None,
                 on_prefix: Callable[[int], None] | None = None,
                 control: SessionControl | None = None, prior: Progress | None = None,
                 recorder=None, client: str = "") -> GenerationResult:
        """Run one session on ``lease``'s chain (blocking). ``provider`` handles mid-session failover.

        With ``page_hashes`` (the prompt's full-page hashes, :mod:`swarm.trust.prefix`) the chain's servers are
        probed first; the pages all of them hold are reused (``on_prefix(reused_tokens)`` is called before
        the prefill) and the new pages are stored after it. If a server fails during a session that reused a
        prefix, the session restarts on a route without it from the prompt plus the tokens generated so far,
        with no reuse — the answer is the one a session without reuse gives.

        With ``prior`` (an earlier session of this request delivered those tokens, then failed) the session runs
        on the prompt plus them for the tokens left, its sampler replayed to that point; the result holds all
        the tokens (``restarts`` = 1).

        With ``recorder`` (:class:`swarm.engine.recording.SpanRecorder`) the hidden states its spans were sent and
        returned are kept for a spot check; a failover drops the recording.

        With the engine's ``speculation`` (and ``params.speculative``) the session drafts tokens from its own text
        and ``client``'s earlier outputs and verifies them in its decode steps, batched or as a petals session
        (:mod:`swarm.engine.single`); its output is then indexed for later drafts in ``client``'s scope.
        """
        if self._closed.is_set():
            raise RuntimeError("the generation engine is closed")
        produced: list[int] = list(prior.tokens) if prior is not None else []
        if produced:
            page_hashes = None  # the prompt pages of a continuation are not probed: it runs without reuse

        def sink(token: int) -> None:
            produced.append(token)
            if on_token is not None:
                on_token(token)

        plan = None
        if page_hashes:
            held = probe_route(self.manager, lease.route, page_hashes, page_tokens=PAGE_TOKENS, ticket=lease.ticket)
            plan = PrefixPlan(list(page_hashes), reusable_pages(held, len(input_ids)), PAGE_TOKENS)
        reused = plan.reused_tokens if plan is not None else 0
        if on_prefix is not None:
            on_prefix(reused)
        restarts = 1 if produced else 0
        prompt, budget = list(input_ids) + produced, params.max_new_tokens - len(produced)
        prefill = len(prompt) - reused
        chooser = None if params.plain_greedy else TokenChooser(params, self.model.config.vocab_size)
        if chooser is not None and produced:
            chooser.replay(produced, prior.logprobs)
        if control is not None:
            control.chooser = chooser  # the runner reads a failed session's logprobs from it
        ignore_eos = not params.stops_at_eos  # ignore_eos: max_new_tokens ends it

        def ended() -> bool:  # the model emitted its end-of-sequence token
            return (bool(produced) and not ignore_eos and self.eos_token_id is not None
                    and produced[-1] == self.eos_token_id)

        drafts = None  # the batched session's drafting (swarm.engine.speculative.SessionDrafts), when it speculates
        freed: list[concurrent.futures.Future] = []  # the batched sessions' kv_freed

        def result(finish_reason: str) -> GenerationResult:
            if self.speculation is not None:
                self.speculation.learn(client, input_ids, produced)
            return GenerationResult(produced, finish_reason, reused, prefill, restarts,
                                    chooser.logprobs[:len(produced)] if chooser else [],
                                    drafts.drafted if drafts is not None else 0,
                                    drafts.accepted if drafts is not None else 0, tuple(freed))

        def resume() -> None:
            """Go on from the prompt plus the tokens produced so far as one petals session, without reuse (drafting
            as before, where the route's servers can take drafts back)."""
            nonlocal prefill, restarts
            restarts = 1
            remaining = params.max_new_tokens - len(produced)
            if recorder is not None:
                recorder.route_changed("the session went on after a failure")
            if remaining > 0 and not ended():
                prompt = list(input_ids) + produced
                prefill += len(prompt)
                if chooser is not None:  # it chose one more token than the failed session delivered
                    chooser.truncate(len(produced))
                self._run(lease, provider, prompt, remaining, chooser, sink, None, control, ignore_eos, drafts=drafts)

        if budget <= 0 or ended():  # the earlier sessions had delivered everything
            return result("stop" if ended() else "length")
        # every request may speculate: a seeded sampled one draws each token from its seed and position, so its text
        # is the same however many tokens its steps drafted (swarm.engine.speculative)
        drafts = self.speculation.session(client) if self.speculation is not None and params.speculative else None
        try:
            try:
                if self.batch_sessions > 0 and tuple(lease.route) not in self._unbatched:
                    try:
                        self._run_batched(lease, prompt, budget, chooser, sink, control, ignore_eos, recorder, drafts,
                                          plan, freed)
                    except SequenceFailed as exc:
                        self.fallbacks += 1
                        logger.warning("a batched session continues on its own: %s", exc)
                        if exc.unsupported:
                            self._unbatched.add(tuple(lease.route))
                        # pages evicted since the probe are no server's fault: the same route, a fresh ticket
                        if exc.peer_id is not None and provider is not None and PREFIX_MISSING not in str(exc):
                            lease.route = self._reroute(lease, provider, exc.peer_id, control)  # its blocks only
                        elif hasattr(provider, "renew_ticket"):
                            provider.renew_ticket(lease)
                        resume()
                else:
                    self._run(lease, provider, prompt, budget, chooser, sink, plan, control, ignore_eos, recorder,
                              drafts)
            except PrefixSessionFailed as exc:
                logger.warning("restarting a prefix-reuse session from the full tokens: %s", exc)
                self._after_prefix_failure(lease, provider, exc, control)
                resume()
        except StopGeneration as stop:  # a token callback completed the request (a stop string, a full reservation)
            return result(stop.finish_reason)
        return result("stop" if ended() else "length")

    def _reroute(self, lease: Lease, provider: LeaseProvider, failed_peer: str,
                 control: SessionControl | None) -> tuple:
        """The lease's route with the failed server's blocks served elsewhere (as petals' own failover does: the
        session keeps its slots on the other servers). Right after a failure the orchestrator may have no ready
        chain for a moment (it re-plans without the server): ask again every half second, for
        ``request_timeout``."""
        start, end = next(((s, e) for peer, s, e in lease.route if peer == failed_peer), (0, len(self.manager)))
        deadline = time.monotonic() + self.request_timeout
        while True:
            try:
                route = splice(lease.route, provider.reroute(lease, start, end, [failed_peer]))
                if control is not None:  # the session moved off the failed server: its no-progress clock restarts,
                    control.progress()  # or the step timeout that found the failure would leave it no time to resume
                return route
            except NoRouteError:
                if time.monotonic() > deadline:
                    raise
            if control is not None:
                control.check()
            time.sleep(0.5)

    def batch_stats(self) -> dict:
        """The batched path's figures (:meth:`swarm.engine.lanes.ChainLanes.stats`) and its fallbacks."""
        return {**self.lanes.stats(), "fallbacks": self.fallbacks}

    def _run_batched(self, lease: Lease, input_ids: list[int], max_new_tokens: int, chooser: TokenChooser | None,
                     sink: Callable[[int], None], control: SessionControl | None,
                     ignore_eos: bool = False, recorder=None, drafts=None, plan: PrefixPlan | None = None,
                     freed: list | None = None) -> None:
        """Run the session in its chain's batch (blocking), reusing ``plan``'s prompt pages; its ``kv_freed`` future
        goes into ``freed``. Raises :class:`SequenceFailed` to fall back."""
        generator = self.lanes.get(tuple(lease.route))
        kv_freed = concurrent.futures.Future()
        stopped = []

        def on_token(token: int) -> None:
            try:
                sink(token)
            except StopGeneration as stop:  # a stop string or a full reservation: the sequence is complete
                stopped.append(stop)
                raise StopSequence() from None

        try:
            future = generator.submit(input_ids, max_new_tokens, eos_token_id=None if ignore_eos else self.eos_token_id,
                                      on_token=on_token, processor=chooser, ticket=lease.ticket, recorder=recorder,
                                      drafts=drafts, prefix=None if plan is None else Prefix(tuple(plan.hashes),
                                                                                             plan.load_pages),
                                      kv_freed=kv_freed)
        except RuntimeError as exc:  # closed meanwhile
            raise SequenceFailed(str(exc), []) from exc
        if freed is not None:
            freed.append(kv_freed)
        unwatch = control.watch_peers(generator.peer_failed) if control is not None else None
        try:
            while True:
                try:
                    future.result(timeout=0.25)
                    if stopped:
                        raise stopped[0]
                    return
                except concurrent.futures.TimeoutError:
                    if control is not None and control.aborted is not None:
                        generator.cancel(future)
                        control.check()
        finally:
            if unwatch is not None:
                unwatch()

    def _run(self, lease: Lease, provider, input_ids: list[int], max_new_tokens: int, chooser: TokenChooser | None,
             sink: Callable[[int], None], plan: PrefixPlan | None, control: SessionControl | None = None,
             ignore_eos: bool = False, recorder=None, drafts=None) -> None:
        """One petals session on the lease's chain (failover as petals does it, routed by the orchestrator). With
        ``drafts``, on a route whose servers can take positions back, it speculates (:mod:`swarm.engine.single`);
        otherwise petals' own ``generate`` runs it, one token per step."""
        from transformers import LogitsProcessorList

        eos = None if ignore_eos else self.eos_token_id
        if drafts is not None and tuple(lease.route) not in self._unbatched and not any(
                peer in self._no_rollback for peer, _, _ in lease.route):
            seq = Decoding("single", list(input_ids), max_new_tokens, eos, sink, chooser, drafts=drafts)
            try:
                with use_lease(lease, provider, control) as context:
                    context.prefix, context.recorder = plan, recorder
                    single.generate(self.model, seq)
                return
            except single.RollbackUnconfirmed as exc:  # the rest without drafts, from the tokens verified so far
                logger.warning("%s", exc)
                self._no_rollback.update(exc.peers)
                if recorder is not None:
                    recorder.route_changed("the session went on after a failed rollback")
                input_ids, plan = list(input_ids) + seq.produced, None
                max_new_tokens -= len(seq.produced)
                if max_new_tokens <= 0:
                    return

        ids = torch.tensor([input_ids], dtype=torch.long)
        sampling: dict = dict(do_sample=False)  # the chooser picks every token; greedy search then emits it
        if chooser is not None:
            sampling["logits_processor"] = LogitsProcessorList([chooser])
        # petals' generate() opens the InferenceSession in a ``with`` block on this thread and closes it (and
        # every server session) here on every path: success, error, abort, failover (swarm.model.petals_sessions)
        with use_lease(lease, provider, control) as context, torch.inference_mode():
            context.prefix, context.recorder = plan, recorder
            self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                # ignore_eos: an id no token has (None would mean the checkpoint's generation_config's)
                eos_token_id=-1 if ignore_eos else self.eos_token_id,
                pad_token_id=self.eos_token_id if self.eos_token_id is not None else 0,
                streamer=_TokenSink(sink), **sampling,
            )

    def close(self) -> None:
        from swarm.engine.petals_client import close_distributed_model

        self._closed.set()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.lanes.close()
        close_distributed_model(self.model, own_dht=self._own_dht)
