"""Results pages from the committed JSON in ``experiments/results/``, and the README's headline numbers.

``make docs`` runs this before ``mkdocs build``. It writes, under ``docs/reference/`` (generated, git-ignored):

* ``results/``: a copy of ``experiments/results`` (REPORT.md, the sections, every PNG and JSON), so the site can
  show the report and link the data;
* ``data-provenance.md``: ``experiments/data/README.md``;
* ``tables/*.md``: tables rendered from the JSON (``scripts/docs/tables.py``), included by the hand-written pages (``--8<--``, pymdownx.snippets)
  so that no page restates a measured number by hand: ``batching.md`` (``bench_batching.json``),
  ``device_check.md`` (``device_check_h200.json``), ``runtime.md`` (``bench_runtime.json``), ``soak.md``
  (``bench_soak.json``), ``kv_lengths.md`` (``kv_lengths.json``), ``headline.md``;
* ``results.md``: the headline table and every generated table on one page.

:func:`headline` is the source of the README's "Headline results" table; ``tests/test_docs.py`` checks that the
README states exactly these values.

Usage: ``python scripts/docs/results.py [--out-dir docs/reference]``
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tables import (  # noqa: E402  (scripts/docs/tables.py)
    GEMMA_COMMAND, GEMMA_SPECULATIVE, PREFIX_COMMAND, PREFIX_SPECULATIVE, SAMPLED_COMMAND, SAMPLED_SPECULATIVE,
    SINGLE_COMMAND, SINGLE_SPECULATIVE, RESULTS, ROOT, by_sessions, minus,
    table_row, sci, batching_table,
    chaos_table, chaos_waves_table, drafting_table, device_check_table, device_swarm_table, http_table, kv_lengths_table, orchestrator_table,
    lm_eval_table, load, runtime_table,
    soak_table, speculative_table, verification_spread_table, verification_steps_table, verification_table)

DATA_README = ROOT / "experiments" / "data" / "README.md"


def headline() -> list[tuple[str, str, str, str]]:
    """(what, value, JSON file(s) separated by spaces, docs page) of each headline result; the README's table states these values."""
    bench = load("bench_batching.json")
    batching = bench["results"]
    multi = by_sessions(batching["chainswarm_multi"])
    http = {r["sessions"]: r for r in bench["http"]["rows"]}
    demo = {r["sessions"]: r for r in bench["http_layouts"]["demo"]["rows"]}
    vanilla = by_sessions(batching["vanilla_petals"])
    relay = load("live_table1.json")["runs"]["relay"]
    petals, auto = relay["petals"]["stats"]["response"], relay["auto"]["stats"]["response"]
    fig8, fig9 = load("fig8.json")["auto"], load("fig9.json")["auto"]
    soak = load("bench_soak.json")["summary"]["total"]
    chaos = load("bench_chaos.json")["summary"]
    gemma = load("bench_batching_gemma3_270m.json")
    gemma_http = {r["sessions"]: r for r in gemma["http"]["rows"]}
    gemma_multi = by_sessions(gemma["results"]["chainswarm_multi"])
    runtime = load("bench_runtime.json")["splits"]
    device = load("device_check_h200.json")
    verify = load("bench_verification.json")
    kinds = verify["adversaries"]["kinds"]
    f32 = [g for g in device["goldens"] if g["dtype"] == "float32"]
    steps = device["block_step_ms"]
    spec = {(p["workload"], p["sessions"]): p for p in load("bench_speculative.json")["points"]}
    orch = {(r["vocab"], r["mode"]): {row["sessions"]: row for row in r["rows"]}
            for r in load("bench_orchestrator.json")["runs"]}
    small, large = min(v for v, _ in orch), max(v for v, _ in orch)
    crowd = max(n for _, n in spec)
    return [
        ("HTTP API with default options (2 × 0.3 GB nodes): aggregate tokens/s ÷ one session, 8 / 16 sessions",
         f"{http[8]['vs_one_session']:.2f}× / {http[16]['vs_one_session']:.2f}×", "bench_batching.json", "batching.md"),
        ("HTTP API with default options ÷ vanilla petals generate (same run), 8 / 16 sessions",
         f"{http[8]['tokens_per_s'] / vanilla[8]['tokens_per_s']:.2f}× / "
         f"{http[16]['tokens_per_s'] / vanilla[16]['tokens_per_s']:.2f}×", "bench_batching.json", "batching.md"),
        ("HTTP API with default options on `make demo`'s four nodes (one 4-hop chain): tokens/s ÷ one session, "
         "8 / 16 sessions", f"{demo[8]['vs_one_session']:.2f}× / {demo[16]['vs_one_session']:.2f}×",
         "bench_batching.json", "batching.md"),
        ("Tokens/s of the orchestrator's batched path ÷ vanilla petals, 8 sessions",
         f"{multi[8]['throughput_ratio']:.2f}×", "bench_batching.json", "batching.md"),
        ("Tokens/s of the orchestrator's batched path ÷ vanilla petals, 16 sessions",
         f"{multi[16]['throughput_ratio']:.2f}×", "bench_batching.json", "batching.md"),
        ("Per-token latency ÷ vanilla petals, 1 session",
         f"{multi[1]['per_token_ratio']:.2f}×", "bench_batching.json", "batching.md"),
        ("Gemma 3 270M, HTTP API with default options: aggregate tokens/s ÷ one session, 8 / 16 sessions",
         f"{gemma_http[8]['vs_one_session']:.2f}× / {gemma_http[16]['vs_one_session']:.2f}×",
         "bench_batching_gemma3_270m.json", "models.md"),
        ("Gemma 3 270M, batched path ÷ petals' server path running the same block, 8 / 16 sessions",
         f"{gemma_multi[8]['throughput_ratio']:.2f}× / {gemma_multi[16]['throughput_ratio']:.2f}×",
         "bench_batching_gemma3_270m.json", "models.md"),
        ("Orchestrator CPU per generated token, 16 sessions, vocabulary 1,024 → 131,072: token chosen on the chain's "
         "servers (default) / on the orchestrator",
         " / ".join(f"{orch[(small, mode)][16]['orchestrator_cpu_ms_per_token']:.2f} → "
                    f"{orch[(large, mode)][16]['orchestrator_cpu_ms_per_token']:.2f} ms" for mode in ("servers", "orchestrator")),
         "bench_orchestrator.json", "batching.md"),
        ("Live Table 1 replay (relay): Auto vs PETALS, mean / P95 response",
         f"{minus(100 * (auto['mean'] / petals['mean'] - 1))}% / {minus(100 * (auto['p95'] / petals['p95'] - 1))}%",
         "live_table1.json", "live-experiments.md"),
        ("placement=auto below Proposed (c*), grid average: Fig. 8 / Fig. 9",
         f"{100 * fig8['grid_avg_gain']:.1f}% / {100 * fig9['grid_avg_gain']:.1f}%", "fig8.json fig9.json", "planner.md"),
        ("Soak: answered of all requests, lost",
         f"{soak['answered']:,} of {soak['requests']:,}, {soak['lost']} lost", "bench_soak.json", "liveness.md"),
        ("Chaos soak (SIGKILL, join, graceful stop every 45–90 s under load): answered right of all, lost, cut after "
         "their first token; targets met",
         f"{chaos['answered']:,} of {chaos['requests']:,}, {chaos['lost']} lost, {chaos['failed_after_first_token']} "
         f"cut; {sum(chaos['targets'].values())} of {len(chaos['targets'])}", "bench_chaos.json", "liveness.md"),
        ("Streamed `/v1/completions` per token ÷ vanilla petals, 2 / 3 servers",
         " / ".join(f"{s['results']['chainswarm_http']['per_token_ratio']:.2f}×" for s in runtime),
         "bench_runtime.json", "runtime.md"),
        ("Spot checks: hostile volunteers banned (5 kinds), most dishonest sessions before a ban; compute overhead "
         "(block-positions); false strikes",
         f"{sum(k['detected'] * len(k['trials']) for k in kinds.values()):.0f} of "
         f"{sum(len(k['trials']) for k in kinds.values())}; {max(k['max_sessions'] for k in kinds.values())}; "
         f"{verify['honest']['compute_overhead']:.1%} ({verify['honest']['overhead']:.1%}); "
         f"{sum(verify['honest']['strikes'].values()) + verify['adversaries']['strikes_on_honest']}",
         "bench_verification.json", "security.md"),
        ("Speculative decoding under RIPE Atlas RTTs, per-token latency ÷ one token per step, 1 session: "
         "code edit / summary / chat / free text",
         " / ".join(f"{spec[(w, 1)]['per_token_ratio']:.2f}×" for w in ("code_edit", "summarise", "chat", "free")),
         "bench_speculative.json", "speculative.md"),
        (f"Speculative decoding, aggregate tokens/s ÷ one token per step, {crowd} sessions: code edit / summary / "
         "chat / free text",
         " / ".join(f"{spec[(w, crowd)]['throughput_ratio']:.2f}×" for w in ("code_edit", "summarise", "chat", "free")),
         "bench_speculative.json", "speculative.md"),
        ("H200: float32 max relative hidden error, every family; greedy tokens equal",
         sci(max(g["hidden_rel_err"] for g in f32)) + "; "
         + ("all" if all(g["tokens_agree"] for g in device["goldens"]) else "NOT all"),
         "device_check_h200.json", "models.md"),
        ("H200: bf16 Llama-3-8B-shaped block, batched decode step at 1 / 8 / 32 sessions",
         " / ".join(f"{float(steps[n]):.2f}" for n in ("1", "8", "32")) + " ms", "device_check_h200.json", "models.md"),
    ]


def headline_table(results_prefix: str = "results/", docs_prefix: str = "../") -> str:
    out = [table_row(["result", "measured", "data", "details"]), table_row(["---"] * 4)]
    for what, value, json_name, page in headline():
        data = ", ".join(f"[{name}]({results_prefix}{name})" for name in json_name.split())
        out.append(table_row([what, value, data, f"[{page}]({docs_prefix}{page})"]))
    return "\n".join(out) + "\n"


def write(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results"
    if results.exists():
        shutil.rmtree(results)
    shutil.copytree(RESULTS, results)
    # the sections are written to be assembled into REPORT.md one level up: their links name its neighbours
    for section in (results / "sections").glob("*.md"):
        section.write_text(re.sub(r"\]\(([^/:#)]+)\)", r"](../\1)", section.read_text()))
    (out_dir / "data-provenance.md").write_text(DATA_README.read_text())
    tables = out_dir / "tables"
    tables.mkdir(exist_ok=True)
    # tables/*.md are included into pages in docs/ (one level up from reference/): links are relative to the page
    generated = {"batching.md": batching_table(), "batching_http.md": http_table(),
                 "orchestrator.md": orchestrator_table().replace("](results/", "](reference/results/"), "device_swarm.md": device_swarm_table().replace("](results/", "](reference/results/"),
                  "device_check.md": device_check_table().replace(
                     "](results/", "](reference/results/"),
                 "runtime.md": runtime_table(), "soak.md": soak_table(), "chaos.md": chaos_table(), "chaos_waves.md": chaos_waves_table(),
                 "verification_spread.md": verification_spread_table(),
                 "verification.md": verification_table().replace("](results/", "](reference/results/"),
                 "speculative.md": speculative_table().replace("](results/", "](reference/results/"),
                 "verification_steps.md": verification_steps_table().replace("](results/", "](reference/results/"),
                 "kv_lengths.md": kv_lengths_table().replace("](results/", "](reference/results/"),
                 "speculative_gemma3.md": speculative_table(
                     GEMMA_SPECULATIVE, GEMMA_COMMAND).replace("](results/", "](reference/results/"),
                 "speculative_single.md": speculative_table(
                     SINGLE_SPECULATIVE, SINGLE_COMMAND).replace("](results/", "](reference/results/"),
                 "speculative_prefix.md": speculative_table(
                     PREFIX_SPECULATIVE, PREFIX_COMMAND).replace("](results/", "](reference/results/"),
                 "speculative_sampled.md": speculative_table(
                     SAMPLED_SPECULATIVE, SAMPLED_COMMAND).replace("](results/", "](reference/results/"),
                 "drafting.md": drafting_table().replace("](results/", "](reference/results/"),
                 "lm_eval.md": lm_eval_table().replace("](results/", "](reference/results/"),
                 "headline.md": headline_table("reference/results/", "")}
    for name, text in generated.items():
        (tables / name).write_text(text)
    page = ["# Results from the committed JSON", "",
            "Generated by `scripts/docs/results.py` from `experiments/results/*.json` at every `make docs`; the",
            "README's headline table is checked against the same values by `tests/test_docs.py`. The simulations'",
            "full report is [REPORT.md](results/REPORT.md).", "",
            "## Headline", "", headline_table(), "",
            "## Batching benchmark", "", "`python -m experiments.bench.batching` "
            "([bench_batching.json](results/bench_batching.json), [plot](results/bench_batching.png)); see "
            "[Batched servers](../batching.md#the-benchmark).", "", batching_table(), "",
            "Through the HTTP API with default options:", "", http_table(), "",
            "## GPU check", "", device_check_table(), "", "The swarm part (`SKIP_GOLDENS=1 scripts/device_check.sh`):",
            "", device_swarm_table(), "",
            "## Runtime against vanilla petals", "", "`python -m experiments.bench.runtime` "
            "([bench_runtime.json](results/bench_runtime.json)); see [Runtime measurements](../runtime.md).", "",
            runtime_table(), "",
            "## Soak", "", "`python -m experiments.bench.soak` ([bench_soak.json](results/bench_soak.json), "
            "[plot](results/bench_soak.png)); see [Liveness](../liveness.md).", "", soak_table(), "",
            "## Spot checks", "", "Honest spreads (`scripts/spread_check.py`):", "", verification_spread_table(), "",
            verification_table(), "",
            "## KV memory by the token", "", kv_lengths_table(), "",
            "## Speculative decoding", "", speculative_table(), "", speculative_table(GEMMA_SPECULATIVE, GEMMA_COMMAND), "",
            "On petals' per-session path:", "", speculative_table(SINGLE_SPECULATIVE, SINGLE_COMMAND), "",
            "With prompt-prefix reuse:", "", speculative_table(PREFIX_SPECULATIVE, PREFIX_COMMAND), "",
            "Sampled requests with a seed:", "", speculative_table(SAMPLED_SPECULATIVE, SAMPLED_COMMAND), "",
            "Drafting policies replayed on the greedy answers (see [Speculative decoding](../speculative.md)):", "",
            drafting_table(), "",
            "## lm-evaluation-harness through the API", "", lm_eval_table(), "",
            "## Report sections", "",
            *(f"* [{p.stem}](results/sections/{p.name})" for p in sorted((RESULTS / "sections").glob("*.md"))), ""]
    (out_dir / "results.md").write_text("\n".join(page))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "reference")
    args = parser.parse_args(argv)
    write(args.out_dir)
    print(f"[docs] wrote {args.out_dir / 'results.md'}, tables/ and a copy of experiments/results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
