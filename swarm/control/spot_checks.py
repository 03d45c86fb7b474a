"""Spot checks by prefill: re-execute a sample of finished sessions' spans on other servers and ban the servers
whose arithmetic is wrong. The policy (rates, tolerance, strikes) is :mod:`swarm.trust.verification`.

How one check goes (TOPLOC's and VeriLLM's idea, "validate by re-running as prefill", on a swarm):

1. **Choose, then record.** When a session starts, the orchestrator draws whether it will be checked (each
   server of its route at that server's rate) and, if so, records the hidden states the chosen servers were
   sent and returned (:mod:`swarm.engine.recording`). Nothing the servers see changes: the checked server is
   never contacted again, so it cannot tell which of its sessions are checked, nor behave better on them.
2. **Re-execute.** After the session ended, another server ``Y`` holding the same blocks runs the span as one
   prefill from the very inputs the checked server ``X`` received (for a session that reused a prompt prefix,
   the prefix positions' inputs are recomputed first by other servers upstream). ``Y`` gets an ordinary
   ticket for a chain it belongs to and an ordinary prefill; it cannot tell a check from a short request.
3. **Compare** ``X``'s outputs and ``Y``'s at sampled positions (the last one always) with the dtypes'
   tolerance. Equal: ``X`` passes — unless ``X`` holds the last block and chose a greedy session's tokens itself
   (:mod:`server.ends`): then ``Y``, which holds it too, verifies ``X``'s last tokens as drafts in the same
   prefill; where ``Y``'s choice parts from ``X``'s, the orchestrator's LM head over ``X``'s own outputs at that
   one position decides (a token clearly below the argmax strikes ``X``), so no head runs here on honest work. Different: a third opinion, from a third server ``Z`` or, where none holds
   the span, from the orchestrator computing it itself (float32, from its checkpoint folder); the server that
   disagrees with the two others is struck (``X``, or ``Y`` if it lied on the check). Where no other server
   holds the span, the orchestrator's own computation is the reference with ``--spot-check-local`` (else the
   span stays unchecked: counted). All three apart: inconclusive, nobody struck.

Checks run on one background thread, one at a time, from a bounded queue (the oldest job is dropped when
it is full), in idle capacity only: a check holds its prefill's KV on the checker in the orchestrator's
occupancy (:meth:`SpotCheckHooks.hold_for_check`; the chains through it give that up while it runs) and waits up
to ``room_wait_s`` for room, else it is skipped.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from swarm.control import token_checks
from swarm.engine.recording import SpanRecorder, SpanTrace
from swarm.trust import records
from swarm.trust.identity import fingerprint
from swarm.trust.verification import EPSILON, Ledger, distance, tolerance

logger = logging.getLogger(__name__)


class SpotCheckHooks:
    """What the orchestrator (a mixin of :class:`swarm.control.orchestrator.Orchestrator`) offers its checker."""

    def is_banned(self, node: str) -> bool:
        """Banned by the spot checks: its node id, or the key it signs with (under any node id)."""
        key = self.pins.owner(node)
        return self.ledger.is_banned(node, fingerprint(key) if key else None)

    def ready_chains(self) -> list:
        return list(self._ready)

    def spot_check_event(self, kind: str, **data) -> None:
        """An event from the checker's thread."""
        self._on_loop(lambda: self._event(kind, **data))

    def banned_now(self, node: str) -> None:
        """A server was banned (checker thread): re-plan without it at once."""
        self._on_loop(self._refresh_now.set)

    def hold_for_check(self, node: str, start: int, end: int, tokens: int) -> Optional[str]:
        """(checker thread) Hold the KV a check's prefill of ``tokens`` takes on ``node``'s blocks, if the
        orchestrator's accounting has room for it there; None: not now (RuntimeError: never, the pool is smaller
        than the check). Checks use idle capacity: the chains through ``node`` give up what the check holds until
        it is released (:mod:`swarm.control.occupancy`)."""
        def take() -> Optional[str]:
            need, slots = self.config.expect.kv_need(tokens, 0), self.kv_pools()
            blocks = need * (end - start)
            if node in slots and blocks > slots[node]:  # waiting would not help
                raise RuntimeError(f"{node}'s KV pool ({slots[node]} block-tokens) cannot hold the check's {blocks}")
            if node in slots and not self.occupancy.can_take({node: blocks}, slots):
                return None
            check_id = f"check-{uuid.uuid4().hex}"
            self.occupancy.hold(check_id, "", [node], [(start, end)], weight=need)
            self._refit()
            return check_id
        return self._on_loop(take, wait=True)

    def release_check(self, check_id: str) -> None:
        def release() -> None:
            if self.occupancy.release(check_id):
                self._refit()
        self._on_loop(release)

    def _on_loop(self, fn: Callable, wait: bool = False):
        """Run ``fn`` on the orchestrator's event loop (its state lives there); ``wait``: for its result."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return fn()
        if not wait:
            loop.call_soon_threadsafe(fn)
            return None
        done = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(exc)
        loop.call_soon_threadsafe(run)
        return done.result(timeout=30)


@dataclass
class CheckJob:
    request_id: str
    token_ids: list[int]  # prompt + generated: positions 0 … len − 2 went through the chain
    recorder: SpanRecorder
    prompt_tokens: int = 0  # the first prompt_tokens of token_ids are the prompt
    greedy: bool = False  # every generated token is its position's argmax (the head check applies)


class Opinion:
    """Who computed a span's outputs for a check: a server (``node``, its dtype) or the orchestrator (node None)."""

    def __init__(self, node: Optional[str], dtype: str, outputs: Optional[torch.Tensor],
                 tokens: Optional[list[int]] = None):
        self.node, self.dtype, self.outputs = node, dtype, outputs
        self.tokens = tokens  # a last-block checker's own greedy choice at the verified positions

    def agrees(self, other: "Opinion", positions: torch.Tensor, slack: float = 0.0) -> tuple[bool, float]:
        d = distance(self.outputs[positions], other.outputs[positions])
        return d <= tolerance(self.dtype, other.dtype) + slack, d


class SpotChecker:
    """Samples sessions for checking, runs the checks, strikes and bans (see the module doc).

    ``orchestrator``: its view (who holds which blocks), tickets and bans; ``run_span(peer, start, end, hidden,
    ticket)`` runs one prefill of ``hidden`` ``(t, H)`` through a server's blocks and returns the outputs;
    ``embed(token_ids)`` the client-side embeddings; ``local_span(start, end, hidden)`` the orchestrator's own
    float32 computation (None: it has no checkpoint to compute from)."""

    def __init__(self, orchestrator, ledger: Ledger, *, run_span: Callable, embed: Callable,
                 local_span: Optional[Callable] = None, num_blocks: int, dtype: str = "float32",
                 local_checker: bool = False, max_pending: int = 64, seed: Optional[int] = None,
                 head: Optional[Callable] = None):
        self.orchestrator, self.ledger, self.policy = orchestrator, ledger, ledger.policy
        self.run_span, self.embed, self.local_span = run_span, embed, local_span
        self.head = head  # hidden (n, H) -> logits (n, V): the head check of the chain's last server
        self.num_blocks, self.dtype, self.local_checker = num_blocks, dtype, local_checker
        self.room_wait_s = 60.0  # how long a check waits for idle KV on its checker before giving up (skipped)
        self._rng = random.Random(seed)  # the orchestrator's secret draws (never sent anywhere)
        self._jobs: queue.Queue = queue.Queue()
        self.max_pending = max_pending
        self._stopped = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._work, name="spot-checks", daemon=True)
        self._thread.start()

    # -- who is who ----------------------------------------------------------------------------------------
    def _profiles(self) -> dict[str, records.ServerProfile]:
        return dict(self.orchestrator.view.profiles)

    def node_of(self, peer: str) -> Optional[str]:
        return next((node for node, p in self._profiles().items() if p.peer_id == peer), None)

    def _holders(self, start: int, end: int, exclude: set[str]) -> list[tuple[str, records.ServerProfile]]:
        """Serving, unbanned servers with KV memory (a standby server has none) whose loaded span covers
        ``[start, end)``, outside ``exclude`` (node ids). KV memory both as loaded (the profile) and as told now
        (the published assignment: a server a re-plan left without sessions has no pool a check could hold)."""
        pools = self.orchestrator.kv_pools()
        return [(node, p) for node, p in self._profiles().items()
                if node not in exclude and p.state == records.SERVING and p.start is not None and p.cache_slots > 0
                and pools.get(node, 0) > 0
                and p.start <= start and end <= p.end and not self.orchestrator.is_banned(node)
                and node not in self.orchestrator.suspects]

    # -- sessions ------------------------------------------------------------------------------------------
    def recorder(self, route: Sequence[tuple[str, int, int]], *, dual: bool = False) -> Optional[SpanRecorder]:
        """A recorder if this session is drawn for a check (each span at its server's rate), else None. ``dual``
        (dual execution): every span, whatever the rates; raises ``RuntimeError`` if one cannot be re-executed."""
        if dual:
            lonely = [(s, e) for p, s, e in route if not self.local_checker
                      and not self._holders(s, e, {self.node_of(p) or p})]
            if lonely:
                raise RuntimeError(f"dual execution needs a second server for every span; blocks "
                                   f"[{lonely[0][0]}, {lonely[0][1]}) have none")
            return SpanRecorder(route, route)
        if not self.policy.enabled:
            return None
        rates = {}
        for peer, start, end in route:  # spans nobody else could re-execute are not recorded
            node = self.node_of(peer) or peer
            if self.local_checker or self._holders(start, end, {node}):
                rates[(peer, start, end)] = self.ledger.rate(node)
        top = max(rates.values(), default=0.0)
        if top <= 0 or self._rng.random() >= top:
            return None
        targets = [span for span, rate in rates.items() if rate >= top or self._rng.random() < rate / top]
        self.ledger.count("recorded")
        return SpanRecorder(route, targets)

    def finished(self, request_id: str, route: Sequence[tuple[str, int, int]], token_ids: Sequence[int],
                 recorder: Optional[SpanRecorder], prompt_tokens: int = 0, drafted: int = 0, accepted: int = 0,
                 greedy: bool = False) -> None:
        """A session ended well after computing ``len(token_ids) − 1`` positions (the first ``prompt_tokens`` of
        them in its prefill; ``drafted`` tokens verified in its decode steps, ``accepted`` of them kept); queue its
        check if recorded. ``greedy``: its tokens are each position's argmax, so the check of the chain's last
        server also recomputes them from that server's own outputs."""
        if not self._served(request_id, route, token_ids, recorder, prompt_tokens, drafted, accepted):
            if recorder is None:  # not drawn
                return
            self.ledger.count("skipped")
            logger.info("spot check of %s skipped: %s", request_id, recorder.reason or "incomplete recording")
            return
        while self._jobs.qsize() >= self.max_pending:
            try:
                self._jobs.get_nowait()
                self.ledger.count("skipped")
            except queue.Empty:
                break
        self._idle.clear()
        self._jobs.put(CheckJob(request_id, list(token_ids), recorder, int(prompt_tokens), bool(greedy)))

    def _served(self, request_id: str, route, token_ids: Sequence[int], recorder: Optional[SpanRecorder],
                prompt_tokens: int = 0, drafted: int = 0, accepted: int = 0) -> bool:
        """Enter the finished session in the ledger (its block-positions and their compute time by the servers'
        profiles: the prompt's positions and the drafted ones at prefill speed, one decode step per further token
        that was not a verified draft); whether ``recorder`` holds all its positions."""
        profiles = self._profiles()
        nodes = [self.node_of(peer) or peer for peer, _, _ in route]
        positions = len(token_ids) - 1
        prefill = min(positions, max(0, int(prompt_tokens)))
        steps = max(0, positions - prefill - int(accepted))
        compute_s = sum((end - start) * ((prefill + drafted) * profiles[node].prefill_s + steps * profiles[node].decode_s)
                        for node, (_, start, end) in zip(nodes, route) if node in profiles)
        self.ledger.served(request_id, nodes, positions * self.num_blocks, compute_s)
        return recorder is not None and recorder.complete(positions)

    def verify_now(self, request_id: str, route, token_ids: Sequence[int], recorder: SpanRecorder,
                   prompt_tokens: int = 0, drafted: int = 0, accepted: int = 0) -> bool:
        """Dual execution (blocking): re-execute every span of the finished session now; True when every span
        matched. A mismatch is settled (and struck) as in any check."""
        if not self._served(request_id, route, token_ids, recorder, prompt_tokens, drafted, accepted):
            return False
        job = CheckJob(request_id, list(token_ids), recorder)
        outcomes = [self._check(job, trace) for trace in list(recorder.traces.values())]
        self.ledger.count("dual_executions")
        return all(o in ("passed", "checker_struck") for o in outcomes)

    def wait_idle(self, timeout: float) -> bool:
        """Block until every queued check has run (tests, benchmarks)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._stopped.set()
        self._jobs.put(None)

    # -- the checks ----------------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stopped.is_set():
            job = self._jobs.get()
            if job is None:
                break
            for trace in list(job.recorder.traces.values()):
                try:
                    self._check(job, trace)
                except Exception as exc:  # a server failed during the check: no opinion, try a later session
                    self.ledger.count("skipped")
                    logger.warning("spot check of %s on %s could not run: %r", job.request_id, trace.span, exc)
            if self._jobs.empty():
                self._idle.set()

    def _opinion(self, node: Optional[str], profile, start: int, end: int, hidden: torch.Tensor,
                 verify: Optional[list[int]] = None) -> Opinion:
        """A server's (or, ``node`` None, the orchestrator's) outputs for the span; with ``verify`` and a checker
        that chooses tokens itself (its profile's ``ends``), its greedy tokens at those positions too."""
        if node is None:
            return Opinion(None, "float32", self.local_span(start, end, hidden))
        deadline = time.monotonic() + self.room_wait_s
        while (hold := self.orchestrator.hold_for_check(node, start, end, hidden.shape[0])) is None:
            if time.monotonic() > deadline or self._stopped.is_set():
                raise RuntimeError(f"{node} had no free KV for the check within {self.room_wait_s:.0f} s")
            time.sleep(0.5)
        tokens = None
        try:
            ticket = self._ticket(profile.peer_id, start, end)
            if verify is not None and getattr(profile, "ends", False):
                outputs, tokens = self.run_span(profile.peer_id, start, end, hidden, ticket, verify=verify)
            else:
                outputs = self.run_span(profile.peer_id, start, end, hidden, ticket)
        finally:
            self.orchestrator.release_check(hold)
        return Opinion(node, profile.torch_dtype, outputs.float(), tokens)

    def _ticket(self, peer: str, start: int, end: int) -> bytes:
        """An ordinary ticket: a ready chain through ``peer`` if there is one (a check looks like a session)."""
        chain = next((c for c in self.orchestrator.ready_chains()
                      if any(p == peer and s <= start and end <= e for p, s, e in c.route)), None)
        route = chain.route if chain is not None else ((peer, start, end),)
        return self.orchestrator.ticket(uuid.uuid4().hex, chain.chain_id if chain else "check", route)

    def _upstream(self, token_ids: Sequence[int], start: int, exclude: set[str]) -> torch.Tensor:
        """The inputs of block ``start`` for ``token_ids`` (a reused prefix), computed by servers outside
        ``exclude`` (or the orchestrator); its cost is counted."""
        hidden = self.embed(list(token_ids)).float()
        block = 0
        while block < start:
            holders = [(n, p) for n, p in self._holders(block, block + 1, exclude)]
            profile = None
            if holders:
                node, profile = self._rng.choice(holders)
                end = min(profile.end, start)
                hidden = self._opinion(node, profile, block, end, hidden).outputs
            elif self.local_span is not None:
                end = start
                hidden = self.local_span(block, end, hidden)
            else:
                raise RuntimeError(f"nobody can compute blocks [{block}, {start}) for a reused prefix")
            self._cost(hidden.shape[0] * (end - block), profile)
            block = end
        return hidden

    def _cost(self, block_positions: int, profile) -> None:
        """A re-execution of ``block_positions`` by a server with ``profile`` (one prefill: its prefill speed;
        None: the orchestrator's own computation, which costs the swarm nothing)."""
        self.ledger.count("check_block_tokens", block_positions)
        if profile is not None:
            self.ledger.count("check_compute_s", block_positions * profile.prefill_s)

    def _check(self, job: CheckJob, trace: SpanTrace) -> str:
        """Check one span; returns ``passed``, ``struck`` (the checked server), ``checker_struck`` (it passed:
        the checker lied), ``inconclusive`` or ``unchecked``."""
        peer, start, end = trace.span
        x_node = self.node_of(peer)
        profiles = self._profiles()
        if x_node is None or self.orchestrator.is_banned(x_node):
            return "unchecked"
        inputs, outputs = trace.tensors()
        exclude, slack = {x_node}, 0.0
        if trace.offset:  # the session reused a prompt prefix: its inputs are recomputed upstream
            inputs = torch.cat([self._upstream(job.token_ids[:trace.offset], start, exclude), inputs])
            slack = 2 * EPSILON.get(self.dtype, 0.0)  # the recomputed prefix is one more honest rounding away
        x = Opinion(x_node, profiles[x_node].torch_dtype, outputs)
        positions = self._positions(outputs.shape[0])
        candidates = self._holders(start, end, exclude)
        self._rng.shuffle(candidates)
        self.ledger.count("checks")
        opinions = []
        verify = token_checks.tokens_to_verify(job, trace.offset, outputs) if end == self.num_blocks else None
        for node, profile in candidates[:1]:
            opinions.append(self._opinion(node, profile, start, end, inputs, verify))
            self._cost(inputs.shape[0] * (end - start), profile)
        if not opinions:  # nobody else holds the span: the orchestrator's own computation is the reference
            if self.local_span is None or not self.local_checker:
                self.ledger.count("unchecked")
                return "unchecked"
            opinions.append(self._opinion(None, None, start, end, inputs))
        y = opinions[0]
        y.outputs = y.outputs[trace.offset:]
        same, d_xy = x.agrees(y, positions, slack)
        if same:
            wrong = None
            if verify is not None and y.tokens is not None:  # the checker chose too: only where the two part
                self.ledger.count("head_checks")
                wrong = token_checks.disagreement(job, trace.offset, outputs, x.dtype, verify, y.tokens, self.head)
            elif verify is not None and self.head is not None:  # else the orchestrator's head, sampled positions
                self.ledger.count("head_checks")
                wrong = token_checks.head_mismatch(job, trace.offset, outputs, x.dtype, self.head, self._rng)
            if wrong is not None:  # its blocks are right and the tokens it chose are not theirs
                self.ledger.count("mismatches")
                self._strike(x_node, job, wrong)
                return "struck"
            self.ledger.passed(x_node, job.request_id)
            return "passed"
        self.ledger.count("mismatches")
        if y.node is None:  # the orchestrator's own arithmetic decides alone
            self._strike(x_node, job, f"blocks [{start}, {end}) off by {d_xy:.3g} from the orchestrator's")
            return "struck"
        third = [(n, p) for n, p in candidates[1:]]
        z = (self._opinion(*third[0], start, end, inputs) if third else
             self._opinion(None, None, start, end, inputs) if self.local_span is not None else None)
        if third:
            self._cost(inputs.shape[0] * (end - start), third[0][1])
        if z is None:
            self.ledger.count("inconclusive")
            self.orchestrator.spot_check_event("spot_check_inconclusive", node=x_node, request=job.request_id,
                                               reason="no third opinion", distance=d_xy)
            return "inconclusive"
        z.outputs = z.outputs[trace.offset:]
        x_z, d_xz = x.agrees(z, positions, slack)
        y_z, d_yz = y.agrees(z, positions, slack)
        if y_z and not x_z:
            self._strike(x_node, job, f"blocks [{start}, {end}) off by {d_xy:.3g} and {d_xz:.3g} from two others")
            return "struck"
        if x_z and not y_z:
            self.ledger.passed(x_node, job.request_id)
            self._strike(y.node, job, f"its check of blocks [{start}, {end}) off by {d_xy:.3g} and {d_yz:.3g}")
            return "checker_struck"
        self.ledger.count("inconclusive")
        self.orchestrator.spot_check_event("spot_check_inconclusive", node=x_node, request=job.request_id,
                                           reason="the three opinions disagree", distance=d_xy)
        return "inconclusive"

    def _positions(self, count: int) -> torch.Tensor:
        picked = set(self._rng.sample(range(count), min(count, self.policy.positions - 1))) | {count - 1}
        return torch.tensor(sorted(picked))

    def _strike(self, node: str, job: CheckJob, reason: str) -> None:
        key = self.orchestrator.pins.owner(node)
        banned = self.ledger.strike(node, job.request_id, fingerprint(key) if key else None, reason)
        self.orchestrator.spot_check_event("server_struck", node=node, request=job.request_id, reason=reason,
                                           strikes=self.ledger.record(node).strikes)
        if banned:
            self.orchestrator.spot_check_event("server_banned", node=node, reason=reason)
            self.orchestrator.banned_now(node)


class LocalSpans:
    """The orchestrator's own opinion: blocks of its checkpoint folder in float32 on its CPU, loaded when first
    needed (only to settle a mismatch, or where no other server holds a span)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._blocks: dict[int, torch.nn.Module] = {}
        self._lock = threading.Lock()

    @torch.inference_mode()
    def __call__(self, start: int, end: int, hidden: torch.Tensor) -> torch.Tensor:
        from swarm.model.local_model import load_blocks

        with self._lock:
            missing = [i for i in range(start, end) if i not in self._blocks]
            self._blocks.update(zip(missing, load_blocks(self.model_dir, missing)))
            hidden = hidden.float()[None]
            for i in range(start, end):
                hidden, _ = self._blocks[i].run(hidden)
            return hidden[0]


def attach(orchestrator, engine, model_dir: str, *, seed: Optional[int] = None) -> SpotChecker:
    """Start the spot checks of ``orchestrator``'s servers through ``engine`` (with the rates at 0 it only serves
    dual-execution requests)."""
    checker = SpotChecker(orchestrator, orchestrator.ledger, run_span=engine.run_span, embed=engine.embed,
                          local_span=LocalSpans(model_dir), num_blocks=orchestrator.config.num_blocks,
                          dtype=orchestrator.config.torch_dtype, local_checker=orchestrator.config.spot_check_local,
                          seed=seed, head=engine.head)
    orchestrator.checks = checker
    return checker
