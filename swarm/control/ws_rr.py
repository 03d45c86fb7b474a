"""WS-RR on the live swarm: the request router of the BPRR baseline (chain-composition spec §12.2).

BPRR does not compose chains with capacities. It routes each request when it arrives: over the servers'
current block ranges, WS-RR picks the path that minimizes Σ over its hops of (tW_ij − t) + τc_j + τp_j·m_ij,
where tW_ij − t is how long until server j has the KV block-slots the hop needs (m_ij, one per block it runs
there), estimated from the running requests' expected completion times (start + the path's service time
under the planner's model). The request is committed to that path and starts once every server on it has
the slots; a server hands freed slots to its committed requests in arrival order, so a later request never
overtakes an earlier one on a server they share.

:class:`WsRrRouter` is pure bookkeeping (no I/O): the orchestrator's ``ws-rr`` router
(:class:`swarm.control.routers.WsRrPaths`) calls :meth:`submit` on arrival, :meth:`startable` whenever slots may have
freed, and :meth:`release` when a request ends. The router keeps its requests across topology updates
(:meth:`update`) so a re-plan does not forget what is running.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from planner.baselines import Route, ws_rr_route
from planner.model import ModelSpec, Placement, Server


@dataclass
class _Routed:
    route: Route
    hops: tuple[tuple[str, int], ...]  # (server id, block-slots used there)
    estimated_end: float  # when the planner's model expects the request to finish
    started: bool = False


class WsRrRouter:
    """Per-server block-slot accounting and WS-RR path choice for committed requests."""

    def __init__(self) -> None:
        self.model: ModelSpec | None = None
        self.servers: list[Server] = []
        self.placement: Placement | None = None
        self.capacity: dict[str, int] = {}  # server id -> block-slots of its KV pool
        self._requests: "OrderedDict[Hashable, _Routed]" = OrderedDict()  # arrival order

    # -- topology --------------------------------------------------------------------------------------
    def update(self, model: ModelSpec, servers: Sequence[Server], placement: Placement,
               capacity: Mapping[str, int]) -> list[Hashable]:
        """The servers that serve now, their ranges (None = not routable) and KV block-slots.

        Returns the waiting requests whose committed path no longer exists; they are dropped here and the
        caller routes them again with :meth:`submit`."""
        if len(servers) != len(placement.spans):
            raise ValueError("one placement span per server")
        self.model, self.servers, self.placement = model, list(servers), placement
        self.capacity = {s.id: int(capacity.get(s.id, 0)) for s in servers}
        spans = {s.id: span for s, span in zip(servers, placement.spans)}
        # a waiting request whose path no longer matches the ranges (a server left or moved) is routed again
        stale = [rid for rid, r in self._requests.items() if not r.started and not all(
            spans.get(sid) is not None and spans[sid][1] == end and spans[sid][0] <= start
            for sid, (start, end) in zip(r.route.servers, r.route.spans))]
        for rid in stale:
            del self._requests[rid]
        return stale

    # -- accounting ------------------------------------------------------------------------------------
    def in_use(self, server_id: str, *, started_only: bool = False) -> int:
        return sum(slots for r in self._requests.values() if not started_only or r.started
                   for sid, slots in r.hops if sid == server_id)

    def _wait_s(self, server_id: str, slots: int, now: float) -> float:
        """Estimated time from ``now`` until ``server_id`` has ``slots`` block-slots for a new request,
        counting every committed request (started or waiting) as holding its slots until its expected end."""
        capacity = self.capacity.get(server_id, 0)
        if slots > capacity:
            return math.inf
        holders = sorted((r.estimated_end, s) for r in self._requests.values() for sid, s in r.hops if sid == server_id)
        free = capacity - sum(s for _, s in holders)
        if free >= slots:
            return 0.0
        for end, s in holders:
            free += s
            if free >= slots:
                return max(0.0, end - now)
        return math.inf  # pragma: no cover - unreachable: all holders released gives the whole capacity

    def submit(self, request_id: Hashable, now: float) -> Route | None:
        """Route a new request (WS-RR) and commit it to the path; None if no path exists."""
        if self.model is None or self.placement is None:
            return None
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already routed")
        ids = [s.id for s in self.servers]
        route = ws_rr_route(self.model, self.servers, self.placement,
                            lambda j, slots: self._wait_s(ids[j], slots, now))
        if route is None:
            return None
        hops = tuple((sid, end - start) for sid, (start, end) in zip(route.servers, route.spans))
        self._requests[request_id] = _Routed(route, hops, now + route.start_delay + route.service_time)
        return route

    def startable(self, now: float) -> list[tuple[Hashable, Route]]:
        """Waiting requests that can start now (their servers have the slots), marked started.

        In arrival order; a waiting request that cannot start blocks its servers for later ones."""
        used = {sid: self.in_use(sid, started_only=True) for sid in self.capacity}
        blocked: set[str] = set()
        out = []
        for request_id, r in self._requests.items():
            if r.started:
                continue
            servers = {sid for sid, _ in r.hops}
            fits = all(sid in self.capacity and used[sid] + s <= self.capacity[sid] for sid, s in r.hops)
            if fits and not servers & blocked:
                r.started = True
                r.estimated_end = now + r.route.service_time
                for sid, s in r.hops:
                    used[sid] += s
                out.append((request_id, r.route))
            else:
                blocked |= servers
        return out

    def release(self, request_id: Hashable) -> bool:
        """The request finished, failed or was cancelled: free its slots. False if unknown."""
        return self._requests.pop(request_id, None) is not None

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def status(self) -> dict:
        waiting = sum(1 for r in self._requests.values() if not r.started)
        return {"router": "ws-rr", "running": len(self._requests) - waiting, "waiting": waiting,
                "block_slots": {sid: {"capacity": cap, "in_use": self.in_use(sid, started_only=True)}
                                for sid, cap in sorted(self.capacity.items())}}
