"""Routers: who is served next, on which chain or path, with how much KV memory.

The orchestrator picks one :class:`Router` by name once at start-up (:data:`ROUTERS`) and leaves every
routing decision to it: the KV slots its assignments carry, which requests start and where
(:meth:`Router.dispatch` returns their :class:`~planner.fairness.types.Grant`), the chain or path a granted
request runs on, the accounting of cancelled, finished, generated and prefilled tokens, the free slots a
reroute prefers, and its block of the status.

* :class:`JffcRouter` (``jffc``, the default): GCA's chains, the fairness scheduler's central queue
  (``planner.fairness``: ``dlpm`` by default, or ``vtc``/``fcfs``/...) and JFFC grants (fastest chain with a
  free slot). Only ready chains (every server serves its assignment) are grantable; costs are charged as the
  spec's §1 says: input tokens at admission, output tokens as they are generated.
* :class:`WsRrPaths` (``ws-rr``, the BPRR baseline of the experiments): requests bypass the chains and the
  fairness queue; each is routed on arrival by WS-RR (:class:`swarm.control.ws_rr.WsRrRouter`, the pure
  bookkeeping) over the servers' block ranges and starts when its path's servers have KV slots; servers keep
  KV for all the sessions their memory holds. A started request runs on its path as a one-slot chain.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from typing import Any, Callable, Collection, Mapping, Sequence

from planner.fairness import ChainSpec, make_scheduler
from planner.fairness.types import FairnessError, Grant
from planner.model import Placement
from planner.plan import Plan
from swarm.control import planning
from swarm.control.planning import RoutableChain
from swarm.trust.records import ServerProfile
from swarm.control.view import OrchestratorConfig, SwarmView
from swarm.control.ws_rr import WsRrRouter

class NoChainsError(Exception):
    """There is no plan (or no ready chain) that could ever serve the request."""


class Router:
    """What the orchestrator asks of a router. ``view`` is the orchestrator's :class:`SwarmView` (read only)."""

    counts_chains = False  # True: grants are bounded by the chains' capacities (fitted to the servers' KV slots)

    def __init__(self, config: "OrchestratorConfig", view: "SwarmView", *,
                 prefix_match: Callable[[Any, str], int] | None = None):
        self.config, self.view = config, view

    def kv_slots(self, plan: Plan, live: Sequence[ServerProfile]) -> Mapping[str, int] | None:
        """Block-slots per server for the plan's assignments (None: the planner's)."""
        return None

    def update(self, ready: Sequence[RoutableChain], suspects: Collection[str]) -> dict[str, Exception]:
        """The view's chains changed (``ready``: the grantable ones). Returns the waiting requests that can no
        longer be served, with the reason; they are forgotten here."""
        raise NotImplementedError

    def submit(self, request_id: str, client_id: str, input_tokens: int, max_new_tokens: int,
               page_hashes: Sequence[bytes], now: float) -> None:
        """Queue a request (raises :class:`NoChainsError` when it can never be served)."""
        raise NotImplementedError

    def dispatch(self, now: float) -> list[Grant]:
        """The requests that start now, with their chain."""
        raise NotImplementedError

    def grow(self, request_id: str, more_tokens: int) -> bool:
        """Let a running request generate ``more_tokens`` more than it reserved, if its KV room allows (True here:
        a router without a KV token budget reserves whole sessions)."""
        return True

    def requeue(self, request_id: str, input_tokens: int, max_new_tokens: int, now: float) -> bool:
        """A running request's session failed: queue its continuation (``input_tokens`` = prompt + tokens so
        far, ``max_new_tokens`` left) in its old place. False: this router cannot (the caller submits anew)."""
        return False

    def cancel(self, request_id: str, now: float) -> None:
        """Take a waiting or running request out (its slots are free again); unknown ids are ignored."""
        raise NotImplementedError

    def finish(self, request_id: str, output_tokens: int | None, now: float) -> None:
        self.cancel(request_id, now)

    def tokens(self, request_id: str, count: int, now: float) -> None:
        """``count`` tokens generated for a running request."""

    def prefilled(self, request_id: str, reused_tokens: int, now: float) -> None:
        """The request's prefill reused ``reused_tokens`` cached prompt tokens."""

    def forget_idle(self, now: float, idle_for: float) -> None:
        """Drop the per-client state of clients with nothing queued or running for ``idle_for`` seconds."""

    def chain(self, chain_id: str) -> RoutableChain | None:
        """The chain (or path) a grant names; None when it is not known (any more)."""
        return next((c for c in self.view.chains if c.chain_id == chain_id), None)

    def free_slots(self) -> dict[str, int]:
        """Free session slots per chain of the view (a reroute prefers chains with one)."""
        raise NotImplementedError

    def active_sessions(self) -> dict[str, int]:
        """Running sessions per chain of the view."""
        return {}

    def kv_tokens(self) -> dict[str, tuple[int, int]]:
        """(held, budget) KV tokens per block of each chain that admits by tokens."""
        return {}

    def status(self) -> dict[str, Any]:
        """The router's part of the orchestrator's status: ``queue`` and ``clients`` at least."""
        raise NotImplementedError

    def client_service(self) -> dict[str, float]:
        """Cumulative service charged per client (the dashboard's fairness chart)."""
        return {}


class JffcRouter(Router):
    """GCA chains, the fairness scheduler's central queue and JFFC grants. Each ready chain is given to the
    scheduler with the planner's mean service time and its servers' measured prefill per prompt token
    (:func:`swarm.control.planning.chain_prefill_s`), which T_k(r) charges for the prompt tokens it must compute."""

    counts_chains = True

    def __init__(self, config, view, *, prefix_match=None):
        super().__init__(config, view)
        options: dict[str, Any] = {}
        if config.policy in ("dlpm", "swarm", "bfio"):
            options["quantum"] = config.quantum
        if config.policy in ("swarm", "bfio") and config.chain_quantum is not None:
            options["chain_quantum"] = config.chain_quantum
        if prefix_match is not None:
            options["prefix_match"] = prefix_match
        self.scheduler = make_scheduler(config.policy, **options)

    def update(self, ready, suspects):
        expect, profiles = self.config.expect, self.view.profiles
        self.scheduler.set_chains([
            ChainSpec(chain_id=c.chain_id, capacity=self._sessions(c.capacity), mean_service_time=c.service_time,
                      prefill_time=planning.chain_prefill_s(c, profiles), max_length=expect.max_length,
                      servers=c.servers, reference_output_tokens=max(1, round(expect.output_tokens)),
                      kv_tokens=c.capacity * expect.slot_tokens if expect.kv_admission == "tokens" else None,
                      kv_page=planning.KV_PAGE)
            for c in ready
        ])
        return {}

    def _sessions(self, capacity: int) -> int:
        """Sessions a chain may run at once: its c_k slots, or with token admission as many as its KV budget
        (c_k · slot_tokens) holds in one-page sessions (the budget is the real bound)."""
        expect = self.config.expect
        if expect.kv_admission != "tokens":
            return capacity
        return capacity * max(1, expect.slot_tokens // planning.KV_PAGE)

    def submit(self, request_id, client_id, input_tokens, max_new_tokens, page_hashes, now):
        self.scheduler.submit(request_id, client_id, input_tokens, now, max_new_tokens=max_new_tokens,
                              page_hashes=page_hashes)

    def dispatch(self, now):
        return self.scheduler.dispatch(now)

    def grow(self, request_id, more_tokens):
        try:
            return self.scheduler.grow(request_id, more_tokens)
        except FairnessError:
            return False

    def requeue(self, request_id, input_tokens, max_new_tokens, now):
        """The scheduler's ``on_failure(requeue=True)``: the head of its client's queue with its original seq,
        the tokens already generated stay charged and the recomputation is not charged again."""
        try:
            self.scheduler.on_failure(request_id, now, requeue=True, input_tokens=input_tokens,
                                      max_new_tokens=max_new_tokens)
        except FairnessError:
            return False
        return True

    def cancel(self, request_id, now):
        with contextlib.suppress(FairnessError):
            self.scheduler.cancel(request_id, now)

    def finish(self, request_id, output_tokens, now):
        with contextlib.suppress(FairnessError):
            self.scheduler.on_finish(request_id, now, output_tokens=output_tokens)

    def tokens(self, request_id, count, now):
        with contextlib.suppress(FairnessError):
            self.scheduler.on_tokens(request_id, count, now)

    def prefilled(self, request_id, reused_tokens, now):
        with contextlib.suppress(FairnessError):
            self.scheduler.on_prefill(request_id, reused_tokens, now)

    def forget_idle(self, now, idle_for):
        self.scheduler.forget_idle_clients(now, idle_for)

    def free_slots(self):
        return self.scheduler.free_slots()

    def active_sessions(self):
        return self.scheduler.active_sessions()

    def kv_tokens(self):
        return self.scheduler.kv_tokens()

    def client_service(self):
        return {str(c): self.scheduler.service(c) for c in self.scheduler.clients()}

    def status(self):
        queue = {str(c): n for c, n in self.scheduler.queue_lengths().items() if n}
        deficit = getattr(self.scheduler, "deficit", None)  # DLPM-family policies keep deficit counters
        running = Counter(str(r.client_id) for r in self.scheduler.running())

        def entry(c) -> dict[str, Any]:
            doc = {"service": self.scheduler.service(c), "waiting": queue.get(str(c), 0),
                   "running": running.get(str(c), 0)}
            if deficit is not None:
                with contextlib.suppress(FairnessError):
                    value = deficit(c)
                    doc["deficit"] = value if math.isfinite(value) else None
            return doc

        return {"queue": queue, "clients": {str(c): entry(c) for c in self.scheduler.clients()}}


class WsRrPaths(Router):
    """BPRR's per-request WS-RR paths over the servers' block ranges; servers keep KV for their whole memory."""

    def __init__(self, config, view, *, prefix_match=None):
        super().__init__(config, view)
        self.router = WsRrRouter()
        self._requests: dict[str, tuple[str, int]] = {}  # request id -> (client, input tokens)
        self._paths: dict[str, RoutableChain] = {}  # request id -> its started path as a one-slot chain

    def kv_slots(self, plan, live):
        model, servers = planning.planner_inputs(list(live), self.config.num_blocks, self.config.expect)
        return planning.memory_slots(plan, model, servers)

    def update(self, ready, suspects):
        """Give WS-RR the servers that serve their assignment now; re-route requests whose path is gone."""
        view = self.view
        live = [p for node, p in view.profiles.items()
                if node in view.published and node not in suspects and p.rtt_s is not None]
        if view.plan is None or not live:
            return {}
        model, servers = planning.planner_inputs(live, self.config.num_blocks, self.config.expect)
        spans, capacity = [], {}
        for server in servers:
            assignment = view.published[server.id]
            serving = assignment.end > assignment.start and planning.server_matches(view.profiles[server.id],
                                                                                    assignment)
            spans.append((assignment.start, assignment.end) if serving else None)
            capacity[server.id] = assignment.cache_slots if serving else 0
        now = time.monotonic()
        failed: dict[str, Exception] = {}
        for request_id in self.router.update(model, servers, Placement(tuple(spans)), capacity):
            if self.router.submit(request_id, now) is None:
                self._requests.pop(request_id, None)
                failed[request_id] = NoChainsError("no path through the serving servers any more")
        return failed

    def submit(self, request_id, client_id, input_tokens, max_new_tokens, page_hashes, now):
        if self.router.submit(request_id, now) is None:
            raise NoChainsError("no path through the serving servers (WS-RR)")
        self._requests[request_id] = (client_id, input_tokens)

    def dispatch(self, now):
        peers = {node: p.peer_id for node, p in self.view.profiles.items()}
        grants = []
        for request_id, route in self.router.startable(now):
            client_id, input_tokens = self._requests.get(request_id, ("", 0))
            chain = RoutableChain(
                f"{self.view.plan_id}/ws-rr/{request_id[:12]}", -1, tuple(route.servers), tuple(route.spans), 1,
                route.service_time, tuple((peers.get(node, ""), a, b) for node, (a, b) in
                                          zip(route.servers, route.spans)), True)
            self._paths[request_id] = chain
            grants.append(Grant(request_id, client_id, chain.chain_id, 0, input_tokens, now))
        return grants

    def cancel(self, request_id, now):
        self._requests.pop(request_id, None)
        self._paths.pop(request_id, None)
        self.router.release(request_id)

    def chain(self, chain_id):
        path = next((c for c in self._paths.values() if c.chain_id == chain_id), None)
        return path or super().chain(chain_id)

    def free_slots(self):
        # the plan's chains carry no WS-RR sessions: a reroute finds all their slots free
        return {c.chain_id: c.capacity for c in self.view.chains if c.ready}

    def status(self):
        return {"ws_rr": self.router.status(), "queue": {}, "clients": {}}


# name -> implementation (the names are swarm.control.options.ROUTER_NAMES, the choices of --router)
ROUTERS: dict[str, type[Router]] = {"jffc": JffcRouter, "ws-rr": WsRrPaths}
