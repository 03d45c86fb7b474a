"""Token-level discrete-event simulation of a Chainswarm swarm under a fairness scheduler.

The swarm is a set of chains from a real GBP-CR + GCA plan (``plan_chains``):
chain k has c_k session slots; a session on k costs

    tfix_k + tpre_k * extend + tdec_k * o          (seconds)

where ``extend`` are the prompt tokens not found in chain k's prefix cache.
Per-token times come from the planner's mean service time T_k of the
reference job it was planned for (Azure "code": 2048 input, 28 output tokens)
with the §14.3 placeholder ratio tpre = tdec / 10, so T_k = tpre_k * 2048 +
tdec_k * 28 exactly (``chain_specs_from_plan``).

Each chain has its own prefix cache: a ``planner.prefix_index.PrefixIndex``
holder with an LRU page budget equal to the chain's KV pool (c_k sessions of
the planned context length).  At grant the simulator looks up the prompt's
cached pages on the chosen chain (the actual reuse, reported with
``on_prefill``), inserts the whole prompt (the KV being written; later
requests may reuse it at once, like SGLang's radix cache), and locks it until
the session ends (in-use pages are never evicted).

The scheduler is driven only through its public interface: ``submit`` when a
call becomes ready, ``dispatch(now)`` after every batch of simultaneous events,
``on_prefill`` at grant, ``on_tokens`` as tokens stream (first token, then
every ``token_report`` tokens, §15 Q26) and ``on_finish``.  Every number is a
pure function of the workload, the chains and the scheduler: no clocks, no
randomness here.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from experiments.paths import EXAMPLES
from planner.fairness import ChainSpec, CentralQueueScheduler
from planner.prefix_index import ChainPrefixMatcher, PrefixIndex

from experiments.sim.workloads import Call, PromptHasher, Workload

REF_INPUT, REF_OUTPUT = 2048, 28  # the planner's reference job (Azure code trace means)
PREFILL_RATIO = 0.1  # tpre = tdec / 10 (fairness-locality.md §14.3 placeholder)


# ------------------------------------------------------------------ chains
@dataclass(frozen=True)
class SwarmSetup:
    """Chains of a plan, ready for the simulator."""

    name: str
    chains: tuple  # ChainSpec, fastest first
    cache_tokens: dict  # chain id -> prefix-cache budget (tokens)
    server_kv_time: dict  # server -> relative KV read time (bfio mode)
    context_tokens: int
    plan_summary: dict

    @property
    def capacities(self) -> list:
        return [c.capacity for c in self.chains]

    def capacity_ref(self) -> float:
        """Swarm capacity in fastest-chain slot-seconds per second: sum_k c_k * tdec_1 / tdec_k."""
        fastest = min(c.decode_time for c in self.chains)
        return sum(c.capacity * fastest / c.decode_time for c in self.chains)

    def ref_times(self) -> tuple:
        fast = min(self.chains, key=lambda c: c.decode_time)
        return fast.prefill_time, fast.decode_time


def chain_specs_from_plan(plan, *, context_tokens: int, ref_input=REF_INPUT, ref_output=REF_OUTPUT,
                          prefill_ratio=PREFILL_RATIO) -> list:
    """One ``ChainSpec`` per plan chain (GCA order, fastest first): tdec_k =
    T_k / (ref_output + prefill_ratio * ref_input), tpre_k = prefill_ratio * tdec_k."""
    specs = []
    for k, ch in enumerate(plan.chains):
        tdec = ch.service_time / (ref_output + prefill_ratio * ref_input)
        specs.append(ChainSpec(chain_id=f"k{k}", capacity=int(ch.capacity), decode_time=tdec,
                               prefill_time=prefill_ratio * tdec, fixed_time=0.0,
                               max_length=context_tokens, servers=tuple(ch.servers)))
    return specs


def plan_chains(context_tokens: int = 8192, *, swarm_file: str | None = None) -> SwarmSetup:
    """GBP-CR + GCA plan of the LLaMA-2-7B 9-MIG swarm (chain-composition.md §9.7/§11,
    experiments/examples/swarm_small.json) for sessions of ``context_tokens``: the
    KV slot s_c is scaled from 32 MiB per block at 2048 tokens to the context
    length, so long contexts give fewer, longer slots."""
    import json
    from pathlib import Path

    from planner.model import ModelSpec
    from planner.plan import parse_swarm, plan

    path = Path(swarm_file) if swarm_file else EXAMPLES / "swarm_small.json"
    model, servers, rate, rho = parse_swarm(json.loads(path.read_text()))
    model = ModelSpec(model.num_blocks, model.block_size_gb, model.cache_slot_gb * context_tokens / 2048)
    p = plan(model, servers, rate, target_load=rho)
    specs = chain_specs_from_plan(p, context_tokens=context_tokens)
    cache = {s.chain_id: s.capacity * context_tokens for s in specs}
    kv_time = {s.id: s.compute_time_s for s in servers}
    summary = {
        "swarm": path.name,
        "model_blocks": model.num_blocks,
        "context_tokens": context_tokens,
        "cache_slot_gb": model.cache_slot_gb,
        "c": p.c,
        "total_capacity": p.total_capacity,
        "chains": [
            {"id": s.chain_id, "servers": list(ch.servers), "spans": [list(sp) for sp in ch.spans],
             "capacity": s.capacity, "service_time_s": ch.service_time, "tdec_s": s.decode_time,
             "tpre_s": s.prefill_time, "cache_tokens": cache[s.chain_id]}
            for s, ch in zip(specs, p.chains)
        ],
    }
    return SwarmSetup(f"llama2-7b-9mig-ctx{context_tokens}", tuple(specs), cache, kv_time, context_tokens, summary)


# ------------------------------------------------------------------ prefix match
class FastChainMatcher:
    """Same answer as ``ChainPrefixMatcher(index)`` for per-chain holders (the chain is
    its own holder), in O(log n) dictionary lookups instead of a walk over all n pages.

    Page hashes are chained (a page's hash covers the whole prefix up to it), so the
    index node holding ``hashes[d - 1]`` is on the query's path, and a holder that
    holds a node holds all its ancestors (insert adds the holder along the whole path,
    eviction removes leaves first, removal drops subtrees).  "Holds the first d pages"
    is therefore monotone in d and a binary search finds the longest match.  Reads the
    index's page -> node map; tests check it against the walking matcher call by call.
    Long-document QA prompts are ~1,340 pages, and the walk was 70 % of a run."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def __call__(self, request, chain_id: Hashable) -> int:
        hashes = getattr(request, "page_hashes", ())
        if not hashes:
            return 0
        where = self.index._where

        def held(d: int) -> bool:
            node = where.get(hashes[d - 1])
            return node is not None and chain_id in node.holders

        lo, hi = 0, len(hashes)  # held(lo) is true (d = 0); find the largest held d
        if held(hi):
            return hi * self.index.page_size
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if held(mid):
                lo = mid
            else:
                hi = mid
        return lo * self.index.page_size


# ------------------------------------------------------------------ results
@dataclass
class CallRecord:
    call: Call
    ready: float
    grant: float = math.nan
    chain: Hashable = None
    reused: int = 0
    first_token: float = math.nan
    finish: float = math.nan


@dataclass
class SimResult:
    service_events: list = field(default_factory=list)  # (t, client, su) actual service (scheduler hook)
    client_view_events: list = field(default_factory=list)  # (t, client, su) full input + 2 * output
    token_events: list = field(default_factory=list)  # (t, output tokens generated)
    backlog: dict = field(default_factory=dict)  # client -> [(start, end)] with a queued request
    records: dict = field(default_factory=dict)  # call id -> CallRecord
    program_end: dict = field(default_factory=dict)  # program id -> finish time of its last call
    violations: int = 0  # dispatch batches that left a free slot while a request waited
    batches: int = 0
    end_time: float = 0.0
    censored: int = 0  # calls unfinished at max_time
    input_tokens: int = 0
    reused_tokens: int = 0
    output_tokens: int = 0
    busy_slot_time: float = 0.0


# ------------------------------------------------------------------ simulator
class TokenSim:
    def __init__(
        self,
        scheduler: CentralQueueScheduler,
        setup: SwarmSetup,
        *,
        page_size: int = 16,
        token_report: int = 16,
        max_time: float = math.inf,
        hasher: PromptHasher | None = None,
        check_work_conservation: bool = False,
    ) -> None:
        self.sched = scheduler
        self.setup = setup
        self.page_size = page_size
        self.token_report = max(1, int(token_report))
        self.max_time = max_time
        self.hasher = hasher or PromptHasher(page_size)
        self.check_wc = check_work_conservation
        self.index = PrefixIndex(page_size)
        for spec in setup.chains:
            self.index.set_budget(spec.chain_id, setup.cache_tokens[spec.chain_id] // page_size)
        scheduler.set_chains(list(setup.chains))
        if scheduler.prefix_match is None:
            scheduler.prefix_match = FastChainMatcher(self.index)
        self.specs = {s.chain_id: s for s in setup.chains}
        self.result = SimResult()
        prev = scheduler.on_service

        def hook(t, client, amount):
            self.result.service_events.append((t, client, amount))
            if prev is not None:
                prev(t, client, amount)

        scheduler.on_service = hook

    def run(self, workload: Workload) -> SimResult:
        sched, res = self.sched, self.result
        calls = {c.call_id: c for c in workload.calls()}
        children: dict = {}
        waiting_parents: dict = {}
        for c in calls.values():
            waiting_parents[c.call_id] = len(c.parents)
            for p in c.parents:
                children.setdefault(p, []).append(c.call_id)
        program_left = {p.program_id: len(p.calls) for p in workload.programs}
        heap: list = []
        seq = 0

        def push(t, kind, payload):
            nonlocal seq
            seq += 1
            heapq.heappush(heap, (t, seq, kind, payload))

        for p in workload.programs:
            for c in p.calls:
                if not c.parents:
                    push(p.start, "ready", c.call_id)
        hashes: dict = {}
        running: dict = {}  # call id -> [emitted]
        open_backlog: dict = {}
        clients = list(workload.clients)
        t = 0.0
        while heap:
            t = heap[0][0]
            if t > self.max_time:
                break
            while heap and heap[0][0] == t:
                _, _, kind, payload = heapq.heappop(heap)
                if kind == "ready":
                    c = calls[payload]
                    h = self.hasher(c.segments)
                    hashes[c.call_id] = h
                    res.records[c.call_id] = CallRecord(c, t)
                    sched.submit(c.call_id, c.client, c.input_tokens, t, max_new_tokens=c.max_new_tokens,
                                 page_hashes=h)
                    if c.client not in open_backlog:
                        open_backlog[c.client] = t
                elif kind == "tokens":
                    cid, upto = payload
                    rec = res.records[cid]
                    emitted = running[cid]
                    sched.on_tokens(cid, upto - emitted, t)
                    res.client_view_events.append((t, rec.call.client, sched.weights.output * (upto - emitted)))
                    res.token_events.append((t, upto - emitted))
                    running[cid] = upto
                    if emitted == 0:
                        rec.first_token = t
                    if upto >= rec.call.output_tokens:
                        sched.on_finish(cid, t)
                        self.index.unlock(rec.chain, hashes[cid])
                        rec.finish = t
                        res.busy_slot_time += t - rec.grant
                        del running[cid]
                        pid = rec.call.program_id
                        program_left[pid] -= 1
                        if program_left[pid] == 0:
                            res.program_end[pid] = t
                        for child in children.get(cid, ()):
                            waiting_parents[child] -= 1
                            if waiting_parents[child] == 0:
                                push(t + calls[child].delay, "ready", child)
            for g in sched.dispatch(t):
                self._start(g, t, res, hashes, running, push)
            res.batches += 1
            free = sum(sched.free_slots().values())
            if free and any(sched.queue_lengths().values()):
                res.violations += 1
            if self.check_wc and not sched.work_conserving():
                res.violations += 1
            for client in clients:
                if client in open_backlog and not sched.is_backlogged(client):
                    res.backlog.setdefault(client, []).append((open_backlog.pop(client), t))
        for client, start in open_backlog.items():
            res.backlog.setdefault(client, []).append((start, t))
        res.end_time = t
        res.censored = sum(1 for r in res.records.values() if math.isnan(r.finish)) + sum(
            1 for cid in calls if cid not in res.records
        )
        return res

    def _start(self, g, t, res, hashes, running, push):
        rec = res.records[g.request_id]
        c = rec.call
        spec = self.specs[g.chain_id]
        h = hashes[c.call_id]
        reused = min(self.index.longest_match(g.chain_id, h, now=t) * self.page_size, c.input_tokens - 1)
        self.sched.on_prefill(c.call_id, reused, t)
        self.index.insert(g.chain_id, h, t)
        self.index.lock(g.chain_id, h)
        rec.grant, rec.chain, rec.reused = t, g.chain_id, reused
        res.input_tokens += c.input_tokens
        res.reused_tokens += reused
        res.output_tokens += c.output_tokens
        res.client_view_events.append((t, c.client, self.sched.weights.extend * c.input_tokens))
        running[c.call_id] = 0
        t0 = t + spec.fixed_time + spec.prefill_time * (c.input_tokens - reused)
        o = c.output_tokens
        marks = sorted({1, o, *range(self.token_report, o, self.token_report)})
        for m in marks:
            push(t0 + m * spec.decode_time, "tokens", (c.call_id, m))


def run_workload(scheduler: CentralQueueScheduler, setup: SwarmSetup, workload: Workload, **kwargs) -> SimResult:
    return TokenSim(scheduler, setup, **kwargs).run(workload)


def chains_total(chains: Sequence[ChainSpec]) -> int:
    return sum(c.capacity for c in chains)
