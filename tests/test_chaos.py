"""The chaos soak's short version (experiments/bench/chaos.py): steady greedy load from three clients (plain and
streamed) on the real model while a server is SIGKILLed, one joins and one is stopped gracefully. Every request is
answered, completely and with local transformers' text; nothing is cut after its first token.

The timing targets (P99 within 3x, the 30 s windows) are the full run's (`python -m experiments.bench.chaos`):
on 2 shared cores and a 40 s run they say more about the machine than about the swarm, so only the
every-answer targets are asserted here.
"""
import json

import pytest

from experiments.bench.chaos import main

pytestmark = pytest.mark.swarm


def test_kill_join_and_stop_under_load_lose_and_change_no_answer(tmp_path, smollm2_dir):
    out = tmp_path / "chaos.json"
    # a fixed offered rate, not a multiple of ν: ν comes from the servers' own profiles, and on a slow hour (load 7,
    # ν 0.54/s) half of it made 7 requests in 48 s where this test asks for 10
    main(["--model", str(smollm2_dir), "--servers", "4", "--min-servers", "3", "--rate", "0.4", "--baseline-s", "8",
          "--chaos-s", "40", "--gap", "8", "10", "--out", str(out)])
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert [e["kind"] for e in summary["events"]][:3] == ["kill", "join", "stop"]
    assert summary["requests"] >= 10
    failures = [r for r in report["requests"] if not r.get("ok")]
    # each failure's own reason (the whole records are too long for pytest to print)
    assert not failures, [(r["i"], r["phase"], r.get("status"), r.get("error"), round(r.get("end", 0) - r["start"], 1))
                          for r in failures]
    for target in ("nothing_lost", "nothing_cut_after_its_first_token", "no_wrong_answer", "every_request_answered"):
        assert summary["targets"][target], (target, summary)
    assert report["after"] == {"active": 0, "queue": 0}
    assert out.with_suffix(".png").stat().st_size > 0
