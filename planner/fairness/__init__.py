"""Fair, locality-aware scheduling for the orchestrator's central queue and the simulator.

Spec: ``fairness-locality.md``.  One interface (``CentralQueueScheduler``) for
FCFS, RPM limit, LPM, VTC/LCF/weighted VTC, DLPM and the combined swarm policy
(global deficits + prefix-aware, stickiness-bounded chain choice, optional
BF-IO chain selection), with chain selection as ``ChainSelector`` objects
(``selectors.py``); the paper-form DoubleQ router and BF-IO placement are
available as standalone pieces.
"""

from .base import CentralQueueScheduler
from .bfio import BfioPlacement, BfioSession, BfioWorker, bfio_objective, bfio_place, server_load_profile, swarm_bfio_cost
from .counters import DeficitCounters, StickinessQuanta
from .dlpm import DLPMScheduler, LPMScheduler, SwarmScheduler
from .doubleq import DoubleQRouter
from .fcfs import FCFSScheduler, RPMLimitScheduler
from .registry import POLICIES, make_scheduler
from .selectors import (
    BFIO,
    CHAIN_MODES,
    JFFC,
    SELECTORS,
    ChainSelector,
    EstimatedTime,
    LongestPrefixMatch,
    MostFree,
)
from .types import (
    ChainSpec,
    CostWeights,
    DuplicateRequestError,
    FairnessError,
    Grant,
    InvalidEventError,
    RequestState,
    UnknownChainError,
    UnknownClientError,
    UnknownRequestError,
)
from .vtc import LCFScheduler, VTCScheduler

__all__ = [
    "BFIO",
    "CHAIN_MODES",
    "JFFC",
    "SELECTORS",
    "ChainSelector",
    "EstimatedTime",
    "LongestPrefixMatch",
    "MostFree",
    "BfioPlacement",
    "BfioSession",
    "BfioWorker",
    "CentralQueueScheduler",
    "ChainSpec",
    "CostWeights",
    "DLPMScheduler",
    "DeficitCounters",
    "DoubleQRouter",
    "DuplicateRequestError",
    "FCFSScheduler",
    "FairnessError",
    "Grant",
    "InvalidEventError",
    "LCFScheduler",
    "LPMScheduler",
    "POLICIES",
    "RPMLimitScheduler",
    "RequestState",
    "StickinessQuanta",
    "SwarmScheduler",
    "UnknownChainError",
    "UnknownClientError",
    "UnknownRequestError",
    "VTCScheduler",
    "bfio_objective",
    "bfio_place",
    "make_scheduler",
    "server_load_profile",
    "swarm_bfio_cost",
]
