"""`chainswarm demo` (orchestrator + 4 nodes + client library, the real SmolLM2 model) runs end to end in a fresh
process, answers in English through a multi-server swarm, and exits cleanly, leaving no process behind."""
import os
import subprocess
import sys
import uuid

import psutil
import pytest

pytestmark = pytest.mark.swarm


def _processes_with_marker(marker: str) -> list:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("CHAINSWARM_TEST_MARKER") == marker:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def test_demo_generates_through_the_swarm_and_exits_cleanly(tmp_path, smollm2_dir):
    marker = uuid.uuid4().hex  # inherited by every process the demo starts (servers, DHTs, p2pd)
    result = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "demo", "--workdir", str(tmp_path), "--max-new-tokens", "12", "--burst", "6"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "CHAINSWARM_TEST_MARKER": marker},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "completion and stream equal the output of local transformers: yes" in result.stdout
    assert "[demo] generated: The capital of France is Paris." in result.stdout
    chains = [line for line in result.stdout.splitlines() if line.startswith("[demo]   chain ")]
    assert chains and all(" -> " in line for line in chains)  # no node holds the model alone: multi-server chains
    assert result.stdout.count(" waited ") == 6
    assert "Traceback" not in output and "Exception ignored" not in output, output
    # the forkserver and resource tracker notice their parent is gone within moments; give them that
    _, alive = psutil.wait_procs(_processes_with_marker(marker), timeout=10)
    assert not alive, [p.cmdline() for p in alive]
