
# Chain composition (spec chain-composition.md): model, GBP-CR, c tuning, GCA, JFFC, bounds, baselines.
from planner.model import Chain, ModelSpec, Placement, Server  # noqa: E402,F401
from planner.plan import Plan, parse_swarm  # noqa: E402,F401  (the function is planner.plan.plan)
from planner.dispatch import JFFC, make_dispatcher  # noqa: E402,F401

# Fairness and prefix locality (spec fairness-locality.md): central-queue schedulers, prefix index, metrics.
from planner.fairness import (  # noqa: E402,F401
    CentralQueueScheduler,
    ChainSpec,
    CostWeights,
    DLPMScheduler,
    FCFSScheduler,
    Grant,
    LPMScheduler,
    SwarmScheduler,
    VTCScheduler,
    make_scheduler,
)
from planner.prefix_index import ChainPrefixMatcher, PrefixIndex, page_hashes  # noqa: E402,F401
