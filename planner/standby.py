"""Standby chains: servers a plan leaves idle hold whole extra chains, so a failure leaves a chain that serves.

A plan chosen for response time (GBP-CR's stopping rule, or auto at light load) can leave many servers with no
blocks. Under churn that is the swarm's weak spot: when a server of a chain leaves, no other server holds its
blocks, and until one loads them (about 6 s per BLOOM-176B block) the broken chain serves nothing — with one
chain, nothing serves at all (planner/replan.py's repair then loads them on an idle server).

:func:`add_standby_chains` stacks the idle servers into extra chains, disjoint from the plan's and from each
other: idle servers are taken most blocks first (the fewest hops), each hosting as many consecutive blocks as
its memory allows with cache for ``cache_jobs`` jobs on each, until they cover the L blocks; a chain that
cannot be completed is not started (its servers stay idle). The plan's own spans are unchanged, so GCA keeps
the plan's chains and gains the extra ones, and JFFC sends a job to a chain only when every faster one is full:
extra chains add capacity where the plan's is used up. What they cost is the blocks loaded once, on memory the
volunteers offered anyway (and the orchestrator's choice stays the plan's: standby is applied after it).

Pure: no I/O, deterministic for a given input (ties by server order).
"""
from __future__ import annotations

from typing import Sequence

from planner.model import ModelSpec, Placement, Server, max_blocks, validate_servers


def add_standby_chains(model: ModelSpec, servers: Sequence[Server], placement: Placement, *,
                       cache_jobs: int = 1, max_chains: int | None = None) -> Placement:
    """``placement`` with its idle servers stacked into at most ``max_chains`` (all: None) extra chains."""
    servers = validate_servers(servers)
    if len(placement.spans) != len(servers):
        raise ValueError("the placement must give a span (or None) for every server")
    if cache_jobs < 1:
        raise ValueError("cache_jobs must be >= 1")
    spans = list(placement.spans)
    room = {j: max_blocks(servers[j], model, cache_jobs) for j, span in enumerate(spans) if span is None}
    pool = sorted((j for j, m in room.items() if m > 0),
                  key=lambda j: (-room[j], servers[j].compute_time_s, servers[j].comm_time_s, j))
    L, made = model.num_blocks, 0
    while pool and sum(room[j] for j in pool) >= L and (max_chains is None or made < max_chains):
        start, used = 0, []
        for j in pool:
            take = min(room[j], L - start)
            used.append((j, (start, start + take)))
            start += take
            if start == L:
                break
        for j, span in used:
            spans[j] = span
        taken = {j for j, _ in used}
        pool = [j for j in pool if j not in taken]
        made += 1
    return Placement(tuple(spans))
