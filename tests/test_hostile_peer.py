"""A hostile peer on a live, secure swarm (loopback): every forgery is refused or ignored, and the honest swarm
keeps answering with the same text throughout.

The swarm: a bootstrap DHT, the orchestrator (prefix reuse on) and two nodes forming one chain, all secure (the
default: nodes were given the orchestrator key and serve only ticketed sessions). The attacker is two real extra
DHT peers in their own processes: ``hostile`` signs with its own key (so it can publish validly signed records
in its own name and push forged bytes to everyone else) and ``raw`` runs no validator at all (it keeps whatever
it stores and serves it to readers). It forges an assignment for a victim node, a profile in another node's name,
the orchestrator record and eviction reports, and opens sessions without a ticket, with an expired one, with one
it signed itself and with one for other blocks. The unit-level checks are in tests/test_signing.py.
"""
from __future__ import annotations

import asyncio
import base64
import os
import time

import pytest
import torch

from server import handler as handler_keys
from server.local_swarm import LocalSwarm, SwarmStartError
from swarm.trust import prefix as protocol, records, tickets
from swarm.trust.identity import Identity
from swarm.trust.validation import swarm_validators
from helpers import HTTP, server_info, wait_for

pytestmark = pytest.mark.swarm

MAX_LENGTH = 256
PROMPT = ("You are a careful assistant. Answer briefly and cite the document. The document says that the harbour "
          "of the old town was rebuilt twice, first after the storm and then after the fire. Question: when?")


@pytest.fixture(scope="module")
def swarm(tiny_model, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("profiles"))
    with LocalSwarm(tiny_model) as local:
        # max-length KV slots: the chain layout and capacities this test's swarm is sized for (token admission:
        # tests/test_kv_admission.py, test_family_swarm.py, bench_batching's HTTP rows)
        local.add_orchestrator(kv_admission="slots", policy="swarm", expected_rate=4.0, max_length=MAX_LENGTH, expected_input_tokens=128,
                               expected_output_tokens=16, refresh_s=0.5, request_timeout_s=8.0,
                               prefix_cache_tokens=128)
        declared = {"prefill_s": 1e-5, "decode_s": 3e-4, "rtt_s": 0.002}
        nodes = [local.add_node(node_id=name, memory_gb=0.0013, wait=False, profile_cache_dir=cache,
                                declared_profile=declared, update_period=2.0) for name in ("n0", "n1")]
        for node in nodes:
            local.wait_profiled(node)
        local.url = local.orchestrator.info["url"]
        local.status = local.wait_chains_ready(["n0", "n1"])
        yield local


@pytest.fixture(scope="module")
def peers(swarm):
    """(hostile, raw, honest reader): three extra DHT peers of the swarm."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    hostile_key = Identity.generate()
    hostile = hivemind.DHT(initial_peers=swarm.initial_peers, start=True,
                           record_validators=[RSASignatureValidator(hostile_key.private_key)])
    hostile.identity = hostile_key
    raw = hivemind.DHT(initial_peers=swarm.initial_peers, start=True)
    reader = hivemind.DHT(initial_peers=swarm.initial_peers, start=True,
                          record_validators=swarm_validators(Identity.generate(), swarm.dht_prefix))
    yield hostile, raw, reader
    for dht in (hostile, raw, reader):
        dht.shutdown()


def complete(swarm, prompt=PROMPT, max_tokens=12):
    response = HTTP.post(f"{swarm.url}/v1/completions", timeout=120, headers={"X-Client-Id": "honest"},
                         json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    prefix = dict(kv.split("=") for kv in response.headers["x-chainswarm-prefix"].split(";"))
    return response.json()["choices"][0]["text"], {k: int(v) for k, v in prefix.items()}


def status(swarm) -> dict:
    return HTTP.get(f"{swarm.url}/v1/swarm", timeout=30).json()


def fake_signature() -> str:
    return "[signature:" + base64.b64encode(os.urandom(256)).decode() + "]"


def later(seconds: float = 60.0) -> float:
    from hivemind.utils.timed_storage import get_dht_time

    return get_dht_time() + seconds


def histories(swarm) -> dict:
    """Every honest node's state history as it reported it (its reports are read here)."""
    for node in swarm.nodes:
        while node.alive and node.info["report"].poll(0):
            swarm._node_message(node, node.info["report"].recv())
    return {n.name: list(n.info.get("history", [])) for n in swarm.nodes if n.name in ("n0", "n1")}


@pytest.fixture(scope="module")
def baseline(swarm):
    """The honest answer before any attack, and the swarm's state it was given on."""
    swarm.histories = histories(swarm)
    first, head = complete(swarm)
    again, head2 = complete(swarm)  # the prompt's pages are now cached on the chain
    assert again == first and head["reused"] == 0 and head2["reused"] > 0
    before = status(swarm)
    assert before["chains"] and before["chains"][0]["cached_prefix_tokens"] > 0
    return first, before


def served_as_before(swarm, baseline):
    """The honest swarm is unchanged: same plan, same servers on the same blocks, same text."""
    text, before = baseline
    now = status(swarm)
    assert now["plan"]["plan_id"] == before["plan"]["plan_id"]
    assert [(s["node_id"], s["peer_id"], s["start"], s["end"], s["state"]) for s in now["servers"]] == \
        [(s["node_id"], s["peer_id"], s["start"], s["end"], s["state"]) for s in before["servers"]]
    assert all(node.alive for node in swarm.nodes if node.name in ("n0", "n1"))
    assert histories(swarm) == swarm.histories  # no node drained, reloaded or went back to waiting
    assert complete(swarm)[0] == text
    return now


def test_forged_assignments_are_refused_or_ignored(swarm, peers, baseline):
    hostile, raw, reader = peers
    key, orch = f"{swarm.dht_prefix}.{records.ASSIGNMENTS}", swarm.orchestrator_identity
    plan_id = baseline[1]["plan"]["plan_id"]
    evil = {"plan_id": "evil", "start": 0, "end": 4, "cache_slots": 1, "max_length": 64}
    # in the orchestrator's name: with a made-up signature, or none (the raw peer keeps it, nobody else does)
    # made-up signatures: a peer without validators may keep them (then store() "succeeds"); readers drop them
    hostile.store(key, evil | {"sig": fake_signature()}, later(), subkey=orch.subkey("n0"))
    raw.store(key, evil, later(), subkey=orch.subkey("n0"))
    raw.store(key, evil, later(), subkey="n0")
    # validly signed, but by the hostile key: stored, and ignored by the node
    assert hostile.store(key, evil, later(), subkey=hostile.identity.subkey("n0"))
    time.sleep(3.0)  # several of the nodes' assignment checks (1 s)
    assigned = records.fetch_assignments(reader, swarm.dht_prefix, orch.public)
    assert assigned["n0"].plan_id == plan_id and (assigned["n0"].start, assigned["n0"].end) != (0, 4)
    served_as_before(swarm, baseline)


def test_a_profile_in_another_nodes_name_is_refused(swarm, peers, baseline):
    hostile, raw, reader = peers
    key = f"{swarm.dht_prefix}.{records.PROFILES}"
    victim = next(s for s in baseline[1]["servers"] if s["node_id"] == "n1")
    forged = {**{k: victim[k] for k in ("node_id", "memory_bytes", "block_bytes", "cache_bytes_per_token",
                                         "prefill_s", "decode_s", "rtt_s")},
              "peer_id": hostile.peer_id.to_base58(), "memory_bytes": 10 * victim["memory_bytes"], "state": "waiting"}
    pinned = next(s for s in baseline[1]["servers"] if s["node_id"] == "n1")["peer_id"]
    # under a key it does not hold: refused by every validating peer (one without validators may keep it)
    hostile.store(key, forged | {"sig": fake_signature()}, later(),
                  subkey=swarm.orchestrator_identity.subkey("n1"))
    # under its own key, validly signed: a second key for a live node id, refused by the orchestrator
    assert hostile.store(key, forged, later(), subkey=hostile.identity.subkey("n1"))
    raw.store(key, forged, later(), subkey="n1")
    wait_for(lambda: any(e["event"] == "server_key_refused" and e["node"] == "n1" for e in status(swarm)["events"]),
             15, what="the orchestrator refusing the second key for n1")
    now = served_as_before(swarm, baseline)
    assert next(s for s in now["servers"] if s["node_id"] == "n1")["peer_id"] == pinned


def test_a_forged_orchestrator_record_is_ignored_and_a_wrong_key_refuses_to_start(swarm, peers, baseline):
    hostile, raw, reader = peers
    key, orch = f"{swarm.dht_prefix}.{records.ORCHESTRATOR}", swarm.orchestrator_identity
    evil = records.OrchestratorInfo(hostile.peer_id.to_base58(), "http://127.0.0.1:9/", "evil").to_dict()
    hostile.store(key, evil | {"sig": fake_signature()}, later(), subkey=orch.subkey("main"))
    raw.store(key, evil, later(), subkey=orch.subkey("main"))
    assert hostile.store(key, evil, later(), subkey=hostile.identity.subkey("main"))
    assert records.fetch_orchestrator(reader, swarm.dht_prefix, orch.public).plan_id == baseline[1]["plan"]["plan_id"]
    # a node given a key that signs no orchestrator record here refuses to start, with a one-line reason
    with pytest.raises(SwarmStartError, match=r"wrong orchestrator key: this server was given \w{12}, but") as err:
        swarm.add_node(node_id="misconfigured", memory_gb=0.0013, orchestrator_key=Identity.generate().public,
                       declared_profile={"prefill_s": 1e-5, "decode_s": 3e-4, "rtt_s": 0.002}, timeout=60)
    assert "\n" not in str(err.value)
    time.sleep(2.0)
    served_as_before(swarm, baseline)


def test_forged_eviction_reports_are_ignored(swarm, peers, baseline):
    hostile, raw, reader = peers
    key = f"{swarm.dht_prefix}.{protocol.REPORTS}"
    resets = status(swarm)["prefix"]["resets"]
    # a new store epoch would make the orchestrator forget everything n0 holds, if it believed it
    report = {"epoch": "forged", "seq": 99, "evicted": [[99, "00" * 16]]}
    assert hostile.store(key, report, later(), subkey=hostile.identity.subkey("n0"))
    # a made-up signature under the orchestrator's key: a peer without validators may keep it (the store then
    # "succeeds", depending on which peers are closest to the key); every validating reader drops it
    hostile.store(key, report | {"sig": fake_signature()}, later(), subkey=swarm.orchestrator_identity.subkey("n0"))
    raw.store(key, report, later(), subkey="n0")
    time.sleep(2.0)  # several orchestrator refreshes (0.5 s)
    now = served_as_before(swarm, baseline)
    assert now["prefix"]["resets"] == resets and now["chains"][0]["cached_prefix_tokens"] > 0
    _, head = complete(swarm)
    assert head["reused"] > 0  # the cached prefix is still found where the orchestrator believes it is


def test_sessions_without_a_valid_ticket_are_refused(swarm, tiny_model, peers, baseline):
    from swarm.engine.petals_client import open_distributed_model
    from swarm.engine.routing import Lease, install, use_lease
    from transformers import AutoTokenizer

    hostile = peers[0]
    ids = AutoTokenizer.from_pretrained(tiny_model)(PROMPT, return_tensors="pt").input_ids
    kw = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    chain = baseline[1]["chains"][0]
    route = tuple(tuple(r) for r in chain["route"])
    # request_timeout: a refusal is immediate; should its answer ever be lost on the way, fail in 30 s, not petals' 180
    with open_distributed_model(tiny_model, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                max_retries=1, request_timeout=30.0) as model:
        # a vanilla petals client: no ticket at all, for an inference session and for a plain forward pass
        with pytest.raises(Exception, match="no ticket"):
            model.generate(ids, **kw)
        with pytest.raises(Exception, match="no ticket"):
            model(ids)
        install(model)  # our routing: the session carries whatever ticket the lease holds

        def run(ticket):
            with use_lease(Lease("attack", chain["id"], route, MAX_LENGTH, ticket=ticket)), torch.inference_mode():
                return model.generate(ids, **kw)

        real = swarm.orchestrator_identity
        attempts = {
            "expired": tickets.mint(real, request_id="r", chain_id="c", route=route, max_length=MAX_LENGTH, ttl_s=-1),
            "signed by the hostile key": tickets.mint(hostile.identity, request_id="r", chain_id="c", route=route,
                                                      max_length=MAX_LENGTH),
            "for other blocks": tickets.mint(real, request_id="r", chain_id="c", route=route[:1],
                                             max_length=MAX_LENGTH),
        }
        reasons = {"expired": "the ticket has expired", "signed by the hostile key": "not signed by this swarm's",
                   "for other blocks": r"does not grant blocks \[2, 4\)"}
        for what, ticket in attempts.items():
            with pytest.raises(Exception, match=reasons[what]):
                run(ticket)
        # the same client with a ticket the orchestrator signed is served: the refusals were the tickets'
        valid = tickets.mint(real, request_id="r", chain_id="c", route=route, max_length=MAX_LENGTH)
        assert run(valid).shape[1] == ids.shape[1] + 4
    served_as_before(swarm, baseline)


def _push(p2p, peer_id: str, uid: str, hidden: torch.Tensor, metadata: dict) -> None:
    """One rpc_push of ``hidden`` (a step's inputs, packed as a petals client packs them) into a session."""
    from hivemind import MSGPackSerializer, serialize_torch_tensor
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2
    from petals.utils.misc import DUMMY, DUMMY_INT64
    from petals.utils.packaging import pack_args_kwargs

    tensors, _ = pack_args_kwargs(hidden, DUMMY, DUMMY_INT64)
    request = runtime_pb2.ExpertRequest(uid=uid, tensors=[serialize_torch_tensor(t) for t in tensors],
                                        metadata=MSGPackSerializer.dumps(metadata))
    RemoteExpertWorker.run_coroutine(asyncio.wait_for(p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), "TransformerConnectionHandler.rpc_push", request, runtime_pb2.ExpertResponse), 10))


def test_pushes_are_taken_only_from_the_previous_server_of_the_route():
    """The rule itself (server.tickets): who may push into a session, by its own ticket or a carried one."""
    from server import tickets as gate

    real, other = Identity.generate(), Identity.generate()
    route = (("A", 0, 2), ("B", 2, 4), ("C", 4, 6))
    mint = lambda key, route, request="r": tickets.mint(key, request_id=request, chain_id="c", route=route,  # noqa
                                                         max_length=64)
    own = tickets.verify(mint(real, route), real.public, peer_id="C", start=4, end=6)
    assert own.pushers("C", 4, 6) == {"B"} and own.pushers("A", 0, 2) == set() and own.pushers("D", 4, 6) == set()
    gate.configure(open=False, orchestrator_key=real.public, peer_id="C", dht_prefix="m")
    grant = gate._Grant(own, mint(real, route), 4, 6, own.pushers("C", 4, 6))
    rerouted = (("A", 0, 2), ("D", 2, 4), ("C", 4, 6))  # B failed; D replaced it (same grant, a fresh ticket)
    cases = {
        ("B", None): True, ("A", None): False, ("X", None): False,
        ("D", mint(real, rerouted)): True,  # the replacement, carrying its session's ticket
        ("D", None): False, ("D", mint(other, rerouted)): False,  # ... not without it, nor with a forged one
        ("D", mint(real, rerouted, request="another")): False,  # a ticket of another grant
        ("X", mint(real, route)): False,  # a stolen ticket names the previous server, not the thief
        ("B", mint(real, rerouted)): True,  # the route of the session's own ticket still counts
        ("B", mint(real, route[:1])): True,  # the pusher's older ticket need not name this server
        ("X", mint(real, route[:1])): False,
        ("B", b"garbage"): False,
    }
    for (sender, carried), allowed in cases.items():
        metadata = {gate.PUSHED_BY: sender} | ({} if carried is None else {tickets.META_KEY: carried})
        assert grant.allows(metadata) is allowed, (sender, carried)
    assert not grant.allows({tickets.META_KEY: mint(real, route)})  # no authenticated sender at all


def test_a_push_from_a_peer_off_the_route_is_refused(swarm, tiny_model, peers, baseline, reference_generate):
    """A stranger that learned a live session's id pushes made-up hidden states into it — with no ticket, and
    with the session's own (stolen) ticket. Both pushes are refused by the server; the session, which a single
    accepted push would derail (an extra step in its KV cache and an extra answer on its stream), ends with the
    reference tokens. Honest servers' pushes are taken meanwhile."""
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    hostile = peers[0]
    p2p = RemoteExpertWorker.run_coroutine(hostile.replicate_p2p())  # the hostile peer's own libp2p identity
    try:
        _push_into_a_live_session(swarm, tiny_model, p2p, baseline, reference_generate)
    finally:
        RemoteExpertWorker.run_coroutine(p2p.shutdown())


def _push_into_a_live_session(swarm, tiny_model, p2p, baseline, reference_generate):
    from swarm.engine.petals_client import open_distributed_model
    from swarm.engine.routing import Lease, install, use_lease
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model)(PROMPT, return_tensors="pt").input_ids
    expected = reference_generate(ids, 8)
    chain = baseline[1]["chains"][0]
    route = tuple(tuple(r) for r in chain["route"])
    victim, v_start, v_end = route[1]
    uid = " ".join(f"{swarm.dht_prefix}.{i}" for i in range(v_start, v_end))
    info = lambda: server_info(p2p, victim, f"{swarm.dht_prefix}.{v_start}")[handler_keys.PUSH_INFO]  # noqa
    honest = info()  # pushes the server took before (none when this test runs alone: the orchestrator's batched
    assert honest["refused"] == 0  # path pushes nothing; this session's honest pushes are counted at the end)
    ticket = tickets.mint(swarm.orchestrator_identity, request_id="push", chain_id=chain["id"], route=route,
                          max_length=MAX_LENGTH)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with open_distributed_model(tiny_model, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                max_retries=1) as model:
        install(model)
        with use_lease(Lease("push", chain["id"], route, MAX_LENGTH, ticket=ticket)), torch.inference_mode():
            with model.inference_session(max_length=ids.shape[1] + 8) as session:
                head = model.generate(ids, max_new_tokens=2, session=session, **kw)
                target = session._server_sessions[1]
                assert target.span.peer_id.to_base58() == victim
                hidden = torch.randn(1, 1, model.config.hidden_size)
                forged = {"session_id": target.session_id, "step_id": "hostile", "pushed": True}
                _push(p2p, victim, uid, hidden, forged)
                _push(p2p, victim, uid, hidden, forged | {"step_id": "hostile-2", tickets.META_KEY: ticket})
                wait_for(lambda: info()["refused"] == honest["refused"] + 2, 10, what="both pushes refused")
                produced = model.generate(None, max_new_tokens=6, session=session, **kw)
    assert torch.equal(torch.cat([head, produced], dim=1), expected)
    served_as_before(swarm, baseline)
    after = info()
    assert after["refused"] == honest["refused"] + 2
    assert after["received"] - honest["received"] >= 2 + 5  # the first server's pushes of this session were taken
