"""Smoke versions of the live-swarm experiments (``chainswarm experiment ...``) on a WAN-emulated swarm.

Each runs the real command at a tiny size (2-3 servers, a dozen requests) and checks that the outputs are
complete and consistent; the numbers themselves are not asserted (2 shared cores).
"""
import json
import math

import pytest

from swarm.cli import main

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def table1(tmp_path_factory):
    out = tmp_path_factory.mktemp("live")
    # at CPU speed (--emulation none): the paper's emulated GPUs make each of these 6-token answers take ~10 s,
    # and the smoke checks the replay, not the GPUs (test_table1_gives_its_hosts_the_papers_gpus checks their
    # wiring; server.emulation is tested with a real server in test_emulation.py)
    code = main(["experiment", "table1", "--quick", "--out", str(out), "--methods", "petals,proposed",
                 "--configs", "relay", "--requests", "4", "--emulation", "none"])
    assert code == 0
    return out, json.loads((out / "live_table1_quick.json").read_text())


def test_table1_smoke_replays_the_trace_on_petals_and_proposed(table1):
    out, data = table1
    runs = data["runs"]["relay"]
    assert set(runs) == {"petals", "proposed"}
    for method, run in runs.items():
        assert run["stats"]["completed"] == 4 and run["stats"]["failed"] == 0, (method, run["stats"])
        for r in run["records"]:
            # §11.4: response = waiting + service, all non-negative, the greedy output has the trace's length
            assert r["submitted"] <= r["started"] + 1e-6 <= r["completed"] + 1e-6
            assert 1 <= r["generated"] <= r["output_tokens"]
        s = run["stats"]
        assert s["response"]["n"] == s["service"]["n"] == 4
        assert s["response"]["mean"] >= s["service"]["mean"] - 1e-6
        assert all(s["response"][k] > 0 for k in ("mean", "median", "p95", "p99"))
    # the same trace for both methods, identical generated lengths (same model, greedy)
    lengths = [[r["generated"] for r in runs[m]["records"]] for m in ("petals", "proposed")]
    assert lengths[0] == lengths[1]
    assert runs["proposed"]["plan"]["chains"] and runs["proposed"]["rtt_ms"]
    assert (out / "live_table1_quick.png").stat().st_size > 0
    section = (out / "sections" / "live_table1_quick.md").read_text()
    assert "Improvement vs PETALS, mean response" in section and "| Response P99 |" in section


def test_table1_gives_its_hosts_the_papers_gpus():
    """The replay's servers emulate the paper's GPUs: the high-performance one on the WAN draw's fast hosts, the
    low one elsewhere, folded into the model's blocks (what ``--emulation paper``, the default, passes to every
    server)."""
    from experiments.live import common as lc, table1 as t1

    config = t1.wan_config(3, 0)
    scaling = t1.settings(quick=True)["scaling"]
    gpus = t1.gpu_emulation(config, {"num_blocks": 8}, scaling)
    paper = lc.emulated_gpus(8, scaling.input_scale)
    fast = set(config.meta.get("high_performance", []))
    assert set(gpus) == set(config.servers) and fast and fast < set(config.servers)
    assert all(gpus[h] == paper["high" if h in fast else "low"] for h in config.servers)
    assert paper["high"].decode_s < paper["low"].decode_s and paper["high"].prefill_s < paper["low"].prefill_s


def test_validation_smoke_compares_service_times_with_the_model(table1):
    out, _ = table1
    assert main(["experiment", "validation", "--quick", "--out", str(out)]) == 0
    data = json.loads((out / "live_validation_quick.json").read_text())
    assert data["summary"]["n"] == 4
    for row in data["rows"]:
        assert row["predicted"] > 0 and row["measured"] > 0 and row["comm"] > 0 and row["comp"] > 0
        # the batch term (petals' one-at-a-time pool on the CPU part) only ever adds time
        assert row["predicted_batch"] >= row["predicted"] * (1 - 1e-12)
    assert (out / "live_validation_quick.png").stat().st_size > 0


def test_fairness_smoke_reports_the_section_9_metrics(tmp_path):
    assert main(["experiment", "fairness", "--quick", "--out", str(tmp_path), "--policies", "dlpm",
                 "--duration", "6"]) == 0
    data = json.loads((tmp_path / "live_fairness_quick.json").read_text())
    m = data["runs"]["dlpm"]["metrics"]
    assert m["completed"] > 0 and m["failed"] == 0
    assert m["throughput_rps"] > 0 and m["good_p99"] >= m["good_p50"] > 0
    assert set(m["cumulative"]) == {"good0", "good1", "flood"}
    assert math.isnan(m["jain_backlogged"]) or 0 < m["jain_backlogged"] <= 1
    assert (tmp_path / "live_fairness_quick.png").stat().st_size > 0


def test_experiment_command_rejects_unknown_methods(tmp_path, capsys):
    """Bad options are one line each, before any swarm starts (a negative --duration was an IndexError after one)."""
    assert main(["experiment", "table1", "--methods", "nope", "--out", str(tmp_path)]) == 2
    assert main(["experiment", "fairness", "--policies", "fcfs,nope", "--out", str(tmp_path)]) == 2
    assert main(["experiment", "fairness", "--duration", "-1", "--out", str(tmp_path)]) == 2
    assert main(["experiment", "validation", "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(": error: ")[0] for line in lines] == [
        "chainswarm experiment table1", "chainswarm experiment fairness", "chainswarm experiment fairness",
        "chainswarm experiment validation"], lines
    assert "unknown policy 'nope'" in lines[1] and "--duration" in lines[2] and not any(tmp_path.iterdir())


def test_fairness_prefix_reuse_smoke_serves_prompt_prefixes_from_cache(tmp_path):
    assert main(["experiment", "fairness", "--quick", "--prefix-reuse", "--out", str(tmp_path), "--policies", "swarm",
                 "--duration", "6"]) == 0
    data = json.loads((tmp_path / "live_fairness_prefix_quick.json").read_text())
    run = data["runs"]["swarm"]
    assert data["prefix_reuse"] and run["metrics"]["completed"] > 0 and run["metrics"]["failed"] == 0
    # every client repeats its own system prompt: after each client's first request the prefix is cached
    assert run["prefix"]["enabled"] and run["prefix"]["hit_rate"] > 0 and run["prefix"]["tokens_saved"] > 0
    section = (tmp_path / "sections" / "live_fairness_prefix_quick.md").read_text()
    assert "prefix hit rate" in section and "system prompt" in section
