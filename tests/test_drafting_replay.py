"""experiments/bench/drafting.py: drafting policies replayed on greedy answers, the live benchmark's counts
reproduced on the real model, and the CLI's JSON and PNG."""
import json

import pytest

from experiments.bench import drafting
from experiments.paths import RESULTS


def test_a_replay_counts_steps_as_the_chain_would():
    """The answer is two new tokens, then the prompt. Prompt lookup finds no earlier pair until (100, 101), then
    drafts the rest of the copy in one step (7 tokens: the room left before the chain's own last token): 5 steps.
    The ceiling drafts the copy from its first token: 4 steps, and never a wrong token."""
    prompt = list(range(100, 110))
    answer = [7, 8, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109]
    counts = drafting.replay(prompt, answer, drafting.NgramPolicy("ngram"), tokens=12)
    assert counts == {"tokens": 12, "steps": 5, "drafted": 7, "accepted": 7}
    ceiling = drafting.replay(prompt, answer, drafting.CeilingPolicy(), tokens=12)
    assert ceiling == {"tokens": 12, "steps": 4, "drafted": 8, "accepted": 8}
    # nothing to copy: no draft, one step per token, and the cost model's ratio is exactly 1
    # the first step is the prompt's prefill: it carries no draft, even where the prompt's end would draft one
    assert drafting.replay([1, 2, 3, 1, 2], [3, 1, 2, 3], drafting.NgramPolicy("ngram"), tokens=4) == {
        "tokens": 4, "steps": 2, "drafted": 2, "accepted": 2}
    plain = drafting.replay([1, 2, 3], [4, 5, 6, 7], drafting.NgramPolicy("ngram"), tokens=4)
    assert plain == {"tokens": 4, "steps": 4, "drafted": 0, "accepted": 0}
    assert drafting.ratio(plain, {"t_step_s": 0.1, "t_draft_s": 0.01}) == pytest.approx(1.0)


def test_a_single_token_drafts_only_where_it_occurred_once():
    """``ngram-unique1``: with no n-gram match, the last token drafts what followed it if it occurred exactly once
    before (30 here: one step saved); a token seen twice (the second 7) drafts nothing."""
    prompt, answer = [10, 20, 30, 40, 50], [7, 30, 40, 50, 8]
    assert drafting.replay(prompt, answer, drafting.NgramPolicy("ngram"), tokens=5) == {
        "tokens": 5, "steps": 4, "drafted": 1, "accepted": 1}
    unique = drafting.NgramPolicy("ngram-unique1", unique_single=True)
    assert drafting.replay(prompt, answer, unique, tokens=5) == {"tokens": 5, "steps": 3, "drafted": 2, "accepted": 2}
    assert drafting.replay([7, 1, 7, 2], [7, 3, 4], unique, tokens=3)["drafted"] == 0


def test_the_cost_model_fits_the_extra_time_per_drafted_position():
    bench = {"points": [
        {"sessions": 1, "off": {"per_token_s": 0.1}, "on": {"drafted": 10, "tokens": 20, "chain_steps": 10,
                                                           "per_token_s": (10 * 0.1 + 10 * 0.02) / 20}},
        {"sessions": 1, "off": {"per_token_s": 0.1}, "on": {"drafted": 0, "tokens": 20, "chain_steps": 20,
                                                           "per_token_s": 0.1}},
        {"sessions": 4, "off": {"per_token_s": 9.0}, "on": {"drafted": 99, "tokens": 1, "chain_steps": 1,
                                                           "per_token_s": 9.0}}]}
    assert drafting.cost_model(bench) == pytest.approx({"t_step_s": 0.1, "t_draft_s": 0.02})


@pytest.mark.swarm
def test_the_replay_reproduces_the_live_benchmarks_counts_on_the_real_model(smollm2_dir):
    """The committed bench_speculative.json ran the orchestrator's drafter through a live swarm; replaying the same
    classes on local transformers' greedy answers (the tests' kept references: tests/real_model.py) gives the same
    chain steps, drafts and accepted tokens on every workload's 1-session point (the first prompt of each)."""
    from experiments.bench.speculative import prompts
    from real_model import greedy_reference

    bench = json.loads((RESULTS / "bench_speculative.json").read_text())
    reference = greedy_reference(smollm2_dir)
    for workload in ["code_edit", "summarise", "chat", "free"]:
        text = prompts(workload)[0]
        prompt, answer = reference.tokenizer(text).input_ids, reference.tokens(text, bench["tokens"])
        counts = drafting.replay(prompt, answer, drafting.NgramPolicy("ngram"), bench["tokens"])
        live = next(p["on"] for p in bench["points"] if p["workload"] == workload and p["sessions"] == 1)
        assert (counts["steps"], counts["drafted"], counts["accepted"]) == (
            live["chain_steps"], live["drafted"], live["accepted"]), workload
        if workload != "free":
            assert drafting.replay(prompt, answer, drafting.CeilingPolicy(), bench["tokens"])["steps"] < counts["steps"]


def test_the_cli_writes_the_json_and_the_plot(tiny_model, tmp_path):
    bench = {"model": "tiny", "dtype": "float32", "tokens": 6, "points": [
        {"workload": w, "sessions": 1, "off": {"per_token_s": 0.1},
         "on": {"drafted": 2, "accepted": 1, "tokens": 6, "chain_steps": 5, "per_token_s": 0.09}} for w in ("summarise", "free")]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = tmp_path / "sim.json"
    assert drafting.main(["--model", tiny_model, "--bench", str(tmp_path / "bench.json"), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["policy"] for r in data["rows"]} == {p.name for p in drafting.POLICIES}
    assert {r["workload"] for r in data["rows"]} == {"code_edit", "summarise", "chat", "free"}
    assert all(r["free_first"] <= r["ratio_first"] + 1e-12 for r in data["rows"])
    assert set(data["live"]) == {"summarise", "free"} and out.with_suffix(".png").stat().st_size > 10_000


def test_the_live_benchmark_pairs_its_repeats_and_takes_medians():
    """bench_speculative runs each mode of a point several times, alternated; a point's ratios are the medians of
    the paired runs' ratios (a run where the machine was slow for both modes cancels), and the text must agree in
    every run."""
    from experiments.bench.speculative import pair_point

    def run(per_token, tps, text="a", drafted=0, accepted=0, errors=()):
        return {"sessions": 1, "speculative": bool(drafted), "wall_s": 1.0, "tokens": 10, "tokens_per_s": tps,
                "per_token_s": per_token, "ttft_s": 0.1, "drafted": drafted, "accepted": accepted,
                "acceptance": 0.0, "chain_steps": 10 - accepted, "tokens_per_step": 1.0, "texts": [text],
                "errors": list(errors)}

    offs = [run(0.10, 10.0), run(0.20, 5.0), run(0.12, 8.0)]  # the second pair ran on a machine twice as slow
    ons = [run(0.05, 20.0, drafted=6, accepted=4), run(0.10, 10.0, drafted=6, accepted=4),
           run(0.09, 11.0, drafted=6, accepted=4)]
    point = pair_point("chat", 1, offs, ons)
    assert point["repeats"] == 3 and point["same_text"]
    assert point["per_token_ratio"] == pytest.approx(0.5)  # paired ratios 0.5, 0.5, 0.75
    assert point["throughput_ratio"] == pytest.approx(2.0)  # 2.0, 2.0, 1.375
    assert point["off"]["per_token_s"] == pytest.approx(0.12) and point["on"]["chain_steps"] == 6
    assert point["on"]["acceptance"] == pytest.approx(4 / 6) and len(point["on"]["runs"]) == 3
    assert not pair_point("chat", 1, offs, [*ons[:2], run(0.09, 11.0, text="b")])["same_text"]
    assert not pair_point("chat", 1, offs, [*ons[:2], run(0.09, 11.0, errors=["boom"])])["same_text"]


def test_a_live_benchmark_cut_short_keeps_the_points_it_measured(tmp_path, monkeypatch):
    """bench_speculative writes its report after every point, marked partial, so a run its time limit ends (the
    lent GPU machine's one prepared call) keeps what it measured; --workloads narrows the run, and an unknown
    workload is refused before anything starts."""
    from experiments.bench import speculative

    asked = {}

    def bench(path, counts, *args):
        workloads, on_point = args[-2], args[-1]
        asked["workloads"] = list(workloads)
        points = []
        for workload in workloads:
            points.append({"workload": workload, "sessions": counts[0], "per_token_ratio": 0.5})
            on_point(points)
        raise KeyboardInterrupt  # the time limit, after the points above

    monkeypatch.setattr(speculative, "bench", bench)
    out = tmp_path / "spec.json"
    with pytest.raises(KeyboardInterrupt):
        speculative.main(["--model", str(tmp_path), "--sessions", "16", "--workloads", "summarise,free",
                          "--out", str(out)])
    report = json.loads(out.read_text())
    assert asked["workloads"] == ["summarise", "free"]
    assert report["partial"] is True and [p["workload"] for p in report["points"]] == ["summarise", "free"]
    with pytest.raises(SystemExit):
        speculative.main(["--model", str(tmp_path), "--workloads", "summarise,poetry", "--out", str(out)])
