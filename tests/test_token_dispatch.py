"""JFFC by KV tokens in the simulators (planner/token_dispatch.py, experiments/sim/batch_sim.py): the orchestrator's
grant rule — a chain admits a job while it has a free slot and room in its KV token budget.

With every need equal to the slot size (the papers' fixed-length sessions) it is exactly slot JFFC; with variable
needs no budget is ever exceeded, every job that fits is eventually run, and short jobs run many at once where
max-length slots would queue them.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from experiments.sim.batch_sim import simulate_shared_chains
from experiments.sim.simulator import poisson_jobs
from planner.service_model import ChainService
from planner.token_dispatch import TokenJFFC

RATES, CAPS = [2.0, 1.0, 0.5], [3, 2, 4]
SERVICES = [ChainService(1.0 / r) for r in RATES]


def test_fixed_length_sessions_are_exactly_slot_jffc():
    jobs = poisson_jobs(4.0, 3000, seed=7)
    slots = simulate_shared_chains(SERVICES, RATES, CAPS, jobs, num_servers=0)
    tokens = simulate_shared_chains(SERVICES, RATES, CAPS, jobs, num_servers=0,
                                    kv_budgets=[c * 80 for c in CAPS], needs=[80] * len(jobs))
    assert np.array_equal(slots.start, tokens.start) and np.array_equal(slots.chain, tokens.chain)
    assert np.array_equal(slots.finish, tokens.finish)


def test_short_sessions_wait_less_by_tokens_than_in_max_length_slots():
    """The same memory (c_k slots of 512 tokens) at 90% of its slot capacity, serving sessions of 32 to 512
    tokens: admitted by their own need they hardly wait; in max-length slots every one takes a whole slot and
    they queue. (No batching slowdown here: what more sessions at once cost is the batching simulator's part.)"""
    jobs = poisson_jobs(9.0, 4000, seed=3)
    needs = np.random.default_rng(3).choice([32, 64, 128, 512], size=len(jobs), p=[0.4, 0.3, 0.2, 0.1])
    slots = simulate_shared_chains(SERVICES, RATES, CAPS, jobs, num_servers=0)
    budgets = [c * 512 for c in CAPS]
    tokens = simulate_shared_chains(SERVICES, RATES, [c * 16 for c in CAPS], jobs, num_servers=0,
                                    kv_budgets=budgets, needs=needs.tolist())
    waited = (slots.start - slots.arrival).mean()
    assert waited > 0.2 and (tokens.start - tokens.arrival).mean() < 0.1 * waited


@settings(max_examples=80, deadline=None)
@given(events=st.lists(st.tuples(st.booleans(), st.integers(16, 300)), min_size=1, max_size=60))
def test_budgets_hold_and_every_fitting_job_runs(events):
    d = TokenJFFC([3.0, 2.0], [4, 2], [400, 300])
    running: list[tuple[int, int, int]] = []  # (job, chain, need)
    waiting: set[int] = set()
    needs = {}
    for job, (finish, need) in enumerate(events):
        if finish and running:
            done = running.pop(0)
            for s in d.complete(done[1], done[2]):
                running.append((s.job, s.chain, needs[s.job]))
                waiting.discard(s.job)
        needs[job] = need
        k = d.arrive(job, need)
        if k is None:
            waiting.add(job)
        else:
            running.append((job, k, need))
        for k in range(2):
            assert sum(n for _, c, n in running if c == k) == d.held()[k] <= d.budgets[k]
            assert sum(1 for _, c, _ in running if c == k) <= d.capacities[k]
        for w in waiting:  # nobody waits while a chain would admit them
            assert all(d.held()[k] + needs[w] > d.budgets[k] or d.state().running[k] == d.capacities[k]
                       for k in range(2))
    while running:  # drain: everything that waited runs
        done = running.pop(0)
        for s in d.complete(done[1], done[2]):
            running.append((s.job, s.chain, needs[s.job]))
            waiting.discard(s.job)
    assert not waiting and d.held() == (0, 0)


def test_a_job_no_chain_can_hold_is_refused():
    d = TokenJFFC([1.0], [2], [256])
    with pytest.raises(ValueError, match="fits no chain"):
        d.arrive("big", 300)
    assert d.arrive("ok", 256) == 0
