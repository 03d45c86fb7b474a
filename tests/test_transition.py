"""Make-before-break re-planning: the wave rule (planner.transition) and the orchestrator moving a swarm in waves
(swarm.control.transition) on an in-memory DHT, with servers that take refreshes to drain and reload."""
import asyncio

from planner.transition import Wave, next_wave
from swarm.trust import records
from swarm.trust.identity import owned_subkey
from test_orchestrator_logic import PREFIX, ORCHESTRATOR, profile, publish, serving_orchestrator


def chains_capacity(chains):
    """capacity(without) for chains given as (servers, c_k): the chains none of whose servers is left out."""
    return lambda without: sum(c for servers, c in chains if not set(servers) & set(without))


def test_a_wave_keeps_half_the_capacity_and_releases_the_cheapest_movers_first():
    # old chains a-b (2) and c-d (2) still serve; e-f (1) already serves the new plan
    capacity = chains_capacity([("ab", 2), ("cd", 2), ("ef", 1)])
    wave = next_wave({"a", "b", "c", "d"}, set(), capacity)
    assert wave == Wave(frozenset({"a", "b"}))  # losing a-b keeps 3 >= ceil(0.5 * 5); c-d would then break it
    assert next_wave({"a", "b", "c", "d"}, set(), capacity, keep=0.2) == Wave(frozenset({"a", "b", "c", "d"}))


def test_no_wave_while_the_last_one_loads_and_a_gap_only_when_unavoidable():
    capacity = chains_capacity([("ab", 2)])
    assert next_wave({"a"}, {"x"}, capacity) == Wave(frozenset())  # x still loads its new range
    assert next_wave({"a", "b"}, set(), capacity) == Wave(frozenset({"a", "b"}), gap=True)  # a-b is all there is
    assert next_wave({"a", "b"}, set(), chains_capacity([])) == Wave(frozenset({"a", "b"}))  # nothing to keep
    assert next_wave(set(), set(), capacity) == Wave(frozenset())


class Servers:
    """Servers that do what they are told, as server.node does, but slowly: a server told a new range drains for
    one refresh and loads for ``load_refreshes`` more before it serves it."""

    def __init__(self, dht, memory, load_refreshes=2):
        self.dht, self.memory, self.load_refreshes = dht, dict(memory), load_refreshes
        self.busy: dict[str, int] = {}  # node -> refreshes until it serves its new range

    def tick(self):
        told = records.fetch_assignments(self.dht, PREFIX, ORCHESTRATOR.public)
        current = records.fetch_profiles(self.dht, PREFIX)
        for node, assignment in told.items():
            now = current.get(node)
            if now is None:  # dead
                continue
            if ((now.start, now.end) == (assignment.start, assignment.end) and now.cache_slots >= assignment.cache_slots
                    or assignment.num_blocks == 0 and now.start is None):  # served in place (the loaded pool)
                if now.state == records.DRAINING:  # told its current range again: the drain is cancelled
                    self.busy.pop(node, None)
                    publish(self.dht, profile(node, self.memory[node], state=records.SERVING, start=now.start,
                                              end=now.end, slots=now.cache_slots))
                continue
            left = self.busy.setdefault(node, self.load_refreshes + 1)
            if left > 0:
                self.busy[node] = left - 1
                state = records.DRAINING if left == self.load_refreshes + 1 and now.start is not None else records.LOADING
                publish(self.dht, profile(node, self.memory[node], state=state, start=now.start, end=now.end,
                                          slots=now.cache_slots))
                continue
            del self.busy[node]
            serving = assignment.num_blocks > 0
            publish(self.dht, profile(node, self.memory[node], state=records.SERVING if serving else records.WAITING,
                                      start=assignment.start if serving else None,
                                      end=assignment.end if serving else None, slots=assignment.cache_slots))


async def _join_and_watch(keep):
    """A 3-server chain x-y-z; a bigger server e joins and the (fresh) plan moves every one of them. Returns the
    ready capacity seen at every refresh, the orchestrator and its servers."""
    memory = {"x": 2.5, "y": 1.5, "z": 1.5, "e": 2.5}
    orch, dht = await serving_orchestrator(profiles=[profile(n, memory[n]) for n in "xyz"], replan_tolerance=-0.9,
                                           replan_keep=keep)
    before = {n: (a.start, a.end) for n, a in orch.view.assignments.items()}
    servers = Servers(dht, memory)
    publish(dht, profile("e", memory["e"]))
    seen = []
    for _ in range(30):
        await orch.refresh()
        seen.append(sum(c.capacity for c in orch.view.chains if c.ready))
        if not orch.transition.active and all(
                orch.view.profiles[n].state == records.SERVING for n, a in orch.view.assignments.items() if a.num_blocks):
            break
        servers.tick()
    return before, seen, orch


def test_a_join_that_moves_every_server_keeps_a_chain_at_every_moment():
    async def scenario():
        before, seen, orch = await _join_and_watch(keep=0.5)
        after = {n: (a.start, a.end) for n, a in orch.view.assignments.items()}
        moved = {n for n in before if before[n] != after[n]}
        assert moved == {"x", "y", "z"}  # the scenario is a real reshuffle
        assert min(seen) >= 1, seen  # some chain routed at every refresh
        events = [e["event"] for e in orch.events]
        assert "transition_wave" in events and events[-1] == "transition_done"
        assert all(e.get("gap") is False for e in orch.events if e["event"] == "transition_wave")
        assert orch.view.published == orch.view.assignments and orch.status()["transition"] is None
        assert {c.servers for c in orch.view.chains if c.ready} == {tuple(ch.servers) for ch in orch.view.plan.chains}
        await orch.stop()

    asyncio.run(scenario())


def test_break_before_make_on_request_leaves_no_chain_while_the_servers_reload():
    async def scenario():
        _, seen, orch = await _join_and_watch(keep=0.0)
        assert 0 in seen  # every mover reloads at once: the window the waves avoid
        assert "transition_wave" not in [e["event"] for e in orch.events]
        await orch.stop()

    asyncio.run(scenario())


def test_movers_keep_their_old_assignment_until_released_and_the_status_says_so():
    async def scenario():
        memory = {"x": 2.5, "y": 1.5, "z": 1.5, "e": 2.5}
        orch, dht = await serving_orchestrator(profiles=[profile(n, memory[n]) for n in "xyz"],
                                               replan_tolerance=-0.9)
        old = dict(orch.view.published)
        publish(dht, profile("e", memory["e"]))
        await orch.refresh()
        told = records.fetch_assignments(dht, PREFIX, ORCHESTRATOR.public)
        status = orch.status()["transition"]
        assert status["on_old_ranges"] == ["x", "y", "z"] and status["moving"] == ["e"]
        assert all(told[n] == old[n] for n in "xyz")  # still told what they serve
        assert told["e"] == orch.view.assignments["e"]  # the joiner loads its new range at once
        plan_event = next(e for e in reversed(orch.events) if e["event"] == "plan")
        assert plan_event["on_old_ranges"] == ["x", "y", "z"]
        await orch.stop()

    asyncio.run(scenario())


def test_a_mover_that_dies_while_it_reloads_is_dropped_and_the_swarm_keeps_a_chain():
    """The switch to a new plan with a death in it: the first server released dies while it reloads (its record
    vanishes); the orchestrator re-plans without it and the transition goes on to the end. A chain routes at
    every refresh until a wave the orchestrator reports as a gap (here the re-plan shrinks the range of the only
    server left holding the first blocks: it must reload, and nothing else covers them)."""
    async def scenario():
        memory = {"x": 2.5, "y": 1.5, "z": 1.5, "e": 2.5}
        orch, dht = await serving_orchestrator(profiles=[profile(n, memory[n]) for n in "xyz"],
                                               replan_tolerance=-0.9)
        servers = Servers(dht, memory)
        publish(dht, profile("e", memory["e"]))
        seen, dead = [], None
        for _ in range(40):
            await orch.refresh()
            if not any(e["event"] == "transition_wave" and e["gap"] for e in orch.events):
                seen.append(sum(c.capacity for c in orch.view.chains if c.ready))
            waves = [e for e in orch.events if e["event"] == "transition_wave"]
            if dead is None and waves:
                dead = waves[0]["nodes"][0]  # released first: it dies in the middle of its reload
                for owner in records.fetch_profile_claims(dht, PREFIX)[dead]:  # its record is gone (expired)
                    dht.drop(f"{PREFIX}.{records.PROFILES}", owned_subkey(dead, owner))
            if dead is not None and not orch.transition.active and all(
                    orch.view.profiles[n].state == records.SERVING
                    for n, a in orch.view.assignments.items() if a.num_blocks):
                break
            servers.tick()
        assert dead is not None and dead not in orch.view.assignments
        assert min(seen) >= 1, seen
        assert not orch.transition.active and orch.view.published == orch.view.assignments
        await orch.stop()

    asyncio.run(scenario())
