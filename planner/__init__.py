
# Chain composition (spec chain-composition.md): model, GBP-CR, c tuning, GCA, JFFC, bounds, baselines.
from planner.model import Chain, ModelSpec, Placement, Server  # noqa: E402,F401
from planner.plan import Plan, parse_swarm, plan  # noqa: E402,F401
from planner.dispatch import JFFC, make_dispatcher  # noqa: E402,F401
