"""WS-RR, BPRR's request router, on the live orchestrator (swarm.control.ws_rr and Orchestrator(router="ws-rr")).

The router itself (pure bookkeeping over planner.baselines.ws_rr_route), then the orchestrator on an in-memory
DHT: servers keep KV for their whole memory, requests get per-request paths that bypass the chains, wait for
slots in arrival order, and free them when they finish.
"""
import asyncio
import math

import pytest

from planner.baselines import ws_rr_route
from planner.model import ModelSpec, Placement, Server
from swarm.control.orchestrator import NoChainsError, QueueTimeout
from swarm.control.ws_rr import WsRrRouter

from test_orchestrator_logic import profile, run, serving_orchestrator

MODEL = ModelSpec(num_blocks=4, block_size_gb=1.0, cache_slot_gb=0.5)
# "fast" holds the whole model; "left" + "right" split it (2 blocks each)
SERVERS = [Server("fast", 6.0, comm_time_s=1.0, compute_time_s=0.5),
           Server("left", 4.0, comm_time_s=0.5, compute_time_s=0.25),
           Server("right", 4.0, comm_time_s=0.5, compute_time_s=0.25)]
PLACEMENT = Placement(((0, 4), (0, 2), (2, 4)))
CAPACITY = {"fast": 4, "left": 4, "right": 4}  # block-slots: one session on fast, two on left and right


def router():
    r = WsRrRouter()
    assert r.update(MODEL, SERVERS, PLACEMENT, CAPACITY) == []
    return r


def test_routes_are_the_planners_ws_rr_choice_and_account_block_slots():
    r = router()
    first = r.submit("r1", now=0.0)
    # split path: 0.5 + 0.5 + 0.25·2·2 = 2.0 s < fast 1.0 + 0.5·4 = 3.0 s
    assert first == ws_rr_route(MODEL, SERVERS, PLACEMENT, lambda j, s: 0.0)
    assert first.servers == ("left", "right") and first.start_delay == 0.0
    assert r.startable(0.0) == [("r1", first)]
    assert r.in_use("left") == 2 and r.in_use("right") == 2 and r.in_use("fast") == 0
    second = r.submit("r2", now=0.1)
    assert second.servers == ("left", "right")  # still free slots (2 of 4 per server)
    assert [rid for rid, _ in r.startable(0.1)] == ["r2"]
    # now left/right are full until ~2.0 s: waiting 1.9 s + 2.0 > fast's 3.0 s, so the next takes fast
    third = r.submit("r3", now=0.1)
    assert third.servers == ("fast",) and third.start_delay == 0.0
    # and the one after waits: fast is full until 3.1 s, the split path frees at ~2.0 s
    fourth = r.submit("r4", now=0.2)
    assert fourth.servers == ("left", "right") and fourth.start_delay == pytest.approx(1.8)
    assert [rid for rid, _ in r.startable(0.2)] == ["r3"]  # r4 has to wait for slots
    assert r.status()["waiting"] == 1
    assert r.release("r1")
    assert [rid for rid, _ in r.startable(2.0)] == ["r4"]
    assert not r.release("r1") and "r1" not in r


def test_a_waiting_request_is_not_overtaken_on_its_servers():
    r = WsRrRouter()
    r.update(MODEL, SERVERS[1:], Placement(((0, 2), (2, 4))), {"left": 2, "right": 2})  # one session each
    assert r.submit("a", 0.0) and [x for x, _ in r.startable(0.0)] == ["a"]
    assert r.submit("b", 0.0) and r.submit("c", 0.0)
    assert r.startable(0.0) == []  # both wait for a
    r.release("a")
    assert [x for x, _ in r.startable(1.0)] == ["b"]  # b first; c still waits behind it
    r.release("b")
    assert [x for x, _ in r.startable(2.0)] == ["c"]


def test_no_path_and_lost_paths():
    r = WsRrRouter()
    assert r.submit("x", 0.0) is None  # no topology yet
    r.update(MODEL, SERVERS[1:2], Placement(((0, 2),)), {"left": 4})
    assert r.submit("x", 0.0) is None  # blocks 2..3 are served by nobody
    r = router()
    r.submit("run", 0.0)
    r.startable(0.0)
    r.submit("wait1", 0.0)
    r.submit("wait2", 0.0)
    r.submit("wait3", 0.0)
    waiting = [rid for rid in ("wait1", "wait2", "wait3") if rid in r and not r._requests[rid].started]
    assert waiting
    # "right" leaves: the waiting requests whose path used it are handed back to be routed again
    lost = r.update(MODEL, SERVERS[:2], Placement(((0, 4), (0, 2))), {"fast": 4, "left": 4})
    assert lost and all(rid not in r for rid in lost)
    assert "run" in r  # a started request keeps its accounting until it ends
    assert r.submit(lost[0], 1.0).servers == ("fast",)


def test_wait_estimate_uses_expected_completions():
    r = WsRrRouter()
    r.update(MODEL, SERVERS[:1], Placement(((0, 4),)), {"fast": 4})
    r.submit("a", 0.0)
    r.startable(0.0)
    assert r._wait_s("fast", 4, 1.0) == pytest.approx(2.0)  # a ends at 3.0 (service 3.0)
    assert r._wait_s("fast", 5, 1.0) == math.inf


# -- on the orchestrator --------------------------------------------------------------------------------

SPLIT = [profile("a", 6), profile("b", 3), profile("c", 3)]


def test_orchestrator_ws_rr_grants_paths_fills_memory_and_frees_slots():
    async def scenario():
        orch, dht = await serving_orchestrator("fcfs", SPLIT, router="ws-rr")
        status = orch.status()
        assert status["router"] == "ws-rr"
        plan_slots = {sp.id: sp.slots_allocated for sp in orch.view.plan.servers if sp.span}
        capacity = {sid: v["capacity"] for sid, v in status["ws_rr"]["block_slots"].items() if v["capacity"]}
        assert capacity and all(capacity[sid] >= plan_slots[sid] for sid in capacity)  # whole memory
        grants = []
        while True:  # take every slot
            try:
                grants.append(await orch.acquire("client", 10, 10, timeout=0.2))
            except QueueTimeout:
                break
        assert len(grants) >= 2
        for g in grants:
            chain = orch.chain(g.chain_id)
            assert "/ws-rr/" in g.chain_id and chain.capacity == 1
            assert [peer for peer, _, _ in chain.route] == [f"peer-{n}" for n in chain.servers]
            assert chain.spans[0][0] == 0 and chain.spans[-1][1] == 4
        in_use = orch.status()["ws_rr"]["block_slots"]
        assert all(v["in_use"] <= v["capacity"] for v in in_use.values())
        waiting = asyncio.ensure_future(orch.acquire("late", 10, 10, timeout=5))
        await asyncio.sleep(0.05)
        assert not waiting.done() and orch.status()["ws_rr"]["waiting"] == 1
        freed_path = orch.chain(grants[0].chain_id).servers
        orch.finish(grants[0].request_id, 10)
        with pytest.raises(Exception, match="not part of the current plan"):
            orch.chain(grants[0].chain_id)  # a finished request's path is gone
        granted = await waiting
        assert orch.chain(granted.chain_id).servers == freed_path
        for g in grants[1:] + [granted]:
            orch.finish(g.request_id, 10)
        assert orch.status()["ws_rr"]["running"] == 0
        assert all(v["in_use"] == 0 for v in orch.status()["ws_rr"]["block_slots"].values())
        await orch.stop()

    run(scenario())


def test_orchestrator_ws_rr_timeout_gives_the_reservation_back():
    async def scenario():
        orch, dht = await serving_orchestrator("fcfs", [profile("solo", 3)], router="ws-rr")
        held = []
        while True:
            try:
                held.append(await orch.acquire("c", 10, 10, timeout=0.2))
            except QueueTimeout:
                break
        assert orch.status()["ws_rr"]["waiting"] == 0  # the timed-out request left no reservation
        for g in held:
            orch.finish(g.request_id, 1)
        again = await orch.acquire("c", 10, 10, timeout=1)
        assert "/ws-rr/" in again.chain_id
        await orch.stop()

    run(scenario())


def test_unknown_router_is_refused():
    from test_orchestrator_logic import make

    with pytest.raises(ValueError, match="unknown router"):
        make("fcfs", router="round-robin")


def test_ws_rr_without_served_servers_has_no_path():
    async def scenario():
        from test_orchestrator_logic import make, publish

        orch, dht = make("fcfs", router="ws-rr")
        publish(dht, *SPLIT)
        await orch.start()  # planned, but nobody serves yet
        with pytest.raises(NoChainsError):
            await orch.acquire("c", 10, 10, timeout=0.2)
        await orch.stop()

    run(scenario())
