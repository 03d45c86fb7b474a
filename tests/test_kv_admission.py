"""Token admission in the orchestrator (``--kv-admission tokens``, the default): a session reserves its own KV
need (prompt + max_tokens, in 16-token pages), a chain admits sessions while its budget — c_k slots of the
expected session length — has room, and the servers' pools never hold more than the plan gave them.

Driven in process (the orchestrator with an in-memory DHT, as test_orchestrator_logic does); the product's path
end to end is measured by ``python -m experiments.bench.batching`` (the HTTP rows).
"""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from planner.plan import plan
from swarm.control import planning
from swarm.control.orchestrator import Orchestrator
from swarm.control.planning import Expectations
from swarm.control.view import OrchestratorConfig
from test_orchestrator_logic import ORCHESTRATOR, PREFIX, SERVERS, MemoryDHT, profile, publish, serve_assignments

TOKENS = Expectations(max_length=1024, input_tokens=64, output_tokens=16, arrival_rate=4.0)
SLOTS = dataclasses.replace(TOKENS, kv_admission="slots")


async def _serving(expect):
    dht = MemoryDHT()
    config = OrchestratorConfig(model_dir="unused", dht_prefix=PREFIX, num_blocks=4, expect=expect, policy="dlpm",
                                settle_s=0.0)
    orch = Orchestrator(config, dht, identity=ORCHESTRATOR)
    publish(dht, *[profile(n, m) for n, m in SERVERS])
    await orch.start()
    serve_assignments(dht)
    await orch.refresh()
    return orch, dht


async def _burst(orch, count, input_tokens, max_new_tokens):
    """``count`` acquires at once; returns the grants made without anyone finishing (the rest time out)."""
    tasks = [asyncio.ensure_future(orch.acquire(f"c{i % 3}", input_tokens, max_new_tokens, timeout=0.5))
             for i in range(count)]
    done = await asyncio.gather(*tasks, return_exceptions=True)
    return [g for g in done if not isinstance(g, BaseException)]


def _pool_tokens(orch) -> dict[str, int]:
    return {node: a.cache_slots * a.slot_size for node, a in orch.view.assignments.items()}


def test_slots_are_the_expected_session_length_and_assignments_say_so():
    assert TOKENS.slot_tokens == 80 and SLOTS.slot_tokens == 1024
    assert TOKENS.kv_need(30, 18) == 48 and TOKENS.kv_need(30, 19) == 64 and SLOTS.kv_need(30, 18) == 1024

    async def scenario():
        orch, _ = await _serving(TOKENS)
        assert all(a.slot_tokens == 80 for a in orch.view.assignments.values() if a.num_blocks)
        await orch.stop()

    asyncio.run(scenario())


def test_short_sessions_run_many_at_once_within_every_servers_pool():
    """The same servers: with max-length slots the plan's capacity bounds concurrency; with token admission
    the same memory runs many more short sessions, and what they hold never exceeds a server's pool."""

    async def scenario(expect):
        orch, _ = await _serving(expect)
        grants = await _burst(orch, 200, 20, 12)  # 32 tokens each
        held, pools = orch.occupancy.per_server(), orch.kv_pools()  # KV token-blocks
        assert all(held.get(n, 0) <= pools[n] for n in pools), (held, pools)
        tokens_held = {}
        for g in grants:
            chain = orch.chain(g.chain_id)
            for node, (a, b) in zip(chain.servers, chain.spans):
                tokens_held[node] = tokens_held.get(node, 0) + (b - a) * orch.session_tokens(g.request_id)
        pools = _pool_tokens(orch)
        assert all(tokens_held[n] <= pools[n] for n in tokens_held), (tokens_held, pools)
        capacity = sum(c.capacity for c in orch.view.chains if c.ready)
        await orch.stop()
        return len(grants), capacity

    by_slots, capacity = asyncio.run(scenario(SLOTS))
    by_tokens, _ = asyncio.run(scenario(TOKENS))
    assert by_slots == capacity
    assert by_tokens >= 3 * by_slots, (by_tokens, by_slots)


def test_the_plan_keeps_a_chain_that_holds_a_max_length_session_when_memory_allows():
    """Slots sized for the expected session (80 tokens) and a 1,024-token max_length: the c that the bound
    prefers (c = 1) forms two chains of capacity 7, whose 560-token budgets hold no max-length session, so such
    a request would get a 400 although the servers can hold it. The plan is made over the c whose chains
    include one of c_k >= c_min = 13 instead, and a max-length request is granted."""
    small = [profile(n, m) for n, m in (("a", 2), ("b", 2), ("c", 1.5))]
    assert TOKENS.min_c == 13 and SLOTS.min_c == 1

    async def scenario():
        dht = MemoryDHT()
        config = OrchestratorConfig(model_dir="unused", dht_prefix=PREFIX, num_blocks=4, expect=TOKENS,
                                    policy="dlpm", settle_s=0.0)
        orch = Orchestrator(config, dht, identity=ORCHESTRATOR)
        publish(dht, *small)
        await orch.start()
        serve_assignments(dht)
        await orch.refresh()
        model, servers = planning.planner_inputs(small, 4, TOKENS)
        unconstrained = plan(model, servers, TOKENS.arrival_rate)
        assert max(ch.capacity for ch in unconstrained.chains) * TOKENS.slot_tokens < TOKENS.max_length
        assert max(c.capacity for c in orch.view.chains) >= TOKENS.min_c
        assert orch.status()["plan"]["longest_session_tokens"] == TOKENS.max_length
        assert not any(e["event"] == "plan_short_sessions" for e in orch.events)
        grant = await orch.acquire("c", 24, TOKENS.max_length - 24, timeout=1.0)
        assert orch.session_tokens(grant.request_id) == TOKENS.max_length
        # the status (and the dashboard) give each chain's KV budget and what its sessions hold of it
        chain = next(c for c in orch.status()["chains"] if c["id"] == grant.chain_id)
        assert chain["kv_tokens"] == chain["capacity"] * TOKENS.slot_tokens
        assert chain["kv_tokens_held"] == TOKENS.max_length and chain["active"] == 1
        orch.finish(grant.request_id, 16)
        await orch.stop()

    asyncio.run(scenario())


def test_a_request_no_chain_can_hold_is_refused_at_once_and_one_that_fits_is_granted():
    long = dataclasses.replace(TOKENS, max_length=8192)

    async def scenario():
        orch, _ = await _serving(long)
        largest = max(c.capacity for c in orch.view.chains) * long.slot_tokens
        assert largest < long.max_length  # these servers cannot hold a max-length session on any chain
        # the operator is told: a warning event with the plan, and the status document's longest session
        assert any(e["event"] == "plan_short_sessions" and e["longest"] == largest for e in orch.events)
        assert orch.status()["plan"]["longest_session_tokens"] == largest
        with pytest.raises(ValueError, match="more than any chain of the current plan holds"):
            await orch.acquire("c", largest, 16, timeout=1.0)
        grant = await orch.acquire("c", largest - 32, 16, timeout=1.0)  # fits the largest chain: granted
        assert orch.session_tokens(grant.request_id) <= largest
        orch.finish(grant.request_id, 16)
        await orch.stop()

    asyncio.run(scenario())


def test_finished_sessions_give_their_tokens_back():
    async def scenario():
        orch, _ = await _serving(TOKENS)
        first = await _burst(orch, 200, 20, 12)
        assert first and len(await _burst(orch, 5, 20, 12)) == 0  # full: the next ones wait (and time out)
        for g in first:
            orch.finish(g.request_id, 12)
        assert orch.occupancy.per_server() == {}
        assert len(await _burst(orch, len(first), 20, 12)) == len(first)
        await orch.stop()

    asyncio.run(scenario())


def test_an_answer_without_max_tokens_reserves_in_parts_and_grows_only_into_room():
    """max_tokens omitted: the rest of the session length is allowed on the servers (their paged pools hold only
    what is used) while the orchestrator reserves a part (``reserve``) and grows it with ``grow``: such answers run
    many at once where full max-length reservations would be refused outright, growth takes free budget only,
    and the occupancy the servers are checked against follows the reservation."""
    long = dataclasses.replace(TOKENS, max_length=8192)

    async def scenario():
        orch, _ = await _serving(long)
        largest = max(c.capacity for c in orch.view.chains) * long.slot_tokens
        with pytest.raises(ValueError, match="more than any chain"):
            await orch.acquire("c", 40, long.max_length - 40, timeout=1.0)  # the whole rest, reserved at once
        grants = [await orch.acquire(f"c{i}", 40, long.max_length - 40, reserve=24, timeout=1.0) for i in range(3)]
        first = grants[0].request_id
        assert orch.reserved_tokens(first) == 64 and orch.session_tokens(first) == long.max_length
        assert orch.occupancy.weight(first) == 64
        assert orch.grow(first, 64) and orch.reserved_tokens(first) == 128 == orch.occupancy.weight(first)
        while orch.grow(first, 64):  # until its chain's budget is used up
            assert orch.reserved_tokens(first) <= largest
        assert any(e["event"] == "reservation_full" for e in orch.events)
        held, pools = orch.occupancy.per_server(), orch.kv_pools()
        assert all(held.get(n, 0) <= pools[n] for n in pools), (held, pools)
        for g in grants:
            orch.finish(g.request_id, 100)
        assert orch.occupancy.per_server() == {}
        await orch.stop()

    asyncio.run(scenario())
