"""JFFC and the load-balancing baselines of §12.4 behind one dispatcher interface."""
from __future__ import annotations

import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.bounds import exact_mean_occupancy, occupancy_bounds
from planner.dispatch import JFFC, JIQ, JSQ, POLICIES, SAJSQ, SED, RandomFree, Started, make_dispatcher
from planner.model import Chain


@st.composite
def scenarios(draw):
    k = draw(st.integers(1, 6))
    rates = sorted((draw(st.integers(1, 8)) for _ in range(k)), reverse=True)
    caps = [draw(st.integers(0, 3)) for _ in range(k)]
    ops = draw(st.lists(st.integers(0, 9), min_size=1, max_size=80))  # 0..5 arrive, 6..9 complete
    return rates, caps, ops


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_jffc_matches_definition(case):
    rates, caps, ops = case
    jffc = JFFC(rates, caps)
    running = [0] * len(rates)
    queue: list[int] = []
    next_job = 0
    for op in ops:
        if op <= 5 or not any(running):
            chain = jffc.arrive(next_job)
            free = [k for k in range(len(rates)) if running[k] < caps[k]]
            if free:
                assert chain == free[0]  # the fastest free chain, ties to the lowest index
                running[free[0]] += 1
            else:
                assert chain is None
                queue.append(next_job)
            next_job += 1
        else:
            busy = [k for k in range(len(rates)) if running[k]]
            k = busy[op % len(busy)]
            started = jffc.complete(k)
            if queue:
                assert started == Started(queue.pop(0), k)  # FIFO head takes the freed chain
            else:
                assert started is None
                running[k] -= 1
        state = jffc.state()
        assert list(state.running) == running
        assert state.central_queue == len(queue)
        if queue:  # invariant: a non-empty queue means every chain is full
            assert running == caps


def test_complete_on_idle_chain_is_an_error():
    with pytest.raises(ValueError):
        JFFC([1.0], [1]).complete(0)
    with pytest.raises(ValueError):
        JFFC([1.0, 2.0], [1, 1])  # not fastest first
    with pytest.raises(ValueError):
        make_dispatcher("nope", [1.0], [1])


def test_from_chains_and_factory():
    chains = [Chain(("a",), ((0, 2),), 2, 1.0), Chain(("b",), ((0, 2),), 1, 2.0)]
    d = JFFC.from_chains(chains)
    assert d.rates == (1.0, 0.5) and d.capacities == (2, 1)
    for name in POLICIES:
        assert make_dispatcher(name, [1.0, 0.5], [2, 1], seed=3).name == name


def test_dedicated_queue_policies():
    rates, caps = [2.0, 1.0], [1, 2]
    # SED: 1/μ + (Z−c+1)+/(μc): empty -> chain 0 (0.5 < 1); then chain 0 full: 0.5+0.5=1 vs 1 -> tie, lowest index
    sed = SED(rates, caps)
    assert [sed.arrive(i) for i in range(3)] == [0, None, 1]
    assert sed.state().chain_queues == (1, 0)
    assert sed.complete(0) == Started(1, 0)
    # SA-JSQ: free chains have metric 0, ties to the fastest; when all full, shortest normalized queue
    sa = SAJSQ(rates, caps)
    assert [sa.arrive(i) for i in range(3)] == [0, 1, 1]
    assert sa.arrive(3) is None and sa.state().chain_queues == (0, 1)  # metrics 1/1 vs 1/2 -> chain 1
    assert sa.arrive(4) is None and sa.state().chain_queues == (1, 1)  # 1 vs 2/2: tie -> the faster chain 0
    # JSQ and JIQ are random among ties but only ever pick a free chain while one exists
    for cls in (JSQ, JIQ, RandomFree):
        d = cls(rates, caps, seed=1)
        assert sorted(d.arrive(i) for i in range(3)) == [0, 1, 1]
        state = d.state()
        assert state.running == (1, 2)
        d.arrive(3)
        assert d.state().in_system == 4
    rnd = RandomFree(rates, caps, seed=0)
    for i in range(4):
        rnd.arrive(i)
    assert rnd.state().central_queue == 1 and rnd.complete(1) == Started(3, 1)


def simulate(dispatcher, rates, lam, jobs, seed):
    """Event-driven simulation with Poisson arrivals and Exp(1) job sizes; returns mean number in system."""
    rng = random.Random(seed)
    t, area, last = 0.0, 0.0, 0.0
    events: list[tuple[float, int, int]] = []  # (time, kind 0=arrival 1=completion, chain)
    heapq.heappush(events, (rng.expovariate(lam), 0, -1))
    arrived = 0
    in_system = 0
    warmup = jobs // 10
    start_time = None
    while events:
        t, kind, chain = heapq.heappop(events)
        if start_time is not None:
            area += in_system * (t - last)
        last = t
        if kind == 0:
            arrived += 1
            if arrived == warmup:
                start_time = t
            if arrived > jobs:
                break
            in_system += 1
            k = dispatcher.arrive(arrived)
            if k is not None:
                heapq.heappush(events, (t + rng.expovariate(1.0) / rates[k], 1, k))
            heapq.heappush(events, (t + rng.expovariate(lam), 0, -1))
        else:
            in_system -= 1
            nxt = dispatcher.complete(chain)
            if nxt is not None:
                heapq.heappush(events, (t + rng.expovariate(1.0) / rates[nxt.chain], 1, nxt.chain))
    return area / (t - start_time)


def test_jffc_simulation_agrees_with_exact_ctmc():
    rates, caps, lam = [1 / 3, 1 / 4, 1 / 5.2], [2, 2, 1], 1.0  # Example 3's chains
    sim = simulate(JFFC(rates, caps), rates, lam, 120_000, seed=7)
    exact = exact_mean_occupancy(rates, caps, lam)
    lower, upper = occupancy_bounds(rates, caps, lam)
    assert exact == pytest.approx(4.792972, abs=1e-4)
    assert sim == pytest.approx(exact, rel=0.05)
    assert lower < sim < upper
