"""Worked examples E1-E10 of fairness-locality.md §13/§14, with their hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from planner.fairness import (
    BfioSession,
    BfioWorker,
    ChainSpec,
    DLPMScheduler,
    DoubleQRouter,
    FCFSScheduler,
    LCFScheduler,
    LPMScheduler,
    RPMLimitScheduler,
    SwarmScheduler,
    VTCScheduler,
    bfio_objective,
    bfio_place,
)
from planner.fairness_metrics import (
    dlpm_bound,
    jain_index,
    max_service_gap,
    service_in_interval,
    swarm_bound,
)
from planner.prefix_index import PrefixIndex, page_hashes
from planner.toy_engine import ToyEngine, ToyRequest

P_A = tuple(range(200))
P_B = tuple(range(10_000, 10_200))


def t1_requests():
    """A1..A4 = P_A + 20 unique tokens, B1..B4 likewise, seq A1 B1 A2 B2 ..., o = 20."""
    reqs = []
    for k in range(1, 5):
        reqs.append(ToyRequest(f"A{k}", "A", P_A + tuple(range(1000 * k, 1000 * k + 20)), 20))
        reqs.append(ToyRequest(f"B{k}", "B", P_B + tuple(range(50_000 + 1000 * k, 50_000 + 1000 * k + 20)), 20))
    return reqs


class Recorder:
    """Wraps a scheduler's events to log counters after each admission and finish."""

    def __init__(self, sched, read):
        self.sched, self.read, self.log = sched, read, []
        dispatch, finish = sched.dispatch, sched.on_finish

        def on_dispatch(now):
            grants = dispatch(now)
            for g in grants:
                self.log.append((g.request_id, "admit", read(sched, g.client_id)))
            return grants

        def on_finish(rid, now, output_tokens=None):
            client = sched.request(rid).client_id
            finish(rid, now, output_tokens)
            self.log.append((rid, "finish", read(sched, client)))

        sched.dispatch, sched.on_finish = on_dispatch, on_finish

    def values(self, kind):
        return [(rid, v) for rid, k, v in self.log if k == kind]


def run_t1(sched, requests=None, capacity=1, observe=None):
    engine = ToyEngine(sched, [ChainSpec("W", capacity, decode_time=1.0)], cache_tokens=250, observe=observe)
    return engine.run(requests if requests is not None else t1_requests())


ORDER_FCFS = "A1 B1 A2 B2 A3 B3 A4 B4".split()
ORDER_LPM = "A1 A2 A3 A4 B1 B2 B3 B4".split()


# ---------------------------------------------------------------- E1
def test_e1a_fcfs():
    trace = run_t1(FCFSScheduler())
    assert trace.order == ORDER_FCFS
    assert [g[3] for g in trace.grants] == [0] * 8
    assert trace.total_extend == 1760


def test_e1b_lpm():
    trace = run_t1(LPMScheduler())
    assert trace.order == ORDER_LPM
    assert trace.total_extend == 560
    assert trace.grants[4][0] == 80  # B's first admission waits 4 * 20 decode steps


def test_e1c_vtc():
    sched = VTCScheduler()
    rec = Recorder(sched, lambda s, c: s.counter(c))
    trace = run_t1(sched)
    assert trace.order == ORDER_FCFS
    assert trace.total_extend == 1760
    assert rec.values("admit")[:4] == [("A1", 220), ("B1", 220), ("A2", 480), ("B2", 480)]
    assert rec.values("finish")[:4] == [("A1", 260), ("B1", 260), ("A2", 520), ("B2", 520)]
    assert sched.counter("A") == sched.counter("B") == 1040


def test_e1d_dlpm_600():
    sched = DLPMScheduler(quantum=600)
    rec = Recorder(sched, lambda s, c: s.deficit(c))
    trace = run_t1(sched)
    assert trace.order == ORDER_LPM
    assert trace.total_extend == 560
    a_values = [v for rid, kind, v in rec.log if rid.startswith("A")]
    assert a_values == [380, 340, 320, 280, 260, 220, 200, 160]
    assert (sched.deficit("A"), sched.deficit("B")) == (160, 160)
    assert (sched.refills("A"), sched.refills("B")) == (1, 1)


def test_e1e_dlpm_300_full_trace():
    sched = DLPMScheduler(quantum=300)
    rec = Recorder(sched, lambda s, c: s.deficit(c))
    trace = run_t1(sched)
    assert trace.order == "A1 A2 B1 B2 B3 B4 A3 A4".split()
    assert [g[4] for g in trace.grants] == [220, 20, 220, 20, 20, 20, 220, 20]
    assert trace.total_extend == 760
    assert rec.values("admit") == [
        ("A1", 80), ("A2", 20), ("B1", 80), ("B2", 20), ("B3", 260), ("B4", 200), ("A3", 60), ("A4", 0)
    ]
    assert rec.values("finish") == [
        ("A1", 40), ("A2", -20), ("B1", 40), ("B2", -20), ("B3", 220), ("B4", 160), ("A3", 20), ("A4", -40)
    ]
    assert (sched.deficit("A"), sched.deficit("B")) == (-40, 160)
    assert (sched.refills("A"), sched.refills("B")) == (2, 2)
    # identity W = K * Q^u + q(start) - q(end), on actual service
    assert sched.service("A") == 2 * 300 + 0 - (-40) == 640
    assert sched.service("B") == 600 - 160 == 440


def test_e1f_dlpm_100_loop_form():
    sched = DLPMScheduler(quantum=100)
    rec = Recorder(sched, lambda s, c: s.deficit(c))
    rounds = []
    refill = sched.deficits.refill_until_credit

    def counting(eligible):
        n = refill(eligible)
        rounds.append(n)
        return n

    sched.deficits.refill_until_credit = counting
    trace = run_t1(sched)
    assert trace.order == "A1 B1 B2 A2 B3 B4 A3 A4".split()
    assert trace.total_extend == 1160
    assert rec.values("admit") == [
        ("A1", -120), ("B1", -120), ("B2", 20), ("A2", -180), ("B3", -140), ("B4", 0), ("A3", -140), ("A4", 0)
    ]
    assert [v for _, v in rec.values("finish")] == [-160, -160, -20, -220, -180, -40, -180, -40]
    assert [n for n in rounds if n] == [1, 2, 1, 2, 2]  # passes 1, 3, 5, 6, 8
    assert (sched.deficit("A"), sched.deficit("B")) == (-40, 60)
    assert (sched.refills("A"), sched.refills("B")) == (8, 7)
    assert sched.service("A") == 8 * 100 + 40 == 840
    assert sched.service("B") == 7 * 100 - 60 == 640


def test_e1g_bound_check_on_e1e():
    sched = DLPMScheduler(quantum=300)
    lowest = []
    trace = run_t1(sched, observe=lambda t, s: lowest.append(min(s.deficit("A"), s.deficit("B"))))
    assert [g[0] for g in trace.grants[:6]] == [0, 20, 40, 60, 80, 100]
    assert trace.backlog["B"] == [(0, 100)]
    ev = trace.service_events
    # D peaks at +320 when A2's last token is charged at t = 40 (B1 is admitted right after it)
    assert service_in_interval(ev, "A", 0, 40) == 320 and service_in_interval(ev, "B", 0, 39) == 0
    assert service_in_interval(ev, "A", 0, 100) == 320 and service_in_interval(ev, "B", 0, 100) == 400
    gap = max_service_gap(ev, "A", "B", 0, 100)
    assert gap == 400
    assert dlpm_bound(220, 20, 300) == 1120 >= gap
    assert dlpm_bound(220, 240, 300) == 2000
    assert min(lowest) > -260
    assert jain_index([320, 400]) == pytest.approx(518400 / 524800)
    assert round(jain_index([320, 400]), 5) == 0.98780


def test_e1f_lowest_deficit_within_u():
    sched = DLPMScheduler(quantum=100)
    seen = []
    sched.on_service = lambda t, c, a: seen.append(min(sched.deficits.deficit.values()))
    run_t1(sched)
    assert min(seen) == -220 > -260


# ---------------------------------------------------------------- E2
def _requests_260(client, n, base):
    return [ToyRequest(f"{client}{j}", client, tuple(range(base + 1000 * j, base + 1000 * j + 220)), 20) for j in range(1, n + 1)]


def test_e2_vtc_lift_vs_lcf():
    reqs = _requests_260("A", 3, 1_000_000) + _requests_260("B", 3, 2_000_000) + _requests_260("C", 6, 3_000_000)
    vtc = VTCScheduler()
    for c, v in (("A", 1000), ("B", 1200), ("C", 0)):
        vtc.set_counter(c, v)
    rec = Recorder(vtc, lambda s, c: s.counter(c))
    engine = ToyEngine(vtc, [ChainSpec("W", 1)], cache_tokens=250)
    # submit by hand to inspect the lift before the first dispatch
    trace = engine.run(reqs)
    assert trace.order[:3] == ["A1", "C1", "B1"]
    assert rec.values("finish")[0] == ("A1", 1260)
    assert rec.values("admit")[1] == ("C1", 1000 + 220)

    lcf = LCFScheduler()
    for c, v in (("A", 1000), ("B", 1200), ("C", 0)):
        lcf.set_counter(c, v)
    rec = Recorder(lcf, lambda s, c: s.counter(c))
    trace = ToyEngine(lcf, [ChainSpec("W", 1)], cache_tokens=250).run(reqs)
    assert trace.order[:5] == ["C1", "C2", "C3", "C4", "A1"]
    assert [v for rid, v in rec.values("finish")[:4]] == [260, 520, 780, 1040]


def test_e2_lift_on_arrival():
    vtc = VTCScheduler()
    vtc.set_chains([ChainSpec("W", 1)])
    for c, v in (("A", 1000), ("B", 1200), ("C", 0)):
        vtc.set_counter(c, v)
    vtc.submit("a", "A", 220, 0)
    vtc.submit("b", "B", 220, 0)
    vtc.submit("c", "C", 220, 0)
    assert vtc.counter("C") == 1000
    assert vtc.counter("B") == 1200


@pytest.mark.parametrize("lift, expected_c, expected_a", [("recommended", 1200, 1200), ("artifact", 0, 1000)])
def test_e2_empty_queue_variant(lift, expected_c, expected_a):
    vtc = VTCScheduler(lift=lift)
    vtc.set_chains([ChainSpec("W", 1)])
    for c, v in (("A", 1000), ("B", 980), ("C", 0)):
        vtc.set_counter(c, v)
    vtc.submit("b", "B", 220, 0)
    (g,) = vtc.dispatch(0)
    assert g.request_id == "b" and vtc.counter("B") == 1200 and vtc.last_left == "B"
    vtc.submit("c", "C", 220, 1)  # Q is empty: paper rule lifts to c[last_left]
    assert vtc.counter("C") == expected_c
    vtc.submit("a", "A", 220, 2)
    assert vtc.counter("A") == expected_a


# ---------------------------------------------------------------- E3
def test_e3_weighted_vtc():
    reqs = []
    for k in range(1, 9):
        reqs.append(ToyRequest(f"A{k}", "A", tuple(range(10_000 * k, 10_000 * k + 100)), 50))
        reqs.append(ToyRequest(f"B{k}", "B", tuple(range(500_000 + 10_000 * k, 500_000 + 10_000 * k + 100)), 50))
    sched = VTCScheduler(client_weights={"A": 1, "B": 2})
    rec = Recorder(sched, lambda s, c: s.counter(c))
    trace = run_t1(sched, reqs)
    assert trace.order[:7] == "A1 B1 B2 A2 B3 B4 A3".split()
    assert rec.values("finish")[:6] == [("A1", 200), ("B1", 100), ("B2", 200), ("A2", 400), ("B3", 300), ("B4", 400)]


# ---------------------------------------------------------------- E4
def test_e4_vtc_per_step_charging():
    reqs = [
        ToyRequest("A1", "A", tuple(range(10)), 3),
        ToyRequest("B1", "B", tuple(range(100, 104)), 1),
        ToyRequest("B2", "B", tuple(range(200, 204)), 1),
    ]
    seen = {}
    sched = VTCScheduler()
    trace = run_t1(sched, reqs, capacity=2, observe=lambda t, s: seen.__setitem__(t, (s.counter("A"), s.counter("B"))))
    assert seen[0] == (10, 4)
    assert seen[1] == (12, 10)  # step 1 charged (12, 6), then B2 admitted
    assert seen[2] == (14, 12)
    assert seen[3] == (16, 12)
    assert trace.finish_time == {"B1": 1, "B2": 2, "A1": 3}


# ---------------------------------------------------------------- E5
def test_e5_rpm_rolling_window():
    sched = RPMLimitScheduler(limit_rpm=2)
    sched.set_chains([ChainSpec("W", 8)])
    got = {f"A@{t}": sched.submit(f"A@{t}", "A", 10, t) for t in (0, 1, 2, 3, 4)}
    got["B@10"] = sched.submit("B@10", "B", 10, 10)
    assert got == {"A@0": True, "A@1": True, "A@2": False, "A@3": False, "A@4": False, "B@10": True}
    for g in sched.dispatch(10):
        sched.on_finish(g.request_id, 15, output_tokens=1)
    assert sched.free_slots() == {"W": 8}  # idle from t = 20 ...
    assert sched.submit("A@25", "A", 10, 25) is False  # ... and still rejected
    assert sched.submit("A@61", "A", 10, 61) is True  # only A@1 is within 60 s
    assert sched.rejected["A"] == 4


# ---------------------------------------------------------------- E6
def test_e6_doubleq_stickiness():
    index = PrefixIndex(page_size=20)
    index.insert("W1", page_hashes(P_A, 20), 0)
    router = DoubleQRouter(["W1", "W2"], quantum=500, index=index)
    rows = []
    for k in range(1, 8):
        tokens = P_A + tuple(range(1000 * k, 1000 * k + 20))
        w = router.route(f"A{k}", "A", 220, page_hashes(tokens, 20), now=k)
        rows.append((w, router.quanta.value("A", "W1"), router.quanta.value("A", "W2"), router.load["W1"], router.load["W2"]))
    assert rows == [
        ("W1", 280, 500, 1, 0),
        ("W1", 60, 500, 2, 0),
        ("W1", -160, 500, 3, 0),
        ("W2", -160, 280, 3, 1),
        ("W2", -160, 60, 3, 2),
        ("W2", -160, -160, 3, 3),
        ("W1", 120, 340, 4, 3),
    ]
    router.on_finish("A1", 20)
    assert router.quanta.value("A", "W1") == 80 and router.load["W1"] == 3
    assert math.ceil(500 / 220) == 3  # at most 3 consecutive requests stuck to W1


# ---------------------------------------------------------------- E7
E7_WORKERS = [BfioWorker((BfioSession(100, 1),), 1), BfioWorker((BfioSession(40, None),), 1)]


def test_e7_bfio_objective_table():
    assert bfio_objective(E7_WORKERS, (0, 1), (50, 10), 0) == (100, 150)
    assert bfio_objective(E7_WORKERS, (0, 1), (50, 10), 1)[0] == 101
    assert bfio_objective(E7_WORKERS, (0, 1), (50, 10), 2)[0] == 103
    assert bfio_objective(E7_WORKERS, (1, 0), (50, 10), 0) == (20, 110)
    assert bfio_objective(E7_WORKERS, (1, 0), (50, 10), 1)[0] == 101
    assert bfio_objective(E7_WORKERS, (1, 0), (50, 10), 2)[0] == 183


@pytest.mark.parametrize("horizon, assignment, j", [(0, (1, 0), 20), (1, (1, 0), 101), (2, (0, 1), 103)])
def test_e7_bfio_choice(horizon, assignment, j):
    placement = bfio_place(E7_WORKERS, (50, 10), horizon)
    assert placement.assignment == assignment and placement.objective == j and placement.exact


def test_e7_fcfs_most_free_baseline():
    sched = FCFSScheduler(chain_mode="most_free")
    sched.set_chains([ChainSpec("W1", 1), ChainSpec("W2", 1)])
    sched.submit("r1", "x", 50, 0)
    sched.submit("r2", "y", 10, 0)
    assert [(g.request_id, g.chain_id) for g in sched.dispatch(0)] == [("r1", "W1"), ("r2", "W2")]


# ---------------------------------------------------------------- E8
def test_e8_jain():
    assert jain_index([100, 100]) == 1
    assert jain_index([300, 100]) == pytest.approx(0.8)
    assert jain_index([3, 1, 1]) == pytest.approx(25 / 33)
    assert round(jain_index([3, 1, 1]), 4) == 0.7576
    for n in (2, 5, 9):
        assert jain_index([7] + [0] * (n - 1)) == pytest.approx(1 / n)


# ---------------------------------------------------------------- E9
def e9_scheduler(**kwargs):
    sched = SwarmScheduler(
        quantum=300,
        chain_quantum=500,
        prefix_match=lambda r, chain: 200 if (r.request_id, chain) == ("A1", "C2") else 0,
        **kwargs,
    )
    sched.set_chains(
        [
            ChainSpec("C1", 1, decode_time=0.05, prefill_time=0.0025),
            ChainSpec("C2", 1, decode_time=0.10, prefill_time=0.005),
        ]
    )
    sched.set_deficit("A", 50)
    sched.set_deficit("B", 0)
    for client in "AB":
        for chain in ("C1", "C2"):
            sched.set_stickiness(client, chain, 500)
    sched.submit("B1", "B", 60, 0, max_new_tokens=20)
    sched.submit("A1", "A", 220, 0, max_new_tokens=20)
    return sched


def test_e9_dispatch_round_matching():
    sched = e9_scheduler()
    grants = sched.dispatch(0)
    assert sorted((g.request_id, g.chain_id) for g in grants) == [("A1", "C2"), ("B1", "C1")]
    assert (sched.deficit("A"), sched.deficit("B")) == (30, 240)
    assert (sched.refills("A"), sched.refills("B")) == (0, 1)
    assert sched.stickiness("A", "C2") == 280 and sched.stickiness("B", "C1") == 440
    assert sum(g.extend_tokens for g in grants) == 80


def test_e9_expected_times():
    sched = e9_scheduler()
    chains = {c.chain_id: c for c in sched.chains()}

    def t(rid, length, chain, matched):
        c = chains[chain]
        return c.fixed_time + c.prefill_time * (length - matched) + c.decode_time * 20

    assert t("A1", 220, "C1", 0) == pytest.approx(1.55)
    assert t("A1", 220, "C2", 200) == pytest.approx(2.10)
    assert t("B1", 60, "C1", 0) == pytest.approx(1.15)
    assert t("B1", 60, "C2", 0) == pytest.approx(2.30)
    assert sched.rank_chains("A1", 0) == ["C1", "C2"]  # alone, A1 prefers C1 (1.55 < 2.10)


@pytest.mark.parametrize("kwargs", [{"joint_assignment": False}, {"chain_mode": "jffc"}])
def test_e9_greedy_and_jffc(kwargs):
    sched = e9_scheduler(**kwargs)
    grants = sched.dispatch(0)
    assert sorted((g.request_id, g.chain_id) for g in grants) == [("A1", "C1"), ("B1", "C2")]
    assert sched.deficit("A") == -170 and sched.deficit("B") == 240
    assert sum(g.extend_tokens for g in grants) == 280


def test_e9_lpm_mode_matches_matching():
    sched = e9_scheduler(chain_mode="lpm")
    grants = sched.dispatch(0)
    assert sorted((g.request_id, g.chain_id) for g in grants) == [("A1", "C2"), ("B1", "C1")]


# ---------------------------------------------------------------- E10
def test_e10_swarm_bound_numbers():
    assert swarm_bound([4, 4, 2], 1536, 512, 8192) == 39936
    assert swarm_bound([4, 4, 2], 1536, 512, 8192, concurrency_cap=4) == 27648
    assert swarm_bound([4, 4, 2], 1536, 512, 8192, lease_output=True) == 39936 + 2 * 2 * 5120


# ------------------------------------------- chain-composition §9.6 (JFFC trace)
def test_jffc_trace_with_fcfs():
    sched = FCFSScheduler()  # chain_mode jffc
    sched.set_chains([ChainSpec("k1", 1, mean_service_time=2), ChainSpec("k2", 2, mean_service_time=4)])
    placed = {}

    def arrive(rid, t):
        sched.submit(rid, rid, 10, t)
        for g in sched.dispatch(t):
            placed[g.request_id] = g.chain_id

    def done(rid, t):
        sched.on_finish(rid, t)
        for g in sched.dispatch(t):
            placed[g.request_id] = g.chain_id

    for rid, t in (("J1", 0), ("J2", 0.5), ("J3", 1.0), ("J4", 1.5), ("J5", 1.6)):
        arrive(rid, t)
    assert placed == {"J1": "k1", "J2": "k2", "J3": "k2"}
    assert sched.queue_lengths()["J4"] == 1
    done("J1", 2.0)
    assert placed["J4"] == "k1"
    done("J3", 3.0)
    assert placed["J5"] == "k2"
