"""Property tests on random traces (§14.10): bounds, counter invariants, work conservation."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from planner.fairness import ChainSpec, DLPMScheduler, SwarmScheduler, make_scheduler
from planner.fairness_metrics import max_backlogged_gap, swarm_bound
from planner.toy_engine import ToyEngine, ToyRequest

L_IN, L_OUT = 48, 6


def random_requests(rng: random.Random, n_clients: int, n_requests: int, horizon: int):
    clients = [f"c{i}" for i in range(n_clients)]
    pools = {c: [tuple(rng.randrange(50) for _ in range(rng.randint(4, 32))) for _ in range(2)] for c in clients}
    shared = tuple(rng.randrange(50) for _ in range(16))
    heavy = rng.choice(clients)
    reqs = []
    for j in range(n_requests):
        c = heavy if rng.random() < 0.4 else rng.choice(clients)
        prefix = shared if rng.random() < 0.1 else rng.choice(pools[c])
        suffix = tuple(rng.randrange(50) for _ in range(rng.randint(1, 16)))
        tokens = (prefix + suffix)[:L_IN]
        reqs.append(ToyRequest(f"r{j}", c, tokens, rng.randint(1, L_OUT), arrival=rng.randint(0, horizon)))
    return reqs


def random_chains(rng: random.Random, k: int):
    return [ChainSpec(f"k{i}", rng.randint(1, 3), decode_time=float(rng.randint(1, 3)), prefill_time=0.01) for i in range(k)]


def run(policy_factory, seed: int, n_chains: int, n_clients: int, n_requests: int, observe=None):
    rng = random.Random(seed)
    chains = random_chains(rng, n_chains)
    reqs = random_requests(rng, n_clients, n_requests, horizon=rng.choice([0, 10, 40]))
    sched = policy_factory()
    engine = ToyEngine(sched, chains, page_size=4, cache_tokens=rng.choice([16, 64, 256]), observe=observe)
    trace = engine.run(reqs)
    assert len(trace.finish_time) == len(reqs)
    return sched, chains, trace


deficit_policies = {
    "dlpm": lambda q: DLPMScheduler(quantum=q),
    "swarm": lambda q: SwarmScheduler(quantum=q, chain_quantum=q * 2),
    "swarm-lpm": lambda q: SwarmScheduler(quantum=q, chain_quantum=q, chain_mode="lpm"),
    "swarm-bfio": lambda q: SwarmScheduler(quantum=q, chain_quantum=q, chain_mode="bfio", bfio_horizon=4),
}


@pytest.mark.parametrize("name", sorted(deficit_policies))
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**9),
    n_chains=st.integers(1, 3),
    n_clients=st.integers(2, 4),
    quantum=st.sampled_from([10, 40, 150]),
)
def test_deficit_policies_bound_invariants_identity(name, seed, n_chains, n_clients, quantum):
    lows, highs = [], []

    def observe(t, s):
        values = list(s.deficits.deficit.values()) or [0.0]
        lows.append(min(values))
        highs.append(max(values))

    sched, chains, trace = run(lambda: deficit_policies[name](quantum), seed, n_chains, n_clients, 40, observe)
    capacities = [c.capacity for c in chains]
    # counter bounds (Thm A.1 / §14.10): -U_sw < q <= Q^u, U_sw = w_e*L_in + w_q*M_out,sw
    u_sw = L_IN + 2 * sum(capacities) * L_OUT
    assert max(highs) <= quantum
    assert min(lows) > -u_sw
    # identity W_i = q_i(0) + Q^u * K_i - q_i(end), to the token (q starts at 0; no reconciliation here)
    for client in sched.clients():
        assert sched.service(client) == quantum * sched.refills(client) - sched.deficit(client)
    # P1: service gap of any two continuously backlogged clients within 2 * (U_sw + Q^u)
    gap, where = max_backlogged_gap(trace.service_events, trace.backlog)
    assert gap <= swarm_bound(capacities, L_IN, L_OUT, quantum), where
    # P3
    assert trace.violations == []


ALL_POLICIES = ["fcfs", "lpm", "vtc", "lcf", "dlpm", "swarm", "bfio"]


@pytest.mark.parametrize("policy", ALL_POLICIES)
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**9), n_chains=st.integers(1, 3), n_clients=st.integers(1, 4))
def test_every_policy_is_work_conserving(policy, seed, n_chains, n_clients):
    options = {"quantum": 60} if policy in ("dlpm", "swarm", "bfio") else {}
    sched, chains, trace = run(lambda: make_scheduler(policy, **options), seed, n_chains, n_clients, 30)
    assert trace.violations == []
    assert not sched.running() and not any(sched.queue_lengths().values())


def test_dlpm_bound_holds_against_a_flooding_client():
    """A deterministic S1-like trace: one client floods hot-prefix requests, another sends a few."""
    hot = tuple(range(40))
    reqs = [ToyRequest(f"h{j}", "heavy", hot + (100 + j,), 4, arrival=0) for j in range(60)]
    reqs += [ToyRequest(f"l{j}", "light", tuple(range(200 + 10 * j, 200 + 10 * j + 40)), 4, arrival=3 * j) for j in range(15)]
    sched = DLPMScheduler(quantum=50)
    trace = ToyEngine(sched, [ChainSpec("k", 2)], page_size=4, cache_tokens=128).run(reqs)
    gap, _ = max_backlogged_gap(trace.service_events, trace.backlog)
    assert gap <= swarm_bound([2], 41, 4, 50)
    light_wait = [trace.grants[i][0] - next(r.arrival for r in reqs if r.request_id == g) for i, g in enumerate(trace.order) if g.startswith("l")]
    lpm = make_scheduler("lpm")
    lpm_trace = ToyEngine(lpm, [ChainSpec("k", 2)], page_size=4, cache_tokens=128).run(reqs)
    lpm_wait = [lpm_trace.grants[i][0] - next(r.arrival for r in reqs if r.request_id == g) for i, g in enumerate(lpm_trace.order) if g.startswith("l")]
    assert max(light_wait) < max(lpm_wait)  # LPM makes the light client wait behind the hot prefix


def test_multi_slot_round_cannot_overdraw_the_deficit():
    """Best-case provisional charges on several free chains must not let q fall below -U
    once settled (the §14.4 pseudocode alone would reach -89 here)."""
    sched = SwarmScheduler(quantum=10, chain_quantum=None, chain_mode="lpm",
                           prefix_match=lambda r, chain: 44 if chain == "k0" else 0)
    sched.set_chains([ChainSpec(f"k{i}", 1) for i in range(3)])
    sched.set_deficit("A", 1)
    for j in range(3):
        sched.submit(f"A{j}", "A", 48, 0, max_new_tokens=4)
    grants = sched.dispatch(0)
    assert sorted(g.chain_id for g in grants) == ["k0", "k1", "k2"]
    assert [g.request_id for g in grants if g.chain_id == "k0"] == ["A0"]
    u = 48 + 2 * 3 * 4
    assert sched.deficit("A") == -39 > -u
    assert sched.service("A") == 4 + 48 + 48 == sched.refills("A") * 10 + 1 - sched.deficit("A")
