"""The WAN emulator applied to a live orchestrated swarm (LocalSwarm(wan=...)).

One swarm for the module: the orchestrator on 127.0.0.1 (relay: no server-to-server push) and two nodes on
127.0.0.2 / 127.0.0.3 whose memory budgets make the planner split the model over both (one chain a → b).
Configured RTTs: orchestrator–a 40 ms, orchestrator–b 70 ms, a–b 20 ms. Checks that

* a ping from the orchestrator's host to each server takes the configured RTT (a small tolerance over the same
  stack's own overhead, measured by a ping to a peer on the same host),
* the servers' own RTT probes (profiles' ``rtt_s``, the planner's communication input) see it too,
* the delay applies to inference traffic: the per-token step time of a relayed two-hop session (the median gap
  between a stream's tokens) is the sum of the two RTTs plus petals' per-step overhead.
"""
import statistics
import time
from functools import partial

import pytest

from server.local_swarm import LocalSwarm
from wan import WanConfig
from helpers import HTTP, http_client, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.alone]  # measures RTTs: nothing may run beside it

RTT_A, RTT_B, RTT_AB = 40.0, 70.0, 20.0
MAX_LENGTH = 256


@pytest.fixture(scope="module")
def wan_swarm(tiny_model, tmp_path_factory):
    config = WanConfig.from_matrix(
        [[0, RTT_A, RTT_B], [RTT_A, 0, RTT_AB], [RTT_B, RTT_AB, 0]], ["client", "a", "b"])
    cache = str(tmp_path_factory.mktemp("profiles"))
    with LocalSwarm(tiny_model, wan=config) as local:
        # max-length KV slots: the chain layout and capacities this test's swarm is sized for (token admission:
        # tests/test_kv_admission.py, test_family_swarm.py, bench_batching's HTTP rows)
        local.add_orchestrator(kv_admission="slots", policy="fcfs", expected_rate=1.0, max_length=MAX_LENGTH, expected_input_tokens=32,
                               expected_output_tokens=16, refresh_s=0.5, use_server_to_server=False)
        nodes = [local.add_node(node_id=name, memory_gb=0.0012, wait=False, profile_cache_dir=cache, rtt_period=5.0)
                 for name in ("a", "b")]
        for peer in nodes:
            local.wait_profiled(peer)
        url = local.orchestrator.info["url"]

        def ready():
            status = HTTP.get(f"{url}/v1/swarm").json()
            servers = {s["node_id"]: s for s in status["servers"]}
            rtts_known = len(servers) == 2 and all(s["rtt_s"] for s in servers.values())
            return status if rtts_known and status["chains"] and all(c["ready"] for c in status["chains"]) else None

        local.status = wait_for(ready, 120, what="a ready chain and both servers' RTTs")
        local.url, local.config = url, config
        yield local


def test_nodes_live_on_their_own_loopback_addresses(wan_swarm):
    by_name = {p.name: p for p in wan_swarm.nodes}
    assert by_name["a"].info["ip"] == "127.0.0.2" and by_name["b"].info["ip"] == "127.0.0.3"
    eps = wan_swarm.wan_endpoints
    for name, peer in by_name.items():  # listens on the real port, announces the proxy port
        assert peer.info["kwargs"]["host_maddrs"] == [eps[name].host_maddr]
        assert peer.info["kwargs"]["announce_maddrs"] == [eps[name].announce_maddr]
    assert wan_swarm.orchestrator.info["options"].dht_announce_port == eps["client"].port


def _ping_ms(dht, peer_id: str) -> float:
    from hivemind.p2p import PeerID
    from petals.utils.ping import ping

    from swarm.model.compat import petals  # noqa: F401

    return dht.run_coroutine(partial(ping, PeerID.from_base58(peer_id), wait_timeout=5)) * 1e3


@pytest.fixture(scope="module")
def pings(wan_swarm):
    """Median pings (ms) from a DHT peer on the orchestrator's host: to each server, and to the swarm's bootstrap
    peer on the same host ("overhead": the same libp2p stack with no delay to emulate; the machine's own cost, which
    varies with its speed: 2-3 ms in a fast hour, 7-13 in a slow one). The targets take turns, so the overhead is
    measured in the same moments as the pings it excuses (measured one after the other, a slow stretch that began
    after the overhead's pings made a server's ping look 25 ms over its RTT). "late": how late the emulator's proxy
    delivered its chunks (90th percentile, ms), its own record of this machine's scheduling delay."""
    import hivemind

    dht = hivemind.DHT(start=True, client_mode=True, initial_peers=wan_swarm.initial_peers)
    try:
        targets = {"overhead": wan_swarm.initial_peers[0].rsplit("/p2p/", 1)[1],
                   **{peer.name: peer.peer_id for peer in wan_swarm.nodes}}
        samples = {name: [] for name in targets}
        for _ in range(10):
            for name, peer_id in targets.items():
                samples[name].append(_ping_ms(dht, peer_id))
        out = {name: statistics.median(values[2:]) for name, values in samples.items()}
        out["late"] = wan_swarm.emulator.stats()["lateness_ms"]["p90"]
        return out
    finally:
        dht.shutdown()


def _excess_ms(pings) -> float:
    """What a ping may take over its configured RTT: the stack's overhead, the proxy's lateness on the way out and
    back, and 8 ms for the server's processes on a busy machine."""
    return pings["overhead"] + 2 * pings["late"] + 8.0


def test_achieved_rtt_from_the_orchestrator_host_matches_the_configuration(wan_swarm, pings):
    for peer in wan_swarm.nodes:
        configured = wan_swarm.config.rtt("client", peer.name)
        assert configured - 1.0 <= pings[peer.name] <= configured + _excess_ms(pings), (peer.name, pings)


def test_profiles_rtt_reflects_the_emulated_wan(wan_swarm, pings):
    # each server pings the orchestrator every 5 s (rtt_period): a probe that met a slow moment of this shared
    # machine is replaced within seconds, so wait (bounded) for the two probes to read their RTTs
    seen = []

    def within():
        status = HTTP.get(f"{wan_swarm.url}/v1/swarm").json()
        rtts = {s["node_id"]: s["rtt_s"] * 1e3 for s in status["servers"]}
        seen.append(rtts)
        ok = all(configured - 1.0 <= rtts[name] <= configured + _excess_ms(pings) + 2.0
                 for name, configured in (("a", RTT_A), ("b", RTT_B)))
        return status if ok else None

    status = wait_for(within, 30, period=1.0, what="the servers' RTT probes within the configured RTTs",
                      explain=lambda: f"probes seen {seen[-5:]}, pings {pings}")
    # ... and the planner's communication time is built from them
    comm = {s["id"]: s["comm_time_s"] for s in status["plan"]["inputs"]["servers"]}
    assert comm["b"] > comm["a"]


def _per_token_ms(url: str) -> float:
    """A streamed answer's median gap between tokens (ms): each gap is one step through the chain;
    their median is immune to the odd stall of this shared machine. One token per step: speculative drafts (on by
    default) would pay one pass for several tokens."""
    body = {"prompt": "The weather today is mild and", "max_tokens": 24, "temperature": 0, "stream": True,
            "speculative": False, "ignore_eos": True}
    arrivals = []
    with http_client(base_url=url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and '"text":""' not in line.replace(" ", ""):
                    arrivals.append(time.monotonic())
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    assert len(gaps) >= 12, arrivals
    return statistics.median(gaps)


def test_inference_steps_pay_the_configured_rtts(wan_swarm, pings):
    chain = wan_swarm.status["chains"][0]
    assert sorted(chain["servers"]) == ["a", "b"]  # one chain through both (their order is the planner's call)
    # relay: orchestrator → a → orchestrator → b → orchestrator per token, two round trips. What a token costs
    # beyond them (petals' per-step work, this machine's scheduling) is measured on the same swarm with the
    # emulator's delays off, in turns with the delayed answers: 10-30 ms a token in a quiet hour, 140-190 ms
    # with four busy loops beside it, where a fixed allowance could not tell a slow hour from a wrong delay
    delayed, undelayed = [], []
    try:
        for _ in range(2):
            wan_swarm.emulator.set_delay_scale(0.0)
            undelayed.append(_per_token_ms(wan_swarm.url))
            wan_swarm.emulator.set_delay_scale(1.0)
            delayed.append(_per_token_ms(wan_swarm.url))
    finally:
        wan_swarm.emulator.set_delay_scale(1.0)
    per_token, work = statistics.mean(delayed), statistics.mean(undelayed)
    network = per_token - work
    print(f"per token {delayed} ms with the WAN, {undelayed} without; network {network:.1f} ms")
    assert per_token >= RTT_A + RTT_B, (delayed, undelayed, pings)
    assert RTT_A + RTT_B - 10.0 <= network <= RTT_A + RTT_B + 2 * pings["overhead"] + 4 * pings["late"] + 30.0, (
        delayed, undelayed, pings)
