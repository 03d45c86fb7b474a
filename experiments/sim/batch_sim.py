"""Occupancy-dependent service in the simulators: servers whose sessions slow each other (issues 19/20).

The model is :mod:`planner.service_model`'s: a job on chain (or path) k whose servers hold n_j sessions runs
at rate 1/T_k(n), T_k(n) = T_k(1) + Σ_j m_kj·D_j·(g_j(n_j) − 1). Between events the occupancy is constant, so
every job in service progresses at a constant speed ``T_k(1)/T_k(n)`` of its time alone; when a job starts or
ends on a server, the speeds of the jobs sharing a batching server with it change and their completion times
are projected again. That is exact and event-driven (processor sharing between a server's sessions, weighted
by the batch curve), with no time step.

* :class:`SharedServers` — the occupancy, each job's speed and projected completion; a job whose path has no
  batching server always runs at speed 1, so its completion is ``start + duration`` exactly as in
  :func:`experiments.sim.simulator.simulate_chains` (with g ≡ 1 both give the same numbers, bit for bit).
* :func:`simulate_shared_chains` — chains with capacities under any :mod:`planner.dispatch` policy (JFFC by
  default), the central queue served at completions, like ``simulate_chains``; :func:`simulate_plan` takes a
  plan's chains and the swarm's servers.
* :class:`RequestClock` — the same for the request-level baselines of :mod:`experiments.sim.baseline_sim`
  (PETALS' and BPRR's paths), which use it when their servers batch.

Heaps may hold stale completions (a job projected again); they are recognised and skipped when popped.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from planner.dispatch import make_dispatcher
from planner.token_dispatch import TokenJFFC
from planner.service_model import ChainService, chain_services, has_batching, path_service
from experiments.sim.simulator import Jobs, SimResult


class SharedServers:
    """Jobs in service and the sessions each batching server holds (see the module doc)."""

    def __init__(self, num_servers: int):
        self.held = [0] * num_servers
        self._jobs_on: list[set] = [set() for _ in range(num_servers)]
        self._service: dict = {}
        self._speed: dict = {}
        self._finish: dict = {}
        self._factor = [1.0] * num_servers  # g_j(held_j), kept current

    def _speed_of(self, service: ChainService) -> float:
        if not service.servers:
            return 1.0
        extra = 0.0
        factor = self._factor
        for j, w in zip(service.servers, service.weights):
            extra += w * (factor[j] - 1.0)
        return service.solo / (service.solo + extra)

    def _occupy(self, service: ChainService, delta: int) -> set:
        touched = set()
        for j, g in zip(service.servers, service.curves):
            self.held[j] += delta
            self._factor[j] = g(self.held[j]) if self.held[j] > 0 else 1.0
            touched |= self._jobs_on[j]
        return touched

    def _reproject(self, jobs, t: float, out: list) -> None:
        for job in sorted(jobs):
            old, new = self._speed[job], self._speed_of(self._service[job])
            if new != old:
                remaining = (self._finish[job] - t) * old
                self._speed[job] = new
                self._finish[job] = t + remaining / new
                out.append((self._finish[job], job))

    def start(self, job, t: float, duration: float, service: ChainService) -> list[tuple[float, object]]:
        """``job`` starts at ``t`` and needs ``duration`` seconds alone; returns the (completion, job) pairs
        that are new or changed, this job's first."""
        touched = self._occupy(service, +1)
        for j in service.servers:
            self._jobs_on[j].add(job)
        speed = self._speed_of(service)
        self._service[job], self._speed[job] = service, speed
        self._finish[job] = t + duration if speed == 1.0 else t + duration / speed
        out = [(self._finish[job], job)]
        self._reproject(touched, t, out)
        return out

    def finish(self, job, t: float) -> list[tuple[float, object]]:
        """``job`` ended at ``t``; returns the changed (completion, job) pairs of the others."""
        service = self._service.pop(job)
        del self._speed[job], self._finish[job]
        for j in service.servers:
            self._jobs_on[j].discard(job)
        out: list = []
        self._reproject(self._occupy(service, -1), t, out)
        return out

    def current(self, job, t: float) -> bool:
        """Is ``t`` the job's current projected completion (False: a stale heap entry)?"""
        return self._finish.get(job) == t


def simulate_shared_chains(services: Sequence[ChainService], rates: Sequence[float], capacities: Sequence[int],
                           jobs: Jobs, policy: str = "jffc", *, num_servers: int, seed: int = 0,
                           service_matrix: np.ndarray | None = None, kv_budgets: Sequence[int] | None = None,
                           needs: Sequence[int] | None = None) -> SimResult:
    """Simulate ``jobs`` on chains (index = dispatch order, ``rates`` nonincreasing as the dispatchers
    require) whose service depends on occupancy: a job of size r needs r·T_k(1) seconds alone on chain k
    (``service_matrix[i, k]`` instead, when given) and progresses at speed T_k(1)/T_k(n(t)).

    With ``kv_budgets`` (KV tokens per block of each chain) and ``needs`` (each job's KV tokens), jobs are
    admitted by tokens as the orchestrator admits them (:class:`planner.token_dispatch.TokenJFFC`; JFFC only)."""
    caps = [int(c) for c in capacities]
    if not (len(services) == len(caps) == len(rates)) or not caps or sum(caps) == 0:
        raise ValueError("need one service, rate and capacity per chain, and some capacity")
    if (kv_budgets is None) != (needs is None) or (kv_budgets is not None and policy != "jffc"):
        raise ValueError("token admission needs both kv_budgets and needs, under jffc")
    n = len(jobs)
    solo = [s.solo for s in services]
    sizes = jobs.sizes.tolist()
    durations = None if service_matrix is None else np.asarray(service_matrix, dtype=np.float64).tolist()
    arrivals = jobs.arrivals.tolist()
    start, finish, chain_of = [0.0] * n, [0.0] * n, [-1] * n
    if kv_budgets is not None:
        disp = _TokenAdmission(TokenJFFC(list(rates), caps, list(kv_budgets)), [int(x) for x in needs])
    else:
        disp = _SlotAdmission(make_dispatcher(policy, list(rates), caps, seed=seed))
    engine = SharedServers(num_servers)
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop

    def begin(job: int, k: int, t: float) -> None:
        start[job], chain_of[job] = t, k
        need = sizes[job] * solo[k] if durations is None else durations[job][k]
        for when, other in engine.start(job, t, need, services[k]):
            push(heap, (when, other, chain_of[other]))

    i, inf = 0, float("inf")
    next_arrival = arrivals[0] if n else inf
    while heap or i < n:
        if heap and heap[0][0] <= next_arrival:
            t, job, k = pop(heap)
            if not engine.current(job, t):
                continue
            finish[job] = t
            for when, other in engine.finish(job, t):
                push(heap, (when, other, chain_of[other]))
            for started in disp.complete(k, job):
                begin(started.job, started.chain, t)
        else:
            k = disp.arrive(i)
            if k is not None:
                begin(i, k, next_arrival)
            i += 1
            next_arrival = arrivals[i] if i < n else inf
    return SimResult(jobs.arrivals.copy(), np.asarray(start), np.asarray(finish), np.asarray(chain_of))


class _SlotAdmission:
    """A :mod:`planner.dispatch` dispatcher behind the interface the loop above uses."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher

    def arrive(self, job: int) -> int | None:
        return self.dispatcher.arrive(job)

    def complete(self, chain: int, job: int) -> list:
        started = self.dispatcher.complete(chain)
        return [] if started is None else [started]


class _TokenAdmission:
    """:class:`TokenJFFC` behind the interface the loop above uses (each job's need looked up)."""

    def __init__(self, dispatcher: TokenJFFC, needs: list[int]):
        self.dispatcher, self.needs = dispatcher, needs

    def arrive(self, job: int) -> int | None:
        return self.dispatcher.arrive(job, self.needs[job])

    def complete(self, chain: int, job: int) -> list:
        return self.dispatcher.complete(chain, self.needs[job])


def simulate_plan(chains: Sequence, servers: Sequence, jobs: Jobs, policy: str = "jffc", *, seed: int = 0,
                  service_matrix: np.ndarray | None = None, slot_tokens: int | None = None,
                  needs: Sequence[int] | None = None) -> SimResult:
    """:func:`simulate_shared_chains` on planner chains (their order and rates) over planner ``servers``
    (whose ``batch`` and ``decode_time_s`` drive the speeds; the chains may come from a plan made with other
    server models, e.g. a plan made blind to batching run on batching servers). With ``slot_tokens`` and
    ``needs``, admission by tokens as the orchestrator's: chain k's budget is c_k · ``slot_tokens``."""
    budgets = None if slot_tokens is None else [ch.capacity * int(slot_tokens) for ch in chains]
    return simulate_shared_chains(chain_services(chains, servers), [ch.rate for ch in chains],
                                  [ch.capacity for ch in chains], jobs, policy, num_servers=len(servers),
                                  seed=seed, service_matrix=service_matrix, kv_budgets=budgets, needs=needs)


class RequestClock:
    """Completions of the request-level baselines (heap entries ``(time, 0, job)``) on batching servers."""

    def __init__(self, servers: Sequence):
        self.servers = servers
        self.engine = SharedServers(len(servers))

    @classmethod
    def for_servers(cls, servers: Sequence) -> "RequestClock | None":
        """A clock when some server batches (its occupancy changes service times), else None."""
        return cls(servers) if has_batching(tuple(servers)) else None

    def begin(self, heap: list, job: int, t: float, duration: float, path) -> None:
        """Start ``job`` on ``path`` (``.servers`` indices, ``.need`` blocks, ``.service_time`` alone)."""
        service = path_service(self.servers, path.servers, path.need, path.service_time)
        for when, other in self.engine.start(job, t, duration, service):
            heapq.heappush(heap, (when, 0, other))

    def ends(self, heap: list, job: int, t: float) -> bool:
        """A completion entry was popped: False if stale (skip it), else end the job and re-project."""
        if not self.engine.current(job, t):
            return False
        for when, other in self.engine.finish(job, t):
            heapq.heappush(heap, (when, 0, other))
        return True
