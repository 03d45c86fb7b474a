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
* **Sessions.** A granted completion runs through :class:`swarm.engine.GenerationEngine` on its chain;
  a lease hands the route to the client, which drives petals itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from planner.fairness import ChainSpec, make_scheduler
from planner.fairness.types import FairnessError, Grant
from planner.plan import Plan
from planner.tuning import InfeasibleError
from swarm import planning, records
from swarm.planning import Expectations, RoutableChain
from swarm.routing import Lease, NoRouteError, RouteSpan, clip_route

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
    refresh_s: float = 1.0
    assignment_ttl_s: float = 30.0
    suspect_s: float = 60.0  # how long a server reported failed stays excluded unless its record expires
    queue_timeout_s: float = 600.0
    lease_timeout_s: float = 1800.0


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
        self.scheduler = self._make_scheduler()
        self.suspects: dict[str, float] = {}
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
        live = {node: p for node, p in profiles.items() if node not in self.suspects and p.rtt_s is not None}
        self.view.profiles = profiles
        members = set(live)
        planned = set(self.view.assignments) if self.view.plan is not None else set()
        if members != planned or self.view.plan is None:
            self._replan(live)
        if now - self._published_at > self.config.assignment_ttl_s / 3:
            await self._publish_assignments()
        self._update_chains()
        self.expire_leases()

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
        view.assignments = planning.assignments_for(new_plan, plan_id, self.config.expect.max_length)
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
        self.scheduler.set_chains([
            ChainSpec(chain_id=c.chain_id, capacity=c.capacity, mean_service_time=c.service_time,
                      max_length=self.config.expect.max_length, servers=c.servers,
                      reference_output_tokens=max(1, round(self.config.expect.output_tokens)))
            for c in ready
        ])
        self._dispatch()

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
        for grant in self.scheduler.dispatch(now):
            future = self._waiters.pop(grant.request_id, None)
            if future is not None and not future.done():
                future.set_result(grant)
            else:  # the waiter is gone (timed out / disconnected): give the slot back
                with contextlib.suppress(FairnessError):
                    self.scheduler.cancel(grant.request_id, now)

    def chain(self, chain_id: str) -> RoutableChain:
        for c in self.view.chains:
            if c.chain_id == chain_id:
                return c
        raise NoRouteError(f"chain {chain_id} is not part of the current plan")

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
        self._waiters[request_id] = future
        self.scheduler.submit(request_id, client_id, input_tokens, time.monotonic(),
                              max_new_tokens=max_new_tokens, page_hashes=page_hashes)
        self._dispatch()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout or self.config.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            self._waiters.pop(request_id, None)
            if future.done() and not future.cancelled() and future.exception() is None:
                self.finish(future.result().request_id, 0)  # granted just as we gave up
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
        with contextlib.suppress(FairnessError):
            self.scheduler.on_finish(request_id, time.monotonic(), output_tokens=output_tokens)
        self._dispatch()

    def abort(self, request_id: str) -> None:
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
                 "ready": c.ready, "service_time": c.service_time}
                for c in view.chains
            ],
            "queue": queue,
            "clients": {str(c): {"service": self.scheduler.service(c), "waiting": queue.get(str(c), 0)}
                        for c in self.scheduler.clients()},
            "leases": len(self.leases),
            "events": list(self.events)[-30:],
        }
