"""scripts/device_check.sh, the lent GPU machine's one prepared run: its parts in the order of what they decide,
each within one deadline, skipped (and saying so) when too little time is left.

The script itself runs here with its Python replaced by a recorder (``PY``): every command it would run is logged
with its arguments, and the benchmarks "write" their output files, so the order, the options and the deadline
logic are what the GPU machine will execute.
"""
import os
import subprocess
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_check(tmp_path: Path, deadline_s: int, **env) -> tuple[list[str], str]:
    calls = tmp_path / "calls"
    recorder = tmp_path / "python"
    recorder.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "$*" >> {calls}
        # a benchmark leaves its JSON where --out says
        prev=""; for a in "$@"; do [ "$prev" = --out ] && echo '{{}}' > "$a"; prev=$a; done
        exit 0
        """))
    recorder.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh")], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PY": str(recorder), "STACK_INSTALLED": "1",
                                             "SKIP_GOLDENS": "1", "OUT": str(out), "DEADLINE_S": str(deadline_s),
                                             **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return calls.read_text().splitlines(), result.stdout


def test_every_part_runs_in_the_order_of_what_it_decides(tmp_path):
    calls, log = run_check(tmp_path, 540, SPEC_MAX_BATCH="64", SPEC_K16="1")
    kinds = [c.split()[1] if c.startswith("-m ") else c.split()[0] for c in calls]
    assert kinds == ["scripts/device_check.py", "swarm.cli", "experiments.bench.batching",
                     "experiments.bench.speculative", "experiments.bench.speculative",
                     "experiments.bench.speculative", "experiments.bench.batching"], calls
    assert "--verification-steps" in calls[0]
    assert "--sessions 16" in calls[3] and "--max-batch 64" in calls[3] and "gpu_mb64.json" in calls[3]
    assert "--sessions 1 " in calls[4] and "--speculative-k" not in calls[4]
    assert "--speculative-k 16" in calls[5]
    assert "--only-http user --http-lanes 2" in calls[6]
    assert "skipped (deadline)" not in log


def test_a_part_that_would_start_too_late_is_skipped_and_says_so(tmp_path):
    calls, log = run_check(tmp_path, 100, SPEC_MAX_BATCH="64", SPEC_WORKLOADS="summarise")
    assert "skipped (deadline): bench_speculative 16 sessions, --max-batch 64" in log
    assert not any("--max-batch 64" in c for c in calls)
    spec = [c for c in calls if "experiments.bench.speculative" in c]
    assert len(spec) == 1 and "--sessions 1 " in spec[0] and "--workloads summarise" in spec[0]
    late = tmp_path / "late"
    late.mkdir()
    calls, log = run_check(late, 20)
    assert [c.split()[0] for c in calls] == ["scripts/device_check.py"]
    assert log.count("skipped (deadline)") == 2  # the batching benchmark and the speculative one
