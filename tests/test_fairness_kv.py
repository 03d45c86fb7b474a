"""KV budgets in tokens (ChainSpec.kv_tokens): a request takes its own need, not a max-length slot.

Under every policy: the running requests' needs never exceed a chain's budget; a request that fits waits only while
the room is taken and starts as soon as it is back; one larger than every budget fits no chain; without budgets the
scheduler behaves as before (one slot per request).
"""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from planner.fairness import ChainSpec, make_scheduler

POLICIES = ("fcfs", "vtc", "dlpm", "swarm", "bfio", "lpm")


def _chains(budget_a=512, budget_b=256):
    return [ChainSpec("a", 100, decode_time=0.05, max_length=512, kv_tokens=budget_a, servers=("s1",)),
            ChainSpec("b", 100, decode_time=0.1, max_length=512, kv_tokens=budget_b, servers=("s2",))]


def test_kv_need_is_prompt_plus_output_cap_in_whole_pages():
    spec = _chains()[0]
    assert spec.kv_need(30, 18) == 48
    assert spec.kv_need(30, 19) == 64
    assert spec.kv_need(100, None) == 512  # no cap: the rest of max_length
    assert ChainSpec("x", 2).kv_need(30, 18) == 0  # no budget: slots only
    assert not spec.fits(500, 20)  # past max_length
    assert not ChainSpec("y", 9, kv_tokens=64).fits(60, 10)  # larger than the whole budget


def test_many_short_requests_share_a_chain_that_two_long_slots_would_fill():
    s = make_scheduler("dlpm", quantum=100)
    s.set_chains(_chains())
    for i in range(20):
        s.submit(f"r{i}", "c", 12, 0.0, max_new_tokens=20)  # 32 tokens each
    grants = s.dispatch(0.0)
    per_chain = {k: sum(g.chain_id == k for g in grants) for k in ("a", "b")}
    assert per_chain == {"a": 16, "b": 4}  # 512 / 32 and the rest on the slower chain
    assert s.work_conserving()


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(POLICIES),
       jobs=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 200), st.sampled_from(["x", "y", "z"])),
                     min_size=1, max_size=40),
       finish_every=st.integers(1, 5))
def test_needs_never_exceed_a_budget_and_fitting_requests_are_never_refused(policy, jobs, finish_every):
    s = make_scheduler(policy, **({"quantum": 200} if policy in ("dlpm", "swarm", "bfio") else {}))
    s.set_chains(_chains())
    budgets = {c.chain_id: c.kv_tokens for c in s.chains()}
    running: dict[str, tuple[str, int]] = {}
    now = 0.0
    for i, (prompt, out, client) in enumerate(jobs):
        now += 0.1
        s.submit(f"r{i}", client, prompt, now, max_new_tokens=out)
        for g in s.dispatch(now):
            spec = next(c for c in s.chains() if c.chain_id == g.chain_id)
            running[g.request_id] = (g.chain_id, spec.kv_need(*next((p, o) for j, (p, o, _) in enumerate(jobs)
                                                                       if f"r{j}" == g.request_id)))
        held = {k: sum(n for c, n in running.values() if c == k) for k in budgets}
        assert all(held[k] <= budgets[k] for k in budgets), held
        assert s.work_conserving()
        if i % finish_every == 0 and running:
            done = sorted(running)[0]
            s.on_finish(done, now, output_tokens=1)
            del running[done]
    for g in s.dispatch(now):  # the orchestrator dispatches after every event: also after the last finish
        running[g.request_id] = (g.chain_id, 0)
    while running:  # drain: every queued request that fits a chain is eventually started
        now += 0.1
        done = sorted(running)[0]
        s.on_finish(done, now, output_tokens=1)
        del running[done]
        for g in s.dispatch(now):
            running[g.request_id] = (g.chain_id, 0)
    assert sum(s.queue_lengths().values()) == 0


def test_without_budgets_one_request_takes_one_slot():
    s = make_scheduler("fcfs")
    s.set_chains([ChainSpec("a", 2, decode_time=0.05, max_length=512)])
    for i in range(5):
        s.submit(f"r{i}", "c", 400, 0.0, max_new_tokens=100)
    assert len(s.dispatch(0.0)) == 2


def test_a_running_request_grows_its_reservation_only_into_free_room():
    """CentralQueueScheduler.grow: an answer reserved in parts takes more of its chain's budget while the budget
    has room, is refused (unchanged) when it has none or past max_length, and gives it all back at its end."""
    s = make_scheduler("fcfs")
    s.set_chains([ChainSpec("a", 10, decode_time=0.05, max_length=512, kv_tokens=160, servers=("s1",))])
    s.submit("long", "c", 16, 0.0, max_new_tokens=16)  # 32 tokens
    s.submit("other", "d", 16, 0.0, max_new_tokens=80)  # 96 tokens
    assert {g.request_id for g in s.dispatch(0.0)} == {"long", "other"}
    assert s.grow("long", 32)  # 64: 160 - 96 = 64 free
    assert s.request("long").kv_tokens == 64 and s.request("long").max_new_tokens == 48
    assert not s.grow("long", 1)  # 80 > the 64 left to it
    assert s.request("long").kv_tokens == 64
    s.on_finish("other", 1.0, output_tokens=80)
    assert s.grow("long", 96) and s.request("long").kv_tokens == 160
    assert not s.grow("long", 400)  # past max_length
    s.submit("next", "d", 8, 1.0, max_new_tokens=8)
    assert s.dispatch(1.0) == []  # the whole budget is the grown answer's
    s.on_finish("long", 2.0, output_tokens=144)
    assert [g.request_id for g in s.dispatch(2.0)] == ["next"]
