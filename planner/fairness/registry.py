"""Build a scheduler from a policy name (CLI ``--policy``)."""

from __future__ import annotations

from .base import CentralQueueScheduler
from .dlpm import DLPMScheduler, LPMScheduler, SwarmScheduler
from .fcfs import FCFSScheduler, RPMLimitScheduler
from .vtc import LCFScheduler, VTCScheduler

POLICIES = {
    "fcfs": FCFSScheduler,
    "rpm": RPMLimitScheduler,
    "lpm": LPMScheduler,
    "vtc": VTCScheduler,
    "lcf": LCFScheduler,
    "dlpm": DLPMScheduler,
    "swarm": SwarmScheduler,
}


def make_scheduler(policy: str, **options) -> CentralQueueScheduler:
    """``fcfs | rpm | lpm | vtc | lcf | dlpm | swarm | bfio`` -> a scheduler.

    ``bfio`` is the swarm policy with the BF-IO chain selector (§14.7).  Options
    are passed to the constructor (e.g. ``quantum``, ``chain_quantum``,
    ``prefix_match``, ``limit_rpm``, ``chain_mode``)."""
    name = policy.strip().lower()
    if name == "bfio":
        options.setdefault("chain_mode", "bfio")
        return SwarmScheduler(**options)
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown fairness policy {policy!r}; expected one of {sorted([*POLICIES, 'bfio'])}") from None
    return cls(**options)
