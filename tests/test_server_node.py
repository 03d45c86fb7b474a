"""Orchestrated server nodes (server.node.ChainswarmServer) on loopback, with the test as orchestrator.

One module-scoped swarm (bootstrap DHT + nodes "a" and "b") goes through a whole life: profile → waiting →
assignment → serving → generation equal to transformers → malformed records ignored → a plan change that
moves both ranges while a session is open (drain, then reload) → an empty assignment (back to waiting).
The unit tests at the top need no processes.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time

import pytest
import torch

from helpers import wait_for
from server import profiling, rtt
from server.batching import DEFAULT_MAX_BATCH
from swarm.trust import records
from swarm.trust.records import Assignment, OrchestratorInfo
from swarm.trust.validation import swarm_validators

GIB = 1024**3


# -- unit tests: profiling, push fix, CLI -----------------------------------------------------------------


def _tiny_config(tiny_model):
    from swarm.model.compat import petals  # noqa: F401
    from petals.utils.auto_config import AutoDistributedConfig

    return AutoDistributedConfig.from_pretrained(tiny_model)


def test_memory_and_cache_sizes(tiny_model, tmp_path):
    config = _tiny_config(tiny_model)
    assert profiling.usable_memory_bytes("cpu", 1.5) == int(1.5 * GIB)
    assert 0 < profiling.usable_memory_bytes("cpu") < __import__("psutil").virtual_memory().total
    with pytest.raises(ValueError):
        profiling.usable_memory_bytes("cpu", -1)
    # K and V of one token on one block: 2 · hidden / groups · 4 bytes (float32); bf16 halves it
    assert profiling.cache_bytes_per_token(config, "float32") == 2 * 64 * 4
    assert profiling.cache_bytes_per_token(config, "bfloat16") == 2 * 64 * 2
    params = sum(p.numel() for p in config.block_class(config).parameters())
    assert params * 4 <= profiling.block_bytes(config, "float32", "none") <= params * 4 * 1.02
    size = profiling.block_bytes(config, "float32", "none")
    assert profiling.block_bytes(config, "float32", "none", cache_dir=tmp_path) == size  # measured, cached
    assert profiling.block_bytes(config, "float32", "none", cache_dir=tmp_path) == size  # read back
    assert len(json.loads((tmp_path / profiling.CACHE_FILE).read_text())) == 1
    assert profiling.job_compute_time(0.01, 0.1, 10, 5, overhead_s=0.001) == pytest.approx(0.001 + 0.1 + 0.4)


def test_compute_times_are_measured_once_and_cached(tiny_model, tmp_path):
    config = _tiny_config(tiny_model)
    first = profiling.compute_times(config, "cpu", "float32", "none", cache_dir=tmp_path)
    assert not first.cached and first.prefill_s > 0 and first.decode_s > 0
    assert first.measured_s < 5.0  # ~0.02-0.05 s on an idle 2-core box; generous for a loaded one
    again = profiling.compute_times(config, "cpu", "float32", "none", cache_dir=tmp_path)
    assert again.cached and (again.prefill_s, again.decode_s) == (first.prefill_s, first.decode_s)
    entries = json.loads((tmp_path / profiling.CACHE_FILE).read_text())
    assert list(entries) == [profiling.compute_cache_key(config, "cpu", "float32", "none")]
    # another dtype is another entry; the fingerprint ignores where the checkpoint lives
    assert profiling.compute_cache_key(config, "cpu", "bfloat16", "none") not in entries
    moved = config.__class__.from_dict({**config.to_dict(), "_name_or_path": "/elsewhere"})
    assert profiling.config_fingerprint(moved) == profiling.config_fingerprint(config)
    deeper = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": 8})
    assert profiling.config_fingerprint(deeper) != profiling.config_fingerprint(config)


def test_push_fix_pushes_with_the_latest_step_metadata(monkeypatch):
    import asyncio

    from petals.server.handler import TransformerConnectionHandler as PetalsHandler

    from server.handler import ChainswarmHandler

    assert ChainswarmHandler.__name__ == "TransformerConnectionHandler"
    steps = [({"session_id": "s"}), ({"session_id": "s", "step_id": 1, "next_servers": [["peer", "s2", 2, 4]]}),
             ({"session_id": "s", "step_id": 2, "pushed": True, "next_servers": [["peer", "s2", 2, 4]]})]

    async def fake_steps(self, first_request, requests, session_id, uids, context):
        for metadata in steps:
            yield object(), metadata

    pushed_with = []

    async def fake_push(self, request, outputs, metadata):
        pushed_with.append(metadata)

    monkeypatch.setattr(PetalsHandler, "_iterate_inference_steps", fake_steps)
    monkeypatch.setattr(PetalsHandler, "_push_outputs", fake_push)
    handler = ChainswarmHandler.__new__(ChainswarmHandler)
    handler._latest_step_metadata, handler._pushes_received = {}, None

    async def session():
        async for _request, metadata in handler._iterate_inference_steps(None, None, "s", (), None):
            await handler._push_outputs(None, None, steps[0])  # petals passes the *opening* metadata
        return dict(handler._latest_step_metadata)

    left = asyncio.run(session())
    assert [m.get("step_id") for m in pushed_with] == [None, 1, 2]
    assert pushed_with[1]["next_servers"] == [["peer", "s2", 2, 4]]
    assert left == {}  # forgotten when the session ends


def test_rtt_monitor_looks_often_until_it_finds_the_orchestrator_then_every_check_period(monkeypatch):
    """A server without an orchestrator cannot be planned: it reads the record every ``search_period`` s until
    one appears, pings it once, then reads every ``check_period`` s (no second ping within ``period``)."""
    reads, pings, found = [], [], {"at": None}
    info = OrchestratorInfo("QmOrchestrator", "http://127.0.0.1:1", "plan-1")

    def read(_dht, _prefix, _key):
        reads.append(time.monotonic())
        if len(reads) == 4:
            found["at"] = time.monotonic()
        return info if found["at"] is not None else None

    monkeypatch.setattr(rtt, "_orchestrator", read)
    monkeypatch.setattr(rtt, "_rtt_to", lambda _dht, peer, **_: pings.append(peer) or 0.004)
    changes = []
    monitor = rtt.RttMonitor(None, "p", period=30.0, check_period=0.6, search_period=0.05,
                                   on_change=changes.append)
    monitor.start()
    try:
        deadline = time.monotonic() + 10
        while found["at"] is None or time.monotonic() < found["at"] + 1.5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        monitor.stop()
        monitor.join(5)
    searching, found_it = reads[:4], reads[3:]  # the fourth read finds it
    assert searching[-1] - searching[0] < 1.0  # quick looks while nothing was there
    assert 2 <= len(found_it) <= 4 and all(b - a >= 0.55 for a, b in zip(found_it, found_it[1:]))  # every 0.6 s
    assert pings == ["QmOrchestrator"] and changes == [0.004] and monitor.rtt_s == 0.004


def test_a_server_that_finds_no_orchestrator_says_so_and_under_which_prefix(monkeypatch, caplog):
    """A volunteer who starts a server with another checkpoint than the orchestrator's (another DHT prefix) is told,
    after ``warn_after`` s and again every ``warn_every`` s, instead of waiting unplanned in silence."""
    found = {"info": None}
    monkeypatch.setattr(rtt, "_orchestrator", lambda _dht, _prefix, _key: found["info"])
    monkeypatch.setattr(rtt, "_rtt_to", lambda _dht, peer, **_: 0.004)

    def run(seconds, **options):
        monitor = rtt.RttMonitor(None, "gemma-3-270m-float32-cs", check_period=0.05, search_period=0.05,
                                       **options)
        with caplog.at_level(logging.WARNING, logger=rtt.__name__):
            monitor.start()
            time.sleep(seconds)
            monitor.stop()
            monitor.join(5)
        warnings = [r.getMessage() for r in caplog.records if "no orchestrator" in r.getMessage()]
        caplog.clear()
        return warnings

    warnings = run(1.2, warn_after=0.3, warn_every=0.5)
    assert 2 <= len(warnings) <= 3 and "'gemma-3-270m-float32-cs'" in warnings[0]  # at 0.3 s, 0.8 s (and 1.3 s)
    assert "model folder's name" in warnings[0] and "--initial-peers" in warnings[0]
    found["info"] = OrchestratorInfo("QmOrchestrator", "http://127.0.0.1:1", "plan-1")
    assert run(0.8, warn_after=0.3) == []  # an orchestrator found: nothing to say


def test_prefix_reports_are_sent_when_they_change_and_renewed_otherwise(monkeypatch):
    """The heartbeat sends the prefix-eviction report only when its epoch or eviction sequence moved (or every
    REPORT_RENEW_S s); a store the DHT refused is retried at the next heartbeat."""
    import types

    from server import node as node_module
    from swarm.trust import prefix as prefix_protocol

    sent, accept = [], {"ok": True}
    monkeypatch.setattr(prefix_protocol, "publish_report",
                        lambda _dht, _prefix, node_id, report, ttl, _owner: sent.append((report["seq"], ttl))
                        or accept["ok"])
    store = types.SimpleNamespace(seq=0, epoch="e1")
    store.report = lambda: {"epoch": store.epoch, "seq": store.seq, "evicted": []}
    fake = types.SimpleNamespace(dht=None, dht_prefix="p", node_id="n0", profile_ttl=5.0,
                                 identity=types.SimpleNamespace(public=b"k"), _report_sent=(None, -float("inf")),
                                 _prefix_store=lambda: store)
    beat = lambda: node_module.ChainswarmServer._publish_prefix_report(fake)  # noqa: E731
    beat(), beat()
    assert sent == [(0, 2 * node_module.REPORT_RENEW_S)]  # unchanged: not sent again
    store.seq = 1
    accept["ok"] = False
    beat()
    accept["ok"] = True
    beat(), beat()
    assert [seq for seq, _ in sent] == [0, 1, 1]  # an eviction: sent; refused once, so sent again, then quiet
    store.epoch = "e2"
    beat()
    fake._report_sent = (fake._report_sent[0], fake._report_sent[1] - node_module.REPORT_RENEW_S)
    beat()
    assert [seq for seq, _ in sent] == [0, 1, 1, 1, 1]  # a new epoch, then the renewal


def test_server_cli_help_and_bad_input(tiny_model, capsys):
    from swarm.cli import main

    with pytest.raises(SystemExit) as help_exit:
        main(["server", "--help"])
    assert help_exit.value.code == 0
    assert "--initial-peers" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad_flag:
        main(["server", "--model", tiny_model, "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--bogus"])
    assert bad_flag.value.code == 2
    peer = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWJ7HxrxtCLSEUwGKxc5dXkjWyyEw7ZwdiaYUsbn4po79R"
    assert main(["server", "--model", tiny_model + "-missing", "--initial-peers", peer]) == 2
    assert main(["server", "--model", tiny_model, "--initial-peers", "not-a-multiaddr"]) == 2
    assert main(["server", "--model", tiny_model, "--initial-peers", peer, "--memory-gb", "-2"]) == 2
    assert main(["server", "--model", tiny_model, "--initial-peers", peer, "--device", "tpu"]) == 2
    assert main(["server", "--model", tiny_model, "--initial-peers", "/ip4/127.0.0.1/tcp/1"]) == 2
    assert main(["server", "--model", tiny_model, "--initial-peers", peer, "--emulate-compute", "fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("chainswarm server: error:") == 7 and all(len(l) < 200 for l in err.splitlines())
    assert "--emulate-compute: expected PREFILL_MS,DECODE_MS" in err
    # what this host does not have, and what Chainswarm's block code does not do: one line each, before any start
    # (--device cuda was a traceback from torch after the node joined; --quant-type int8 on the CPU served float32
    # blocks that the profile counted at a quarter of their size; tensor parallelism failed every load)
    import torch

    for argv, needle in [(["--device", "cpu:1"], "expected cpu, cuda[:N] or mps"),
                         (["--device", f"cuda:{torch.cuda.device_count()}"], "--device cuda:"),
                         (["--device", "cpu", "--quant-type", "int8"], "--quant-type int8 quantizes on CUDA devices"),
                         (["--tensor-parallel-devices", "cpu", "cpu"], "--tensor-parallel-devices is not supported")]:
        assert main(["server", "--model", tiny_model, "--initial-peers", peer, *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("chainswarm server: error: ") and needle in err and "\n" not in err, err
    assert "--tensor-parallel-devices" not in main_help(capsys)


def main_help(capsys) -> str:
    from swarm.cli import main

    with pytest.raises(SystemExit):
        main(["server", "--help"])
    return capsys.readouterr().out


# -- a live swarm of two nodes -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swarm(tiny_model, tmp_path_factory):
    from server.local_swarm import LocalSwarm

    profile_dir = tmp_path_factory.mktemp("profiles")
    # open_sessions: these tests drive the nodes with vanilla petals clients (tickets: tests/test_hostile_peer.py)
    with LocalSwarm(tiny_model, open_sessions=True) as local:
        started = time.monotonic()
        options = dict(profile_cache_dir=str(profile_dir), update_period=1.0, wait=False, num_handlers=1)
        nodes = [local.add_node(node_id="a", memory_gb=0.5, **options),
                 local.add_node(node_id="b", memory_gb=0.25, **options)]
        for node in nodes:
            local.wait_profiled(node)
        local.timings = {"profiled_s": time.monotonic() - started}
        local.profile_dir = profile_dir
        yield local


@pytest.fixture(scope="module")
def orchestrator_dht(swarm):
    """The test's own DHT peer, acting as the orchestrator (created after the nodes started)."""
    import hivemind

    dht = hivemind.DHT(initial_peers=swarm.initial_peers, start=True,
                       record_validators=swarm_validators(swarm.orchestrator_identity, swarm.dht_prefix))
    yield dht
    dht.shutdown()


def _wait(predicate, timeout: float, what: str, period: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(period)


def _profiles(dht, swarm):
    return records.fetch_profiles(dht, swarm.dht_prefix)


def _online(servers: dict) -> set:
    """The peers of one block's announcements that petals' clients route to."""
    from petals.data_structures import ServerState

    return {peer for peer, info in servers.items() if info.state == ServerState.ONLINE}


def _block_servers(dht, swarm):
    """{block index: {peer_id: ServerInfo}} as petals announces it."""
    from petals.utils.dht import get_remote_module_infos

    uids = [f"{swarm.dht_prefix}.{i}" for i in range(4)]
    infos = get_remote_module_infos(dht, uids, latest=True)
    return {i: {peer.to_base58(): info for peer, info in module.servers.items()} for i, module in enumerate(infos)}


def _assign(dht, swarm, node, assignment, ttl=120.0):
    """Publish ``node``'s assignment as the orchestrator does; a DHT store can time out on a loaded machine, and the
    orchestrator simply publishes again on its next round: so does this, up to three times."""
    for attempt in range(3):
        if records.publish_assignment(dht, swarm.dht_prefix, node, assignment, ttl,
                                      swarm.orchestrator_identity.public):
            return
        time.sleep(1.0)
    raise AssertionError(f"the DHT refused {node}'s assignment three times")


def test_nodes_publish_their_profiles(swarm, orchestrator_dht):
    a, b = swarm.nodes
    found = _wait(lambda: (lambda p: p if {"a", "b"} <= set(p) else None)(_profiles(orchestrator_dht, swarm)),
                  10, "both profiles")
    for peer, budget in ((a, 0.5), (b, 0.25)):
        profile = found[peer.name]
        assert profile.peer_id == peer.peer_id and profile.state == records.WAITING
        assert profile.memory_bytes == int(budget * GIB)
        assert profile.prefill_s > 0 and profile.decode_s > 0 and profile.decode_s < 0.5
        assert profile.block_bytes > 0 and profile.cache_bytes_per_token == 512
        assert (profile.device, profile.torch_dtype, profile.quant_type) == ("cpu", "float32", "none")
        assert profile.plan_id is None and profile.start is None and profile.rtt_s is None
        assert peer.info["profile"] == profile.to_dict() | {"state": records.WAITING}
        # the batching pool's decode step at 1, 2, 4, 8, 16 sessions: one session is the profile's decode time
        steps = profile.batch_step_s
        assert profile.max_batch == DEFAULT_MAX_BATCH == 16 and len(steps) == 5 and steps[0] == pytest.approx(profile.decode_s)
        assert list(steps) == sorted(steps) and steps[-1] <= 16 * steps[0] + 1e-12
    # both nodes share one cache entry for this model on this device (plus the block size and batch curve)
    keys = sorted(json.loads((swarm.profile_dir / profiling.CACHE_FILE).read_text()))
    compute = [k for k in keys if not k.startswith(("block_bytes|", "batch|"))]
    assert len(keys) == 3 and len(compute) == 1 and compute[0].endswith("|float32|none")
    assert f"batch|{compute[0]}" in keys and any(k.startswith("block_bytes|") for k in keys)
    # once an orchestrator is known, the nodes measure their RTT to it over the swarm
    info = OrchestratorInfo(peer_id=orchestrator_dht.peer_id.to_base58(), http_url=None)
    assert records.publish_orchestrator(orchestrator_dht, swarm.dht_prefix, info, ttl=300,
                                        owner=swarm.orchestrator_identity.public)
    rtts = _wait(lambda: (lambda p: p if all(x.rtt_s is not None for x in p.values()) else None)(
        _profiles(orchestrator_dht, swarm)), 15, "RTTs in the profiles")
    assert all(0 < p.rtt_s < 1.0 for p in rtts.values())
    print(f"\nnodes profiled {swarm.timings['profiled_s']:.1f} s after launch; RTTs "
          f"{ {n: round(p.rtt_s * 1e3, 2) for n, p in rtts.items()} } ms")


def test_assignment_is_served_with_cache_sized_to_the_slots(swarm, orchestrator_dht):
    a, b = swarm.nodes
    started = time.monotonic()
    _assign(orchestrator_dht, swarm, "a", Assignment("p1", 0, 2, cache_slots=2, max_length=128))
    _assign(orchestrator_dht, swarm, "b", Assignment("p1", 2, 4, cache_slots=3, max_length=128))
    swarm.wait_serving(a, "p1", timeout=60)
    swarm.wait_serving(b, "p1", timeout=60)
    swarm.timings["assigned_to_serving_s"] = time.monotonic() - started
    assert [(a.start, a.end), (b.start, b.end)] == [(0, 2), (2, 4)]
    assert [s for s, *_ in a.info["history"]] == ["loading", "serving"]

    from petals.data_structures import ServerState

    # a node reports "serving" once its blocks run; petals' ONLINE announcement is a DHT store of its announcer thread
    # that can land seconds later on a loaded machine (CI saw JOINING still announced): wait for it, bounded
    last: dict = {}

    def announced_online():
        last["blocks"] = servers = _block_servers(orchestrator_dht, swarm)
        return servers if all(len(servers[i]) == 1 and all(info.state == ServerState.ONLINE for info in
                                                            servers[i].values()) for i in range(4)) else None

    blocks = wait_for(announced_online, 30, period=0.2, what="petals' ONLINE announcements of blocks 0-3",
                      explain=lambda: {i: {peer[-6:]: info.state.name for peer, info in servers.items()}
                                       for i, servers in last.get("blocks", {}).items()})
    for index in range(4):
        ((peer_id, info),) = blocks[index].items()
        node, slots, span = (a, 2, (0, 2)) if index < 2 else (b, 3, (2, 4))
        assert peer_id == node.peer_id and info.state == ServerState.ONLINE
        assert (info.start_block, info.end_block) == span and info.public_name == node.name
        # petals counts free cache in (token-slots · 2 · blocks); the pool holds slots·max_length block-tokens
        assert info.cache_tokens_left == slots * 128 * 2
    # petals' block announcements live twice max(heartbeat, 10 s), not twice these nodes' 1 s heartbeat: the heartbeat
    # renews the profile records only (server/node.py: ANNOUNCE_PERIOD_MIN_S)
    from hivemind.utils import get_dht_time

    announced = orchestrator_dht.get(f"{swarm.dht_prefix}.0", latest=True)
    lives = max(item.expiration_time for item in announced.value.values()) - get_dht_time()
    assert 10.0 < lives <= 20.5, lives
    served = _wait(lambda: (lambda p: p if all(x.state == records.SERVING for x in p.values()) else None)(
        _profiles(orchestrator_dht, swarm)), 10, "serving profiles")
    assert (served["a"].plan_id, served["a"].start, served["a"].end, served["a"].cache_slots) == ("p1", 0, 2, 2)
    assert (served["b"].plan_id, served["b"].start, served["b"].end, served["b"].cache_slots) == ("p1", 2, 4, 3)
    print(f"\nassignment → serving in {swarm.timings['assigned_to_serving_s']:.2f} s")


def test_two_nodes_generate_like_transformers_with_server_to_server_pushes(swarm, tiny_model, reference_generate):
    from transformers import AutoTokenizer

    from swarm.engine.petals_client import open_distributed_model

    a, b = swarm.nodes
    input_ids = AutoTokenizer.from_pretrained(tiny_model)("A journey of a thousand miles", return_tensors="pt").input_ids
    expected = reference_generate(input_ids, 32)
    pushes_before = b.info["pushes"].value
    with open_distributed_model(tiny_model, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                use_server_to_server=True) as model:
        produced = model.generate(input_ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(produced, expected)
    # with the push fix, a (blocks 0:2) pushes its outputs straight to b (blocks 2:4) at every decode step
    assert b.info["pushes"].value - pushes_before >= 24
    assert a.info["pushes"].value == 0  # nobody precedes the first span


def test_malformed_assignments_are_ignored(swarm, orchestrator_dht):
    a, _b = swarm.nodes
    key = f"{swarm.dht_prefix}.{records.ASSIGNMENTS}"
    from hivemind.utils.timed_storage import get_dht_time

    from swarm.trust.identity import Identity

    subkey = swarm.orchestrator_identity.subkey("a")
    refused_records = [
        {"plan_id": "bad1", "start": "zero", "end": 2, "cache_slots": 1, "max_length": 64},  # mistyped
        {"plan_id": "bad2", "start": 3, "end": 1, "cache_slots": 1, "max_length": 64},  # inverted range
        "not a mapping",
    ]
    for raw in refused_records:  # schema-invalid: no validating DHT peer stores them, not even signed
        assert not orchestrator_dht.store(key, raw, expiration_time=get_dht_time() + 120, subkey=subkey)
    # well-formed and signed, but past the model's last block: stored, and the node ignores it
    assert orchestrator_dht.store(key, {"plan_id": "bad3", "start": 0, "end": 9, "cache_slots": 1, "max_length": 64},
                                  expiration_time=get_dht_time() + 120, subkey=subkey)
    time.sleep(1.2)  # > check_period: the node has looked at it
    # well-formed but signed by another key: the node obeys only the orchestrator key it was given
    assert records.publish_assignment(orchestrator_dht, swarm.dht_prefix, "a", Assignment("bad4", 2, 4, 1, 64), 120,
                                      owner=Identity.generate().public) is False  # the DHT signs with its own key only
    time.sleep(1.2)
    profile = _profiles(orchestrator_dht, swarm)["a"]
    assert (profile.state, profile.plan_id, profile.start, profile.end) == (records.SERVING, "p1", 0, 2)
    assert a.alive and [s for s, *_ in a.info["history"]] == ["loading", "serving"]
    _assign(orchestrator_dht, swarm, "a", Assignment("p1", 0, 2, cache_slots=2, max_length=128))  # restore


def test_same_layout_under_a_new_plan_id_is_adopted_without_reload(swarm, orchestrator_dht):
    a, _b = swarm.nodes
    _assign(orchestrator_dht, swarm, "a", Assignment("p1b", 0, 2, cache_slots=2, max_length=128))
    swarm.wait_serving(a, "p1b", timeout=15)
    assert [s for s, *_ in a.info["history"]] == ["loading", "serving", "serving"]


def test_plan_change_drains_open_session_then_reloads(swarm, orchestrator_dht, tiny_model, reference_generate):
    from petals.data_structures import ServerState
    from transformers import AutoTokenizer

    from swarm.engine.petals_client import open_distributed_model

    a, b = swarm.nodes
    input_ids = AutoTokenizer.from_pretrained(tiny_model)("Every volunteer GPU", return_tensors="pt").input_ids
    expected = reference_generate(input_ids, 32)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with open_distributed_model(tiny_model, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix) as model:
        with model.inference_session(max_length=input_ids.shape[1] + 16) as session:
            first = model.generate(input_ids, max_new_tokens=8, session=session, **kw)
            _assign(orchestrator_dht, swarm, "a", Assignment("p2", 0, 3, cache_slots=3, max_length=96))
            _assign(orchestrator_dht, swarm, "b", Assignment("p2", 3, 4, cache_slots=4, max_length=96))
            swarm.wait_state(a, records.DRAINING, timeout=15)
            swarm.wait_state(b, records.DRAINING, timeout=15)
            # draining servers leave petals' routing (JOINING) but keep serving the open session
            blocks = _wait(lambda: (lambda s: s if s[0] and all(i.state == ServerState.JOINING for i in s[0].values())
                                    else None)(_block_servers(orchestrator_dht, swarm)), 10, "JOINING announcement")
            assert set(blocks[0]) == {a.peer_id}
            time.sleep(1.5)  # the nodes keep waiting for the session
            assert (a.info["state"], b.info["state"]) == (records.DRAINING, records.DRAINING)
            rest = model.generate(None, max_new_tokens=8, session=session, **kw)
        closed = time.monotonic()
        assert torch.equal(torch.cat([first, rest], dim=1), expected[:, : input_ids.shape[1] + 16])
        swarm.wait_serving(a, "p2", timeout=60)
        swarm.wait_serving(b, "p2", timeout=60)
        swarm.timings["reload_s"] = time.monotonic() - closed
    assert [(a.start, a.end), (b.start, b.end)] == [(0, 3), (3, 4)]
    assert [s for s, *_ in a.info["history"]][-3:] == ["draining", "loading", "serving"]

    # (the old ranges' OFFLINE announcements live on until they expire: petals' clients route to ONLINE servers only)
    servers = _wait(lambda: (lambda s: s if [_online(s[i]) for i in range(4)] == [{a.peer_id}] * 3 + [{b.peer_id}]
                             else None)(_block_servers(orchestrator_dht, swarm)), 15, "the new layout in petals")
    assert servers[0][a.peer_id].cache_tokens_left == 3 * 96 * 2  # 3 block-slots: one session on 3 blocks
    assert servers[3][b.peer_id].cache_tokens_left == 4 * 96 * 2
    # the reloaded blocks compute the same model
    with open_distributed_model(tiny_model, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix) as model:
        produced = model.generate(input_ids, max_new_tokens=32, **kw)
    assert torch.equal(produced, expected)
    print(f"\nsession closed → both nodes serving the new plan in {swarm.timings['reload_s']:.2f} s")


def test_streams_that_outlive_a_servers_reload_are_reopened_not_blamed_on_it(swarm, orchestrator_dht, tiny_model):
    """A ChainGenerator keeps its multi-session streams open a while after its sessions end (``idle_close_s``); a
    server that drains (no session of ours is open there) and reloads meanwhile has ended them. The next sessions
    go on over new streams, on the same live server. Before, they failed with the lost connection and the
    orchestrator excluded the server: the chaos soak once saw the plan dropped that way, right after a move."""
    from swarm.engine.batching import ChainGenerator
    from swarm.engine.petals_client import open_distributed_model

    a, b = swarm.nodes
    swarm.wait_serving(a, "p2", timeout=60)
    prompt = [1, 45, 479, 33, 263]
    with open_distributed_model(tiny_model, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                torch_dtype=torch.float32) as model:
        route = [(a.peer_id, 0, 3), (b.peer_id, 3, 4)]
        with ChainGenerator(model, route, idle_close_s=600) as generator:
            before = generator.submit(prompt, 6).result(timeout=60)
            streams = generator.batch
            loads = [s for s, *_ in a.info["history"]].count("loading")
            _assign(orchestrator_dht, swarm, "a", Assignment("p4", 0, 3, cache_slots=6, max_length=96))  # a reload
            swarm.wait_serving(a, "p4", timeout=60)
            assert [s for s, *_ in a.info["history"]].count("loading") == loads + 1
            assert generator.batch is streams  # the idle streams were kept across the reload
            assert generator.submit(prompt, 6).result(timeout=60) == before
            assert generator.reopened == 1 and generator.batch is not streams
    assert a.alive


def test_empty_assignment_sends_a_node_back_to_waiting(swarm, orchestrator_dht):
    _a, b = swarm.nodes
    _assign(orchestrator_dht, swarm, "b", Assignment("p3", 0, 0, cache_slots=0, max_length=96))
    swarm.wait_state(b, records.WAITING, plan_id="p3", timeout=30)
    profile = _wait(lambda: (lambda p: p if p.state == records.WAITING else None)(
        _profiles(orchestrator_dht, swarm)["b"]), 10, "waiting profile")
    assert (profile.plan_id, profile.start, profile.end, profile.cache_slots) == ("p3", None, None, 0)
    from petals.data_structures import ServerState

    _wait(lambda: all(info.state == ServerState.OFFLINE for info in _block_servers(orchestrator_dht, swarm)[3].values()),
          15, "block 3 offline")
    assert b.alive


def test_chainswarm_server_command_serves_its_assignment_and_stops_cleanly(swarm, orchestrator_dht, tiny_model):
    import os
    import signal
    import subprocess
    import sys

    import psutil

    command = [sys.executable, "-m", "swarm.cli", "server", "--model", tiny_model, "--initial-peers",
               *swarm.initial_peers, "--node-id", "c", "--memory-gb", "0.1", "--device", "cpu",
               "--torch-dtype", "float32", "--quant-type", "none", "--host", "127.0.0.1", "--update-period", "1",
               "--num-handlers", "1", "--cache-dir", str(swarm.profile_dir), "--log-level", "WARNING",
               "--drain-timeout", "1", "--open",  # a vanilla petals client drives it below
               "--orchestrator-key", swarm.orchestrator_identity.public_b64]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        profile = _wait(lambda: _profiles(orchestrator_dht, swarm).get("c"), 60, "the CLI node's profile", 0.3)
        assert profile.state == records.WAITING and profile.memory_bytes == int(0.1 * GIB)
        _assign(orchestrator_dht, swarm, "c", Assignment("p4", 3, 4, cache_slots=2, max_length=64))
        _wait(lambda: (lambda p: p is not None and p.state == records.SERVING and p.plan_id == "p4")(
            _profiles(orchestrator_dht, swarm).get("c")), 60, "the CLI node serving", 0.3)
        # petals' ONLINE announcement is its announcer thread's DHT store, which can land after the node reports
        # serving (CI at a065a69 read none yet): wait for it, bounded, as the test above does
        _wait(lambda: _online(_block_servers(orchestrator_dht, swarm)[3]) == {profile.peer_id}, 30,
              "petals' ONLINE announcement of block 3 by the CLI node", 0.3)

        # a session that outlives --drain-timeout does not block a plan change forever
        from swarm.engine.petals_client import open_distributed_model

        with open_distributed_model(tiny_model, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                    max_retries=0) as model:
            opened = model.inference_session(max_length=16)
            session = opened.__enter__()
            try:
                model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, session=session, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
                _assign(orchestrator_dht, swarm, "c", Assignment("p5", 3, 4, cache_slots=3, max_length=64))  # a bigger pool
                reloaded = _wait(lambda: (lambda p: p is not None and p.state == records.SERVING
                                          and p.plan_id == "p5" and p)(_profiles(orchestrator_dht, swarm).get("c")),
                                 30, "reload after the drain timeout", 0.3)
                assert reloaded.cache_slots == 3
            finally:
                with contextlib.suppress(Exception):  # c dropped this session when it reloaded
                    opened.__exit__(None, None, None)
        family = psutil.Process(process.pid).children(recursive=True)
        assert family  # DHT, p2pd, handler
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(family, timeout=5)
        assert not alive, [p.pid for p in alive]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        output = process.stdout.read().decode(errors="replace")
    assert "Traceback" not in output, output[-2000:]


def test_fewer_slots_on_the_same_blocks_are_served_in_place_more_need_a_reload():
    from server.node import _served_in_place

    loaded = Assignment("p1", 0, 2, cache_slots=4, max_length=128)
    fewer = _served_in_place(Assignment("p2", 0, 2, cache_slots=3, max_length=128), loaded)
    assert fewer == Assignment("p2", 0, 2, cache_slots=4, max_length=128)  # keeps the bigger pool it has
    assert _served_in_place(Assignment("p2", 0, 2, cache_slots=5, max_length=128), loaded) is None
    assert _served_in_place(Assignment("p2", 0, 3, cache_slots=1, max_length=128), loaded) is None
    assert _served_in_place(Assignment("p2", 0, 2, cache_slots=1, max_length=256), loaded) is None
    assert _served_in_place(Assignment("p2", 0, 2, cache_slots=1, max_length=128), None) is None


def test_declared_profile_replaces_measurements_and_rejects_unknown_keys(tiny_model, tmp_path):
    from server.node import ChainswarmServer

    with pytest.raises(ValueError, match="declared_profile accepts"):
        ChainswarmServer(converted_model_name_or_path=tiny_model, dht_prefix="declared", initial_peers=[],
                         device="cpu", torch_dtype="float32", throughput=1.0, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                         use_relay=False, use_auto_relay=False, reachable_via_relay=False, skip_reachability_check=True,
                         num_handlers=1, memory_gb=0.01, profile_cache_dir=str(tmp_path),
                         declared_profile={"decode_ms": 3})
