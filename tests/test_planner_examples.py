"""The worked examples of chain-composition.md §9 as unit tests, with their numbers."""
from __future__ import annotations

import pytest

from planner.allocation import gca
from planner.baselines import whole_model_placement
from planner.bounds import (
    death_rates,
    exact_mean_occupancy,
    exact_mean_response_time,
    occupancy_bounds,
    response_time_bounds,
)
from planner.dispatch import JFFC
from planner.model import (
    Link,
    ModelSpec,
    Placement,
    Server,
    c_max,
    check_chain,
    check_memory,
    feasible_links,
    free_slots,
    max_blocks,
)
from planner.placement import gbp_cr
from planner.tuning import evaluate_c, iter_candidates, tune_c

EXACT = 1e-9
QUOTED = 1e-4


# --- §9.1 Example 1: the c tradeoff --------------------------------------------------------------

EX1_MODEL = ModelSpec(2, 1.0, 0.5)
EX1_SERVERS = [Server("s1", 4, 1, 1), Server("s2", 4, 1, 1)]


@pytest.mark.parametrize(
    "c, m, gbp_chains, gbp_time, gbp_rate, gca_chains, gca_rate",
    [
        (1, 2, [("s1",), ("s2",)], 3.0, 2 / 3, [(("s1",), 2), (("s2",), 2)], 4 / 3),
        (2, 2, [("s1",), ("s2",)], 3.0, 4 / 3, [(("s1",), 2), (("s2",), 2)], 4 / 3),
        (3, 1, [("s1", "s2")], 4.0, 0.75, [(("s1", "s2"), 6)], 1.5),
    ],
)
def test_example1_c_tradeoff(c, m, gbp_chains, gbp_time, gbp_rate, gca_chains, gca_rate):
    assert [max_blocks(s, EX1_MODEL, c) for s in EX1_SERVERS] == [m, m]
    result = gbp_cr(EX1_MODEL, EX1_SERVERS, c, 100.0, 0.5)  # large λ: never stops early
    assert list(result.chains) == gbp_chains
    assert all(t == pytest.approx(gbp_time, abs=EXACT) for t in result.chain_times)
    assert c * result.scaled_rate == pytest.approx(gbp_rate, abs=EXACT)
    alloc = gca(EX1_MODEL, EX1_SERVERS, result.placement)
    assert [(ch.servers, ch.capacity) for ch in alloc.chains] == gca_chains
    assert alloc.total_rate == pytest.approx(gca_rate, abs=EXACT)
    if c == 3:
        assert result.placement.spans == ((0, 1), (1, 2))


# --- §9.2 Example 2: the paper's Fig. 2 ----------------------------------------------------------

EPS = 0.01
EX2_MODEL = ModelSpec(3, 1.0, 0.1)
EX2_SERVERS = [
    Server(f"j{l}", 3 if l == 2 else 2, 2 if l == 2 else 1, l * EPS) for l in range(1, 6)
]


def test_example2_gbp_cr():
    result = gbp_cr(EX2_MODEL, EX2_SERVERS, 1, 100.0, 0.5)
    # 1-based (a, m): j1 (1,1), j2 (2,2), j3 (1,1), j4 (2,1), j5 (3,1)
    assert result.placement.spans == ((0, 1), (1, 3), (0, 1), (1, 2), (2, 3))
    assert result.chains == (("j1", "j2"), ("j3", "j4", "j5"))
    assert result.chain_times == pytest.approx((3 + 5 * EPS, 3 + 12 * EPS), abs=EXACT)
    expected = 1 / (3 + 5 * EPS) + 1 / (3 + 12 * EPS)  # eq. (15)
    assert result.scaled_rate == pytest.approx(expected, abs=EXACT)
    assert result.scaled_rate == pytest.approx(0.648382, abs=QUOTED)
    assert not result.requirement_met and result.num_chains is None


def test_example2_routing_topology():
    placement = gbp_cr(EX2_MODEL, EX2_SERVERS, 1, 100.0, 0.5).placement
    assert [free_slots(s, EX2_MODEL, placement.num_blocks(i)) for i, s in enumerate(EX2_SERVERS)] == [10] * 5
    j0, jE = -1, 5
    j1, j2, j3, j4, j5 = range(5)
    expected = {
        Link(j0, j1, 1), Link(j0, j3, 1),
        Link(j1, j2, 2), Link(j3, j2, 2),
        Link(j1, j4, 1), Link(j3, j4, 1),
        Link(j4, j5, 1), Link(j4, j2, 1),
        Link(j2, jE, 1), Link(j5, jE, 1),
    }  # fmt: skip
    assert set(feasible_links(placement, 3)) == expected


def test_example2_gca():
    placement = gbp_cr(EX2_MODEL, EX2_SERVERS, 1, 100.0, 0.5).placement
    alloc = gca(EX2_MODEL, EX2_SERVERS, placement)
    assert [(ch.servers, ch.capacity) for ch in alloc.chains] == [
        (("j1", "j2"), 5),
        (("j1", "j4", "j5"), 5),
        (("j3", "j4", "j5"), 5),
    ]
    assert [ch.service_time for ch in alloc.chains] == pytest.approx(
        [3 + 5 * EPS, 3 + 10 * EPS, 3 + 12 * EPS], abs=EXACT
    )
    expected = 5 / (3 + 5 * EPS) + 5 / (3 + 10 * EPS) + 5 / (3 + 12 * EPS)  # eq. (16)
    assert alloc.total_rate == pytest.approx(expected, abs=EXACT)
    assert alloc.total_rate == pytest.approx(4.854812, abs=QUOTED)
    assert alloc.slots_free == (0, 0, 5, 0, 0)  # j3 keeps 5 unused slots
    assert alloc.slots_allocated == (10, 10, 5, 10, 10)
    check_memory(EX2_MODEL, EX2_SERVERS, placement, alloc.chains)
    for ch in alloc.chains:
        check_chain(ch, EX2_MODEL, placement, EX2_SERVERS)


# --- §9.3 Example 3: heterogeneous servers, shift-back, stopping, leftovers ------------------------

EX3_MODEL = ModelSpec(4, 1.0, 0.25)
EX3_SERVERS = [
    Server("A", 6, 1, 0.5),
    Server("B", 4.5, 0.5, 0.5),
    Server("C", 3, 0.2, 1),
    Server("D", 3, 1, 1),
    Server("E", 1.5, 0.1, 2),
    Server("F", 1.4, 0.1, 0.1),
]
EX3_MU = (1 / 3, 1 / 4, 1 / 5.2)
EX3_CAP = (2, 2, 1)


def test_example3_max_blocks():
    assert [max_blocks(s, EX3_MODEL, 2) for s in EX3_SERVERS] == [4, 3, 2, 2, 1, 0]


def test_example3_gbp_cr():
    result = gbp_cr(EX3_MODEL, EX3_SERVERS, 2, 0.3, 0.5)
    assert result.requirement == pytest.approx(0.3, abs=EXACT)
    # B (1,3), A shifted back to (1,4), C (1,2), D (3,2); E never reached, F excluded.
    assert result.placement.spans == ((0, 4), (0, 3), (0, 2), (2, 4), None, None)
    assert result.chains == (("B", "A"), ("C", "D"))
    assert result.chain_times == pytest.approx((5.0, 5.2), abs=EXACT)
    assert result.scaled_rate == pytest.approx(0.2 + 1 / 5.2, abs=EXACT)
    assert result.scaled_rate == pytest.approx(0.392308, abs=QUOTED)
    assert result.num_chains == 2
    assert result.c * result.num_chains == 4  # g(2)


def test_example3_gca():
    placement = gbp_cr(EX3_MODEL, EX3_SERVERS, 2, 0.3, 0.5).placement
    slots = [free_slots(s, EX3_MODEL, placement.num_blocks(i)) for i, s in enumerate(EX3_SERVERS[:4])]
    assert slots == [8, 6, 4, 4]
    alloc = gca(EX3_MODEL, EX3_SERVERS, placement)
    assert [(ch.servers, ch.capacity) for ch in alloc.chains] == [(("A",), 2), (("B", "D"), 2), (("C", "D"), 1)]
    assert [ch.service_time for ch in alloc.chains] == pytest.approx([3.0, 4.0, 5.2], abs=EXACT)
    assert alloc.chains[1].spans == ((0, 3), (3, 4))
    assert alloc.slots_free[:4] == (0, 0, 2, 0)
    assert alloc.total_rate == pytest.approx(2 / 3 + 2 / 4 + 1 / 5.2, abs=EXACT)
    assert alloc.total_rate == pytest.approx(1.358974, abs=QUOTED)
    assert alloc.total_capacity == 5
    # GBP-CR's own conservative view: 2·(1/5 + 1/5.2)
    assert 2 * (1 / 5 + 1 / 5.2) == pytest.approx(0.784615, abs=QUOTED)


@pytest.mark.parametrize(
    "lam, n_lo, n_ex, n_up, t_lo, t_ex, t_up",
    [
        (0.3, 0.924917, 0.957810, 1.362504, 3.083057, 3.192699, 4.541679),
        (0.5, 1.610709, 1.698250, 2.169923, 3.221417, 3.396501, 4.339846),
        (1.0, 4.595323, 4.792972, 5.173087, 4.595323, 4.792972, 5.173087),
    ],
)
def test_example3_bounds_and_exact(lam, n_lo, n_ex, n_up, t_lo, t_ex, t_up):
    lo, up = occupancy_bounds(EX3_MU, EX3_CAP, lam)
    assert lo == pytest.approx(n_lo, abs=QUOTED)
    assert up == pytest.approx(n_up, abs=QUOTED)
    assert exact_mean_occupancy(EX3_MU, EX3_CAP, lam) == pytest.approx(n_ex, abs=QUOTED)
    bounds = response_time_bounds(EX3_MU, EX3_CAP, lam)
    assert bounds.lower == pytest.approx(t_lo, abs=QUOTED)
    assert bounds.upper == pytest.approx(t_up, abs=QUOTED)
    assert exact_mean_response_time(EX3_MU, EX3_CAP, lam) == pytest.approx(t_ex, abs=QUOTED)


# --- §9.4 Example 4: the c-tuning table ------------------------------------------------------------

# c -> (placement spans A..F or None, K, GCA chains [(servers, capacity, T)], ν, (T̄ lo, ex, up))
EX4_LAMBDA_03 = {
    1: ({"F": (0, 1), "B": (1, 4), "A": (0, 4)}, 2,
        [(("F", "B"), 1, 2.2), (("A",), 2, 3.0)], 1.1212, (2.4488, 2.5676, 3.0003)),
    2: ({"B": (0, 3), "A": (0, 4), "C": (0, 2), "D": (2, 4)}, 2,
        [(("A",), 2, 3.0), (("B", "D"), 2, 4.0), (("C", "D"), 1, 5.2)], 1.3590, (3.0831, 3.1927, 4.5417)),
    3: ({"B": (0, 2), "A": (1, 4)}, 1, [(("B", "A"), 5, 3.5)], 1.4286, (3.5042,) * 3),
    4: ({"B": (0, 2), "A": (1, 4)}, 1, [(("B", "A"), 5, 3.5)], 1.4286, (3.5042,) * 3),
    5: ({"B": (0, 2), "A": (2, 4)}, 1, [(("B", "A"), 5, 3.5)], 1.4286, (3.5042,) * 3),
    **{c: ({"A": (0, 2), "B": (2, 3), "C": (3, 4)}, 1, [(("A", "B", "C"), 8, 4.2)], 1.9048, (4.2000,) * 3)
       for c in (6, 7, 8)},
}  # fmt: skip
EX4_LAMBDA_06 = {
    1: ({"F": (0, 1), "B": (1, 4), "A": (0, 4), "C": (0, 2), "D": (2, 4), "E": (0, 1)}, None,
        [(("F", "B"), 1, 2.2), (("A",), 2, 3.0), (("C", "B"), 1, 3.7), (("C", "D"), 1, 5.2)], 1.5838,
        (2.6223, 2.8448, 3.9048)),
    2: ({"B": (0, 3), "A": (0, 4), "C": (0, 2), "D": (2, 4), "E": (0, 1)}, None,
        [(("A",), 2, 3.0), (("B", "D"), 2, 4.0), (("C", "D"), 1, 5.2)], 1.3590, (3.3295, 3.5232, 4.3073)),
    **{c: ({"B": (0, 2), "A": (1, 4), "C": (0, 1), "D": (1, 2)}, None,
           [(("B", "A"), 5, 3.5), (("C", "D", "A"), 1, 5.2)], 1.6209, (3.5372, 3.5745, 4.0385))
       for c in (3, 4)},
    5: ({"B": (0, 2), "A": (2, 4)}, 1, [(("B", "A"), 5, 3.5)], 1.4286, (3.5859,) * 3),
    **{c: ({"A": (0, 2), "B": (2, 3), "C": (3, 4)}, 1, [(("A", "B", "C"), 8, 4.2)], 1.9048, (4.2036,) * 3)
       for c in (6, 7, 8)},
}  # fmt: skip


@pytest.mark.parametrize("lam, table", [(0.3, EX4_LAMBDA_03), (0.6, EX4_LAMBDA_06)])
def test_example4_tuning_table(lam, table):
    assert c_max(EX3_MODEL, EX3_SERVERS) == 20
    evaluations = list(iter_candidates(EX3_MODEL, EX3_SERVERS, lam, 0.5))
    assert [ev.candidate.c for ev in evaluations] == list(range(1, 21))
    ids = [s.id for s in EX3_SERVERS]
    for ev in evaluations:
        cand = ev.candidate
        if cand.c >= 9:  # Σ m_j(c) < 4: no complete chain
            assert not cand.feasible and cand.num_chains is None and cand.lower is None
            continue
        spans, k, chains, nu, (t_lo, t_ex, t_up) = table[cand.c]
        assert dict((ids[i], s) for i, s in enumerate(ev.gbp.placement.spans) if s) == spans
        assert cand.num_chains == k
        assert cand.g == (None if k is None else cand.c * k)
        got = [(ch.servers, ch.capacity, pytest.approx(ch.service_time, abs=EXACT)) for ch in ev.allocation.chains]
        assert got == [(s, cap, t) for s, cap, t in chains]
        assert cand.total_rate == pytest.approx(nu, abs=QUOTED)
        assert cand.lower == pytest.approx(t_lo, abs=QUOTED)
        assert cand.upper == pytest.approx(t_up, abs=QUOTED)
        mu = [ch.rate for ch in ev.allocation.chains]
        cap = [ch.capacity for ch in ev.allocation.chains]
        assert exact_mean_response_time(mu, cap, lam) == pytest.approx(t_ex, abs=QUOTED)


def test_example4_choices():
    # λ = 0.3: surrogate and lower bound both pick c* = 1.
    assert tune_c(EX3_MODEL, EX3_SERVERS, 0.3, 0.5, tuning="surrogate").c == 1
    assert tune_c(EX3_MODEL, EX3_SERVERS, 0.3, 0.5, tuning="lower-bound").c == 1
    # λ = 0.6: the surrogate picks c = 5, the lower bound c = 1 (the surrogate is conservative).
    sur = tune_c(EX3_MODEL, EX3_SERVERS, 0.6, 0.5, tuning="surrogate")
    low = tune_c(EX3_MODEL, EX3_SERVERS, 0.6, 0.5, tuning="lower-bound")
    assert (sur.c, low.c) == (5, 1)
    assert sur.candidate.lower == pytest.approx(3.5859, abs=QUOTED)
    assert not low.overloaded
    # c = 3 at λ = 0.6: GCA uses C and D from GBP-CR's incomplete chain.
    fixed = evaluate_c(EX3_MODEL, EX3_SERVERS, 3, 0.6, 0.5)
    assert fixed.tuning == "fixed" and fixed.gbp_cr.chains == (("B", "A"),)
    assert ("C", "D", "A") in [ch.servers for ch in fixed.allocation.chains]


# --- §9.5 Example 5: Theorem 3.7 by hand -----------------------------------------------------------


def test_example5_by_hand():
    mu, cap = (2.0, 1.0), (1, 1)
    assert list(death_rates(mu, cap, fastest_first=True)) == [2.0, 3.0]
    assert list(death_rates(mu, cap, fastest_first=False)) == [1.0, 3.0]
    lo, up = occupancy_bounds(mu, cap, 1.0)
    exact = exact_mean_occupancy(mu, cap, 1.0)
    assert lo == pytest.approx(9 / 14, abs=EXACT)
    assert exact == pytest.approx(27 / 38, abs=EXACT)
    assert up == pytest.approx(0.9, abs=EXACT)
    assert lo <= exact <= up
    assert response_time_bounds(mu, cap, 1.0).lower == pytest.approx(9 / 14, abs=EXACT)


@pytest.mark.parametrize("mu, cap, lam, expected", [(1.0, 1, 0.5, 1.0), (1.0, 2, 1.0, 4 / 3)])
def test_example5_sanity_mmc(mu, cap, lam, expected):
    lo, up = occupancy_bounds([mu], [cap], lam)
    assert lo == pytest.approx(expected, abs=EXACT)
    assert up == pytest.approx(expected, abs=EXACT)
    assert exact_mean_occupancy([mu], [cap], lam) == pytest.approx(expected, abs=EXACT)


def test_bounds_unstable_and_zero_load():
    assert response_time_bounds([1.0], [1], 1.0) is None
    assert occupancy_bounds([1.0], [1], 2.0) == (float("inf"), float("inf"))
    b = response_time_bounds([2.0, 0.5], [1, 1], 0.0)
    assert (b.lower, b.upper) == (0.5, 2.0)


# --- §9.6 Example 6: a deterministic JFFC trace ------------------------------------------------------


def test_example6_jffc_trace():
    times = (2.0, 4.0)  # k1: T=2, c=1; k2: T=4, c=2
    jffc = JFFC([1 / t for t in times], [1, 2])
    arrivals = [("J1", 0.0, 1.0), ("J2", 0.5, 1.0), ("J3", 1.0, 0.5), ("J4", 1.5, 1.0), ("J5", 1.6, 0.25)]
    size = {job: s for job, _, s in arrivals}
    submitted = {job: t for job, t, _ in arrivals}
    started, finished, on_chain = {}, {}, {}
    running: list[tuple[float, str, int]] = []  # (end time, job, chain)
    log = []

    def start(job, chain, now):
        started[job], on_chain[job] = now, chain
        running.append((now + size[job] * times[chain], job, chain))

    pending = list(arrivals)
    while pending or running:
        next_arrival = pending[0][1] if pending else float("inf")
        next_end = min(running)[0] if running else float("inf")
        if next_arrival < next_end:  # arrivals strictly before completions at equal times don't occur here
            job, now, _ = pending.pop(0)
            chain = jffc.arrive(job)
            if chain is not None:
                start(job, chain, now)
        else:
            end, job, chain = min(running)
            running.remove((end, job, chain))
            finished[job] = end
            nxt = jffc.complete(chain)
            if nxt is not None:
                assert nxt.chain == chain
                start(nxt.job, nxt.chain, end)
        st = jffc.state()
        log.append((st.running, st.central_queue))

    assert on_chain == {"J1": 0, "J2": 1, "J3": 1, "J4": 0, "J5": 1}
    assert started == pytest.approx({"J1": 0, "J2": 0.5, "J3": 1.0, "J4": 2.0, "J5": 3.0})
    assert finished == pytest.approx({"J1": 2.0, "J2": 4.5, "J3": 3.0, "J4": 4.0, "J5": 4.0})
    response = [finished[j] - submitted[j] for j in size]
    waiting = [started[j] - submitted[j] for j in size]
    assert response == pytest.approx([2, 4, 2, 2.5, 2.4])
    assert waiting == pytest.approx([0, 0, 0, 0.5, 1.4])
    assert sum(response) / 5 == pytest.approx(2.58)
    assert sum(waiting) / 5 == pytest.approx(0.38)
    # Z after each event, as in the table: (1,0) (1,1) (1,2) (1,2)+[J4] (1,2)+[J4,J5] ...
    assert log[:5] == [((1, 0), 0), ((1, 1), 0), ((1, 2), 0), ((1, 2), 1), ((1, 2), 2)]
    assert log[-1] == ((0, 0), 0)


# --- §9.7 Example 7: the PETALS experiment arithmetic (LLaMA-2-7B) ------------------------------------

LLAMA = ModelSpec(32, 0.4375, 0.0336)
MIG = [Server(f"big{i}", 40, 1, 0.05) for i in range(3)] + [Server(f"small{i}", 20, 1, 0.08) for i in range(6)]


def test_example7_llama_arithmetic():
    assert LLAMA.num_blocks * LLAMA.block_size_gb == 14
    assert 2 * 4096 * 2048 * 2 == 32 * 2**20  # s_c = 32 MiB per block for 2048 tokens
    assert max_blocks(MIG[0], LLAMA, 35) == 24
    assert max_blocks(MIG[3], LLAMA, 35) == 12
    assert 32 * LLAMA.cache_slot_gb == pytest.approx(1.0752)  # KV per session ≈ 1 GiB
    placement = whole_model_placement(LLAMA, MIG)
    assert placement.spans == ((0, 32),) * 9
    alloc = gca(LLAMA, MIG, placement)
    caps = {ch.servers[0]: ch.capacity for ch in alloc.chains}
    assert [caps[s.id] for s in MIG] == [24, 24, 24, 5, 5, 5, 5, 5, 5]
    assert alloc.total_capacity == 102
    # the free-but-unusable memory is just under one session on every server
    for s, free in zip(MIG, alloc.slots_free):
        assert 0 <= free < 32
    assert Placement(((0, 32),)).validate(LLAMA, MIG[:1]) is None


def test_gca_total_rate_can_fall_below_gbp_cr():
    """The issue's caveat: GCA's fastest chain is at least as fast, but its total rate can be lower."""
    model = ModelSpec(4, 1.0, 0.5)
    servers = [Server("x", 5, 0.5, 0.5), Server("y", 6, 0.2, 1), Server("z", 5, 1, 0.5)]
    result = gbp_cr(model, servers, 1, 100.0, 0.7)
    assert result.chains == (("x", "z"), ("y",))
    alloc = gca(model, servers, result.placement)
    assert [(ch.servers, ch.capacity) for ch in alloc.chains] == [(("x", "y"), 1)]
    assert alloc.chains[0].service_time == pytest.approx(3.2)  # GBP-CR's fastest really takes 3.5
    assert alloc.total_rate < 1 * result.scaled_rate
