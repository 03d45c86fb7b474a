"""The orchestrator's control logic on an in-memory DHT: planning, assignments, readiness, JFFC, fairness, leases.

(The same orchestrator runs against real server processes in tests/test_runtime.py.)
"""
import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from planner.plan import plan as run_planner
from swarm.control import planning
from swarm.trust import records
from swarm.trust.identity import Identity
from swarm.control.orchestrator import NoChainsError, Orchestrator, OrchestratorConfig, QueueTimeout, UnknownLeaseError
from swarm.control.planning import Expectations
from swarm.engine.routing import NoRouteError

MB = 10**6


class MemoryDHT:
    """Just enough of hivemind.DHT's get/store (subkeys, latest) for the orchestrator's records."""

    def __init__(self):
        self.data: dict[str, dict[str, object]] = {}
        self.peer_id = SimpleNamespace(to_base58=lambda: "orchestrator-peer")

    def store(self, key, value, expiration_time, subkey=None):
        self.data.setdefault(key, {})[subkey] = value
        return True

    def get(self, key, latest=False):
        if key not in self.data:
            return None
        return SimpleNamespace(value={k: SimpleNamespace(value=v) for k, v in self.data[key].items()})

    def drop(self, key, subkey):
        self.data[key].pop(subkey, None)


def profile(node, memory_mb, *, state=records.WAITING, start=None, end=None, slots=0, rtt=0.001):
    return records.ServerProfile(node_id=node, peer_id=f"peer-{node}", memory_bytes=int(memory_mb * MB),
                                 block_bytes=200_000, cache_bytes_per_token=512, prefill_s=1e-5, decode_s=5e-4,
                                 rtt_s=rtt, state=state, start=start, end=end, cache_slots=slots)


ORCHESTRATOR = Identity.generate()  # the orchestrator's signing key in these tests
_NODE_KEYS: dict[str, Identity] = {}


def node_key(node: str) -> bytes:
    """The public key node ``node`` signs its profile with (one per node id, made once: a 2048-bit RSA key takes
    ~0.1 CPU-s to make, and ``setdefault(node, Identity.generate())`` made one on every call, 17 CPU-s a run)."""
    if node not in _NODE_KEYS:
        _NODE_KEYS[node] = Identity.generate()
    return _NODE_KEYS[node].public


EXPECT = Expectations(max_length=1024, input_tokens=64, output_tokens=16, arrival_rate=4.0,
                      kv_admission="slots")  # the papers' fixed-length slots (token admission: test_kv_admission)
PREFIX = "tiny-cs"


def make(policy="dlpm", **kw):
    dht = MemoryDHT()
    config = OrchestratorConfig(model_dir="unused", dht_prefix=PREFIX, num_blocks=4, expect=EXPECT, policy=policy,
                                quantum=kw.pop("quantum", 8192.0), settle_s=kw.pop("settle_s", 0.0), **kw)
    return Orchestrator(config, dht, identity=ORCHESTRATOR), dht


def publish(dht, *profiles):
    for p in profiles:
        records.publish_profile(dht, PREFIX, p, ttl=10, owner=node_key(p.node_id))


def serve_assignments(dht):
    """Every server does what it was told (what server.node does for real)."""
    assigned = records.fetch_assignments(dht, PREFIX, ORCHESTRATOR.public)
    for node, p in records.fetch_profiles(dht, PREFIX).items():
        a = assigned[node]
        state = records.SERVING if a.end > a.start else records.WAITING
        publish(dht, profile(node, p.memory_bytes / MB, state=state, start=a.start if a.end > a.start else None,
                             end=a.end if a.end > a.start else None, slots=a.cache_slots))


SERVERS = [("a", 6), ("b", 3), ("c", 3), ("d", 2)]


async def serving_orchestrator(policy="dlpm", profiles=None, **kw):
    """An orchestrator whose plan's chains are all served (every server did what it was assigned)."""
    orch, dht = make(policy, **kw)
    publish(dht, *(profiles or [profile(n, m) for n, m in SERVERS]))
    await orch.start()
    serve_assignments(dht)
    await orch.refresh()
    return orch, dht


def run(coro):
    return asyncio.run(coro)


def test_plan_equals_planner_output_and_chains_become_ready_only_when_served():
    async def scenario():
        orch, dht = make()
        publish(dht, *(profile(n, m) for n, m in SERVERS))
        await orch.start()
        status = orch.status()
        model, servers = planning.planner_inputs([profile(n, m) for n, m in SERVERS], 4, EXPECT)
        expected = run_planner(model, servers, EXPECT.arrival_rate, target_load=EXPECT.target_load)
        published = {k: v for k, v in status["plan"].items() if k not in ("plan_id", "kept_ranges", "replans", "inputs",
                                                                     "longest_session_tokens")}
        assert published == expected.to_dict()
        assigned = records.fetch_assignments(dht, PREFIX, ORCHESTRATOR.public)
        assert {n: (a.start, a.end) for n, a in assigned.items() if a.end > a.start} == {
            sp.id: sp.span for sp in expected.servers if sp.span}
        assert records.fetch_orchestrator(dht, PREFIX, ORCHESTRATOR.public).peer_id == "orchestrator-peer"
        assert records.fetch_orchestrator(dht, PREFIX, node_key("a")) is None  # believed under its key only
        assert status["chains"] and not any(c["ready"] for c in status["chains"])
        with pytest.raises(QueueTimeout):  # a plan but no served chain yet: the request waits
            await orch.acquire("alice", 10, 10, timeout=0.2)
        serve_assignments(dht)
        await orch.refresh()
        assert all(c["ready"] for c in orch.status()["chains"])
        await orch.stop()

    run(scenario())


def test_jffc_fills_the_fastest_chain_first_then_queues():
    async def scenario():
        orch, dht = await serving_orchestrator("fcfs")
        chains = orch.view.chains
        total = sum(c.capacity for c in chains)
        grants = [await orch.acquire(f"client{i}", 10, 10, timeout=1) for i in range(total)]
        order = [orch.chain(g.chain_id).index for g in grants]
        assert order == sorted(order), "JFFC must fill chains fastest first"
        assert [order.count(c.index) for c in chains] == [c.capacity for c in chains]
        waiting = asyncio.ensure_future(orch.acquire("late", 10, 10, timeout=5))
        await asyncio.sleep(0.05)
        assert not waiting.done() and orch.status()["queue"] == {"late": 1}
        freed = grants[-1]
        orch.finish(freed.request_id, 10)
        granted = await waiting
        assert granted.chain_id == freed.chain_id
        await orch.stop()

    run(scenario())


def test_a_failed_session_resumes_in_its_place_ahead_of_newer_requests_and_times_out_cleanly():
    async def scenario():
        orch, dht = await serving_orchestrator("fcfs")
        total = sum(c.capacity for c in orch.view.chains)
        grants = [await orch.acquire("alice", 10, 10, timeout=1) for _ in range(total)]
        newer = asyncio.ensure_future(orch.acquire("alice", 10, 10, timeout=5))  # queued behind a full swarm
        await asyncio.sleep(0.05)
        failed = grants[0]  # its server died after 4 tokens: the continuation is prompt + 4, 6 tokens left
        orch.tokens(failed.request_id, 4)
        resumed = await orch.resume(failed.request_id, "alice", 14, 6, timeout=1)
        # its own slot is free again and it keeps its place: it starts before the newer request, same id
        assert resumed.request_id == failed.request_id and not newer.done()
        assert orch.session_tokens(failed.request_id) == orch.config.expect.kv_need(14, 6)
        orch.finish(resumed.request_id, 6)
        assert (await newer).request_id != failed.request_id
        # every server failed: no chain within the bound, a clear QueueTimeout, and the request leaves
        for p in list(orch.view.profiles.values()):
            orch.report_failure(p.peer_id)
        await asyncio.sleep(0.05)
        refusals = lambda: sum(e.get("count", 1) for e in orch.events if e["event"] == "refused")  # noqa: E731
        before = refusals()
        with pytest.raises(QueueTimeout, match="rest of the session within 0 s"):
            await orch.resume(grants[1].request_id, "alice", 14, 6, timeout=0.2)
        assert grants[1].request_id not in orch.router.scheduler._requests
        assert refusals() == before + 1  # a failed session that finds no chain: its client gets a 503
        with pytest.raises(QueueTimeout):  # a preempted answer's rest: it ends at length, not a refusal
            await orch.resume(grants[2].request_id, "alice", 14, 6, timeout=0.2, refused=False)
        assert refusals() == before + 1
        await orch.stop()

    run(scenario())


def test_dlpm_keeps_serving_a_light_client_behind_a_flood():
    async def scenario():
        orch, dht = await serving_orchestrator("dlpm", [profile("solo", 3)], quantum=100.0)
        capacity = sum(c.capacity for c in orch.view.chains)
        running = [await orch.acquire("flood", 50, 20, timeout=1) for _ in range(capacity)]
        flood = [asyncio.ensure_future(orch.acquire("flood", 50, 20, timeout=30)) for _ in range(20)]
        await asyncio.sleep(0.05)
        light = asyncio.ensure_future(orch.acquire("light", 50, 20, timeout=30))
        await asyncio.sleep(0.05)
        served = []
        for _ in range(6):  # complete sessions one at a time; see who gets the freed slots
            done = running.pop(0)
            orch.tokens(done.request_id, 20)
            orch.finish(done.request_id, 20)
            await asyncio.sleep(0.01)
            for fut, who in [(light, "light")] + [(f, "flood") for f in flood]:
                if fut.done() and fut not in [s[0] for s in served]:
                    served.append((fut, who))
                    running.append(fut.result())
        assert "light" in [who for _, who in served][:3], "the light client must not wait behind the flood"
        for fut in flood:
            fut.cancel()
        await orch.stop()

    run(scenario())


def test_leases_release_unknown_and_too_long():
    async def scenario():
        orch, dht = await serving_orchestrator()
        record = await orch.grant_lease("alice", 10, 10, timeout=1)
        chain = orch.chain(record.lease.chain_id)
        assert record.lease.route == chain.route and chain.route[0][1] == 0 and chain.route[-1][2] == 4
        assert orch.status()["chains"][chain.index]["active"] == 1
        orch.release_lease(record.lease.lease_id, output_tokens=10)
        assert orch.status()["chains"][chain.index]["active"] == 0
        with pytest.raises(UnknownLeaseError):
            orch.release_lease(record.lease.lease_id)
        with pytest.raises(ValueError, match="exceeds"):
            await orch.acquire("alice", 1000, 100, timeout=1)
        await orch.stop()

    run(scenario())


def test_failed_server_is_excluded_at_once_and_reroute_avoids_it():
    async def scenario():
        orch, dht = await serving_orchestrator()
        first = orch.view.chains[0]
        victim = first.route[0][0]
        route = await orch.reroute(first.chain_id, 0, 4, [victim])
        assert victim not in [p for p, _, _ in route] and route[0][1] == 0 and route[-1][2] == 4
        await orch.refresh()  # GCA rebuild without the failed server, before its record even expires
        assert all(victim not in [p for p, _, _ in c.route] for c in orch.view.chains)
        with pytest.raises(NoRouteError):
            await orch.reroute(first.chain_id, 0, 4, [p for c in orch.view.chains for p, _, _ in c.route])
        await orch.stop()

    run(scenario())


def test_failures_after_a_move_exclude_nobody_and_real_ones_still_do():
    """A session on a chain of an older plan fails when its server moved to the new plan's range: no evidence
    (the chaos soak saw such reports cascade into excluding healthy survivors); the same report on blocks the
    server still has, or on a chain of the current plan, excludes it."""
    async def scenario():
        orch, dht = await serving_orchestrator()
        peer = orch.view.chains[0].route[0][0]
        node = next(n for n, p in orch.view.profiles.items() if p.peer_id == peer)
        serving = orch.view.published[node]
        # the current plan moves it to blocks [2, 4); a session of the older plan had it for [0, 2)
        orch.view.published[node] = replace(serving, start=2, end=4)
        await orch.reroute("an-older-plan/0", 0, 2, [peer])
        assert node not in orch.suspects and "failure_after_a_move" in [e["event"] for e in orch.events]
        await orch.reroute("an-older-plan/0", 2, 4, [peer])  # still loading [2, 4): its failures are expected
        assert node not in orch.suspects and orch.events[-1]["event"] == "failure_while_moving"
        await asyncio.sleep(0.2)  # the probes that check a mover is alive (this DHT cannot probe: reachable)
        assert node not in orch.suspects and [e["event"] for e in orch.events].count("failure_claim_refuted") >= 1
        orch.view.published[node] = serving  # it serves what it is assigned and still has the blocks: real
        await orch.reroute("an-older-plan/0", 0, 2, [peer])
        assert node in orch.suspects
        await orch.stop()

    run(scenario())


def test_a_server_that_dies_while_moving_is_excluded_once_the_probe_cannot_reach_it():
    """A mover's failed sessions are no evidence by themselves, but a mover that died (killed as it loads its new
    range) would stay in the chains it served until its record expires, each session sent there waiting out a
    step timeout: the probe that cannot reach it excludes it."""
    class Unreachable:
        def __init__(self):
            self.probed = []

        def reachable(self, peer_id):
            self.probed.append(peer_id)
            return False

    async def scenario():
        orch, dht = await serving_orchestrator()
        orch.probe = Unreachable()
        peer = orch.view.chains[0].route[0][0]
        node = next(n for n, p in orch.view.profiles.items() if p.peer_id == peer)
        orch.view.published[node] = replace(orch.view.published[node], start=2, end=4)  # moving to [2, 4)
        await orch.reroute(orch.view.chains[0].chain_id, 2, 4, [peer])
        assert "failure_while_moving" in [e["event"] for e in orch.events]
        for _ in range(50):
            if node in orch.suspects:
                break
            await asyncio.sleep(0.02)
        assert node in orch.suspects and orch.probe.probed == [peer]
        await orch.refresh()
        assert all(peer not in [p for p, _, _ in c.route] for c in orch.view.chains)
        await orch.stop()

    run(scenario())


def test_a_dht_read_that_hangs_does_not_stop_the_control_loop():
    """A refresh whose DHT read of the server records never returns goes on with the records it read last time
    (bounded, swarm.runtime.bounded): a server reported failed meanwhile is still planned out at once, and the hung
    read is not started again but picked up when it returns."""
    import threading

    async def scenario():
        orch, dht = await serving_orchestrator()
        peer = orch.view.chains[0].route[0][0]
        release, reads = threading.Event(), []
        original = dht.get

        def hanging_get(*args, **kwargs):
            reads.append(1)
            release.wait(30)
            return original(*args, **kwargs)

        dht.get = hanging_get
        orch._profiles_read.timeout_s = 0.2
        orch.report_failure(peer)
        began = time.monotonic()
        await orch.refresh()
        await orch.refresh()
        # (the control loop refreshes too, at the failure report: at least these two waits ran out)
        assert time.monotonic() - began < 5 and orch._profiles_read.timeouts >= 2 and len(reads) == 1
        assert orch.view.chains and all(peer not in [p for p, _, _ in c.route] for c in orch.view.chains)
        timeouts = orch._profiles_read.timeouts
        dht.get = original
        release.set()
        await orch.refresh()  # the hung read's answer, then fresh ones
        await orch.refresh()
        assert len(reads) == 1 and orch._profiles_read.timeouts == timeouts
        await orch.stop()

    run(scenario())


class ExpiringDHT(MemoryDHT):
    """A MemoryDHT whose records carry their expiration time (as hivemind's do) and whose next reads can miss."""

    def __init__(self):
        super().__init__()
        self.expires: dict[tuple[str, str], float] = {}
        self.misses = 0  # how many of the next reads come back empty (a lookup that timed out on a loaded peer)

    def store(self, key, value, expiration_time, subkey=None):
        self.expires[(key, subkey)] = expiration_time
        return super().store(key, value, expiration_time, subkey)

    def get(self, key, latest=False):
        if self.misses > 0:
            self.misses -= 1
            return None
        now = records.dht_now()
        live = {k: v for k, v in self.data.get(key, {}).items() if self.expires[(key, k)] > now}
        return SimpleNamespace(value={k: SimpleNamespace(value=v, expiration_time=self.expires[(key, k)])
                                      for k, v in live.items()}) if live else None


def test_a_read_that_misses_live_records_keeps_the_plan_and_an_expired_record_still_leaves():
    """On a loaded machine one DHT read came back without any server record: every server "left", the plan was
    dropped and every running session requeued, a second before the next read found them all again. A record
    seen before that has not expired stays as last read; a server whose record expires leaves as before."""
    async def scenario():
        orch, dht = make()
        dht.__class__ = ExpiringDHT
        ExpiringDHT.__init__(dht)
        publish(dht, *[profile(n, m) for n, m in SERVERS])
        await orch.start()
        serve_assignments(dht)
        await orch.refresh()
        plan_id, chains = orch.view.plan_id, [c.chain_id for c in orch.view.chains]
        assert chains and len(orch.view.profiles) == 4
        dht.misses = 1
        await orch.refresh()
        assert orch.view.plan_id == plan_id and [c.chain_id for c in orch.view.chains] == chains
        assert set(orch.view.profiles) == {n for n, _ in SERVERS}
        assert not [e for e in orch.events if e["event"] in ("server_left", "plan_dropped")]
        gone = "d"  # its server renews its record once more, then stops: it leaves when that record expires
        records.publish_profile(dht, PREFIX, orch.view.profiles[gone], ttl=0.5, owner=node_key(gone))
        await orch.refresh()
        assert gone in orch.view.profiles
        await asyncio.sleep(0.6)
        await orch.refresh()
        assert gone not in orch.view.profiles
        assert [e["node"] for e in orch.events if e["event"] == "server_left"] == [gone]
        await orch.stop()

    run(scenario())


def test_a_joining_server_that_adds_little_does_not_move_blocks():
    async def scenario():
        orch, dht = make()
        publish(dht, *(profile(n, m) for n, m in SERVERS))
        await orch.start()
        before = {n: (a.start, a.end) for n, a in orch.view.assignments.items()}
        first_plan = orch.view.plan_id
        publish(dht, profile("tiny", 0.3))  # room for one block and no cache: cannot improve the plan
        await orch.refresh()
        assert orch.view.plan_id != first_plan and orch.view.plan_kept_ranges
        after = {n: (a.start, a.end) for n, a in orch.view.assignments.items()}
        assert {n: after[n] for n in before} == before
        await orch.stop()

    run(scenario())


def test_no_servers_means_a_clear_error():
    async def scenario():
        orch, _ = make()
        await orch.start()
        with pytest.raises(NoChainsError, match="no servers"):
            await orch.acquire("alice", 10, 10, timeout=1)
        await orch.stop()

    run(scenario())


def test_malformed_profile_records_are_skipped():
    dht = MemoryDHT()
    publish(dht, profile("good", 3))
    dht.store(f"{PREFIX}.{records.PROFILES}", {"node_id": "bad", "memory_bytes": "lots"}, 0,
              subkey=Identity.generate().subkey("bad"))
    dht.store(f"{PREFIX}.{records.PROFILES}", profile("unowned", 3).to_dict(), 0, subkey="unowned")
    assert set(records.fetch_profiles(dht, PREFIX)) == {"good"}


def test_auto_replans_incrementally_when_a_chain_server_leaves():
    """--placement auto after the first plan repairs the broken chain from idle servers (planner.replan)
    instead of planning afresh: the chain's survivors keep their ranges, and fewer blocks load."""
    expect = Expectations(max_length=1024, input_tokens=64, output_tokens=16, arrival_rate=0.2, placement="auto",
                          kv_admission="slots")  # max-length slots: the memory layout the chains below assume
    swarm = [profile(n, m) for n, m in [("a", 3), ("b", 3), ("c", 2.5), ("d", 2.5), ("e", 2), ("f", 2), ("g", 3),
                                        ("h", 2), ("i", 2.5)]]
    first, _ = planning.choose_plan(swarm, 12, expect, None)
    spans = {s.id: s.span for s in first.servers}
    assert [c.servers for c in first.chains] == [("a", "b", "g")]  # one chain; six servers idle
    rest = [p for p in swarm if p.node_id != "b"]
    repaired, kept = planning.choose_plan(rest, 12, expect, first)
    fresh, _ = planning.choose_plan(rest, 12, expect, None)

    def loaded(p):
        return sum(s.span[1] - s.span[0] for s in p.servers if s.span is not None and s.span != spans.get(s.id))

    after = {s.id: s.span for s in repaired.servers}
    assert not kept and repaired.chains
    assert after["a"] == spans["a"] and after["g"] == spans["g"]
    assert loaded(repaired) == 4 < loaded(fresh)  # b's four blocks, on idle servers


def test_a_server_back_after_it_left_serves_again_while_the_others_keep_their_ranges():
    """With ranges kept on every re-plan (a large --replan-tolerance), a server whose record expired under load and
    that came back a second later was planned with no blocks, and its chains were gone for good (a real-model test
    swarm waited for them in vain). Servers that hold nothing take their fresh ranges where that is better: loading
    them moves nobody else."""
    expect = Expectations(max_length=1024, input_tokens=64, output_tokens=16, arrival_rate=4.0, kv_admission="slots",
                          replan_tolerance=100.0)
    swarm = [profile(n, 5) for n in "abcd"]  # two chains of two
    first, _ = planning.choose_plan(swarm, 12, expect, None)
    spans = {s.id: s.span for s in first.servers}
    assert len(first.chains) == 2
    gone = first.chains[-1].servers[0]
    without, kept = planning.choose_plan([p for p in swarm if p.node_id != gone], 12, expect, first)
    assert kept and len(without.chains) == 1 and all(s.span == spans[s.id] for s in without.servers if s.span)
    back, kept = planning.choose_plan(swarm, 12, expect, without)
    after = {s.id: s.span for s in back.servers}
    assert kept and after == spans and len(back.chains) == 2  # the others did not move; the chain is back
    little = planning.choose_plan(swarm + [profile("tiny", 0.3)], 12, expect, first)[0]
    assert {s.id: s.span for s in little.servers} == {**spans, "tiny": None}  # a joiner that adds nothing: none


def test_servers_back_after_their_partners_formed_one_chain_get_a_chain_of_their_own():
    """Two chains a->b and c->d; b and d fail, a re-plan moves c to the second half (one chain a->c); b and d come
    back. The fresh plan's ranges for them are both the second half, which adds nothing beside the kept chain, so
    with ranges kept they were planned with no blocks and the swarm stayed at one chain for good (a real-model test
    swarm under a CPU hog waited for its second chain in vain). Planned alone, they form a chain of their own."""
    expect = Expectations(max_length=1024, input_tokens=64, output_tokens=16, arrival_rate=4.0, kv_admission="slots",
                          replan_tolerance=100.0)
    swarm = [profile(n, 5) for n in "abcd"]
    first, _ = planning.choose_plan(swarm, 12, expect, None)
    assert [c.servers for c in first.chains] == [("a", "b"), ("c", "d")]
    pair, _ = planning.choose_plan([p for p in swarm if p.node_id in "ac"], 12, expect, None)
    assert [c.servers for c in pair.chains] == [("a", "c")]
    back, kept = planning.choose_plan(swarm, 12, expect, pair)
    after = {s.id: s.span for s in back.servers}
    assert kept and (after["a"], after["c"]) == ((0, 6), (6, 12))  # nobody that serves moved
    assert len(back.chains) == 2 and {after["b"], after["d"]} == {(0, 6), (6, 12)}


def test_standby_chains_put_idle_servers_to_use_without_moving_the_plan():
    """--standby-chains N: the servers a plan leaves idle hold up to N extra whole chains (planner.standby);
    the plan's own ranges, c and tuning stay as the placement method chose them."""
    swarm = [profile(n, m) for n, m in [("a", 3), ("b", 3), ("c", 2.5), ("d", 2.5), ("e", 2), ("f", 2), ("g", 3),
                                        ("h", 2), ("i", 2.5)]]
    plain = Expectations(max_length=1024, input_tokens=64, output_tokens=16, arrival_rate=0.2, placement="auto",
                         kv_admission="slots")
    base, _ = planning.choose_plan(swarm, 12, plain, None)
    spans = {s.id: s.span for s in base.servers}
    for n, more in ((1, 1), (-1, 1)):  # the six idle servers hold 15 blocks: one chain of 12
        expect = replace(plain, standby_chains=n)
        standby, _ = planning.choose_plan(swarm, 12, expect, None)
        after = {s.id: s.span for s in standby.servers}
        assert all(after[k] == span for k, span in spans.items() if span is not None)
        assert len(standby.chains) == len(base.chains) + more
        assert (standby.c, standby.tuning) == (base.c, base.tuning)
        assert standby.total_rate > base.total_rate


def test_a_routes_drafting_room_is_its_servers_smallest_batch_bound():
    """The engine fills a chain step with speculative drafts up to the smallest ``--max-batch`` its servers publish
    (None where one publishes none: the engine's default)."""
    orch, _ = make()
    orch.view.profiles = {node: replace(profile(node, 3), max_batch=bound)
                          for node, bound in (("a", 64), ("b", 8), ("c", None))}
    assert orch.route_batch_bound((("peer-a", 0, 2), ("peer-b", 2, 4))) == 8
    assert orch.route_batch_bound((("peer-a", 0, 4),)) == 64
    assert orch.route_batch_bound((("peer-a", 0, 2), ("peer-c", 2, 4))) is None
    assert orch.route_batch_bound((("peer-x", 0, 4),)) is None  # a server it has no profile of
