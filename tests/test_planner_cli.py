"""``chainswarm plan`` end to end, through the installed console script."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXE = ROOT / ".venv" / "bin" / "chainswarm"
EXAMPLE = ROOT / "experiments" / "examples" / "swarm_small.json"


def chainswarm(*args: str) -> subprocess.CompletedProcess:
    cmd = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "swarm.cli"]
    return subprocess.run(cmd + ["plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def write(tmp_path: Path, doc) -> str:
    path = tmp_path / "swarm.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


EX3 = {
    "model": {"num_blocks": 4, "block_size_gb": 1, "cache_slot_gb": 0.25},
    "servers": [
        {"id": "A", "memory_gb": 6, "comm_time_s": 1, "compute_time_s": 0.5},
        {"id": "B", "memory_gb": 4.5, "comm_time_s": 0.5, "compute_time_s": 0.5},
        {"id": "C", "memory_gb": 3, "comm_time_s": 0.2, "compute_time_s": 1},
        {"id": "D", "memory_gb": 3, "comm_time_s": 1, "compute_time_s": 1},
        {"id": "E", "memory_gb": 1.5, "comm_time_s": 0.1, "compute_time_s": 2},
        {"id": "F", "memory_gb": 1.4, "comm_time_s": 0.1, "compute_time_s": 0.1},
    ],
    "arrival_rate": 0.6,
    "target_load": 0.5,
}


def test_json_output_example_4(tmp_path):
    proc = chainswarm("--swarm", write(tmp_path, EX3), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["c"] == 1 and doc["tuning"] == "lower-bound"
    assert [ch["servers"] for ch in doc["chains"]] == [["F", "B"], ["A"], ["C", "B"], ["C", "D"]]
    assert [ch["capacity"] for ch in doc["chains"]] == [1, 2, 1, 1]
    assert doc["total_capacity"] == 5
    assert doc["total_rate"] == pytest.approx(1.5838, abs=1e-4)
    assert doc["bounds"]["lower"] == pytest.approx(2.6223, abs=1e-4)
    assert len(doc["candidates"]) == 20
    assert doc["candidates"][4] == {
        "c": 5, "K": 1, "g": 5, "total_rate": pytest.approx(10 / 7), "lower": pytest.approx(3.5859, abs=1e-4),
        "upper": pytest.approx(3.5859, abs=1e-4),
    }  # fmt: skip
    assert doc["candidates"][10]["total_rate"] == 0 and doc["candidates"][10]["K"] is None


def test_min_c_keeps_a_chain_that_holds_a_longest_session(tmp_path):
    """``--min-c 3``: the bound alone picks c = 1, whose chains hold at most 2 sessions' slots; the rule picks the
    best c whose GCA forms a chain of capacity >= 3. The candidate table is the same; --min-c 0 is refused."""
    path = write(tmp_path, EX3)
    plain, kept = (json.loads(chainswarm("--swarm", path, "--json", *extra).stdout) for extra in ((), ("--min-c", "3")))
    assert max(ch["capacity"] for ch in plain["chains"]) == 2
    assert kept["c"] != 1 and max(ch["capacity"] for ch in kept["chains"]) >= 3
    assert kept["candidates"] == plain["candidates"]
    allowed = [c for c in plain["candidates"] if c["total_rate"] > 0 and c["c"] == kept["c"]]
    assert allowed and kept["bounds"]["lower"] == pytest.approx(allowed[0]["lower"])
    proc = chainswarm("--swarm", path, "--min-c", "0")
    assert proc.returncode == 2 and "--min-c must be >= 1" in proc.stderr


def test_surrogate_and_fixed_c(tmp_path):
    path = write(tmp_path, EX3)
    doc = json.loads(chainswarm("--swarm", path, "--json", "--tuning", "surrogate").stdout)
    assert doc["c"] == 5 and doc["tuning"] == "surrogate"
    doc = json.loads(chainswarm("--swarm", path, "--json", "--c", "2").stdout)
    assert doc["c"] == 2 and doc["tuning"] == "fixed" and len(doc["candidates"]) == 1
    unused = [s for s in doc["servers"] if s["start"] is None]
    assert [s["id"] for s in unused] == ["F"] and unused[0]["end"] is None


def test_example_file_all_placements():
    for placement in ("gbp-cr", "petals", "bprr", "whole-model", "random"):
        proc = chainswarm("--swarm", str(EXAMPLE), "--json", "--placement", placement)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["chains"], placement
        for server in doc["servers"]:
            assert server["slots_free"] >= 0 and server["slots_allocated"] >= 0
        for chain in doc["chains"]:
            assert chain["spans"][0][0] == 0 and chain["spans"][-1][1] == 32
            assert chain["rate"] == pytest.approx(1 / chain["service_time"])
        times = [ch["service_time"] for ch in doc["chains"]]
        assert times == sorted(times)


def test_text_output():
    proc = chainswarm("--swarm", str(EXAMPLE))
    assert proc.returncode == 0, proc.stderr
    assert "chains (fastest first)" in proc.stdout
    assert "Theorem 3.7" in proc.stdout
    assert "*" in proc.stdout  # the chosen c is marked in the candidate table


@pytest.mark.parametrize(
    "doc, needle",
    [
        ({k: v for k, v in EX3.items() if k != "model"}, "missing field 'model'"),
        ({**EX3, "servers": [{"id": "A", "memory_gb": 6, "comm_time_s": 1}]}, "compute_time_s"),
        ({**EX3, "servers": [{**EX3["servers"][0], "memory_gb": -6}]}, "memory_gb must be >= 0"),
        ({**EX3, "model": {"num_blocks": 40, "block_size_gb": 1, "cache_slot_gb": 0.25}}, "no server set can hold"),
        ({**EX3, "arrival_rate": -1}, "arrival_rate"),
        ({**EX3, "target_load": 1.5}, "target_load"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_input_exit_2(tmp_path, doc, needle):
    proc = chainswarm("--swarm", write(tmp_path, doc))
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_bad_arguments_exit_2(tmp_path):
    path = write(tmp_path, EX3)
    assert chainswarm("--swarm", str(tmp_path / "missing.json")).returncode == 2
    proc = chainswarm("--swarm", path, "--c", "9")  # Σ m_j(9) < L
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert chainswarm("--swarm", path, "--c", "2", "--tuning", "surrogate").returncode == 2
    assert chainswarm("--swarm", path, "--placement", "petals", "--c", "2").returncode == 2
    assert chainswarm("--swarm", path, "--placement", "nope").returncode == 2
