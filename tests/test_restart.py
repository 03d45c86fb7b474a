"""Restart without loss, on loopback: an orchestrator with a state directory is SIGKILLed and started again.

The orchestrator is the swarm's DHT bootstrap (no separate DHT), so the two nodes' initial peers name only
it: after the restart they must find it again by themselves. It comes back with the same peer id, DHT and
HTTP addresses, re-adopts the same plan (the nodes keep their blocks: no reload), its prefix namespace
(a prompt's pages cached before the kill are reused after it), its API keys (none given on the restart) and
the flooding client's fairness counters; a greedy request gives the same text as before the kill, also for a
client that was retrying while the orchestrator was down.
"""
import json
import threading
import time

import httpx
import pytest

from helpers import HTTP, http_client, wait_for
from server.local_swarm import LocalSwarm
from swarm.trust.validation import swarm_validators

pytestmark = pytest.mark.swarm

KEYS = {"key-a": "a", "key-flood": "flood", "key-admin": "admin"}
ADMIN = {"Authorization": "Bearer key-admin"}
SHARED = ("You are a careful assistant. Answer briefly and cite the document. The document says that the "
          "harbour of the old town was rebuilt twice, first after the storm and then after the fire, and that "
          "the lighthouse keeper kept a diary of every ship. ")
PROMPT = SHARED + "Question: who kept the diary?"
OPTIONS = dict(policy="dlpm", quantum=200.0, expected_rate=4.0, max_length=256, expected_input_tokens=128,
               expected_output_tokens=16, refresh_s=0.5, request_timeout_s=8.0, prefix_cache_tokens=128)


def complete(url, prompt=PROMPT, key="key-a", max_tokens=12):
    with http_client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    reused = dict(kv.split("=") for kv in response.headers["x-chainswarm-prefix"].split(";"))["reused"]
    return response.json()["choices"][0]["text"], int(reused)


def retrying_complete(url, out: list):
    """A SwarmClient sent while the orchestrator is down: it retries the refused connection until it is back."""
    from client import SwarmClient

    with SwarmClient(url, "key-a", reconnect_s=90.0) as c:
        out.append(c.generate(PROMPT, 12, temperature=0).text)


def admin_status(url):
    return HTTP.get(f"{url}/v1/swarm", headers=ADMIN, timeout=30).json()


def test_sigkilled_orchestrator_restarts_from_its_state_dir_without_loss(tiny_model, tmp_path):
    state_dir = tmp_path / "state"
    local = LocalSwarm(tiny_model)
    try:
        orch = local.add_orchestrator(bootstrap=True, api_keys=KEYS, state_dir=str(state_dir), **OPTIONS)
        url, maddrs = orch.info["url"], orch.info["maddrs"]
        declared = {"prefill_s": 1e-5, "decode_s": 3e-4, "rtt_s": 0.002}
        nodes = [local.add_node(node_id=name, memory_gb=0.0013, wait=False, declared_profile=declared,
                                profile_cache_dir=str(tmp_path / "profiles"))
                 for name in ("left", "right")]
        assert all(p.info["kwargs"]["initial_peers"] == maddrs for p in nodes)
        before = local.wait_chains_ready()
        for peer in nodes:
            local.wait_serving(peer, before["plan"]["plan_id"])
        text, reused = complete(url)
        assert text and reused == 0

        # a flood from one client: its service goes up and its deficit moves (refilled by the quantum when it runs
        # out, and credited back for prompt positions the prefix stores served, so its value depends on timing)
        threads = [threading.Thread(target=complete, args=(url, SHARED + f"Flood {i}.", "key-flood", 16))
                   for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        flood = admin_status(url)["clients"]["flood"]
        assert flood["service"] > 0 and flood["deficit"] != 0.0
        # the snapshot (at most ~1 s old) holds exactly these counters
        snapshot = state_dir / "fairness.json"  # written atomically, first within ~1 s of the first request

        def saved() -> dict:
            return dict(json.loads(snapshot.read_text())["scheduler"]["service"]) if snapshot.exists() else {}

        wait_for(lambda: saved().get("flood") == flood["service"], 10, what="fairness snapshot",
                 explain=lambda: f"saved {saved()}, read {flood['service']} then, now "
                                 f"{admin_status(url)['clients']['flood']['service']}; flood threads still running: "
                                 f"{sum(t.is_alive() for t in threads)}")
        history = {p.name: len(p.info.get("history", [])) for p in nodes}
        # the servers' DHT addresses, which a restarted orchestrator dials at once
        peer_ids = {s["peer_id"] for s in before["servers"]}
        wait_for(lambda: {m.rsplit("/", 1)[1] for m in json.loads((state_dir / "node.json").read_text())
                          .get("peers", [])} == peer_ids, 15, what="servers' addresses saved")

        local.kill(orch)
        orch.process.join(10)
        assert not orch.process.is_alive()
        # while it is down, an impostor claims the live node id "left" under its own key
        impostor = claim_node_id(local, "left", json.loads((state_dir / "node.json").read_text())["peers"])
        retried: list[str] = []
        retrier = threading.Thread(target=retrying_complete, args=(url, retried))
        retrier.start()

        t0 = time.monotonic()
        again = local.add_orchestrator(bootstrap=True, state_dir=str(state_dir), **OPTIONS)  # no keys given
        started_s = time.monotonic() - t0
        assert (again.info["url"], again.info["maddrs"]) == (url, maddrs)  # same peer id, DHT and HTTP address
        after = local.wait_chains_ready()
        back_s = time.monotonic() - t0
        assert after["plan"]["plan_id"] == before["plan"]["plan_id"] and after["plan"]["replans"] == 0
        assert [s["assignment"] for s in after["servers"]] == [s["assignment"] for s in before["servers"]]
        status = admin_status(url)  # the saved API keys: the admin key still works
        assert status["clients"]["flood"]["service"] == flood["service"]
        assert status["clients"]["flood"]["deficit"] == flood["deficit"]
        # the saved pins: the impostor's claim is refused (unpinned, two keys on "left" would have kept it out
        # of the plan, and the plan would have changed)
        assert any(e["event"] == "server_key_refused" and e["node"] == "left" and e["key"] == impostor.fingerprint
                   for e in status["events"])
        assert next(s for s in status["servers"] if s["node_id"] == "left")["peer_id"] == \
            next(s for s in before["servers"] if s["node_id"] == "left")["peer_id"]

        again_text, again_reused = complete(url)
        assert again_text == text
        assert again_reused >= 32  # the pages cached before the kill, found in the same namespace
        retrier.join(60)
        assert retried == [text]
        for peer in nodes:  # no drain, no reload: the nodes only ever served the first assignment
            local.wait_serving(peer)
            assert peer.process.is_alive()
            assert len(peer.info.get("history", [])) == history[peer.name], peer.info["history"]
        print(f"orchestrator serving {started_s:.1f} s after the restart began, all chains ready after {back_s:.1f} s")
    finally:
        if getattr(local, "impostor_dht", None) is not None:
            local.impostor_dht.shutdown()
        local.stop()


def claim_node_id(local, node_id, peers):
    """A DHT peer with its own key republishes ``node_id``'s profile as its own (a validly signed claim)."""
    import hivemind

    from swarm.trust import records
    from swarm.trust.identity import Identity

    identity = Identity.generate()
    local.impostor_dht = dht = hivemind.DHT(initial_peers=peers, start=True,
                                            record_validators=swarm_validators(identity, local.dht_prefix))
    real = wait_for(lambda: records.fetch_profile_claims(dht, local.dht_prefix).get(node_id), 15,
                    what=f"{node_id}'s profile")
    # a store that no peer acknowledged in time (a loaded machine) returns False: try again, bounded
    wait_for(lambda: records.publish_profile(dht, local.dht_prefix, next(iter(real.values())), 120, identity.public),
             30, period=1.0, what=f"the impostor's claim on {node_id} stored")
    return identity


def _group_alive(pgid):
    import os

    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_cli_orchestrator_sigkilled_leaves_no_orphan_and_restarts_on_the_same_addresses(tiny_model, tmp_path):
    """``kill -9`` of the ``chainswarm orchestrator`` process takes its DHT process and p2pd along (an orphaned
    p2pd would keep listening on the same port under the same identity), and a restart with the same
    ``--state-dir`` comes back on the same DHT multiaddr and HTTP port."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "swarm.cli", "orchestrator", "--model", tiny_model, "--no-proxy",
               "--state-dir", str(tmp_path / "state"), "--http", "127.0.0.1:0", "--log-level", "INFO"]
    env = {**os.environ, "PYTHONPATH": str(root)}

    node_file = tmp_path / "state" / "node.json"
    started = []

    def start():
        proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        started.append(proc)

        status = wait_for(lambda: _cli_status(proc, node_file), 120, what="orchestrator ready")
        return proc, status["initial_peers"]

    try:
        proc, maddrs = start()
        url = f"http://127.0.0.1:{json.loads(node_file.read_text())['http_port']}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not _group_alive(proc.pid), 10, what="the orchestrator's DHT process and p2pd gone")
        proc, maddrs_again = start()
        assert maddrs_again == maddrs
        assert HTTP.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        for proc in started:
            if _group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)


def test_a_plain_restart_keeps_the_orchestrator_key_and_ephemeral_does_not(tiny_model, tmp_path):
    """Without --state-dir the command keeps its state in the default directory (here $CHAINSWARM_STATE): a plain
    restart comes back with the same signing key, so servers that pinned it keep obeying; --ephemeral gets a new
    one every start."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "CHAINSWARM_STATE": str(tmp_path / "state-home"),
           "HIVEMIND_LOGLEVEL": "INFO"}  # the key line is INFO

    def key_of(*extra):
        command = [sys.executable, "-m", "swarm.cli", "orchestrator", "--model", tiny_model, "--no-proxy",
                   "--dht-prefix", "keep-key", "--http", "127.0.0.1:0", *extra]
        ephemeral = "--ephemeral" in extra  # its key is read from its log (no state file to find the port in)
        proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE if ephemeral else subprocess.DEVNULL,
                                start_new_session=True, text=True)
        from swarm.state.ownership import model_fingerprint  # the default directory: prefix and fingerprint

        state = tmp_path / "state-home" / "orchestrator" / f"keep-key-{model_fingerprint(tiny_model)}"
        node_file = state / "node.json"
        try:
            if ephemeral:
                return _ephemeral_key(proc)
            return wait_for(lambda: _cli_status(proc, node_file), 120, what="orchestrator ready")["orchestrator_key"]
        finally:
            if _group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            wait_for(lambda: not _group_alive(proc.pid), 10, what="the orchestrator's processes gone")

    first, second = key_of(), key_of()
    assert first == second
    assert list((tmp_path / "state-home" / "orchestrator").glob("keep-key-*/orchestrator.key"))
    assert key_of("--ephemeral") != first


def _cli_status(proc, node_file):
    """GET /v1/swarm of a `chainswarm orchestrator` process once its state file names its HTTP port (None before)."""
    if proc.poll() is not None:
        raise AssertionError(f"the orchestrator exited with code {proc.returncode}")
    port = node_file.exists() and json.loads(node_file.read_text()).get("http_port")
    try:
        return port and HTTP.get(f"http://127.0.0.1:{port}/v1/swarm", timeout=5).json()
    except httpx.TransportError:
        return None


def _ephemeral_key(proc) -> str:
    """The key an --ephemeral orchestrator logs at start ("orchestrator key <fingerprint>: ssh-rsa ...")."""
    import queue

    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if "orchestrator key" in line:
            return line.rsplit(": ", 1)[1].strip()
    raise AssertionError("the --ephemeral orchestrator never logged its key")
