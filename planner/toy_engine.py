"""A tiny deterministic discrete-time serving engine for tests and examples.

It is the "T1" engine of fairness-locality.md §13.0 generalised to several
chains: time advances in whole decode steps; at each step the engine first
submits the arrivals of that step, then runs a dispatch round of the scheduler
(admission; prefill is instantaneous, the prompt is inserted into the chain's
prefix cache, LRU eviction of whole leaf nodes under a token budget), then
every running request emits one output token every ``period`` steps of its
chain (charged as it is generated) and finishes after its o-th token; the
next admission follows at once.

Pure: no clocks, no I/O; the scheduler is driven exactly as the orchestrator
drives it (submit, dispatch, on_prefill, on_tokens, on_finish).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from .fairness.base import CentralQueueScheduler
from .fairness.types import ChainSpec
from .prefix_index import ChainPrefixMatcher, PrefixIndex, page_hashes


@dataclass(frozen=True)
class ToyRequest:
    request_id: Hashable
    client_id: Hashable
    tokens: tuple  # prompt token ids
    output_tokens: int  # o(r), revealed only by generation
    arrival: int = 0  # step
    max_new_tokens: int | None = None


@dataclass
class ToyTrace:
    order: list = field(default_factory=list)  # request ids in grant order
    grants: list = field(default_factory=list)  # (time, request_id, chain_id, matched, extend)
    service_events: list = field(default_factory=list)  # (time, client, amount) actual service
    backlog: dict = field(default_factory=dict)  # client -> [(start, end)] of non-empty queue
    finish_time: dict = field(default_factory=dict)
    violations: list = field(default_factory=list)  # times where a free slot idled with a fitting request waiting
    end_time: int = 0
    states: list = field(default_factory=list)  # optional per-step snapshots from ``observe``

    @property
    def total_extend(self) -> int:
        return sum(g[4] for g in self.grants)


class ToyEngine:
    def __init__(
        self,
        scheduler: CentralQueueScheduler,
        chains: Sequence[ChainSpec],
        *,
        page_size: int = 1,
        cache_tokens: int | None = None,
        periods: dict | None = None,
        observe=None,
    ) -> None:
        self.scheduler = scheduler
        self.chains = list(chains)
        self.page_size = page_size
        budget = None if cache_tokens is None else cache_tokens // page_size
        self.cache = PrefixIndex(page_size, default_budget=budget)
        self.periods = periods or {c.chain_id: max(1, int(round(c.decode_time))) for c in self.chains}
        self.observe = observe  # callable(time, scheduler) after each dispatch round
        scheduler.set_chains(self.chains)
        if scheduler.prefix_match is None:
            scheduler.prefix_match = ChainPrefixMatcher(self.cache)
        self.trace = ToyTrace()
        prev = scheduler.on_service

        def hook(time, client, amount):
            self.trace.service_events.append((time, client, amount))
            if prev is not None:
                prev(time, client, amount)

        scheduler.on_service = hook

    def run(self, requests: Sequence[ToyRequest], max_steps: int = 1_000_000) -> ToyTrace:
        sched, trace = self.scheduler, self.trace
        pending = sorted(requests, key=lambda r: r.arrival)  # stable: list order within a step
        by_id = {r.request_id: r for r in requests}
        hashes = {r.request_id: page_hashes(r.tokens, self.page_size) for r in requests}
        running: dict = {}  # rid -> [start, emitted]
        open_backlog: dict = {}
        i, t = 0, 0
        while t <= max_steps:
            while i < len(pending) and pending[i].arrival <= t:
                r = pending[i]
                i += 1
                accepted = sched.submit(
                    r.request_id, r.client_id, len(r.tokens), t,
                    max_new_tokens=r.max_new_tokens, page_hashes=hashes[r.request_id],
                )
                if accepted and r.client_id not in open_backlog:
                    open_backlog[r.client_id] = t
            grants = sched.dispatch(t)
            # prefills of one round run concurrently: each sees the cache as it was
            # before the round (what the scheduler matched against), then all insert
            reused = {
                g.request_id: min(
                    self.cache.longest_match(g.chain_id, hashes[g.request_id], now=t) * self.page_size,
                    len(by_id[g.request_id].tokens) - 1,
                )
                for g in grants
            }
            for g in grants:
                actual = reused[g.request_id]
                sched.on_prefill(g.request_id, actual, t)
                self.cache.insert(g.chain_id, hashes[g.request_id], t)
                trace.order.append(g.request_id)
                trace.grants.append((t, g.request_id, g.chain_id, actual, len(by_id[g.request_id].tokens) - actual))
                running[g.request_id] = [t, 0]
            for client, start in list(open_backlog.items()):
                if not sched.is_backlogged(client):
                    trace.backlog.setdefault(client, []).append((start, t))
                    del open_backlog[client]
            if not sched.work_conserving():
                trace.violations.append(t)
            if self.observe is not None:
                self.observe(t, sched)
            if not running and i >= len(pending) and not any(sched.queue_lengths().values()):
                break
            t += 1
            for rid in list(running):
                start, emitted = running[rid]
                chain = sched.request(rid).chain_id
                if (t - start) % self.periods[chain] == 0:
                    emitted += 1
                    running[rid][1] = emitted
                    sched.on_tokens(rid, 1, t)
                    if emitted >= by_id[rid].output_tokens:
                        sched.on_finish(rid, t)
                        trace.finish_time[rid] = t
                        del running[rid]
        for client, start in open_backlog.items():
            trace.backlog.setdefault(client, []).append((start, t))
        trace.end_time = t
        return trace
