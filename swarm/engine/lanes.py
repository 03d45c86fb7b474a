"""The engine's batches of sessions: one :class:`swarm.engine.batching.ChainGenerator` per chain and lane.

``--batch-lanes L`` spreads a chain's sessions over L cohorts, each stepped through the chain on its own (a new
session joins the least busy lane), so one cohort's step on a server overlaps another's on the next; together the
lanes hold at most ``--batch-sessions`` sessions of a chain. A lane whose generator broke (a server of its route
failed) gets a new one; the generators of routes that no plan uses any more are closed once idle for
:data:`GENERATOR_IDLE_S`. Their step counts outlive them (the metrics' mean batch).
"""
from __future__ import annotations

import threading
from typing import Callable

from swarm.engine.batching import ChainGenerator

GENERATOR_IDLE_S = 120.0  # a chain's generator unused this long is closed when another chain's is needed


class ChainLanes:
    """The live generators by (route, lane). Thread-safe."""

    def __init__(self, model, *, lanes: int, sessions: int, step_timeout: float,
                 batch_bound: Callable[[tuple], int | None], route_ends: Callable[[tuple], bool] = lambda r: False):
        if lanes < 1:
            raise ValueError("batch_lanes must be >= 1")
        self.model, self.lanes, self.step_timeout, self.batch_bound = model, int(lanes), step_timeout, batch_bound
        self.route_ends = route_ends  # route -> its servers run the embeddings, head and choice (server.ends)
        self.lane_sessions = -(-int(sessions) // self.lanes)  # per lane: the chain's total stays bounded
        self._generators: dict[tuple, ChainGenerator] = {}  # (route, lane) -> that lane's batch of sessions
        self._lock = threading.Lock()
        self._retired = {"steps": 0, "sequence_steps": 0, "chosen_steps": 0}  # of generators replaced or closed

    def get(self, route: tuple) -> ChainGenerator:
        """The chain's batch of sessions in its least busy lane (a new one if that lane has none, or its last one
        broke)."""
        done = []  # replaced or long idle (routes of earlier plans): closed outside the lock (a bounded wait)
        with self._lock:
            for key, generator in list(self._generators.items()):
                if (key[0] == route and not generator.usable) or (key[0] != route
                                                                   and generator.idle_s() > GENERATOR_IDLE_S):
                    done.append(self._generators.pop(key))
                    self._retire(done[-1])
            lanes = [self._generators.get((route, lane)) for lane in range(self.lanes)]
            lane = min(range(self.lanes), key=lambda i: lanes[i].sessions() if lanes[i] is not None else 0)
            generator = lanes[lane]
            if generator is None:
                generator = self._generators[(route, lane)] = ChainGenerator(
                    self.model, route, max_sessions=self.lane_sessions, step_timeout=self.step_timeout,
                    step_positions=self.batch_bound(route) or ChainGenerator.STEP_POSITIONS,
                    ends=self.route_ends(route))
        for old in done:
            old.close()
        return generator

    def _retire(self, generator: ChainGenerator) -> None:
        self._retired["steps"] += generator.steps
        self._retired["sequence_steps"] += generator.stepped_sequences
        self._retired["chosen_steps"] += generator.chosen_steps

    def stats(self) -> dict:
        """Chain steps run, the session-steps they carried (÷: the mean batch), the live generators (one per chain
        and lane) and the fewest positions one of them fills with drafts."""
        with self._lock:
            live = list(self._generators.values())
            steps = self._retired["steps"] + sum(g.steps for g in live)
            sequence_steps = self._retired["sequence_steps"] + sum(g.stepped_sequences for g in live)
            chosen_steps = self._retired["chosen_steps"] + sum(g.chosen_steps for g in live)
        return {"steps": steps, "sequence_steps": sequence_steps, "chosen_steps": chosen_steps, "generators": len(live),
                "step_positions": min((g.step_positions for g in live), default=0)}

    def close(self) -> None:
        """Close every generator (each a bounded wait)."""
        with self._lock:
            generators, self._generators = list(self._generators.values()), {}
            for generator in generators:
                self._retire(generator)
        for generator in generators:
            generator.close()
