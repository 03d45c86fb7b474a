"""The orchestrator: plans the swarm, tells servers what to load, and dispatches sessions to chains.

One asyncio service owns all state; blocking work (DHT calls, petals sessions) runs in threads.

* **Membership and planning.** Every ``refresh_s`` it reads the servers' profile records from the DHT.
  When the set of live servers changes it re-plans (``swarm.planning.choose_plan``: GBP-CR with c tuned
  by the Theorem 3.7 lower bound, then GCA, keeping current block ranges when that is nearly as good)
  and publishes one :class:`~swarm.records.Assignment` per server, renewed while the plan stands. A
  server reported failed by a session is excluded at once (GCA over the remaining placement), before
  its heartbeat record even expires.
* **Dispatch.** Every request — a proxied completion or a client's lease — enters the fairness
  scheduler's central queue (``planner.fairness``: ``dlpm`` by default, or ``vtc``/``fcfs``/...). Chain
  slots are granted with JFFC (fastest chain with a free slot); a chain becomes grantable only when all
  its servers report that they serve their assignment. Costs are charged as the spec's §1 says: input
  tokens at admission, output tokens as they are generated.
* **BPRR's router.** With ``router="ws-rr"`` (the BPRR baseline of the experiments) requests bypass the
  chains and the fairness queue: each is routed on arrival by WS-RR (:mod:`swarm.ws_rr`) over the servers'
  block ranges and starts when its path's servers have KV slots; servers then keep KV for all the sessions
  their memory holds.
* **Sessions.** A granted completion runs through :class:`swarm.engine.GenerationEngine` on its chain;
  a lease hands the route to the client, which drives petals itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from planner.fairness import ChainSpec, make_scheduler
from planner.prefix_index import ChainPrefixMatcher, PrefixIndex
from planner.fairness.types import FairnessError, Grant
from planner.plan import Plan
from planner.tuning import InfeasibleError
from swarm import planning, prefix as prefix_protocol, records
from swarm.planning import Expectations, RoutableChain
from swarm.routing import Lease, NoRouteError, RouteSpan, clip_route
from swarm.ws_rr import WsRrRouter

ROUTERS = ("jffc", "ws-rr")

logger = logging.getLogger(__name__)


class QueueTimeout(Exception):
    """A request waited longer than its timeout for a chain slot."""


class NoChainsError(Exception):
    """There is no plan (or no ready chain) that could ever serve the request."""


class UnknownLeaseError(KeyError):
    pass


@dataclass
class OrchestratorConfig:
    model_dir: str
    dht_prefix: str
    num_blocks: int
    expect: Expectations
    policy: str = "dlpm"
    quantum: float = 8192.0  # DLPM Q^u, in cost units (w_e·input + w_q·output tokens)
    chain_quantum: float | None = None  # per-client per-chain stickiness (swarm policy); None = off
    router: str = "jffc"  # "jffc": GCA chains, fairness queue, JFFC; "ws-rr": BPRR's per-request WS-RR paths
    torch_dtype: str = "float32"  # the swarm's serving dtype: servers computing in another dtype are not planned
    refresh_s: float = 1.0
    assignment_ttl_s: float = 30.0
    suspect_s: float = 60.0  # how long a server reported failed stays excluded unless its record expires
    queue_timeout_s: float = 600.0
    lease_timeout_s: float = 1800.0
    # Prompt-prefix reuse (swarm.prefix): the per-block prefix-store budget in tokens (0 = off; the planner
    # reserves it in expect.prefix_cache_tokens) and the secret that roots this orchestrator's hash namespace.
    prefix_secret: bytes = field(default_factory=lambda: os.urandom(32))


@dataclass
class LeaseRecord:
    lease: Lease
    request_id: str
    client_id: str
    granted_at: float
    expires_at: float


@dataclass
class SwarmView:
    """What the orchestrator currently believes; rebuilt on every refresh (read by the HTTP layer)."""

    profiles: dict[str, records.ServerProfile] = field(default_factory=dict)
    plan: Plan | None = None
    plan_id: str | None = None
    plan_kept_ranges: bool = False
    plan_error: str | None = None
    plan_inputs: dict | None = None  # the planner's input for this plan, in `chainswarm plan --swarm` format
    assignments: dict[str, records.Assignment] = field(default_factory=dict)
    chains: list[RoutableChain] = field(default_factory=list)


class Orchestrator:
    """The control plane. ``dht`` is a running hivemind.DHT (or anything with get/store)."""

    def __init__(self, config: OrchestratorConfig, dht, *, http_url: str | None = None,
                 on_event: Callable[[str, dict], None] | None = None):
        self.config = config
        self.dht = dht
        self.http_url = http_url
        self.view = SwarmView()
        self.prefix_enabled = config.expect.prefix_cache_tokens > 0
        self.prefix_index = PrefixIndex(prefix_protocol.PAGE_TOKENS)
        self.prefix_matcher = ChainPrefixMatcher(self.prefix_index, {})
        self.prefix_root = prefix_protocol.namespace_root(config.prefix_secret, config.dht_prefix)
        self.prefix_stats = dict(requests=0, hits=0, prompt_tokens=0, reused_tokens=0, expected_tokens=0,
                                 stale=0, evictions_applied=0, resets=0)
        self._report_state: dict[str, tuple[str, int]] = {}  # node -> (store epoch, last eviction seq applied)
        if config.router not in ROUTERS:
            raise ValueError(f"unknown router {config.router!r}; expected one of {ROUTERS}")
        self.scheduler = self._make_scheduler()
        self.ws_rr = WsRrRouter() if config.router == "ws-rr" else None
        self._ws_rr_requests: dict[str, tuple[str, int]] = {}  # request id -> (client, input tokens)
        self._path_chains: dict[str, RoutableChain] = {}  # request id -> its WS-RR path as a one-slot chain
        self.suspects: dict[str, float] = {}
        self._dtype_refused: set[str] = set()
        self.leases: dict[str, LeaseRecord] = {}
        self.events: deque[dict] = deque(maxlen=200)
        self.on_event = on_event
        self._waiters: dict[str, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._refresh_now = asyncio.Event()
        self._published_at = 0.0
        self._replans = 0
        self.started_at = time.monotonic()

    def _make_scheduler(self):
        options: dict[str, Any] = {}
        if self.config.policy in ("dlpm", "swarm", "bfio"):
            options["quantum"] = self.config.quantum
        if self.config.policy in ("swarm", "bfio") and self.config.chain_quantum is not None:
            options["chain_quantum"] = self.config.chain_quantum
        if self.prefix_enabled:
            options["prefix_match"] = self.prefix_matcher
        return make_scheduler(self.config.policy, **options)

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.refresh()
        self._task = asyncio.create_task(self._control_loop(), name="orchestrator-control")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(NoChainsError("the orchestrator is shutting down"))

    async def _control_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._refresh_now.wait(), self.config.refresh_s)
            self._refresh_now.clear()
            try:
                await self.refresh()
            except Exception:  # never let one bad refresh kill the control plane
                logger.exception("refresh failed")

    def _event(self, kind: str, **data) -> None:
        entry = {"time": time.time(), "event": kind, **data}
        self.events.append(entry)
        logger.info("%s %s", kind, data)
        if self.on_event is not None:
            self.on_event(kind, data)

    # -- membership, planning, assignments ---------------------------------------------------------------
    async def refresh(self) -> None:
        profiles = await asyncio.to_thread(records.fetch_profiles, self.dht, self.config.dht_prefix)
        now = time.monotonic()
        for node, since in list(self.suspects.items()):
            if node not in profiles or now - since > self.config.suspect_s:
                del self.suspects[node]  # gone for good (record expired) or back after the grace period
        live = {node: p for node, p in profiles.items()
                if node not in self.suspects and p.rtt_s is not None and self._same_dtype(node, p)}
        self.view.profiles = profiles
        members = set(live)
        planned = set(self.view.assignments) if self.view.plan is not None else set()
        if members != planned or self.view.plan is None:
            self._replan(live)
        if now - self._published_at > self.config.assignment_ttl_s / 3:
            await self._publish_assignments()
        if self.prefix_enabled:
            reports = await asyncio.to_thread(prefix_protocol.fetch_reports, self.dht, self.config.dht_prefix)
            self.apply_prefix_reports(reports, live=set(profiles))
        self._update_chains()
        self.expire_leases()

    def _same_dtype(self, node: str, profile: records.ServerProfile) -> bool:
        """Only servers computing in the swarm's dtype are planned (mixed dtypes change greedy answers)."""
        if profile.torch_dtype == self.config.torch_dtype:
            self._dtype_refused.discard(node)
            return True
        if node not in self._dtype_refused:
            self._dtype_refused.add(node)
            self._event("server_refused", node=node, reason=f"serves in {profile.torch_dtype}, the swarm in "
                        f"{self.config.torch_dtype} (start it with --torch-dtype {self.config.torch_dtype})")
        return False

    def _replan(self, live: dict[str, records.ServerProfile]) -> None:
        view = self.view
        if not live:
            if view.plan is not None:
                self._event("plan_dropped", reason="no live servers")
            view.plan, view.plan_id, view.assignments, view.plan_error = None, None, {}, "no servers have joined"
            return
        try:
            new_plan, kept = planning.choose_plan(list(live.values()), self.config.num_blocks, self.config.expect,
                                                  view.plan)
        except (InfeasibleError, ValueError) as exc:
            view.plan_error = str(exc)
            if view.plan is not None:
                self._event("plan_dropped", reason=str(exc))
            view.plan, view.plan_id, view.assignments = None, None, {}
            return
        plan_id = planning.new_plan_id()
        view.plan, view.plan_id, view.plan_kept_ranges, view.plan_error = new_plan, plan_id, kept, None
        view.plan_inputs = planning.swarm_document(list(live.values()), self.config.num_blocks, self.config.expect)
        slots = None
        if self.ws_rr is not None:  # WS-RR routes over whole KV pools: every server fills its memory
            model, servers = planning.planner_inputs(list(live.values()), self.config.num_blocks, self.config.expect)
            slots = planning.memory_slots(new_plan, model, servers)
        view.assignments = planning.assignments_for(new_plan, plan_id, self.config.expect.max_length,
                                                    self.config.expect.prefix_cache_tokens, slots=slots)
        self._published_at = 0.0
        self._replans += 1
        self._event("plan", plan_id=plan_id, kept_ranges=kept, c=new_plan.c, servers=sorted(live),
                    chains=[[list(ch.servers), ch.capacity] for ch in new_plan.chains])

    async def _publish_assignments(self) -> None:
        ttl, prefix = self.config.assignment_ttl_s, self.config.dht_prefix
        items = list(self.view.assignments.items())
        info = records.OrchestratorInfo(self.dht.peer_id.to_base58(), self.http_url, self.view.plan_id)

        def publish() -> None:
            records.publish_orchestrator(self.dht, prefix, info, ttl)
            for node, assignment in items:
                records.publish_assignment(self.dht, prefix, node, assignment, ttl)

        await asyncio.to_thread(publish)
        self._published_at = time.monotonic()

    def _update_chains(self) -> None:
        view = self.view
        if view.plan is None:
            view.chains = []
        else:
            view.chains = planning.routable_chains(view.plan, view.plan_id, view.profiles, view.assignments)
        ready = [c for c in view.chains if c.ready]
        self.prefix_matcher.chain_servers = {c.chain_id: tuple(c.servers) for c in ready}
        if self.prefix_enabled:
            pages = self.config.expect.prefix_cache_tokens // prefix_protocol.PAGE_TOKENS
            for node in {n for c in ready for n in c.servers}:
                if self.prefix_index.budget(node) != pages:
                    self.prefix_index.set_budget(node, pages)
        self.scheduler.set_chains([
            ChainSpec(chain_id=c.chain_id, capacity=c.capacity, mean_service_time=c.service_time,
                      max_length=self.config.expect.max_length, servers=c.servers,
                      reference_output_tokens=max(1, round(self.config.expect.output_tokens)))
            for c in ready
        ])
        if self.ws_rr is not None:
            self._update_ws_rr()
        self._dispatch()

    def _update_ws_rr(self) -> None:
        """Give the WS-RR router the servers that serve their assignment now; re-route orphaned requests."""
        view = self.view
        live = [p for node, p in view.profiles.items()
                if node in view.assignments and node not in self.suspects and p.rtt_s is not None]
        if view.plan is None or not live:
            return
        model, servers = planning.planner_inputs(live, self.config.num_blocks, self.config.expect)
        spans, capacity = [], {}
        for server in servers:
            assignment = view.assignments[server.id]
            serving = assignment.end > assignment.start and planning.server_matches(view.profiles[server.id],
                                                                                    assignment)
            spans.append((assignment.start, assignment.end) if serving else None)
            capacity[server.id] = assignment.cache_slots if serving else 0
        now = time.monotonic()
        for request_id in self.ws_rr.update(model, servers, planning.Placement(tuple(spans)), capacity):
            if self.ws_rr.submit(request_id, now) is None:
                self._fail_waiter(request_id, NoChainsError("no path through the serving servers any more"))

    def _fail_waiter(self, request_id: str, exc: Exception) -> None:
        self._ws_rr_requests.pop(request_id, None)
        future = self._waiters.pop(request_id, None)
        if future is not None and not future.done():
            future.set_exception(exc)

    def report_failure(self, peer_id: str) -> None:
        """A session saw ``peer_id`` fail: exclude its server now and rebuild chains without it."""
        node = next((n for n, p in self.view.profiles.items() if p.peer_id == peer_id), None)
        if node is None or node in self.suspects:
            return
        self.suspects[node] = time.monotonic()
        self._event("server_failed", node=node, peer_id=peer_id)
        self._refresh_now.set()

    # -- dispatch ----------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        now = time.monotonic()
        if self.ws_rr is not None:
            self._dispatch_ws_rr(now)
        for grant in self.scheduler.dispatch(now):
            future = self._waiters.pop(grant.request_id, None)
            if future is not None and not future.done():
                self._insert_pending(grant, now)
                future.set_result(grant)
            else:  # the waiter is gone (timed out / disconnected): give the slot back
                with contextlib.suppress(FairnessError):
                    self.scheduler.cancel(grant.request_id, now)

    def _dispatch_ws_rr(self, now: float) -> None:
        peers = {node: p.peer_id for node, p in self.view.profiles.items()}
        for request_id, route in self.ws_rr.startable(now):
            client_id, input_tokens = self._ws_rr_requests.get(request_id, ("", 0))
            chain = RoutableChain(
                f"{self.view.plan_id}/ws-rr/{request_id[:12]}", -1, tuple(route.servers), tuple(route.spans), 1,
                route.service_time, tuple((peers.get(node, ""), a, b) for node, (a, b) in
                                          zip(route.servers, route.spans)), True)
            self._path_chains[request_id] = chain
            future = self._waiters.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(Grant(request_id, client_id, chain.chain_id, 0, input_tokens, now))
            else:  # the waiter is gone: give the slots back
                self._release_ws_rr(request_id)

    def _release_ws_rr(self, request_id: str) -> bool:
        self._ws_rr_requests.pop(request_id, None)
        self._path_chains.pop(request_id, None)
        return self.ws_rr is not None and self.ws_rr.release(request_id)

    def chain(self, chain_id: str) -> RoutableChain:
        for c in self._path_chains.values():
            if c.chain_id == chain_id:
                return c
        for c in self.view.chains:
            if c.chain_id == chain_id:
                return c
        raise NoRouteError(f"chain {chain_id} is not part of the current plan")

    def planned_step_s(self, chain_id: str, tokens: int) -> float:
        """Planned time of a ``tokens``-position step on the chain with its servers fully occupied (the
        no-progress watchdog's yardstick; 0 for a chain that is no longer known)."""
        with contextlib.suppress(NoRouteError):
            return planning.planned_step_s(self.chain(chain_id), self.view.profiles, self.view.assignments, tokens)
        return 0.0

    def _fits(self, input_tokens: int, max_new_tokens: int) -> None:
        limit = self.config.expect.max_length
        if input_tokens + max_new_tokens > limit:
            raise ValueError(f"prompt ({input_tokens} tokens) + max_tokens ({max_new_tokens}) exceeds the "
                             f"swarm's maximum session length of {limit} tokens")

    async def acquire(self, client_id: str, input_tokens: int, max_new_tokens: int, *,
                      timeout: float | None = None, page_hashes=()) -> Grant:
        """Queue a request and wait for its chain slot (JFFC chain, fairness-ordered queue)."""
        self._fits(input_tokens, max_new_tokens)
        if self.view.plan is None:
            raise NoChainsError(f"no chains: {self.view.plan_error or 'no plan yet'}")
        request_id = uuid.uuid4().hex
        future = self._loop.create_future()
        if self.ws_rr is not None:
            if self.ws_rr.submit(request_id, time.monotonic()) is None:
                raise NoChainsError("no path through the serving servers (WS-RR)")
            self._ws_rr_requests[request_id] = (client_id, input_tokens)
        else:
            self.scheduler.submit(request_id, client_id, input_tokens, time.monotonic(),
                                  max_new_tokens=max_new_tokens, page_hashes=page_hashes)
        self._waiters[request_id] = future
        self._dispatch()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout or self.config.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            self._waiters.pop(request_id, None)
            if future.done() and not future.cancelled() and future.exception() is None:
                self.finish(future.result().request_id, 0)  # granted just as we gave up
            elif self._release_ws_rr(request_id):
                self._dispatch()
            else:
                with contextlib.suppress(FairnessError):
                    self.scheduler.cancel(request_id, time.monotonic())
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise QueueTimeout(f"no chain slot within {timeout or self.config.queue_timeout_s:.0f} s") from None

    def tokens(self, request_id: str, count: int) -> None:
        with contextlib.suppress(FairnessError):
            self.scheduler.on_tokens(request_id, count, time.monotonic())

    def finish(self, request_id: str, output_tokens: int | None = None) -> None:
        if self._release_ws_rr(request_id):
            self._dispatch()
            return
        with contextlib.suppress(FairnessError):
            self.scheduler.on_finish(request_id, time.monotonic(), output_tokens=output_tokens)
        self._dispatch()

    def abort(self, request_id: str) -> None:
        if self._release_ws_rr(request_id):
            self._dispatch()
            return
        with contextlib.suppress(FairnessError):
            self.scheduler.cancel(request_id, time.monotonic())
        self._dispatch()

    def reroute(self, chain_id: str, start: int, end: int, failed_peers) -> tuple[RouteSpan, ...]:
        """Spans for blocks [start, end) on the fastest ready chain avoiding ``failed_peers``."""
        for peer in failed_peers:
            self.report_failure(peer)
        bad = set(failed_peers)
        candidates = [c for c in self.view.chains if c.ready and not bad & {p for p, _, _ in c.route}]
        free = self.scheduler.free_slots()
        candidates.sort(key=lambda c: (free.get(c.chain_id, 0) <= 0, c.index))
        for c in candidates:
            with contextlib.suppress(NoRouteError):
                return tuple(clip_route(c.route, start, end))
        raise NoRouteError(f"no ready chain covers blocks [{start}, {end}) without {sorted(bad)}")

    # -- prefix reuse ------------------------------------------------------------------------------------
    def prompt_hashes(self, token_ids) -> list[bytes]:
        """Page hashes of a prompt this orchestrator tokenized, in its secret namespace ([] when off)."""
        if not self.prefix_enabled:
            return []
        return prefix_protocol.prompt_hashes(token_ids, self.prefix_root)

    def _insert_pending(self, grant: Grant, now: float) -> None:
        """Optimistic insert at dispatch (§14.4): every server of the chain will hold the prompt's pages
        once the session's prefill is done (the servers' eviction reports correct it later)."""
        if not self.prefix_enabled:
            return
        with contextlib.suppress(FairnessError):
            hashes = self.scheduler.request(grant.request_id).page_hashes
            if hashes:
                for node in self.prefix_matcher.chain_servers.get(grant.chain_id, ()):
                    self.prefix_index.insert(node, list(hashes), now)

    def prefilled(self, request_id: str, reused_tokens: int, prompt_tokens: int, expected_tokens: int = 0) -> None:
        """The session's probe found ``reused_tokens`` on every server of its chain: reconcile the
        client's charge to the extend actually computed (§14.5) and count the hit."""
        stats = self.prefix_stats
        stats["requests"] += 1
        stats["hits"] += reused_tokens > 0
        stats["prompt_tokens"] += prompt_tokens
        stats["reused_tokens"] += reused_tokens
        stats["expected_tokens"] += expected_tokens
        stats["stale"] += reused_tokens < expected_tokens
        with contextlib.suppress(FairnessError):
            self.scheduler.on_prefill(request_id, reused_tokens, time.monotonic())

    def apply_prefix_reports(self, reports: dict[str, dict], live: set[str] | None = None) -> None:
        """Follow the servers' eviction reports (``swarm.prefix``): drop evicted pages from the radix index;
        a new store epoch (reload) or a gap in the eviction sequence drops everything the node held."""
        index = self.prefix_index
        for node, report in reports.items():
            epoch, seq = report["epoch"], report["seq"]
            last = self._report_state.get(node)
            if last is not None and last[0] == epoch and seq <= last[1]:
                continue
            entries = [e for e in report.get("evicted", ())
                       if isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], int)]
            if last is None or last[0] != epoch:
                if last is not None:
                    self._reset_holder(node)  # the server's store restarted (reload): what it held is gone
                base = 0
            else:
                base = last[1]
            fresh = [e for e in entries if e[0] > base]
            if seq > base and (not fresh or min(e[0] for e in fresh) != base + 1):
                self._reset_holder(node)  # reports were lost: forget what we believed about this node
            else:
                hashes = []
                for _, h in fresh:
                    with contextlib.suppress(ValueError, TypeError):
                        hashes.append(bytes.fromhex(h))
                self.prefix_stats["evictions_applied"] += index.remove(node, hashes)
            self._report_state[node] = (epoch, seq)
        if live is not None:
            for node in [n for n in index.holders() if n not in live]:
                self._reset_holder(node)
                self._report_state.pop(node, None)

    def _reset_holder(self, node: str) -> None:
        budget = self.prefix_index.budget(node)
        self.prefix_index.remove_holder(node)
        self.prefix_index.set_budget(node, budget)
        self.prefix_stats["resets"] += 1

    def prefix_status(self) -> dict[str, Any]:
        stats = dict(self.prefix_stats)
        page = prefix_protocol.PAGE_TOKENS
        requests, prompt = stats["requests"], stats["prompt_tokens"]
        return {
            "enabled": self.prefix_enabled, "page_tokens": page,
            "cache_tokens_per_block": self.config.expect.prefix_cache_tokens,
            "hit_rate": stats["hits"] / requests if requests else 0.0,
            "token_hit_rate": stats["reused_tokens"] / prompt if prompt else 0.0,
            "tokens_saved": stats["reused_tokens"], **stats,
            "servers": {str(n): self.prefix_index.pages_held(n) * page for n in self.prefix_index.holders()},
        }

    def chain_cached_tokens(self, chain: RoutableChain) -> int:
        """Prompt tokens cached on every server of the chain, per the radix index (what a request could reuse
        there): the sum over the index's leaves of the pages all the chain's servers hold."""
        if not self.prefix_enabled or not chain.servers:
            return 0
        return self._chain_volume(chain.servers) * prefix_protocol.PAGE_TOKENS

    def _chain_volume(self, servers) -> int:
        total = 0
        stack = [self.prefix_index._root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if all(s in child.holders for s in servers):
                    total += len(child.pages)
                    stack.append(child)
        return total

    # -- leases (clients that drive petals themselves) --------------------------------------------------
    async def grant_lease(self, client_id: str, input_tokens: int, max_new_tokens: int, *,
                          timeout: float | None = None) -> LeaseRecord:
        grant = await self.acquire(client_id, input_tokens, max_new_tokens, timeout=timeout)
        chain = self.chain(grant.chain_id)
        lease = Lease(uuid.uuid4().hex, grant.chain_id, chain.route, self.config.expect.max_length)
        now = time.monotonic()
        record = LeaseRecord(lease, grant.request_id, client_id, now, now + self.config.lease_timeout_s)
        self.leases[lease.lease_id] = record
        self._event("lease", lease_id=lease.lease_id, client=client_id, chain=grant.chain_id)
        return record

    def lease(self, lease_id: str) -> LeaseRecord:
        try:
            return self.leases[lease_id]
        except KeyError:
            raise UnknownLeaseError(lease_id) from None

    def release_lease(self, lease_id: str, output_tokens: int | None = None) -> None:
        record = self.leases.pop(lease_id, None)
        if record is None:
            raise UnknownLeaseError(lease_id)
        self.finish(record.request_id, output_tokens)

    def expire_leases(self) -> None:
        now = time.monotonic()
        for lease_id, record in list(self.leases.items()):
            if record.expires_at < now:
                self._event("lease_expired", lease_id=lease_id, client=record.client_id)
                self.release_lease(lease_id)

    # -- status ------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        view = self.view
        active = self.scheduler.active_sessions()
        queue = {str(c): n for c, n in self.scheduler.queue_lengths().items() if n}
        return {
            "dht_prefix": self.config.dht_prefix,
            "policy": self.config.policy,
            "router": self.config.router,
            **({"ws_rr": self.ws_rr.status()} if self.ws_rr is not None else {}),
            "plan": None if view.plan is None else {"plan_id": view.plan_id, "kept_ranges": view.plan_kept_ranges,
                                                    "replans": self._replans, "inputs": view.plan_inputs,
                                                    **view.plan.to_dict()},
            "plan_error": view.plan_error,
            "servers": [
                {**p.to_dict(), "suspect": node in self.suspects,
                 "assignment": None if node not in view.assignments else view.assignments[node].to_dict()}
                for node, p in sorted(view.profiles.items())
            ],
            "chains": [
                {"id": c.chain_id, "servers": list(c.servers), "spans": [list(s) for s in c.spans],
                 "route": [list(r) for r in c.route], "capacity": c.capacity, "active": active.get(c.chain_id, 0),
                 "ready": c.ready, "service_time": c.service_time, "cached_prefix_tokens": self.chain_cached_tokens(c)}
                for c in view.chains
            ],
            "prefix": self.prefix_status(),
            "queue": queue,
            "clients": {str(c): {"service": self.scheduler.service(c), "waiting": queue.get(str(c), 0)}
                        for c in self.scheduler.clients()},
            "leases": len(self.leases),
            "events": list(self.events)[-30:],
        }
