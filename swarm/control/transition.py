"""Make-before-break re-planning, the orchestrator's side: which assignment each server is told while the swarm
moves from one plan to the next, and which chains route meanwhile (the wave rule: :func:`planner.transition.next_wave`).

The view keeps two maps: ``assignments`` (the new plan's, the *target*) and ``published`` (what each server is
told now). On a re-plan (:meth:`Transition.begin`) a server that holds no blocks, that does not serve what it was
told, or whose range and pool do not change is told its target at once; every other server (a *mover*) is still
told its old assignment, so it keeps serving its old range. While movers remain, requests route on the *interim*
chains: GCA over what the servers serve at that moment (old ranges and new ranges already loaded), recomposed
whenever that changes (:meth:`Transition.chains`). Every refresh (:meth:`Transition.advance`) releases the next
wave of movers; when the last one serves its new range the transition ends and the plan's own chains route.

Cost: no memory beyond the plans' own (a server serves one range at a time; a mover keeps its old range until it
is released), and time: a transition takes one drain and one load per wave instead of one in all.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from planner.plan import Plan
from planner.transition import DEFAULT_KEEP, next_wave
from swarm.control.planning import RoutableChain, new_plan_id, routable_chains, server_matches
from swarm.control.view import SwarmView

Compose = Callable[[Mapping[str, "tuple[int, int] | None"]], "Plan | None"]
"""GCA (and the bounds) over a placement ``{node: (start, end) or None}`` of the planned servers; None when it
forms no chain."""

DEFAULT_WAVE_TIMEOUT_S = 180.0
"""A released server that does not serve its new range this long after its release (it failed to load, or it
drains long sessions) no longer holds the next wave back."""


@dataclass
class Transition:
    """The move in progress, if any. ``keep``: a wave keeps at least this share of the routable capacity
    (0: break-before-make, every server told its target at once)."""

    keep: float = DEFAULT_KEEP
    wave_timeout_s: float = DEFAULT_WAVE_TIMEOUT_S
    from_plan: str | None = None  # the plan id the swarm moves away from (None: no transition)
    released: dict[str, float] = field(default_factory=dict)  # node -> when it was told to move
    started: float | None = None
    waves: int = 0
    _interim: tuple | None = None  # (the compose it came from, served placement, interim plan id, its plan)

    @property
    def active(self) -> bool:
        return self.from_plan is not None

    def reset(self, view: SwarmView) -> None:
        """No transition: every server is told its target."""
        self.from_plan, self.released, self.started, self.waves, self._interim = None, {}, None, 0, None
        view.published = dict(view.assignments)

    def begin(self, view: SwarmView, replaced: str | None, now: float | None = None) -> list[str]:
        """``view`` holds the new plan, which replaces plan ``replaced`` (None: the first plan). Returns the
        movers kept on their old ranges."""
        now = time.monotonic() if now is None else now
        if replaced is None or self.keep <= 0:
            self.reset(view)
            return []
        told, pending = {}, []
        for node, target in view.assignments.items():
            current = view.published.get(node)
            in_place = target.in_place_of(current)
            if (current is None or current.num_blocks == 0 or in_place is not None
                    or not server_matches(view.profiles.get(node), current)):
                told[node] = target
                if in_place is None and target.num_blocks:
                    self.released[node] = now
            else:
                told[node] = current
                pending.append(node)
                self.released.pop(node, None)  # told to stay: not moving (any more)
        if not pending:  # nothing to keep serving: every server is told its target (break-before-make is free)
            self.reset(view)
            return []
        view.published = told
        self.released = {n: t for n, t in self.released.items() if n in view.assignments}
        self.from_plan = self.from_plan or replaced
        self.started = now if self.started is None else self.started
        return sorted(pending)

    def advance(self, view: SwarmView, compose: Compose, now: float | None = None) -> list[tuple[str, dict]]:
        """Release the next wave once the previous one serves; the events to record (``transition_wave``,
        ``transition_done``)."""
        if not self.active or view.plan is None:
            return []
        now = time.monotonic() if now is None else now
        target, told = view.assignments, view.published
        pending = {n for n, a in told.items() if n in target and a != target[n]}
        serving_new = {n for n, a in target.items() if server_matches(view.profiles.get(n), a)}
        in_transit = {n for n, t in self.released.items()
                      if n in target and n not in serving_new and now - t < self.wave_timeout_s}
        if not pending and not in_transit:
            events = [("transition_done", {"plan_id": view.plan_id, "from_plan": self.from_plan, "waves": self.waves,
                                           "seconds": round(now - (self.started or now), 1)})]
            self.reset(view)
            return events
        served = self.served(view)

        def capacity(without) -> int:
            plan = compose({n: None if n in without else span for n, span in served.items()})
            return 0 if plan is None else sum(ch.capacity for ch in plan.chains)

        wave = next_wave(pending, in_transit, capacity, self.keep)
        if not wave.release:
            return []
        for node in wave.release:
            told[node] = target[node]
            self.released[node] = now
        self.waves += 1
        return [("transition_wave", {"plan_id": view.plan_id, "nodes": sorted(wave.release), "gap": wave.gap,
                                     "still_on_old_ranges": sorted(pending - wave.release)})]

    @staticmethod
    def served(view: SwarmView) -> dict[str, tuple[int, int] | None]:
        """What each planned server serves now and is still told to: its range, or None."""
        out = {}
        for node in view.assignments:
            told = view.published.get(node)
            serving = told is not None and told.num_blocks > 0 and server_matches(view.profiles.get(node), told)
            out[node] = (told.start, told.end) if serving else None
        return out

    def chains(self, view: SwarmView, compose: Compose) -> list[RoutableChain]:
        """The interim chains (GCA over what is served now) while a transition runs; [] otherwise."""
        if not self.active:
            return []
        served = self.served(view)
        key = tuple(sorted(served.items(), key=lambda item: item[0]))
        if self._interim is None or self._interim[0] is not compose or self._interim[1] != key:  # a re-plan: a new compose
            self._interim = (compose, key, f"{new_plan_id()}-interim", compose(served))
        _, _, plan_id, plan = self._interim
        if plan is None:
            return []
        return routable_chains(plan, plan_id, view.profiles, view.published)

    def status(self, view: SwarmView) -> dict[str, Any] | None:
        if not self.active:
            return None
        return {"from_plan": self.from_plan, "to_plan": view.plan_id, "waves": self.waves,
                "on_old_ranges": sorted(n for n, a in view.published.items()
                                        if n in view.assignments and a != view.assignments[n]),
                "moving": sorted(self.released), "interim_plan": None if self._interim is None else self._interim[2]}
