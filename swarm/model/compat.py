"""``from swarm.model.compat import petals``: the one way Chainswarm's code imports petals.

It applies the shim (:mod:`swarm.model.petals_shim`: hivemind 1.1.12's dropped names, petals' internet
start-up calls switched off) and then makes every petals client of the process close its server sessions
explicitly, without ever blocking hivemind's event loop from a finalizer (:mod:`swarm.model.petals_sessions`;
petals 2.2's own close can deadlock that loop), and registers the supported model families on Chainswarm's
block code (:mod:`swarm.model.families`). Every step is idempotent.
"""
from __future__ import annotations

from swarm.model import families, petals_sessions
from swarm.model.petals_shim import HIVEMIND_TOP_LEVEL_NAMES, petals, restore_hivemind_names

petals_sessions.install()
families.register()

__all__ = ["petals", "restore_hivemind_names", "HIVEMIND_TOP_LEVEL_NAMES"]
