"""The orchestrator's membership and planning (mixed into :class:`swarm.control.orchestrator.Orchestrator`).

Each refresh reads the servers' signed profile records (one key pinned per node id), drops suspects, banned
servers and servers of another dtype, re-plans when the live set changed (GBP-CR with cache reservation and GCA,
:mod:`swarm.control.planning`), advances a make-before-break transition (:mod:`swarm.control.transition`),
publishes the assignments, applies the servers' prefix eviction reports and rebuilds the routable chains. Its DHT
calls are bounded (:mod:`swarm.runtime.bounded`): one that hangs must not stop re-plans and failover.

These methods use the orchestrator's state (``view``, ``transition``, ``suspects``, ``pins``, ``router``,
``prefix``, ``reservations`` ...); they live here so that the orchestrator module keeps to dispatch, sessions and
status.
"""
from __future__ import annotations

import logging
import time

from planner.tuning import InfeasibleError
from swarm.control import planning
from swarm.runtime.bounded import BoundedCall, CallTimeout
from swarm.trust import prefix as prefix_protocol, records

logger = logging.getLogger(__name__)

DHT_CALL_S = 15.0  # the longest the control loop waits for one DHT read or write (it goes on in its thread)


def dht_calls() -> tuple[BoundedCall, BoundedCall, BoundedCall]:
    """The control loop's bounded DHT calls: reading the server records, the prefix reports; publishing."""
    return tuple(BoundedCall(what, DHT_CALL_S) for what in (
        "reading the server records", "reading the prefix reports", "publishing the assignments"))


class Membership:
    async def refresh(self) -> None:
        try:
            expires: dict = {}
            claims = await self._profiles_read(records.fetch_profile_claims, self.dht, self.config.dht_prefix, expires)
            profiles = self._pinned_profiles(self._with_missed(claims, expires))
        except CallTimeout as exc:  # plan on the records read last time (the suspects still apply)
            logger.warning("refresh: %s", exc)
            profiles = self.view.profiles
        now = time.monotonic()
        for node, suspicion in list(self.suspects.items()):
            current = profiles.get(node)
            restarted = current is not None and current.peer_id != suspicion.peer_id and not suspicion.repeated
            if current is None or restarted or now - suspicion.since > self.config.suspect_s:
                # gone for good (record expired), restarted (a new process under its node id: what failed was the
                # old one; not after a second failure in a row), or back after the grace period
                del self.suspects[node]
        for node, at in list(self.failed_at.items()):
            if now - at > self.config.suspect_s:
                del self.failed_at[node]
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
        if self.prefix.enabled:  # from the records just read, whatever the DHT calls below do: a reloaded server's
            # old pages are forgotten before the chains below are brought up to date and get requests
            self.prefix.follow_epochs({node: p.prefix_epoch for node, p in profiles.items()})
        try:
            if now - self._published_at > self.config.assignment_ttl_s / 3:
                await self._publish_assignments()
            if self.prefix.enabled:  # a server that left is forgotten at once; reports are read every reports_s
                reports = {}
                if now - self._reports_read_at >= self.config.reports_s:
                    self._reports_read_at = now
                    reports = await self._reports_read(prefix_protocol.fetch_reports, self.dht,
                                                       self.config.dht_prefix, dict(self.pins.pins))
                self.prefix.apply_reports(reports, live=set(profiles))
        except CallTimeout as exc:  # the chains below are still brought up to date
            logger.warning("refresh: %s", exc)
        for node, why in self.prefix.drain_resets():
            self._event("prefix_index_reset", node=node, reason=why)
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
        """Whether the first plan may be made: the live servers unchanged for ``settle_s`` (at most 5x that), or
        as many as ``expect_servers`` live."""
        if self.view.plan is not None or self.config.settle_s <= 0 or not members:
            return True
        if 0 < self.config.expect_servers <= len(members):
            return True
        first, since, seen = self._settling
        if members != seen:
            self._settling = (first if first is not None else now, now, set(members))
            first, since = self._settling[:2]
        return now - since >= self.config.settle_s or now - first >= 5 * self.config.settle_s

    def _with_missed(self, claims: dict, expires: dict) -> dict:
        """``claims`` with the live records this read missed: a DHT lookup can come back without records that are
        alive (on a loaded machine, a test swarm's four servers all "left" at once and were back a second later,
        every running session requeued). A server's record, under its pinned key, that an earlier read saw and
        that has not expired yet stays as last read; the server leaves when its record expires (or at once when a
        session reports it failed)."""
        now = records.dht_now()
        self._record_expires = {k: t for k, t in {**self._record_expires, **expires}.items() if t > now}
        claims = dict(claims)
        for node, profile in self.view.profiles.items():
            owner = self.pins.owner(node)
            if owner is not None and owner not in claims.get(node, {}) and (node, owner) in self._record_expires:
                claims[node] = {**claims.get(node, {}), owner: profile}
        return claims

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
