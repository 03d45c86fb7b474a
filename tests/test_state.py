"""The state directory (swarm.state.store) and what the orchestrator keeps in it (swarm.state.persistence)."""
import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from swarm.state import persistence
from swarm.trust import records
from swarm.control.options import OrchestratorOptions
from swarm.state.store import StateDir, StateError, atomic_write
from test_orchestrator_logic import make, profile, publish, run, serve_assignments, SERVERS

ROOT = Path(__file__).resolve().parents[1]


def test_round_trip_and_missing_file(tmp_path):
    store = StateDir(tmp_path / "state")
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
    assert store.read("plan.json") is None  # never saved: a first start
    store.write("plan.json", {"plan_id": "p1", "n": [1, 2.5]})
    assert store.read("plan.json") == {"plan_id": "p1", "n": [1, 2.5]}
    store.write("plan.json", {"plan_id": "p2"})
    assert StateDir(store.path).read("plan.json") == {"plan_id": "p2"}
    assert stat.S_IMODE(os.stat(store.file("plan.json")).st_mode) == 0o600


def test_a_leftover_temp_file_is_never_read_and_is_swept(tmp_path):
    store = StateDir(tmp_path)
    store.write("fairness.json", {"v": 1})
    # what a crash in the middle of the next write leaves: a truncated temp file beside the intact target
    (tmp_path / ".tmp-fairness.json.abc123").write_text('{"v": 2, "trunc')
    reopened = StateDir(tmp_path)
    assert reopened.read("fairness.json") == {"v": 1}
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_write_that_fails_before_the_rename_keeps_the_old_file(tmp_path, monkeypatch):
    store = StateDir(tmp_path)
    store.write("plan.json", {"plan_id": "old"})

    def crash(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.write("plan.json", {"plan_id": "new"})
    monkeypatch.undo()
    assert store.read("plan.json") == {"plan_id": "old"}
    assert not list(tmp_path.glob(".tmp-*"))


WRITER = """
import sys
from swarm.state.store import StateDir
store = StateDir(sys.argv[1])
i = 0
while True:
    i += 1
    store.write("fairness.json", {"i": i, "pad": "x" * 200_000})
"""


def test_sigkill_during_writes_leaves_a_whole_file(tmp_path):
    """A process killed at arbitrary points while it rewrites a file: the file is always a whole version."""
    seen = []
    for delay in (0.3, 0.35, 0.42, 0.5):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        doc = StateDir(tmp_path).read("fairness.json")
        if doc is not None:
            assert doc["pad"] == "x" * 200_000
            seen.append(doc["i"])
    assert seen, "the writer never completed a write"


def test_corrupt_files_are_a_one_line_error_naming_the_file(tmp_path):
    store = StateDir(tmp_path)
    (tmp_path / "plan.json").write_text('{"plan_id": ')
    with pytest.raises(StateError, match=r"plan\.json is corrupt") as err:
        store.read("plan.json")
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "node.json").write_text('{"prefix_secret": "not hex"}')
    with pytest.raises(StateError, match=r"node\.json is corrupt"):
        store.prefix_secret()
    (tmp_path / "api_keys.json").write_text('[1, 2]')
    with pytest.raises(StateError, match=r"api_keys\.json is corrupt"):
        store.api_keys({})
    atomic_write(tmp_path / "identity.key", b"garbage", 0o400)
    with pytest.raises(StateError, match=r"identity\.key is corrupt"):
        store.identity_path()


def test_identity_secret_ports_and_api_keys_persist(tmp_path):
    store = StateDir(tmp_path)
    key = store.identity_path()
    peer = store.peer_id()
    secret = store.prefix_secret()
    assert len(secret) == 32
    store.record_ports(dht_port=40001, http_port=40002)
    again = StateDir(tmp_path)
    assert again.identity_path() == key and again.peer_id() == peer and again.prefix_secret() == secret
    options = persistence.prepare(OrchestratorOptions(model_dir="m", http_port=0, api_keys={"k1": "alice"}),
                                  again)
    assert (options.dht_port, options.http_port, options.api_keys) == (40001, 40002, {"k1": "alice"})
    assert stat.S_IMODE(os.stat(again.file("api_keys.json")).st_mode) == 0o600
    # keys given nowhere: the saved ones; explicit ports win over the saved ones
    options = persistence.prepare(OrchestratorOptions(model_dir="m", dht_port=5555, http_port=8000),
                                  StateDir(tmp_path))
    assert (options.dht_port, options.http_port, options.api_keys) == (5555, 8000, {"k1": "alice"})


def test_plan_and_fairness_counters_survive_a_restart(tmp_path):
    """An orchestrator saves; a new one restores the same plan id, assignments and chains, and the deficits."""
    async def scenario():
        store = StateDir(tmp_path)
        orch, dht = make(quantum=500.0)
        keeper = persistence.Persistence(store, orch)
        assert keeper.restore() == {"plan_id": None, "clients": [], "pins": []}
        publish(dht, *(profile(n, m) for n, m in SERVERS))
        await orch.start()
        serve_assignments(dht)
        await orch.refresh()
        for _ in range(3):
            grant = await orch.acquire("flood", 200, 16)
            orch.tokens(grant.request_id, 16)
            orch.finish(grant.request_id, 16)
        before = orch.status()
        deficit = orch.router.scheduler.deficit("flood")
        assert keeper.save(force=True)
        assert not keeper.save(force=True)  # nothing changed: nothing written
        await orch.stop()

        again, dht2 = make(quantum=500.0)
        dht2.data = dht.data  # the servers' records, as the DHT still holds them
        restored = persistence.Persistence(StateDir(tmp_path), again).restore()
        assert restored == {"plan_id": before["plan"]["plan_id"], "clients": ["flood"], "pins": ["a", "b", "c", "d"]}
        await again.start()
        after = again.status()
        assert after["plan"]["plan_id"] == before["plan"]["plan_id"] and after["plan"]["replans"] == 0
        assert [s["assignment"] for s in after["servers"]] == [s["assignment"] for s in before["servers"]]
        assert [(c["id"], c["servers"], c["capacity"], c["ready"]) for c in after["chains"]] == \
            [(c["id"], c["servers"], c["capacity"], c["ready"]) for c in before["chains"]]
        assert again.router.scheduler.deficit("flood") == deficit
        assert after["clients"]["flood"]["service"] == before["clients"]["flood"]["service"]
        await again.stop()

        # a plan saved for another model is refused by name
        other, _ = make(quantum=500.0)
        other.config.num_blocks = 8
        with pytest.raises(StateError, match="plan.json holds a plan for 4 blocks"):
            persistence.Persistence(StateDir(tmp_path), other).restore()

    run(scenario())


def test_a_dht_that_does_not_answer_delays_no_snapshot_of_the_counters(tmp_path, caplog):
    """The saver asks the DHT process which servers it is connected to (their addresses, which a restarted
    orchestrator dials); a DHT that does not answer holds up neither the fairness snapshots, nor the stop."""
    async def scenario():
        orch, dht = make(quantum=500.0)
        hung = threading.Event()
        dht.run_coroutine = lambda *_: hung.wait(30)  # the peer list never comes (until the test ends)
        keeper = persistence.Persistence(StateDir(tmp_path), orch, min_interval_s=0.05)
        keeper._peers_call = persistence.BoundedCall("reading the DHT's connected peers", 0.3)  # DHT_CALL_S: 15
        keeper.restore()
        publish(dht, *(profile(n, m) for n, m in SERVERS))
        await orch.start()
        serve_assignments(dht)
        await orch.refresh()
        saver = asyncio.ensure_future(keeper.run(peers_every=2))
        try:
            await asyncio.sleep(0.5)  # the peer list asked for and waited for past its bound
            grant = await orch.acquire("flood", 200, 16)
            orch.tokens(grant.request_id, 16)
            orch.finish(grant.request_id, 16)
            service = orch.status()["clients"]["flood"]["service"]
            snapshot = tmp_path / "fairness.json"
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and not (
                    snapshot.exists() and dict(json.loads(snapshot.read_text())["scheduler"]["service"])
                    .get("flood") == service):
                await asyncio.sleep(0.05)
            assert dict(json.loads(snapshot.read_text())["scheduler"]["service"]).get("flood") == service
        finally:
            t0 = time.monotonic()
            saver.cancel()
            await asyncio.gather(saver, return_exceptions=True)
            assert time.monotonic() - t0 < 1.0
            hung.set()
            await orch.stop()
        assert any("the servers' addresses were not saved" in r.getMessage() for r in caplog.records)

    run(scenario())


def test_a_restart_waits_for_its_servers_at_most_its_bound_when_the_dht_does_not_answer(tmp_path):
    """After a restart the orchestrator waits (bounded) for the restored plan's servers to publish again; a DHT
    read that never returns ends that wait at its bound instead of holding the restart for good."""
    async def scenario():
        orch, dht = make(quantum=500.0)
        keeper = persistence.Persistence(StateDir(tmp_path), orch)
        keeper.restore()
        publish(dht, *(profile(n, m) for n, m in SERVERS))
        await orch.start()
        serve_assignments(dht)
        await orch.refresh()
        assert keeper.save(force=True)
        await orch.stop()

        again, dht2 = make(quantum=500.0)
        hung = threading.Event()
        dht2.get = lambda *_, **__: hung.wait(30)  # the records never come (until the test ends)
        restarted = persistence.Persistence(StateDir(tmp_path), again)
        restarted.DHT_CALL_S = 0.3
        assert restarted.restore()["plan_id"] is not None
        t0 = time.monotonic()
        missing = await restarted.await_servers(timeout_s=1.0)
        waited = time.monotonic() - t0
        hung.set()
        assert missing == {n for n, _ in SERVERS} and waited < 1.0 + 0.3 + 1.0, waited

    run(scenario())


def test_node_key_pins_survive_a_restart_and_an_impostor_is_refused_right_after(tmp_path):
    """The node id -> key pins are saved; after a restart an impostor's profile for a live node id is refused
    from the first refresh (without the saved pins, two keys claiming one id would keep the node out of the
    plan), and a restored pin whose node never comes back is released when its hold ends."""
    from swarm.trust.identity import Identity
    from test_orchestrator_logic import PREFIX, node_key

    async def scenario():
        orch, dht = make()
        keeper = persistence.Persistence(StateDir(tmp_path), orch)
        publish(dht, *(profile(n, m) for n, m in SERVERS))
        await orch.start()
        assert keeper.save(force=True)
        saved = json.loads((tmp_path / "pins.json").read_text())["pins"]
        assert saved == {n: node_key(n).decode() for n, _ in SERVERS}
        assert not keeper.save(force=True)  # unchanged pins: nothing written
        plan_id = orch.status()["plan"]["plan_id"]
        await orch.stop()

        impostor = Identity.generate()
        records.publish_profile(dht, PREFIX, profile("a", 60), ttl=10, owner=impostor.public)  # a bigger "a"
        again, dht2 = make()
        dht2.data = dht.data
        restored = persistence.Persistence(StateDir(tmp_path), again).restore()
        assert restored["pins"] == ["a", "b", "c", "d"] and restored["plan_id"] == plan_id
        await again.start()
        status = again.status()
        assert status["plan"]["plan_id"] == plan_id and status["plan"]["replans"] == 0
        assert {s["id"] for s in status["plan"]["servers"]} == {"a", "b", "c", "d"}
        assert again.pins.owner("a") == node_key("a")
        assert any(e["event"] == "server_key_refused" and e["node"] == "a" and e["key"] == impostor.fingerprint
                   for e in status["events"])
        await again.stop()

        # without the saved pins the same two claims keep "a" out: that is what the file prevents
        fresh, dht3 = make()
        dht3.data = dht.data
        await fresh.start()
        assert "a" not in {s["id"] for s in fresh.status()["plan"]["servers"]}
        await fresh.stop()

    run(scenario())


def test_a_restored_pin_is_held_only_until_its_node_is_seen_or_the_hold_ends():
    from swarm.trust.identity import KeyPins

    pins = KeyPins()
    pins.restore({"a": b"key-a", "b": b"key-b"}, hold_s=30.0, now=100.0)
    # no records yet (the DHT reconnects): both held; an impostor's claim on "a" is refused
    chosen, refused = pins.select({"a": {b"evil": "forged"}}, now=110.0)
    assert chosen == {} and [node for node, _ in refused] == ["a"] and pins.owner("a") == b"key-a"
    # "a" is seen under its key: an ordinary pin again (dropped as soon as its record goes)
    assert pins.select({"a": {b"key-a": "real"}}, now=111.0)[0] == {"a": "real"}
    assert pins.owner("b") == b"key-b"  # still held
    assert pins.select({}, now=131.0) == ({}, [])  # hold over for "b"; "a"'s record gone
    assert pins.owner("a") is None and pins.owner("b") is None
    assert pins.select({"b": {b"new-b": "new"}}, now=132.0)[0] == {"b": "new"}  # the id is free again


def test_a_corrupt_pins_file_is_a_one_line_error(tmp_path):
    orch, _ = make()
    for text in ('{"pins": ["a"]}', '{"pins": {"a": "/etc/passwd"}}', '{"pins": {"a": "ssh-rsa AAAA"}}'):
        (tmp_path / "pins.json").write_text(text)
        with pytest.raises(StateError, match=r"pins\.json is corrupt") as err:
            persistence.Persistence(StateDir(tmp_path), orch).restore()
        assert "\n" not in str(err.value)


def test_the_cli_refuses_a_corrupt_state_file_with_one_line(tiny_model, tmp_path):
    state = StateDir(tmp_path / "state")
    state.file("node.json").write_text('{"prefix_secret": ')
    result = subprocess.run([sys.executable, "-m", "swarm.cli", "orchestrator", "--model", tiny_model,
                             "--state-dir", str(state.path), "--http", "127.0.0.1:0"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("chainswarm orchestrator: error: state file ") and "node.json is corrupt" in lines[-1]
    assert "Traceback" not in result.stderr
