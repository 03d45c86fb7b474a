"""What the orchestrator is configured with and what it currently believes, read by its routers and its status.

:class:`OrchestratorConfig` is the options resolved for the served model; :class:`SwarmView` the profiles, plan,
assignments and chains of the last refresh. Both live below :mod:`swarm.control.orchestrator` so that the
routers (:mod:`swarm.control.routers`) can read them without importing the orchestrator.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple

from planner.plan import Plan
from swarm.control.options import OrchestratorOptions
from swarm.control.planning import Expectations, RoutableChain
from swarm.trust import records


@dataclass(kw_only=True)
class OrchestratorConfig(OrchestratorOptions):
    """The options resolved for the served model (:func:`swarm.service.build_config`): ``dht_prefix`` (never
    None here), the model's ``num_blocks`` and ``expect``, what the planning options come to
    (:func:`swarm.control.planning.expectations`; the orchestrator plans with ``expect`` only)."""

    num_blocks: int
    expect: Expectations
    assignment_ttl_s: float = 30.0
    # the secret that roots this orchestrator's prefix-hash namespace (swarm.trust.prefix)
    prefix_secret: bytes = field(default_factory=lambda: os.urandom(32))


class Suspicion(NamedTuple):
    """A server reported failed: when, and which process (peer id) failed. The suspicion is of that process: a
    record of the same node id under another peer id is the node restarted, and is planned at once — unless the
    node's previous process had failed too within the grace period (``repeated``): a node that keeps failing
    waits the grace period out, so that a crash loop does not re-plan the swarm at every restart."""

    since: float
    peer_id: str
    repeated: bool = False


@dataclass
class SwarmView:
    """What the orchestrator currently believes; rebuilt on every refresh (read by the HTTP layer)."""

    profiles: dict[str, records.ServerProfile] = field(default_factory=dict)
    plan: Plan | None = None
    plan_id: str | None = None
    plan_kept_ranges: bool = False
    plan_error: str | None = None
    plan_inputs: dict | None = None  # the planner's input for this plan, in `chainswarm plan --swarm` format
    assignments: dict[str, records.Assignment] = field(default_factory=dict)  # the plan's (the target)
    # what each server is told now: its target, or, while a re-plan moves the swarm in waves
    # (swarm.control.transition), the assignment it still serves
    published: dict[str, records.Assignment] = field(default_factory=dict)
    chains: list[RoutableChain] = field(default_factory=list)
