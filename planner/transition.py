"""Make-before-break re-planning: which servers may move to the new plan now (issue 29, item 2).

A petals server serves one contiguous range and reloads to change it; while it drains and loads, every chain
through it is down. Moving every server of a new plan at once (break-before-make) leaves the swarm without a
chain for the longest reload when the new placement moves the blocks a surviving chain holds. The orchestrator
instead tells the servers to move in **waves** (:func:`next_wave`):

* a server whose range and KV pool do not change adopts the new plan at once (no reload), and a server that holds
  no blocks (a joiner, an idle one) starts loading its new range at once (nothing is lost);
* a *mover* (a server that must reload) keeps serving its old range until it is released; meanwhile requests
  route on the chains GCA composes from what the servers serve at that moment (old ranges, and new ranges already
  loaded). A wave releases movers while those chains, composed without them, keep at least ``keep`` × the
  capacity Σ c_k routable at the wave's start (and at least one chain): movers that cost the least capacity go
  first;
* the next wave starts when every server of the previous one serves its new range;
* when no mover can go without taking the last chain down (each is the only holder of blocks every chain needs)
  and nothing is loading, all remaining movers go at once: the gap is unavoidable, and this keeps it to one
  reload (the caller reports it).

Pure: no I/O, deterministic (ties by server name).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet, Callable

DEFAULT_KEEP = 0.5
"""A wave keeps at least this share of the routable capacity Σ c_k it started with."""


Capacity = Callable[[AbstractSet[str]], int]
"""Σ c_k of the chains GCA composes from what the servers serve now, with the given servers holding nothing."""


@dataclass(frozen=True)
class Wave:
    """Movers to release now; ``gap`` when they take the last routable chain down (no wave could avoid it)."""

    release: frozenset[str]
    gap: bool = False


def next_wave(pending: AbstractSet[str], in_transit: AbstractSet[str], capacity: Capacity,
              keep: float = DEFAULT_KEEP) -> Wave:
    """The movers of ``pending`` (servers still on their old range, waiting to move) to release now.

    ``in_transit``: servers released earlier that do not serve their new range yet (no new wave before they
    do). ``capacity(without)``: the routable capacity if the servers ``without`` held nothing.
    """
    if not pending or in_transit:
        return Wave(frozenset())
    start = capacity(frozenset())
    if start <= 0:
        return Wave(frozenset(pending))  # nothing routes: nothing to keep
    floor = max(1, math.ceil(keep * start))
    loss = {server: start - capacity(frozenset({server})) for server in pending}
    released: set[str] = set()
    for server in sorted(pending, key=lambda s: (loss[s], s)):
        if capacity(frozenset(released | {server})) >= floor:
            released.add(server)
    if released:
        return Wave(frozenset(released))
    return Wave(frozenset(pending), gap=True)
