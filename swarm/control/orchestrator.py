"""The orchestrator: plans the swarm, tells servers what to load, and dispatches sessions to chains.

One asyncio service owns all state; blocking work (DHT calls, petals sessions) runs in threads.

* **Membership and planning.** Every ``refresh_s`` it reads the servers' profile records from the DHT.
  When the set of live servers changes it re-plans (``swarm.control.planning.choose_plan``: GBP-CR with c tuned
  by the Theorem 3.7 lower bound, then GCA, keeping current block ranges when that is nearly as good)
  and publishes one :class:`~swarm.trust.records.Assignment` per server, renewed while the plan stands. A
  server reported failed by a session is excluded at once (GCA over the remaining placement), before
  its heartbeat record even expires.
* **Dispatch.** Every request — a proxied completion or a client's lease — goes to the router chosen by
  ``config.router`` at start-up (:mod:`swarm.control.routers`): by default GCA's chains, the fairness scheduler's
  central queue and JFFC grants; ``ws-rr``, BPRR's per-request WS-RR paths. The router decides everything
  about routing (KV slots per assignment, who starts where, the accounting of tokens); the orchestrator only
  hands grants to the waiting requests.
* **Failover and leases** are in :mod:`swarm.control.failover` (mixed in): reroutes, failure claims, lease operations.
* **Lease bookkeeping and prefix reuse** live in rooms of their own: :class:`swarm.control.leases.LeaseBook` and
  :class:`swarm.control.prefix_view.PrefixView` (radix index of who holds which prompt pages, eviction reports).
* **Sessions.** A granted completion runs through :class:`swarm.engine.generation.GenerationEngine` on its chain;
  a lease hands the route to the client, which drives petals itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Sequence

from planner.fairness.types import Grant
from planner.tuning import InfeasibleError
from swarm.control import planning
from swarm.trust import prefix as prefix_protocol, records, tickets
from swarm.control.failures import DhtPing, FailureClaims
from swarm.control.failover import Failover, LeaseOps
from swarm.trust.identity import Identity, KeyPins
from swarm.trust.verification import CheckPolicy, Ledger
from swarm.control.leases import LeaseBook, LeaseMisuse, LeaseRecord, UnknownLeaseError
from swarm.control.reservations import Reservations
from swarm.control.occupancy import Occupancy, blocks_of, fit_capacities
from swarm.control.planning import RoutableChain
from swarm.control.prefix_view import PrefixView
from swarm.control.routers import ROUTERS, NoChainsError
from swarm.engine.routing import NoRouteError
from swarm.control.service_history import ServiceHistory
from swarm.control.spot_checks import SpotCheckHooks
from swarm.control.status import swarm_status
from swarm.control.transition import Transition
from swarm.control.view import OrchestratorConfig, SwarmView
from swarm.runtime.bounded import BoundedCall, CallTimeout

DHT_CALL_S = 15.0  # the longest the control loop waits for one DHT read or write (it goes on in its thread)

__all__ = ["Orchestrator", "OrchestratorConfig", "SwarmView", "NoChainsError", "QueueTimeout", "UnknownLeaseError",
           "LeaseRecord", "LeaseMisuse"]

logger = logging.getLogger(__name__)


class QueueTimeout(Exception):
    """A request waited longer than its timeout for a chain slot; ``retry_after_s`` estimates when to retry."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(Exception):
    """The queue (overall or the client's share) is at its bound; ``retry_after_s`` estimates when to retry."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Orchestrator(Failover, LeaseOps, SpotCheckHooks):
    """The control plane. ``dht`` is a running hivemind.DHT (or anything with get/store)."""

    def __init__(self, config: OrchestratorConfig, dht, *, http_url: str | None = None,
                 on_event: Callable[[str, dict], None] | None = None, identity: Identity | None = None,
                 ledger: Ledger | None = None):
        self.config = config
        self.dht = dht
        # the key that signs assignments, the orchestrator record and tickets (the DHT must sign with it too:
        # swarm.service installs swarm_validators() on it); servers pin its public half
        self.identity = identity or Identity.generate()
        self.pins = KeyPins()  # node id -> the key its profiles are signed with (swarm.trust.identity)
        self._refused_keys: set[tuple[str, str]] = set()
        self.http_url = http_url
        self.view = SwarmView()
        self.transition = Transition(keep=config.replan_keep)  # make-before-break waves (swarm.control.transition)
        self._compose = lambda spans: None  # GCA over a placement of the planned servers (set by each plan)
        self.prefix = PrefixView(config.expect.prefix_cache_tokens, config.prefix_secret, config.dht_prefix)
        router = ROUTERS.get(config.router)
        if router is None:
            raise ValueError(f"unknown router {config.router!r}; expected one of {tuple(ROUTERS)}")
        self.router = router(config, self.view, prefix_match=self.prefix.matcher if self.prefix.enabled else None)
        self.leases = LeaseBook(config.lease_ttl_s, config.expect.max_length)
        self.suspects: dict[str, float] = {}
        self.claims = FailureClaims()  # lease holders' failure reports, excluded only when confirmed
        self.probe = DhtPing(dht)
        # the control loop's DHT calls, each bounded: one that hangs must not stop re-plans and failover
        self._profiles_read, self._reports_read, self._publish = (
            BoundedCall(what, DHT_CALL_S) for what in ("reading the server records", "reading the prefix reports",
                                                       "publishing the assignments"))
        self._probing: set[str] = set()
        self.occupancy = Occupancy()  # KV block-slots each running session holds, whatever its plan
        self.reservations = Reservations(config.expect)  # each admitted session's KV tokens per block
        self.running: dict[str, Any] = {}  # request id -> its session's control (proxied sessions; peer_failed)
        self._ready: list[RoutableChain] = []
        self._slot_freed = asyncio.Event()
        self._rerouting = 0  # reroutes waiting for a KV slot (the queue waits behind them)
        self._dtype_refused: set[str] = set()
        self.events: deque[dict] = deque(maxlen=200)
        self.service_history = ServiceHistory()
        self._members: set[str] = set()  # nodes whose profile record was seen at the last refresh
        self.on_event = on_event
        # request id -> (its future, its prompt's page hashes)
        self._queued: dict[str, int] = {}  # client -> requests waiting in acquire()
        self._waiters: dict[str, tuple[asyncio.Future, Sequence[bytes]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._refresh_now = asyncio.Event()
        self._published_at = 0.0
        self.replans = 0
        self._stopping = False
        self._settling: tuple[float | None, float, set[str]] = (None, 0.0, set())  # first change, last change, set
        self.started_at = time.monotonic()
        # spot checks of the servers' arithmetic (swarm.trust.verification): the ledger of checks, strikes and
        # bans; the checker (swarm.control.spot_checks) is attached once the generation engine runs
        self.ledger = ledger or Ledger(CheckPolicy(config.spot_check_rate, config.spot_check_new_rate,
                                                   strikes_to_ban=config.spot_check_strikes))
        self.checks = None

    @property
    def prefix_index(self):
        return self.prefix.index

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.refresh()
        self._task = asyncio.create_task(self._control_loop(), name="orchestrator-control")

    async def stop(self) -> None:
        self._stopping = True  # Python 3.11's wait_for can swallow a cancel that meets a set event: the loop checks
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for future, _ in self._waiters.values():
            if not future.done():
                future.set_exception(NoChainsError("the orchestrator is shutting down"))

    async def _control_loop(self) -> None:
        while not self._stopping:
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

    def _refused(self, client_id: str, reason: str) -> None:
        """A refusal event; a burst of them from one client for one reason is one event with a count (so the
        recent events still show joins and plans under a flood)."""
        last = self.events[-1] if self.events else None
        if last and last["event"] == "refused" and last["client"] == client_id and last["reason"] == reason \
                and time.time() - last["time"] < 10.0:
            last["count"] += 1
            last["time"] = time.time()
            return
        self._event("refused", client=client_id, reason=reason, count=1)

    # -- membership, planning, assignments ---------------------------------------------------------------
    async def refresh(self) -> None:
        try:
            claims = await self._profiles_read(records.fetch_profile_claims, self.dht, self.config.dht_prefix)
            profiles = self._pinned_profiles(claims)
        except CallTimeout as exc:  # plan on the records read last time (the suspects still apply)
            logger.warning("refresh: %s", exc)
            profiles = self.view.profiles
        now = time.monotonic()
        for node, since in list(self.suspects.items()):
            if node not in profiles or now - since > self.config.suspect_s:
                del self.suspects[node]  # gone for good (record expired) or back after the grace period
        live = {node: p for node, p in profiles.items() if node not in self.suspects and p.rtt_s is not None
                and self._same_dtype(node, p) and not self.is_banned(node)}
        gone = {n: p.peer_id for n, p in self.view.profiles.items() if n not in profiles}
        self.view.profiles = profiles
        self._membership(set(profiles))
        for peer_id in gone.values():  # its record expired: steps waiting for it fail over now, not at their timeout
            for control in list(self.running.values()):
                control.peer_failed(peer_id)
        members = set(live)
        planned = set(self.view.assignments) if self.view.plan is not None else set()
        if (members != planned or self.view.plan is None) and self._settled(members, now):
            self._replan(live)
        for kind, data in self.transition.advance(self.view, self._compose, now):
            self._event(kind, **data)
            self._published_at = 0.0  # tell the released servers now
        try:
            if now - self._published_at > self.config.assignment_ttl_s / 3:
                await self._publish_assignments()
            if self.prefix.enabled:
                reports = await self._reports_read(prefix_protocol.fetch_reports, self.dht, self.config.dht_prefix,
                                                   dict(self.pins.pins))
                self.prefix.apply_reports(reports, live=set(profiles))
        except CallTimeout as exc:  # the chains below are still brought up to date
            logger.warning("refresh: %s", exc)
        self._update_chains()
        self.expire_leases()
        self.router.forget_idle(now, self.config.forget_idle_s)
        self.service_history.sample(time.time(), self.router.client_service())

    def _membership(self, nodes: set[str]) -> None:
        """Events for servers whose profile record appeared or vanished since the last refresh."""
        for node in sorted(nodes - self._members):
            self._event("server_joined", node=node)
        for node in sorted(self._members - nodes):
            self._event("server_left", node=node)
        self._members = nodes

    def _settled(self, members: set[str], now: float) -> bool:
        """Whether the first plan may be made: the live servers unchanged for ``settle_s`` (at most 5x that)."""
        if self.view.plan is not None or self.config.settle_s <= 0 or not members:
            return True
        first, since, seen = self._settling
        if members != seen:
            self._settling = (first if first is not None else now, now, set(members))
            first, since = self._settling[:2]
        return now - since >= self.config.settle_s or now - first >= 5 * self.config.settle_s

    def _pinned_profiles(self, claims) -> dict[str, records.ServerProfile]:
        """One profile per node id: the one signed by the key pinned for it (a second key claiming a live node
        id is refused, with a ``server_key_refused`` event once per key)."""
        profiles, refused = self.pins.select(claims)
        for node, key in refused:
            if (node, key) not in self._refused_keys:
                self._refused_keys.add((node, key))
                self._event("server_key_refused", node=node, key=key,
                            reason="another key already holds this node id while its profile is alive")
        return profiles

    def ticket(self, request_id: str, chain_id: str, route, page_hashes=()) -> bytes:
        """A session ticket (swarm.trust.tickets) for ``route``, signed by this orchestrator."""
        return tickets.mint(self.identity, request_id=request_id, chain_id=chain_id, route=route,
                            max_length=self.config.expect.max_length, ttl_s=self.config.ticket_ttl_s,
                            page_hashes=page_hashes)

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
            self.transition.reset(view)
            return
        try:
            new_plan, kept = planning.choose_plan(list(live.values()), self.config.num_blocks, self.config.expect,
                                                  view.plan)
        except (InfeasibleError, ValueError) as exc:
            view.plan_error = str(exc)
            if view.plan is not None:
                self._event("plan_dropped", reason=str(exc))
            view.plan, view.plan_id, view.assignments = None, None, {}
            self.transition.reset(view)
            return
        replaced = view.plan_id if view.plan is not None else None
        plan_id = planning.new_plan_id()
        view.plan, view.plan_id, view.plan_kept_ranges, view.plan_error = new_plan, plan_id, kept, None
        view.plan_inputs = planning.swarm_document(list(live.values()), self.config.num_blocks, self.config.expect)
        view.assignments = planning.assignments_for(new_plan, plan_id, self.config.expect.max_length,
                                                    self.config.expect.prefix_cache_tokens,
                                                    slots=self.router.kv_slots(new_plan, list(live.values())),
                                                    slot_tokens=self.config.expect.slot_tokens)
        self._compose = planning.composer(list(live.values()), self.config.num_blocks, self.config.expect,
                                          method=new_plan.placement_method)
        on_old_ranges = self.transition.begin(view, replaced)
        self._published_at = 0.0
        self.replans += 1
        self._event("plan", plan_id=plan_id, kept_ranges=kept, c=new_plan.c, servers=sorted(live),
                    chains=[[list(ch.servers), ch.capacity] for ch in new_plan.chains],
                    on_old_ranges=on_old_ranges)
        longest = self.reservations.longest(new_plan.chains)
        if longest is not None and longest < self.config.expect.max_length:
            logger.warning("plan %s: no chain holds a %d-token session (the longest is %d tokens); longer requests "
                           "get a 400", plan_id, self.config.expect.max_length, longest)
            self._event("plan_short_sessions", plan_id=plan_id, longest=longest,
                        max_length=self.config.expect.max_length)

    async def _publish_assignments(self) -> None:
        ttl, prefix = self.config.assignment_ttl_s, self.config.dht_prefix
        items = list(self.view.published.items())
        info = records.OrchestratorInfo(self.dht.peer_id.to_base58(), self.http_url, self.view.plan_id)

        owner = self.identity.public

        def publish() -> None:
            records.publish_orchestrator(self.dht, prefix, info, ttl, owner)
            for node, assignment in items:
                records.publish_assignment(self.dht, prefix, node, assignment, ttl, owner)

        fresh = self._publish.idle  # else the call still running from a refresh ago sends older assignments
        await self._publish(publish)
        if fresh:
            self._published_at = time.monotonic()

    def _update_chains(self) -> None:
        view = self.view
        if view.plan is None:
            view.chains = []
        else:
            view.chains = planning.routable_chains(view.plan, view.plan_id, view.profiles, view.assignments)
            if self.transition.active:  # servers move in waves: route on what is served meanwhile
                view.chains = self.transition.chains(view, self._compose) + [c for c in view.chains if not c.ready]
        self._ready = [c for c in view.chains if c.ready]
        self.prefix.set_chains(self._ready)
        self._refit()

    def _refit(self) -> None:
        """Give the router the ready chains with the capacities the servers' KV slots leave them, once the
        sessions it does not count (earlier plans', rerouted ones') are placed (:mod:`swarm.control.occupancy`)."""
        ready = self._ready
        if self.router.counts_chains and ready:
            pools = self.kv_pools()  # KV tokens per server; a chain's session slot is slot_tokens on each block
            slot = self.config.expect.slot_tokens
            blocks = {c.chain_id: blocks_of((n, a, b) for n, (a, b) in zip(c.servers, c.spans)) for c in ready}
            capacity = fit_capacities(
                [(c.chain_id, c.capacity, {n: m * slot for n, m in blocks[c.chain_id].items()}) for c in ready],
                pools, self.occupancy.uncounted(blocks))
            ready = [c if capacity[c.chain_id] == c.capacity else replace(c, capacity=capacity[c.chain_id])
                     for c in ready]
        for request_id, exc in self.router.update(ready, self.suspects).items():
            self._fail_waiter(request_id, exc)
        self._slot_freed.set()
        self._dispatch()

    def _fail_waiter(self, request_id: str, exc: Exception) -> None:
        future, _ = self._waiters.pop(request_id, (None, ()))
        if future is not None and not future.done():
            future.set_exception(exc)

    # -- dispatch ----------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        if self._rerouting:
            return  # a failed-over session waits for a slot: the next one freed is its, not the queue's
        now = time.monotonic()
        for grant in self.router.dispatch(now):
            future, page_hashes = self._waiters.pop(grant.request_id, (None, ()))
            if future is not None and not future.done():
                self.prefix.dispatched(grant.chain_id, page_hashes, now)
                chain = self.router.chain(grant.chain_id)
                if chain is not None:
                    self.occupancy.hold(grant.request_id, grant.chain_id, chain.servers, chain.spans,
                                        self.reserved_tokens(grant.request_id))
                future.set_result(grant)
            else:  # the waiter is gone (timed out / disconnected): give the slot back
                self.router.cancel(grant.request_id, now)

    async def _await_grant(self, request_id: str, client_id: str, future: asyncio.Future, timeout: float,
                           what: str = "no chain slot") -> Grant:
        """Wait up to ``timeout`` for the queued request's grant; after that it leaves the queue
        (:class:`QueueTimeout`, "``what`` within ... s")."""
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            self._waiters.pop(request_id, None)
            if future.done() and not future.cancelled() and future.exception() is None:
                self.finish(future.result().request_id, 0)  # granted just as we gave up
            else:
                self.abort(request_id)
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._refused(client_id, "queue timeout")
            raise QueueTimeout(f"{what} within {timeout:.0f} s",
                               self.retry_after_s(sum(self._queued.values()))) from None

    def chain(self, chain_id: str) -> RoutableChain:
        found = self.router.chain(chain_id)
        if found is None:
            raise NoRouteError(f"chain {chain_id} is not part of the current plan")
        return found

    def planned_step_s(self, chain_id: str, tokens: int) -> float:
        """Planned time of a ``tokens``-position step on the chain with its servers fully occupied (the
        no-progress watchdog's yardstick; 0 for a chain that is no longer known)."""
        with contextlib.suppress(NoRouteError):
            return planning.planned_step_s(self.chain(chain_id), self.view.profiles, self.view.published, tokens)
        return 0.0

    def kv_pools(self) -> dict[str, int]:
        """KV tokens each assigned server's session pool holds (its cache_slots × slot size, per block, as told)."""
        return {node: a.cache_slots * a.slot_size for node, a in self.view.published.items()}

    def grow(self, request_id: str, more_tokens: int) -> bool:
        """Let the running session ``request_id`` generate ``more_tokens`` past its reservation: True when its
        chain's KV budget has room (the reservation grows), False when not (the caller ends the answer there)."""
        grown = self.router.grow(request_id, more_tokens)
        if not grown:
            self._event("reservation_full", request=request_id, tokens=more_tokens)
        else:
            reserved = self.reservations.grow(request_id, more_tokens)
            if reserved is not None:
                self.occupancy.reweigh(request_id, reserved)
        return grown

    def reserved_tokens(self, request_id: str) -> int:
        """KV tokens per block the session ``request_id`` holds in the orchestrator's accounting now (its
        reservation: grows with :meth:`grow`)."""
        return self.reservations.reserved(request_id)

    def session_tokens(self, request_id: str) -> int:
        """KV tokens per block the session ``request_id`` reserves on its servers (its own need with token
        admission, ``max_length`` with slots)."""
        return self.reservations.bound(request_id)

    async def acquire(self, client_id: str, input_tokens: int, max_new_tokens: int, *,
                      timeout: float | None = None, page_hashes=(), reserve: int | None = None) -> Grant:
        """Queue a request with the router and wait for its grant (chain or path). ``reserve``: the output tokens
        its KV reservation covers at first (default all of ``max_new_tokens``; more with :meth:`grow`)."""
        reserve = max_new_tokens if reserve is None else min(reserve, max_new_tokens)
        self.reservations.check(input_tokens, max_new_tokens, reserve, self.view.chains)
        if self.view.plan is None:
            self._refused(client_id, "no plan")
            raise NoChainsError(f"no chains: {self.view.plan_error or 'no plan yet'}")
        waiting, mine = sum(self._queued.values()), self._queued.get(client_id, 0)
        if waiting >= self.config.max_queue or mine >= self.config.max_queue_per_client:
            bound = ("the swarm's queue is full" if waiting >= self.config.max_queue else
                     f"client {client_id!r} already has {mine} requests waiting (the per-client bound)")
            self._refused(client_id, "queue full")
            raise QueueFull(f"{bound}; retry later", self.retry_after_s(waiting))
        request_id = uuid.uuid4().hex
        self.reservations.open(request_id, input_tokens, reserve, max_new_tokens)
        future = self._loop.create_future()
        page_hashes = tuple(page_hashes)
        self.router.submit(request_id, client_id, input_tokens, reserve, page_hashes, time.monotonic())
        self._waiters[request_id] = (future, page_hashes)
        self._queued[client_id] = mine + 1
        self._dispatch()
        try:
            return await self._await_grant(request_id, client_id, future, timeout or self.config.queue_timeout_s)
        finally:
            left = self._queued.get(client_id, 1) - 1
            if left > 0:
                self._queued[client_id] = left
            else:
                self._queued.pop(client_id, None)

    def service_rate(self) -> float:
        """Requests per second the ready chains complete when full: ν = Σ_k c_k / T_k."""
        return sum(c.capacity / c.service_time for c in self.view.chains if c.ready and c.service_time > 0)

    def retry_after_s(self, waiting: int) -> float:
        """When a request sent now would likely start: the ``waiting`` requests ahead served at rate ν."""
        rate = self.service_rate()
        return max(1.0, (waiting + 1) / rate) if rate > 0 else 30.0

    def tokens(self, request_id: str, count: int) -> None:
        self.router.tokens(request_id, count, time.monotonic())

    def finish(self, request_id: str, output_tokens: int | None = None) -> None:
        self.router.finish(request_id, output_tokens, time.monotonic())
        self._ended(request_id)

    def abort(self, request_id: str) -> None:
        self.router.cancel(request_id, time.monotonic())
        self._ended(request_id)

    def _ended(self, request_id: str) -> None:
        self.reservations.close(request_id)
        if self.occupancy.release(request_id):
            self._refit()  # its slots are free, on whichever servers it held them
        else:
            self._dispatch()

    # -- prefix reuse (swarm.control.prefix_view) ----------------------------------------------------------------
    def prompt_hashes(self, token_ids) -> list[bytes]:
        """Page hashes of a prompt this orchestrator tokenized, in its secret namespace ([] when off)."""
        return self.prefix.prompt_hashes(token_ids)

    def prefilled(self, request_id: str, reused_tokens: int, prompt_tokens: int, expected_tokens: int = 0) -> None:
        """The session's probe found ``reused_tokens`` on every server of its chain: count the hit and
        reconcile the client's charge to the extend actually computed (§14.5)."""
        self.prefix.prefilled(reused_tokens, prompt_tokens, expected_tokens)
        self.router.prefilled(request_id, reused_tokens, time.monotonic())

    def prefix_status(self) -> dict[str, Any]:
        return self.prefix.status()

    def chain_cached_tokens(self, chain: RoutableChain) -> int:
        return self.prefix.chain_cached_tokens(chain)

    # -- status ------------------------------------------------------------------------------------------
    def status(self, detail: bool = True) -> dict[str, Any]:
        """The swarm's state (:func:`swarm.control.status.swarm_status`); without ``detail``, the public view."""
        return swarm_status(self, detail)
