"""A cold restart of the whole swarm, as a user runs it: ``chainswarm orchestrator`` and ``chainswarm server``
processes with the default state directory, both stopped at once (a power cut), then started again in either
order. The orchestrator is the swarm's bootstrap: the servers it remembers are only a hint; a server whose
orchestrator is not up yet waits for it (``--join-timeout``)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import HTTP, wait_for

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[1]
NOBODY = "QmTvHSGBJKfBZ3aBbV4ki2kuyHRsX6vNe8oUhnLpkYKmH9"


@pytest.mark.filterwarnings("ignore:path is deprecated:DeprecationWarning")  # hivemind's own use of importlib
def test_remembered_peers_are_a_hint_the_dht_starts_alone_when_none_answers():
    """One remembered address has nothing listening (skipped by the probe), the other listens but is no libp2p peer
    (the daemon refuses to start with it): the orchestrator's DHT starts alone. Initial peers the operator gave
    must answer (the one-line error as before)."""
    import hivemind

    from swarm import service
    from swarm.runtime.dht import PeersUnreachable, stop_dht

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    remembered = [f"/ip4/127.0.0.1/tcp/{listening.getsockname()[1]}/p2p/{NOBODY}",
                  f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}/p2p/{NOBODY}"]
    closed.close()
    dialled = []

    def start(dial):
        dialled.append(list(dial))
        return hivemind.DHT(start=True, initial_peers=dial, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                            ensure_bootstrap_success=False)

    try:
        dht = service._start_bootstrap(start, [], remembered)
        try:
            assert dht.is_alive() and dht.get_visible_maddrs()
        finally:
            stop_dht(dht)
        assert dialled == [remembered[:1], []]
        with pytest.raises(PeersUnreachable, match="cannot reach any initial peer"):
            service._start_bootstrap(start, remembered[1:], [])
    finally:
        listening.close()


class _Processes:
    """``chainswarm`` commands started in their own process groups, each logging to a file; all killed at the end."""

    def __init__(self, tmp_path: Path, model: str):
        self.tmp, self.model = tmp_path, model
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "CHAINSWARM_STATE": str(tmp_path / "state-home"),
                    "HIVEMIND_LOGLEVEL": "INFO"}
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, *argv: str) -> tuple[subprocess.Popen, Path]:
        log = self.tmp / f"{name}-{len(self.started)}.log"
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "swarm.cli", *argv], cwd=ROOT, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append(proc)
        return proc, log

    def orchestrator(self):
        return self.start("orchestrator", "orchestrator", "--model", self.model, "--host", "127.0.0.1", "--http",
                          "127.0.0.1:0")

    def server(self, maddr: str):
        return self.start("server", "server", "--model", self.model, "--initial-peers", maddr, "--node-id", "n1",
                          "--identity-key", str(self.tmp / "n1.key"), "--host", "127.0.0.1", "--device", "cpu",
                          "--memory-gb", "1", "--update-period", "2", "--join-timeout", "120")

    def power_cut(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.started.clear()


def _state_dir(tmp_path: Path) -> Path:
    dirs = list((tmp_path / "state-home" / "orchestrator").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def _answer(url: str) -> str | None:
    try:
        response = HTTP.post(f"{url}/v1/completions", json={"prompt": "The harbour", "max_tokens": 6,
                                                            "temperature": 0}, timeout=30)
    except Exception:
        return None
    return response.json()["choices"][0]["text"] if response.status_code == 200 else None


def _serving(processes, log: Path, url: str, timeout: float = 150) -> tuple[str, dict]:
    for proc in processes.started:
        assert proc.poll() is None, log.read_text()[-3000:]
    text = wait_for(lambda: _answer(url), timeout, period=1.0, what="a completion",
                    explain=lambda: log.read_text()[-3000:])
    return text, HTTP.get(f"{url}/v1/swarm", timeout=30).json()


def test_a_cold_restart_works_orchestrator_first_or_servers_first(tiny_model, tmp_path):
    processes = _Processes(tmp_path, tiny_model)
    try:
        _, orch_log = processes.orchestrator()
        node_file = wait_for(lambda: (f := next((tmp_path / "state-home").rglob("node.json"), None)) and
                             json.loads(f.read_text()).get("http_port") and f, 120, what="the orchestrator's state")
        node = json.loads(node_file.read_text())
        url = f"http://127.0.0.1:{node['http_port']}"
        maddr = wait_for(lambda: HTTP.get(f"{url}/v1/swarm", timeout=10).json()["initial_peers"][0], 120,
                         what="the orchestrator's multiaddr")
        processes.server(maddr)
        text, status = _serving(processes, orch_log, url)
        key = status["orchestrator_key"]
        wait_for(lambda: json.loads(node_file.read_text()).get("peers"), 60, what="the server's address saved")
        state = _state_dir(tmp_path)
        assert (state / "model.json").exists()

        # a power cut, then the orchestrator first: it starts alone and the server rejoins when it comes back
        processes.power_cut()
        began = time.monotonic()
        _, orch_log = processes.orchestrator()
        wait_for(lambda: "do not answer: not dialled" in orch_log.read_text(), 120, what="the skipped peer line",
                 explain=lambda: orch_log.read_text()[-3000:])
        processes.server(maddr)
        again, status = _serving(processes, orch_log, url)
        assert again == text and status["orchestrator_key"] == key
        assert [s["id"] for s in status["plan"]["servers"]] == ["n1"]
        assert _state_dir(tmp_path) == state
        orchestrator_first_s = time.monotonic() - began

        # a power cut, then the server first: it waits for the orchestrator (one line a try), then joins
        processes.power_cut()
        _, server_log = processes.server(maddr)
        wait_for(lambda: "cannot reach the swarm yet" in server_log.read_text(), 120, what="the server's retry line",
                 explain=lambda: server_log.read_text()[-3000:])
        _, orch_log = processes.orchestrator()
        again, status = _serving(processes, orch_log, url)
        assert again == text and status["orchestrator_key"] == key
        assert "error" not in server_log.read_text().lower().replace("error_", "")
        print(f"orchestrator first: answering {orchestrator_first_s:.1f} s after the restart")
    finally:
        processes.power_cut()
