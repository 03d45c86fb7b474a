"""The orchestrator: plans the swarm, tells servers what to load, and dispatches sessions to chains.

One asyncio service owns all state; blocking work (DHT calls, petals sessions) runs in threads.

* **Membership and planning.** Every ``refresh_s`` it reads the servers' profile records from the DHT.
  When the set of live servers changes it re-plans (``swarm.control.planning.choose_plan``: GBP-CR with c tuned
  by the Theorem 3.7 lower bound, then GCA, keeping current block ranges when that is nearly as good)
  and publishes one :class:`~swarm.trust.records.Assignment` per server, renewed while the plan stands. A
  server reported failed by a session is excluded at once (GCA over the remaining placement), before
  its heartbeat record even expires. These are in :mod:`swarm.control.membership` (mixed in).
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
from swarm.control import planning
from swarm.trust import tickets
from swarm.control.failures import DhtPing, FailureClaims
from swarm.control.failover import Failover, LeaseOps
from swarm.trust.identity import Identity, KeyPins
from swarm.trust.verification import CheckPolicy, Ledger
from swarm.control.membership import Membership, dht_calls
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
from swarm.control.view import OrchestratorConfig, Suspicion, SwarmView

__all__ = ["Orchestrator", "OrchestratorConfig", "SwarmView", "NoChainsError", "QueueTimeout", "UnknownLeaseError",
           "LeaseRecord", "LeaseMisuse"]

logger = logging.getLogger(__name__)
# a finished batched session's close reaches its servers with its chain's next step or its streams' close (at most
# the engine's 30 s step timeout and 10 s close): after this its slots are free in the accounting whatever was heard
KV_FREED_WAIT_S = 60.0


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


class Orchestrator(Membership, Failover, LeaseOps, SpotCheckHooks):
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
        self.suspects: dict[str, Suspicion] = {}  # node id -> the failed process, excluded for a while
        self.failed_at: dict[str, float] = {}  # node id -> its last reported failure (within the grace period)
        self.claims = FailureClaims()  # lease holders' failure reports, excluded only when confirmed
        self.probe = DhtPing(dht)
        self._profiles_read, self._reports_read, self._publish = dht_calls()  # bounded (swarm.control.membership)
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
        self._record_expires: dict[tuple[str, bytes], float] = {}  # (node, key) -> its record's expiry (DHT time)
        self.on_event = on_event
        # request id -> (its future, its prompt's page hashes)
        self._queued: dict[str, int] = {}  # client -> requests waiting in acquire()
        self._waiters: dict[str, tuple[asyncio.Future, Sequence[bytes]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._refresh_now = asyncio.Event()
        self._published_at = 0.0
        self._reports_read_at = -float("inf")
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

    # -- tickets and chain capacities (membership and planning: swarm.control.membership) ----------------
    def ticket(self, request_id: str, chain_id: str, route, page_hashes=()) -> bytes:
        """A session ticket (swarm.trust.tickets) for ``route``, signed by this orchestrator."""
        return tickets.mint(self.identity, request_id=request_id, chain_id=chain_id, route=route,
                            max_length=self.config.expect.max_length, ttl_s=self.config.ticket_ttl_s,
                            page_hashes=page_hashes)

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
                           what: str = "no chain slot", refused: bool = True) -> Grant:
        """Wait up to ``timeout`` for the queued request's grant; after that it leaves the queue
        (:class:`QueueTimeout`, "``what`` within ... s"; a "queue timeout" refusal event unless not ``refused``:
        the caller ends the request without an error)."""
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
            if refused:
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

    def route_batch_bound(self, route) -> int | None:
        """The smallest batch bound (``chainswarm server --max-batch``) that the servers of ``route`` (``(peer id,
        start, end)`` spans) publish; None if one of them publishes none. Safe from the engine's threads (one copy
        of the profiles, taken at once)."""
        bounds = {p.peer_id: p.max_batch for p in list(self.view.profiles.values())}
        found = [bounds.get(peer) for peer, _, _ in route]
        return None if not found or None in found else min(found)

    def route_ends(self, route) -> bool:
        """Whether the first and last servers of ``route`` embed token ids and choose tokens themselves (they
        publish ``ends``): the engine then sends them token ids and gets token ids back (:mod:`server.ends`).
        Safe from the engine's threads."""
        ends = {p.peer_id: p.ends for p in list(self.view.profiles.values())}
        return bool(route) and all(ends.get(peer, False) for peer, _, _ in (route[0], route[-1]))

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

    def can_hold(self, input_tokens: int, max_new_tokens: int, reserve: int) -> bool:
        """Whether some chain of the current plan can hold a session of this prompt (prompt + tokens so far) with
        ``reserve`` of its ``max_new_tokens`` covered: a preempted answer then waits for room rather than ends."""
        if self.view.plan is None:
            return False
        try:
            self.reservations.check(input_tokens, max_new_tokens, reserve, self.view.chains)
        except ValueError:
            return False
        return True

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

    def finish(self, request_id: str, output_tokens: int | None = None, *, kv_freed: Sequence = ()) -> None:
        """The session ended. ``kv_freed``: futures (:class:`concurrent.futures.Future`) that resolve once its
        servers no longer hold its KV; its slots stay counted till then (:meth:`_release`)."""
        self.router.finish(request_id, output_tokens, time.monotonic())
        self._ended(request_id, kv_freed)

    def abort(self, request_id: str) -> None:
        self.router.cancel(request_id, time.monotonic())
        self._ended(request_id)

    def _ended(self, request_id: str, kv_freed: Sequence = ()) -> None:
        self.reservations.close(request_id)
        if self._release(request_id, kv_freed):
            self._refit()  # its slots are free (or held apart from its chain), on whichever servers it held them
        else:
            self._dispatch()

    def _release(self, request_id: str, kv_freed: Sequence = ()) -> bool:
        """Free the session's KV slots in the accounting: now, or — while some of ``kv_freed`` is pending — once
        they resolve (at most ``KV_FREED_WAIT_S`` later); until then they are held apart from any chain
        (:meth:`Occupancy.retire`: part of U_j), so no grant or reroute takes a slot a server still holds. False
        for a session the accounting did not know."""
        pending = [f for f in kv_freed if not f.done()]
        key = self.occupancy.retire(request_id) if pending and self._loop is not None else None
        if key is None:
            return self.occupancy.release(request_id)
        loop = self._loop

        def free() -> None:  # on the loop; once (release is False for a key already released)
            if self.occupancy.release(key):
                self._refit()

        def resolved(_) -> None:  # on any thread
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(lambda: all(f.done() for f in pending) and free())

        for future in pending:
            future.add_done_callback(resolved)
        loop.call_later(KV_FREED_WAIT_S, free)
        return True

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
