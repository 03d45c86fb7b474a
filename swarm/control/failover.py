"""The orchestrator's failover and lease operations (mixed into :class:`swarm.control.orchestrator.Orchestrator`).

* **Failover.** A session that sees a server fail asks for a reroute: the orchestrator's own evidence excludes the
  server at once; a lease holder's report is a claim confirmed by another client or the orchestrator's probe
  (:mod:`swarm.control.failures`). A rerouted session takes a KV block-slot on every server of its new route or waits for
  one, before the queue (:mod:`swarm.control.occupancy`).
* **Leases** (clients that drive petals themselves; :mod:`swarm.control.leases`): grant through the fair queue, renewal,
  reroutes bounded to the lease's own peers, release and expiry.

These methods use the orchestrator's state (``view``, ``router``, ``occupancy``, ``leases``, ``claims``,
``probe``, ``suspects``, ``_ready`` ...); they live here so that the orchestrator module keeps to membership,
planning and dispatch.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from planner.fairness.types import Grant
from swarm.control.leases import LeaseRecord
from swarm.control.occupancy import blocks_of
from swarm.control.planning import server_matches
from swarm.control.view import Suspicion
from swarm.engine.routing import NoRouteError, RouteSpan, clip_route

logger = logging.getLogger(__name__)


class Failover:
    def report_failure(self, peer_id: str, *, confirmed: bool = False) -> None:
        """The orchestrator's own session saw ``peer_id`` fail (or, ``confirmed``, its probe cannot reach it):
        exclude its server now and rebuild chains without it."""
        node = self._node_of(peer_id)
        if node is None or node in self.suspects:
            return
        assignment = self.view.published.get(node)
        if not confirmed and assignment is not None and not server_matches(self.view.profiles.get(node), assignment):
            # it is moving to its range of a newer plan (draining, loading): its sessions fail by design, and
            # excluding it would shrink the plan again and move the next survivor (the chaos soak saw that cascade
            # take the swarm below the model). But a server that died while moving would stay in the chains it
            # served until its record expires, and every session sent there would wait out a step timeout: the
            # probe tells the two apart, and excludes it if it cannot be reached.
            self._event("failure_while_moving", node=node, peer_id=peer_id)
            self._check_reachable(peer_id)
            return
        now = time.monotonic()
        last = self.failed_at.get(node)
        self.failed_at[node] = now
        self.suspects[node] = Suspicion(now, peer_id, repeated=last is not None and now - last < self.config.suspect_s)
        self.claims.forget(node)
        self._event("server_failed", node=node, peer_id=peer_id)
        for control in list(self.running.values()):  # sessions stepping on it fail over now, not at the timeout
            control.peer_failed(peer_id)
        self._refresh_now.set()

    def claim_failure(self, peer_id: str, client_id: str) -> None:
        """A lease holder says ``peer_id`` failed. Excluded only once confirmed (swarm.control.failures): by another
        client's claim, or by the orchestrator's own probe, started here in the background."""
        node = self._node_of(peer_id)
        if node is None or node in self.suspects:
            return
        if self.claims.claim(node, client_id, time.monotonic()):
            self.report_failure(peer_id)
        else:
            self._check_reachable(peer_id)

    def _check_reachable(self, peer_id: str) -> None:
        """Probe ``peer_id`` in the background (once at a time); it is excluded if it cannot be reached."""
        if peer_id not in self._probing and self._loop is not None:
            self._probing.add(peer_id)
            self._loop.create_task(self._probe(peer_id))

    async def _probe(self, peer_id: str) -> None:
        try:
            if not await asyncio.to_thread(self.probe.reachable, peer_id):
                self.report_failure(peer_id, confirmed=True)
            else:
                self._event("failure_claim_refuted", peer_id=peer_id)
        finally:
            self._probing.discard(peer_id)

    def _moved(self, peer_id: str, start: int, end: int) -> bool:
        """The server no longer has blocks [start, end) in the current plan (it moved, or it is not in it)."""
        assignment = self.view.published.get(self._node_of(peer_id) or "")
        return assignment is None or not (assignment.start <= start and end <= assignment.end)

    def _node_of(self, peer_id: str) -> str | None:
        return next((n for n, p in self.view.profiles.items() if p.peer_id == peer_id), None)

    async def resume(self, request_id: str, client_id: str, input_tokens: int, max_new_tokens: int, *,
                     timeout: float, page_hashes=(), reserve: int | None = None, refused: bool = True,
                     kv_freed=()) -> Grant:
        """The session ``request_id`` failed on its chain (a server died, its route could not be mended, or it
        stalled): its continuation — ``input_tokens`` = prompt + tokens delivered so far, ``max_new_tokens``
        left — goes back to the head of its client's queue in its original place (the router's ``requeue``;
        the tokens already generated stay charged), its KV reservation moves with it, and it waits up to
        ``timeout`` for a chain with room (:class:`QueueTimeout` after that: "no chain ... within N s").
        Accepted work is not counted against the queue bounds again. ``reserve``: as :meth:`acquire`'s. Not
        ``refused``: a timeout raises no refusal event (a preempted answer then ends at ``length``, not refused).
        ``kv_freed``: as :meth:`finish`'s (the old session's slots stay counted until its servers free them)."""
        now = time.monotonic()
        reserve = max_new_tokens if reserve is None else min(reserve, max_new_tokens)
        self._release(request_id, kv_freed)  # (a preempted batched session's servers may still hold its KV)
        if not self.router.requeue(request_id, input_tokens, reserve, now):
            self._ended(request_id)  # this router cannot keep its place: a new request at the back
            return await self.acquire(client_id, input_tokens, max_new_tokens, timeout=timeout,
                                      page_hashes=page_hashes, reserve=reserve)
        self.reservations.open(request_id, input_tokens, reserve, max_new_tokens)
        future = self._loop.create_future()
        self._waiters[request_id] = (future, tuple(page_hashes))
        self._event("session_requeued", request=request_id, client=client_id, tokens=input_tokens)
        self._refit()  # its old reservation is free (and dispatch: it may start at once)
        return await self._await_grant(request_id, client_id, future, timeout,
                                       "no chain with room for the rest of the session", refused)

    async def reroute(self, chain_id: str, start: int, end: int, failed_peers, *, request_id: str | None = None,
                      claimant: str | None = None, wait_s: float = 20.0) -> tuple[RouteSpan, ...]:
        """Spans for blocks [start, end) on the fastest ready chain avoiding ``failed_peers``. Without
        ``claimant`` the failures are the orchestrator's own evidence; a lease holder's (``claimant``) are claims
        to confirm (:meth:`claim_failure`); a session on a chain of an older plan whose server no longer has those
        blocks is no evidence (the server moved to the new plan's range; a dead one is dropped when its record
        expires). The session ``request_id`` takes a KV block-slot on every server of
        its new route, waiting up to ``wait_s`` for one (:class:`NoRouteError` after that)."""
        older = self.view.plan_id is not None and not chain_id.startswith(f"{self.view.plan_id}/")
        for peer in failed_peers:
            if older and self._moved(peer, start, end):  # its sessions fail by design: not a failure
                self._event("failure_after_a_move", chain=chain_id, peer_id=peer)
                self._check_reachable(peer)  # unless it is also dead (then the probe excludes it)
            elif claimant is None:
                self.report_failure(peer)
            else:
                self.claim_failure(peer, claimant)
        bad = set(failed_peers)
        nodes = {p.peer_id: n for n, p in self.view.profiles.items()}
        deadline = time.monotonic() + wait_s
        waiting = False
        try:
            while True:
                routes = []
                free = self.router.free_slots()
                for c in sorted((c for c in self._ready if not bad & {p for p, _, _ in c.route}),
                                key=lambda c: (free.get(c.chain_id, 0) <= 0, c.index)):
                    with contextlib.suppress(NoRouteError):
                        routes.append(tuple(clip_route(c.route, start, end)))
                if not routes:
                    raise NoRouteError(f"no ready chain covers blocks [{start}, {end}) without {sorted(bad)}")
                slots = self.kv_pools()  # KV tokens per server (a session takes its need on each block)
                for route in routes:
                    spans = [(nodes.get(p, p), a, b) for p, a, b in route]
                    weight = 1 if request_id is None else self.occupancy.weight(request_id)
                    taken = {node: weight * blocks for node, blocks in blocks_of(spans).items()}
                    if request_id is None or self.occupancy.can_take(taken, slots):
                        if request_id is not None:
                            self.occupancy.move(request_id, start, end, spans)
                            self._refit()
                        logger.info("reroute of %s: blocks [%d, %d) on %s after %.1f s", request_id, start, end,
                                    [n for n, _, _ in spans], wait_s - (deadline - time.monotonic()))
                        return route
                if time.monotonic() >= deadline:
                    used = self.occupancy.per_server()
                    full = sorted({f"{n} {used.get(n, 0)}/{slots[n]}" for r in routes for p, _, _ in r
                                   if (n := nodes.get(p, p)) in slots})
                    raise NoRouteError(f"no free KV slot on a chain covering blocks [{start}, {end}) within "
                                       f"{wait_s:.0f} s (KV token-blocks used/held: {', '.join(full)}; "
                                       f"{self._rerouting} reroutes waiting)")
                self._slot_freed.clear()
                if not waiting:
                    waiting = True
                    self._rerouting += 1  # sessions already in service go before the queue
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), min(1.0, max(0.01, deadline - time.monotonic())))
        finally:
            if waiting:
                self._rerouting -= 1
                self._dispatch()


class LeaseOps:
    async def grant_lease(self, client_id: str, input_tokens: int, max_new_tokens: int, *,
                          timeout: float | None = None) -> LeaseRecord:
        grant = await self.acquire(client_id, input_tokens, max_new_tokens, timeout=timeout)
        record = self.leases.grant(grant.request_id, client_id, self.chain(grant.chain_id), time.monotonic())
        record.lease.ticket = self.ticket(grant.request_id, grant.chain_id, record.lease.route)
        self._event("lease", lease_id=record.lease.lease_id, client=client_id, chain=grant.chain_id)
        return record

    def rerouted_lease_ticket(self, record: LeaseRecord, route) -> bytes:
        """After a reroute of ``record``'s lease: its route as the client now drives it, and a fresh ticket."""
        from swarm.engine.routing import splice

        record.lease.route = splice(record.lease.route, route)
        record.lease.ticket = self.ticket(record.request_id, record.lease.chain_id, record.lease.route)
        return record.lease.ticket

    def lease(self, lease_id: str) -> LeaseRecord:
        return self.leases.get(lease_id)

    def renew_lease(self, lease_id: str) -> LeaseRecord:
        return self.leases.renew(lease_id, time.monotonic())

    async def reroute_lease(self, lease_id: str, start: int, end: int, failed_peers,
                            wait_s: float = 20.0) -> tuple[RouteSpan, ...]:
        """A lease holder's failover: only peers of its own route, a bounded number of times (``LeaseMisuse``);
        its failure reports are claims (:meth:`claim_failure`)."""
        record = self.leases.check_reroute(lease_id, failed_peers)
        route = await self.reroute(record.lease.chain_id, start, end, failed_peers, request_id=record.request_id,
                                   claimant=record.client_id, wait_s=wait_s)
        self.leases.rerouted(lease_id, route, time.monotonic())
        return route

    def release_lease(self, lease_id: str, output_tokens: int | None = None) -> None:
        self.finish(self.leases.release(lease_id).request_id, output_tokens)

    def expire_leases(self) -> None:
        for lease_id in self.leases.expired(time.monotonic()):
            self._event("lease_expired", lease_id=lease_id, client=self.leases.get(lease_id).client_id)
            self.release_lease(lease_id)
