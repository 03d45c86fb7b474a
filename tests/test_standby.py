"""planner/standby.py: idle servers are stacked into extra whole chains, disjoint from the plan's and from each
other, without touching the plan's spans; GCA keeps the plan's chains first and gains the standby ones."""
from __future__ import annotations

import pytest

from planner.allocation import gca
from planner.auto import auto_placement
from planner.model import ModelSpec, Placement, Server, check_memory, max_blocks
from planner.standby import add_standby_chains
from tests.test_replan import _swarm


@pytest.mark.parametrize("seed", range(3))
def test_idle_servers_become_whole_disjoint_chains_and_the_plan_stays(seed):
    model = ModelSpec(70, 1.32, 0.11)
    servers = _swarm(30, seed)
    base = auto_placement(model, servers, 0.2).best.placement
    idle = [j for j, span in enumerate(base.spans) if span is None]
    assert idle  # light load: the plan leaves servers idle
    out = add_standby_chains(model, servers, base)
    assert all(out.spans[j] == base.spans[j] for j in range(len(servers)) if base.spans[j] is not None)
    standby = [j for j in idle if out.spans[j] is not None]
    # the standby servers tile [0, L) a whole number of times: every chain starts at 0 and ends at L
    starts = sum(out.spans[j][0] == 0 for j in standby)
    assert starts >= 1 and sum(out.spans[j][1] - out.spans[j][0] for j in standby) == starts * model.num_blocks
    before, after = gca(model, servers, base).chains, gca(model, servers, out).chains
    check_memory(model, servers, out, after)  # blocks and the chains' cache fit every server
    assert len(after) >= len(before) + starts
    assert sum(c.capacity / c.service_time for c in after) > sum(c.capacity / c.service_time for c in before)
    assert add_standby_chains(model, servers, base) == out  # deterministic


def test_servers_that_cannot_complete_a_chain_stay_idle_and_bad_input_is_refused():
    model = ModelSpec(10, 1.0, 0.1)
    servers = [Server("a", 12.0, 1.0, 0.1), Server("b", 4.0, 1.0, 0.1), Server("c", 3.0, 1.0, 0.1)]
    assert max_blocks(servers[0], model, 1) == 10 and max_blocks(servers[1], model, 1) == 3
    out = add_standby_chains(model, servers, Placement((None, None, None)))
    assert out.spans == ((0, 10), None, None)  # b and c together hold 5 of 10 blocks: no chain, left idle
    assert add_standby_chains(model, servers, Placement((None,) * 3), max_chains=0).spans == (None,) * 3
    with pytest.raises(ValueError):
        add_standby_chains(model, servers, Placement((None,)))
    with pytest.raises(ValueError):
        add_standby_chains(model, servers, Placement((None,) * 3), cache_jobs=0)
