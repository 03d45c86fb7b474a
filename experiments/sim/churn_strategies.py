"""What each re-planning strategy does when servers join and leave (the churn experiment, issue 20 item 5).

Every strategy maps the servers present now and the spans they hold (loaded or loading) to the spans
they should hold; a server whose span changes reloads it (experiments/figures/churn.py charges the time).

* :class:`Incremental`: planner/replan.py — survivors keep their ranges, the previous chains' missing
  segments go to idle servers, a fresh auto plan only when it predicts a clearly better response time.
* :class:`IncrementalStandby`: the same, and after every plan the servers it leaves idle hold standby chains
  (planner/standby.py), so that a leaving server's blocks are usually held elsewhere already;
  :class:`IncrementalReserve` holds those chains in reserve: they take jobs only while no other chain is up.
* :class:`Scratch`: a fresh plan (auto or GBP-CR with tuned c*) at every change, whatever it moves.
* :class:`PetalsRebalancing`: petals 2.2's own block selection, with its functions
  (``petals.server.block_selection``, imported through ``swarm.model.compat``) applied to module infos built
  from the spans held: a joining server takes ``choose_best_blocks`` for its memory-sized span; every
  server checks ``should_choose_other_blocks`` (balance quality 0.75) at intervals drawn uniformly from
  [0, 2·120 s] (petals' defaults), and when it says so the server drops its blocks and loads the span
  ``choose_best_blocks`` then gives it (petals restarts its module container: the whole span reloads).
  Leaving servers trigger nothing. Served over GCA chains with petals' fixed per-server KV pools.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from planner.allocation import gca
from planner.baselines import petals_num_blocks, petals_throughput
from planner.model import Chain, ModelSpec, Placement, Server, Span
from planner.plan import plan
from planner.replan import DEFAULT_TOLERANCE, auto_fresh, incremental_replan
from planner.standby import add_standby_chains
from planner.tuning import InfeasibleError

Spans = dict[str, Span | None]

STRATEGIES = ("incremental", "incremental + standby", "incremental + reserve", "scratch (auto)", "scratch (gbp-cr)",
              "petals rebalancing")
"""The strategies the churn experiment compares (experiments/figures/churn.py), in report order."""

PETALS_CHECK_PERIOD_S = 120.0
"""petals' ``mean_balance_check_period``."""
PETALS_BALANCE_QUALITY = 0.75
PETALS_CACHE_SLOTS_PER_BLOCK = 2
"""planner.baselines.petals_placement's KV pool per block, in slots of s_c."""


@dataclass(frozen=True)
class Context:
    model: ModelSpec
    arrival_rate: float
    target_load: float
    tolerance: float = DEFAULT_TOLERANCE


def _spans(servers: Sequence[Server], placement: Placement) -> Spans:
    return {s.id: span for s, span in zip(servers, placement.spans)}


@dataclass
class Incremental:
    name: str = "incremental"
    decisions: Counter = field(default_factory=Counter)
    chains: tuple[Chain, ...] = ()
    periodic: bool = False

    def start(self, ctx: Context, present: Sequence[Server]) -> Spans:
        placement = auto_fresh(ctx.model, present, ctx.arrival_rate, ctx.target_load)
        return self._adopt(ctx, present, placement, gca(ctx.model, present, placement).chains, fresh=True)

    def change(self, ctx: Context, present: Sequence[Server], held: Spans, joined: str | None) -> Spans:
        r = incremental_replan(ctx.model, present, held, self.chains, ctx.arrival_rate, ctx.target_load,
                               tolerance=ctx.tolerance)
        self.decisions[r.strategy] += 1
        return self._adopt(ctx, present, r.placement, r.allocation.chains, fresh=r.strategy == "fresh")

    def _adopt(self, ctx: Context, present: Sequence[Server], placement: Placement, chains: Sequence[Chain], *,
               fresh: bool) -> Spans:
        """Run ``placement`` (GCA's ``chains`` over it) from now on; ``fresh``: every span is new."""
        self.chains = tuple(chains)
        return _spans(present, placement)

    def slot_budget(self, ctx: Context, servers: Sequence[Server], spans) -> None:
        return None

    def serving(self, chains: Sequence[Chain]) -> Sequence[Chain]:
        """The chains that take jobs (all of them)."""
        return chains


@dataclass
class IncrementalStandby(Incremental):
    name: str = "incremental + standby"

    reserve: set = field(default_factory=set)  # the servers given standby spans (and still holding them)

    def _adopt(self, ctx: Context, present: Sequence[Server], placement: Placement, chains: Sequence[Chain], *,
               fresh: bool) -> Spans:
        if fresh:  # everyone's span is new: the standby set starts over
            self.reserve = set()
        self.reserve &= {s.id for s in present}
        extended = add_standby_chains(ctx.model, present, placement)
        self.reserve |= {s.id for s, a, b in zip(present, placement.spans, extended.spans) if a is None and b}
        return super()._adopt(ctx, present, extended, gca(ctx.model, present, extended).chains, fresh=fresh)


@dataclass
class IncrementalReserve(IncrementalStandby):
    """Standby chains held in reserve: they take jobs only while no chain without a standby server is up."""

    name: str = "incremental + reserve"

    def serving(self, chains: Sequence[Chain]) -> Sequence[Chain]:
        primary = [c for c in chains if not self.reserve & set(c.servers)]
        return primary or chains


@dataclass
class Scratch:
    placement: str = "auto"
    decisions: Counter = field(default_factory=Counter)
    periodic: bool = False

    @property
    def name(self) -> str:
        return f"scratch ({self.placement})"

    def _plan(self, ctx: Context, present: Sequence[Server], held: Spans) -> Spans:
        try:
            p = plan(ctx.model, present, ctx.arrival_rate, target_load=ctx.target_load,
                     placement="gbp-cr" if self.placement == "gbp-cr" else "auto")
        except InfeasibleError:  # no chain can be formed: servers keep what they hold
            self.decisions["infeasible"] += 1
            return dict(held)
        self.decisions["fresh"] += 1
        return _spans(present, p.placement)

    def start(self, ctx: Context, present: Sequence[Server]) -> Spans:
        return self._plan(ctx, present, {})

    def change(self, ctx: Context, present: Sequence[Server], held: Spans, joined: str | None) -> Spans:
        return self._plan(ctx, present, held)

    def slot_budget(self, ctx: Context, servers: Sequence[Server], spans) -> None:
        return None

    def serving(self, chains: Sequence[Chain]) -> Sequence[Chain]:
        return chains


class PetalsRebalancing:
    """petals' join-time block choice and periodic rebalancing (see the module docstring)."""

    name = "petals rebalancing"
    periodic = True

    def __init__(self, seed: int):
        from swarm.model.compat import petals  # noqa: F401  (petals through the compatibility shim)
        from hivemind import PeerID
        from petals.data_structures import RemoteModuleInfo, ServerInfo, ServerState
        from petals.server import block_selection

        self._sel, self._info, self._module, self._state, self._peer = (
            block_selection, ServerInfo, RemoteModuleInfo, ServerState, PeerID)
        self.rng = np.random.default_rng(seed)
        self.decisions: Counter = Counter()

    def _blocks(self, ctx: Context, server: Server) -> int:
        return petals_num_blocks(server, ctx.model, cache_slots_per_block=PETALS_CACHE_SLOTS_PER_BLOCK)

    def _infos(self, ctx: Context, present: Sequence[Server], held: Spans, ready: set[str], skip: str | None):
        servers: list[dict] = [{} for _ in range(ctx.model.num_blocks)]
        for s in present:
            span = held.get(s.id)
            if span is None or s.id == skip:
                continue
            state = self._state.ONLINE if s.id in ready else self._state.JOINING
            info = self._info(state=state, throughput=float(petals_throughput(s, span[1] - span[0])),
                              start_block=span[0], end_block=span[1])
            for b in range(*span):
                servers[b][self._peer(s.id.encode())] = info
        return [self._module(uid=f"model.{b}", servers=servers[b]) for b in range(ctx.model.num_blocks)]

    def _choose(self, ctx: Context, server: Server, present, held, ready) -> Span | None:
        m = self._blocks(ctx, server)
        if m == 0:
            return None
        blocks = self._sel.choose_best_blocks(m, self._infos(ctx, present, held, ready, skip=server.id))
        return (blocks[0], blocks[-1] + 1)

    def start(self, ctx: Context, present: Sequence[Server]) -> Spans:
        held: Spans = {}
        for s in present:  # servers join one at a time, each seeing the ones before it
            held[s.id] = self._choose(ctx, s, present, held, set(held))
        return held

    def change(self, ctx: Context, present: Sequence[Server], held: Spans, joined: str | None) -> Spans:
        out = dict(held)
        if joined is not None:
            server = next(s for s in present if s.id == joined)
            out[joined] = self._choose(ctx, server, present, held, {s for s in held if held[s] is not None})
            self.decisions["join"] += 1
        return out

    def next_check(self) -> float:
        return float(self.rng.uniform(0.0, 2 * PETALS_CHECK_PERIOD_S))

    def check(self, ctx: Context, server: Server, present, held: Spans, ready: set[str]) -> Span | None | bool:
        """After ``server``'s periodic check: False (it stays), or the span it reloads (even the same one:
        petals restarts its module container)."""
        span = held.get(server.id)
        if span is None or server.id not in ready:
            return False
        np.random.seed(int(self.rng.integers(2**31)))  # should_choose_other_blocks shuffles with np.random
        infos = self._infos(ctx, present, held, ready, skip=None)
        if not self._sel.should_choose_other_blocks(self._peer(server.id.encode()), infos, PETALS_BALANCE_QUALITY):
            return False
        self.decisions["rebalance"] += 1
        return self._choose(ctx, server, present, held, ready)

    def serving(self, chains: Sequence[Chain]) -> Sequence[Chain]:
        return chains

    def slot_budget(self, ctx: Context, servers: Sequence[Server], spans) -> list[int]:
        return [0 if sp is None else (sp[1] - sp[0]) * PETALS_CACHE_SLOTS_PER_BLOCK for sp in spans]
