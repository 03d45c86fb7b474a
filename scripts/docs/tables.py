"""Tables rendered from the committed JSON in ``experiments/results/``, one function per benchmark or figure
(used by :mod:`results`, which writes them under ``docs/reference/tables/`` and onto the results page)."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def table_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def sci(x: float) -> str:
    """1.4899e-06 -> '1.5e-6'."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def minus(x: float) -> str:
    return f"{x:.1f}".replace("-", "−")


# -- bench_batching.json ----------------------------------------------------------------------------------------

def by_sessions(rows: list[dict], client: str = "generate") -> dict[int, dict]:
    return {r["sessions"]: r for r in rows if r.get("client", "generate") == client}


def batching_table() -> str:
    d = load("bench_batching.json")["results"]
    vanilla, multi = by_sessions(d["vanilla_petals"]), by_sessions(d["chainswarm_multi"])
    batched = by_sessions(d["chainswarm_batched"])
    out = [table_row(["sessions", "vanilla petals tok/s", "`ChainGenerator` tok/s", "×", "per-token latency (median)",
                 "TTFT", "server CPU per token", "petals `generate` on Chainswarm servers ×"]),
           table_row(["---"] * 8)]
    for n in sorted(multi):
        v, m, b = vanilla[n], multi[n], batched[n]
        latency = f"{m['per_token_ratio']:.2f}×"
        if n in (1, 8):
            latency += f" ({v['per_token_ms_median']:.0f} → {m['per_token_ms_median']:.0f} ms)"
        tok, ratio = f"{m['tokens_per_s']:.1f}", f"{m['throughput_ratio']:.2f}"
        if n == 8:  # the target: ≥ 3× at 8 sessions
            tok, ratio = f"**{tok}**", f"**{ratio}**"
        cpu = "{:.0f} / {} ms".format(v["server_cpu_ms_per_token"], f"{m['server_cpu_ms_per_token']:.1f}"
                                       if m["server_cpu_ms_per_token"] < 10 else f"{m['server_cpu_ms_per_token']:.0f}")
        out.append(table_row([n, f"{v['tokens_per_s']:.1f}", tok, ratio, latency, f"{m['ttft_ratio']:.2f}×", cpu,
                         f"{b['throughput_ratio']:.2f}"]))
    return "\n".join(out) + "\n"


def http_table() -> str:
    """The HTTP rows of bench_batching.json: every layout measured, tokens/s ÷ one session."""
    bench = load("bench_batching.json")
    vanilla = by_sessions(bench["results"]["vanilla_petals"])
    layouts = [bench["http"], *bench.get("http_layouts", {}).values()]
    out = [table_row(["server layout", "chains", "sessions", "tok/s", "× one session", "× vanilla petals (2 × 0.3 GB)",
                 "same text as local greedy"]), table_row(["---"] * 7)]
    for http in layouts:  # (each layout's name as the benchmark wrote it: http_throughput.HTTP_LAYOUTS)
        chains = " ; ".join("→".join(c["servers"]) for c in http["chains"])
        for r in http["rows"]:
            v = vanilla.get(r["sessions"]) if http["layout"] == "user" else None  # vanilla ran the user layout
            out.append(table_row([http["layout_text"], chains, r["sessions"], f"{r['tokens_per_s']:.1f}",
                                  f"{r['vs_one_session']:.2f}",
                                  f"{r['tokens_per_s'] / v['tokens_per_s']:.2f}" if v else "",
                                  "yes" if r["same_text_as_local_greedy"] else "**no**"]))
    return "\n".join(out) + "\n"


# -- bench_orchestrator.json -----------------------------------------------------------------------------------

def orchestrator_table() -> str:
    """bench_orchestrator.json: the orchestrator's CPU and memory per generated token, token chosen on the chain's
    servers (the default) or on the orchestrator, per vocabulary and concurrency."""
    bench = load("bench_orchestrator.json")
    out = [f"{bench['host_cpu']}; random llama checkpoints, {bench['layers']} blocks of hidden {bench['hidden']}, "
           f"an orchestrator and two servers with default options, {bench['tokens']} greedy tokens per "
           "`/v1/completions` ([bench_orchestrator.json](results/bench_orchestrator.json), "
           "[plot](results/bench_orchestrator.png)).", "",
           table_row(["vocabulary", "sessions", "orchestrator CPU ms/token: servers choose", "orchestrator chooses",
                      "orchestrator RSS MiB: servers / orchestrator", "servers' CPU ms/token: servers / orchestrator",
                      "tok/s: servers / orchestrator"]), table_row(["---"] * 7)]
    runs = {(r["vocab"], r["mode"]): {row["sessions"]: row for row in r["rows"]} for r in bench["runs"]}
    for vocab in sorted({v for v, _ in runs}):
        for n, mine in sorted(runs[(vocab, "servers")].items()):
            theirs = runs[(vocab, "orchestrator")][n]
            out.append(table_row([f"{vocab:,}", n, f"{mine['orchestrator_cpu_ms_per_token']:.2f}",
                                  f"{theirs['orchestrator_cpu_ms_per_token']:.2f}",
                                  f"{mine['orchestrator_rss_mb']:.0f} / {theirs['orchestrator_rss_mb']:.0f}",
                                  f"{mine['servers_cpu_ms_per_token']:.2f} / {theirs['servers_cpu_ms_per_token']:.2f}",
                                  f"{mine['tokens_per_s']:.1f} / {theirs['tokens_per_s']:.1f}"]))
    prof = bench.get("profile")
    if prof:
        waits = ("EpollSelector.select", "Condition.wait", "RemoteExpertWorker._run_event_loop", "_worker (")
        busy = prof["samples"] / (prof["seconds"] * 200)
        out += ["", f"Where the orchestrator's time goes with the servers choosing (py-spy at 200 Hz over "
                f"{prof['seconds']:.0f} s, {prof['sessions']} sessions at vocabulary {prof['vocab']:,}, "
                f"{prof['tokens_generated']:,} tokens generated meanwhile; {busy:.0%} of one core sampled, most of it "
                "waits on sockets and conditions): the functions that ran, by their share of the samples.", "",
                table_row(["function (running)", "share of the samples"]), table_row(["---"] * 2)]
        out += [table_row([f"`{e['function']}`", f"{e['share']:.1%}"]) for e in prof["leaf"]
                if not any(w in e["function"] for w in waits)][:8]
    return "\n".join(out) + "\n"


# -- device_check_h200.json -------------------------------------------------------------------------------------

def device_check_table() -> str:
    d = load("device_check_h200.json")
    cases: dict[str, dict[str, dict]] = {}
    for g in d["goldens"]:
        cases.setdefault(g["case"], {})[g["dtype"]] = g
    dtypes = ("float32", "float16", "bfloat16")
    out = [f"{d['device']}, torch {d['torch']} (`scripts/device_check.sh`, "
           "[device_check_h200.json](results/device_check_h200.json)): relative error of the last block's hidden "
           "states against the float32 goldens made by transformers, and greedy tokens against the goldens' "
           "(tokens compared up to the first near-tie).", "",
           table_row(["case", "family", "float32 rel. error", "float16", "bfloat16", "greedy tokens equal (compared f32 / f16 / bf16)",
                 "batched vs alone (f32)"]), table_row(["---"] * 7)]
    for case, by in cases.items():
        f32 = by["float32"]
        out.append(table_row([f"`{case}`", f"`{f32['family']}`", *(sci(by[t]["hidden_rel_err"]) for t in dtypes),
                         ("yes" if all(by[t]["tokens_agree"] for t in dtypes) else "**no**") + " ("
                         + " / ".join(str(by[t]["tokens_compared"]) for t in dtypes) + ")",
                         sci(f32["batched_vs_alone_rel"])]))
    steps = d["block_step_ms"]
    out += ["", "A Llama-3-8B-shaped bfloat16 block, one batched decode step: "
            + ", ".join(f"{float(ms):.2f} ms at {n} session{'s' if n != '1' else ''}" for n, ms in steps.items()) + "."]
    return "\n".join(out) + "\n"


# -- device_bench_batching_h200.json ----------------------------------------------------------------------------

def device_swarm_table() -> str:
    """The device check's swarm part: bench_batching's Chainswarm ÷ vanilla rows and its HTTP rows."""
    d = load("device_bench_batching_h200.json")
    res = d["results"]
    vanilla = by_sessions(res["vanilla_petals"])
    out = [f"{d['machine']}; servers: {d['server_device']}; weights: {d['weights']} "
           "([device_bench_batching_h200.json](results/device_bench_batching_h200.json)).", "",
           table_row(["sessions", "vanilla petals tok/s", "Chainswarm servers, petals client: ×",
                      "`ChainGenerator`: ×", "`/v1/completions`, defaults: tok/s", "× one session",
                      "same text as local greedy"]), table_row(["---"] * 7)]
    batched, multi = by_sessions(res["chainswarm_batched"]), by_sessions(res["chainswarm_multi"])
    for r in d["http"]["rows"]:
        n = r["sessions"]
        out.append(table_row([n, f"{vanilla[n]['tokens_per_s']:.1f}",
                              f"{batched[n]['tokens_per_s'] / vanilla[n]['tokens_per_s']:.2f}",
                              f"{multi[n]['tokens_per_s'] / vanilla[n]['tokens_per_s']:.2f}",
                              f"{r['tokens_per_s']:.1f}", f"{r['vs_one_session']:.2f}",
                              "yes" if r["same_text_as_local_greedy"] else "**no**"]))
    return "\n".join(out) + "\n"


# -- bench_runtime.json -----------------------------------------------------------------------------------------

RUNTIME_CLIENTS = {"vanilla_petals": "vanilla petals 2.2 client",
                   "chainswarm_http": "`/v1/completions` (streamed, through the orchestrator)",
                   "chainswarm_direct": "`DirectSwarmModel` (lease, client drives the chain)"}


def runtime_table() -> str:
    d = load("bench_runtime.json")
    out = [table_row(["split", "client", "TTFT (ms)", "× vanilla", "per token (ms)", "× vanilla"]), table_row(["---"] * 6)]
    for split in d["splits"]:
        for key, label in RUNTIME_CLIENTS.items():
            r = split["results"][key]
            out.append(table_row([f"{split['servers']} servers", label, f"{r['ttft_ms']:.0f}", f"{r['ttft_ratio']:.2f}×",
                             f"{r['per_token_ms']:.1f}", f"{r['per_token_ratio']:.2f}×"]))
    return "\n".join(out) + "\n"


# -- bench_soak.json --------------------------------------------------------------------------------------------

def _seconds(x: float) -> str:
    return f"{x:.2g}" if x < 10 else f"{x:.1f}"


def soak_table() -> str:
    d = load("bench_soak.json")
    rate = d["planned_rate"]
    out = [table_row(["phase", "requests", "answered", "refused (429)", "failed", "lost", "P50 / P99 response (s)"]),
           table_row(["---"] * 7)]
    for phase in d["phases"]:
        s = d["summary"][phase["name"]]
        if phase["kind"] == "burst":
            label = f"{phase['name'].replace('-', ' ')} ({phase['value']} at once)"
        else:
            label = f"{phase['name']} ({phase['value'] / rate:.1f}× ν)".replace(".0×", "×")
        out.append(table_row([label, f"{s['requests']:,}", f"{s['answered']:,}", f"{s['refused']:,}", s["failed"], s["lost"],
                         f"{_seconds(s['p50_s'])} / {_seconds(s['p99_s'])}"]))
    t = d["summary"]["total"]
    out.append(table_row(["**total**", f"**{t['requests']:,}**", f"**{t['answered']:,}**", f"{t['refused']:,}", t["failed"],
                     f"**{t['lost']}**", ""]))
    return "\n".join(out) + "\n"


# -- kv_lengths.json ----------------------------------------------------------------------------------------------

def kv_lengths_table() -> str:
    """Admission by KV tokens on the Azure trace's own lengths, at the planned rate (``chainswarm simulate
    kv-lengths``)."""
    d = load("kv_lengths.json")
    cfg = d["config"]
    point = min(d["points"], key=lambda p: abs(p["rate"] - d["plan_rate"]))
    st, plans = point["stats"], cfg["plans"]
    c_fit = plans["tokens"]["c"]
    best_c, best = min([(c_fit, st["tokens"])] + [(int(c), s) for c, s in st["sweep"].items()],
                       key=lambda cs: cs[1]["mean"])
    chains = lambda n: f"{n} chain{'s' if n > 1 else ''}"  # noqa: E731
    rows = [(f"max-length slots ({cfg['max_length']:,} tokens)", f"c = {plans['max-length']['c']}, "
             + chains(len(plans["max-length"]["chains"])), st["max-length slots"]),
            (f"expected-length slots ({cfg['slot_tokens']:,} tokens)", f"c = {c_fit}, "
             + chains(len(plans["tokens"]["chains"])), st["expected-length slots"]),
            ("tokens", f"c = {c_fit}, " + chains(len(plans["tokens"]["chains"])), st["tokens"]),
            ("tokens, best c of the sweep", f"c = {best_c}, " + chains(cfg["sweep"][str(best_c)]["chains"]), best)]
    out = [f"`chainswarm simulate kv-lengths` ([kv_lengths.json](results/kv_lengths.json), "
           f"[section](results/sections/kv_lengths.md)): {d['runs']} runs × {d['num_jobs']:,} jobs per rate, at the "
           f"planned λ = {point['rate']:g} req/s. Needs per request (prompt + output in {cfg['page_tokens']}-token pages): "
           f"mean {cfg['trace']['mean_need']:,.0f}, median {cfg['trace']['median_need']:,.0f}, "
           f"max {cfg['trace']['max_need']:,}.", "",
           table_row(["admission", "plan", "mean response (s)", "P95 (s)", "wait, short / long requests (s)",
                 "KV held ÷ the chains' KV", "sessions started over their chain's KV"]), table_row(["---"] * 7)]
    for name, plan, s in rows:
        out.append(table_row([name, plan, f"{s['mean']:.1f}", f"{s['p95']:.1f}",
                         f"{s['waiting_short']:.2f} / {s['waiting_long']:.2f}", f"{s['kv_use']:.0%}",
                         f"{s['over_budget_starts']:.1%}"]))
    tuned = cfg["tuned_token_plan"]
    out += ["", f"Short requests: at most one slot ({cfg['slot_tokens']:,} tokens), "
            f"{cfg['trace']['short_share']:.0%} of the trace. The planner's tuned c = {tuned['c']} gives a largest "
            f"chain budget of {tuned['largest_budget']:,} tokens, and would refuse "
            f"{tuned['refused_by_tuned_plan']:.1%} of the trace's requests."]
    return "\n".join(out) + "\n"


# -- bench_chaos.json --------------------------------------------------------------------------------------------

def chaos_table() -> str:
    d = load("bench_chaos.json")
    s = d["summary"]
    fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    out = [table_row(["target (issue 29)", "measured", "met"]), table_row(["---"] * 3)]
    rows = [("nothing lost", f"{s['lost']} lost", "nothing_lost"),
            ("nothing cut after its first token", f"{s['failed_after_first_token']} cut",
             "nothing_cut_after_its_first_token"),
            ("no wrong answer (local transformers' greedy text)", f"{s['wrong_answers']} wrong", "no_wrong_answer"),
            ("every request answered", f"{s['answered']} of {s['requests']}", "every_request_answered"),
            ("P99 response within 3× its no-churn value", f"{fmt(s['p99_churn_s'])} s vs {fmt(s['p99_no_churn_s'])} s",
             "p99_within_3x_no_churn"),
            ("answers in every 30 s window", f"min {min(s['answered_per_30s_churn'], default=0)} per 30 s",
             "answers_in_every_30s_window"),
            ("≥ 80% of the no-churn rate within 60 s of each event",
             ", ".join(f"{e['kind']} {e['server']}: " + ("not judged (the load's last 60 s)" if not e.get("judged", True)
                                                         else "—" if e["recovered_within_s"] is None
                                                         else f"{e['recovered_within_s']} s") for e in s["events"]),
             "80pct_rate_within_60s_of_each_event")]
    for what, value, key in rows:
        out.append(table_row([what, value, "yes" if s["targets"][key] else "**no**"]))
    return "\n".join(out) + "\n"


def chaos_waves_table() -> str:
    """The chaos soak with make-before-break waves (the default) against every server moving at once (same run
    settings, one after the other)."""
    runs = [("waves (`--replan-keep 0.5`, default)", load("bench_chaos.json")),
            ("all at once (`--replan-keep 0`)", load("bench_chaos_break_before_make.json"))]
    fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    out = [table_row(["re-planning", "requests", "answered right", "P99 no churn / churn (s)", "fewest answers per 30 s",
                 "re-plans that moved servers: waves, gaps", "targets met"]), table_row(["---"] * 7)]
    for name, d in runs:
        s, r = d["summary"], d.get("replans", {})
        moved = sum(1 for n in r.get("movers_kept_on_old_ranges", []) if n)
        out.append(table_row([name, f"{s['requests']:,}", f"{s['answered']:,}",
                         f"{fmt(s['p99_no_churn_s'])} / {fmt(s['p99_churn_s'])}",
                         f"{min(s['answered_per_30s_churn'], default=0)} (no churn: {s['answered_per_30s_no_churn']:.0f})",
                         f"{moved}: {r.get('waves', 0)}, {r.get('gaps', 0)}" if d.get("replan_keep", 0.5) > 0
                         else "— (no waves)",
                         f"{sum(s['targets'].values())} of {len(s['targets'])}"]))
    return "\n".join(out) + "\n"


# -- verification_spread*.json, bench_verification.json (spot checks) ----------------------------------------

def verification_spread_table() -> str:
    """The honest spreads behind the spot checks' tolerance: worst relative L2 per position, each dtype against
    CPU float32, over every measured span length."""
    cpu, gpu = load("verification_spread.json"), load("verification_spread_h100.json")
    out = [table_row(["model", "where", "span lengths (blocks)", "float32", "TF32", "float16", "bfloat16"]), table_row(["---"] * 7)]
    for doc, where in ((cpu, "CPU"), (gpu, gpu["device"].replace("NVIDIA ", ""))):
        for model, m in doc["models"].items():
            values: dict[str, list] = {}
            for row in m["spans"]:
                values.setdefault(row["dtype"], []).append(row["max"])
            lengths = sorted({row["blocks"] for row in m["spans"]})

            def cell(dtype):
                if dtype not in values:
                    return "–"
                worst = values[dtype]
                return "not finite" if None in worst else ("0" if max(worst) == 0 else sci(max(worst)))
            out.append(table_row([model, where, f"{lengths[0]}–{lengths[-1]}", cell("float32"), cell("float32-tf32"),
                             cell("float16"), cell("bfloat16")]))
    return "\n".join(out) + "\n"


def verification_table() -> str:
    d = load("bench_verification.json")
    honest, adv = d["honest"], d["adversaries"]
    out = [f"`python -m experiments.bench.verification` ([bench_verification.json](results/bench_verification.json), "
           f"[plot](results/bench_verification.png)), {d['model']} in {d['dtype']}, {d['tokens']} tokens per session, "
           "default rates.", "",
           table_row(["adversary", "what it does", "trials", "banned", "dishonest sessions before the ban: median / P95 / max"]),
           table_row(["---"] * 5)]
    what = {"noise": f"noise {adv['scale']:.0%} × RMS on its last block's output",
            "weights": f"another checkpoint (weights × (1 + {adv['scale']}·N(0,1)))",
            "skip": "skips its last block", "late": f"honest for {adv['late_after']} sessions, then noise",
            "ordinary": "noise on decode steps only (never on a prefill)"}
    for kind, row in adv["kinds"].items():
        out.append(table_row([f"`{kind}`", what.get(kind, ""), str(len(row["trials"])), f"{row['detected']:.0%}",
                         f"{row['median_sessions']:g} / {row['p95_sessions']:g} / {row['max_sessions']}"]))
    counts = honest["counts"]
    out += ["", f"Honest part: {honest['sessions']:,} sessions on {honest['servers']} honest servers "
            f"({' and '.join(' → '.join(c) for c in honest['chains'])}): {counts['checks']} checks, "
            f"{counts['passed']} passed, {counts['skipped']} could not run, {counts['unchecked']} spans without a "
            f"second holder, {sum(honest['strikes'].values())} strikes; compute overhead "
            f"{honest['compute_overhead']:.1%} (checks' compute time per compute time served, by the nodes' profile "
            f"measured before the run: prefill {honest['profile']['prefill_s'] * 1e3:.2f} ms and decode "
            f"{honest['profile']['decode_s'] * 1e3:.2f} ms per block and position), "
            f"{honest['overhead']:.1%} of the block-positions served. Strikes on the adversary part's honest servers: "
            f"{adv['strikes_on_honest']}. Targets: "
            + ", ".join(f"{k.replace('_', ' ')} {'✓' if v else '✗'}" for k, v in d["targets"].items()) + "."]
    return "\n".join(out) + "\n"


# -- bench_speculative.json ---------------------------------------------------------------------------------------
GEMMA_SPECULATIVE = "bench_speculative_gemma3_270m.json"
GEMMA_COMMAND = " --model ~/.cache/chainswarm/models/gemma-3-270m-float32 --out " \
                "experiments/results/bench_speculative_gemma3_270m.json"
SINGLE_SPECULATIVE = "bench_speculative_single.json"  # petals' per-session path (--batch-sessions 0)
SINGLE_COMMAND = " --sessions 1 --batch-sessions 0 --out experiments/results/bench_speculative_single.json"
PREFIX_SPECULATIVE = "bench_speculative_prefix.json"  # prompt-prefix reuse on
PREFIX_COMMAND = " --sessions 1 --prefix-cache-tokens 512 --out experiments/results/bench_speculative_prefix.json"
SAMPLED_SPECULATIVE = "bench_speculative_sampled.json"  # seeded sampling at temperature 0.7
SAMPLED_COMMAND = " --sessions 1 --temperature 0.7 --out experiments/results/bench_speculative_sampled.json"


SPECULATIVE_TARGETS = {"copy_heavy_at_most_half": "per-token latency ≤ 0.5× on the copy-heavy workloads at 1 session",
                       "throughput_at_least_1_3x": "aggregate tokens/s ≥ 1.3× at 16 sessions",
                       "free_at_most_1_05x": "per-token latency ≤ 1.05× on free text",
                       "same_text_everywhere": "the same text with and without speculation"}


def verification_steps_table() -> str:
    d = load("device_verification_steps_h100.json")
    steps = d["verify_step_ms"]
    out = [f"`scripts/device_check.py --verification-steps` on an {d['device']} "
           f"([device_verification_steps_h100.json](results/device_verification_steps_h100.json)): one "
           f"Llama-3-8B-shaped block in bfloat16, {d['cached']} cached positions per session, ms per step.", "",
           table_row(["sessions", "1 position (decode)", "5 positions (4 drafts)", "9 positions (8 drafts)"]),
           table_row(["---"] * 4)]
    for n in (1, 8, 16):
        base = steps[f"{n}x1"]
        out.append(table_row([str(n), f"{base:.2f}"] + [f"{steps[f'{n}x{p}']:.2f} ({steps[f'{n}x{p}'] / base:.2f}×)"
                                                   for p in (5, 9)]))
    return "\n".join(out) + "\n"


def _per_step(off: dict, on: dict) -> str:
    """Tokens per chain step off → on (the batched path's step counter; "—" on petals' per-session path)."""
    if off.get("tokens_per_step") is None or on.get("tokens_per_step") is None:
        return "—"
    return f"{off['tokens_per_step']:.2f} → {on['tokens_per_step']:.2f}"


def speculative_table(name: str = "bench_speculative.json", command: str = "") -> str:
    d = load(name)
    rtts = ", ".join(f"{peer} {ms:.0f} ms" for peer, ms in sorted(d["wan"]["rtt_ms"].items()))
    png = name.replace(".json", ".png")
    how = (f" tokens per request, sampled at temperature {d['temperature']} (session i seeded {d['seed']} + i in "
           "both modes)" if d.get("temperature") else " greedy tokens per request")
    out = [f"`python -m experiments.bench.speculative{command}` ([{name}](results/{name}), "
           f"[plot](results/{png})), {d['model']} in {d['dtype']}, {d['tokens']}{how}, chains "
           f"{'; '.join(' → '.join(c['servers']) for c in d['chains'])}, RTT to the orchestrator "
           f"{rtts}; " + (f"each mode run {d['repeats']} times per point, alternated, ratios the medians of the "
                          "paired runs' ratios." if d.get("repeats", 1) > 1 else "one run of each mode per point."),
           "",
           table_row(["workload", "sessions", "per-token latency off → on (ratio)", "tokens/s off → on (ratio)",
                 "acceptance", "tokens per chain step", "same text"]), table_row(["---"] * 7)]
    for p in d["points"]:
        off, on = p["off"], p["on"]
        out.append(table_row([p["workload"], str(p["sessions"]),
                         f"{off['per_token_s'] * 1e3:.0f} → {on['per_token_s'] * 1e3:.0f} ms ({p['per_token_ratio']:.2f}×)",
                         f"{off['tokens_per_s']:.1f} → {on['tokens_per_s']:.1f} ({p['throughput_ratio']:.2f}×)",
                         f"{on['acceptance']:.0%}", _per_step(off, on),
                         "yes" if p["same_text"] else "NO"]))
    vanilla = d["vanilla_petals"]
    one = {p["workload"]: p for p in d["points"] if p["sessions"] == 1}
    if vanilla:
        out += ["", "Vanilla petals' `generate` on the same servers, 1 session, per-token latency: "
                + ", ".join(f"{w} {v['per_token_s'] * 1e3:.0f} ms (speculative ÷ petals "
                            f"{one[w]['on']['per_token_s'] / v['per_token_s']:.2f}×)" for w, v in vanilla.items()
                            if w in one) + "."]
    out += ["", "Targets (issue 30): " + ", ".join(f"{SPECULATIVE_TARGETS.get(k, k)} {'✓' if v else '✗'}"
                                                  for k, v in d["targets"].items() if isinstance(v, bool)) + "."]
    return "\n".join(out) + "\n"


# -- sim_drafting.json ----------------------------------------------------------------------------------------------
def drafting_table() -> str:
    d = load("sim_drafting.json")
    cost = d["cost_model"]
    policies = list(dict.fromkeys(r["policy"] for r in d["rows"]))
    workloads = list(dict.fromkeys(r["workload"] for r in d["rows"]))
    out = [f"`python -m experiments.bench.drafting` ([sim_drafting.json](results/sim_drafting.json), "
           f"[plot](results/sim_drafting.png)), {d['model']}, {d['tokens']} greedy tokens; cost model from "
           f"bench_speculative.json: a step {cost['t_step_s'] * 1e3:.0f} ms, a drafted position "
           f"{cost['t_draft_s'] * 1e3:.1f} ms more. Per-token latency ÷ no speculation, first prompt (the benchmark's "
           "1-session point) / mean over the four prompts, with free verification in brackets:", "",
           table_row(["policy"] + workloads), table_row(["---"] * (len(workloads) + 1))]
    for policy in policies:
        cells = []
        for w in workloads:
            r = next(x for x in d["rows"] if x["workload"] == w and x["policy"] == policy)
            cells.append(f"{r['ratio_first']:.2f} / {r['ratio_mean']:.2f} ({r['free_first']:.2f} / {r['free_mean']:.2f})")
        out.append(table_row([policy] + cells))
    same = [w for w, c in d["live"].items() if (c["replayed"]["steps"], c["replayed"]["drafted"],
                                                c["replayed"]["accepted"]) == (c["live"]["chain_steps"],
                                                                               c["live"]["drafted"],
                                                                               c["live"]["accepted"])]
    out += ["", "The replay of `ngram` gives the live benchmark's 1-session chain steps, drafts and accepted tokens "
            f"exactly on {', '.join(same) or 'no workload'}"
            + "".join(f"; {w}: {c['replayed']['steps']} steps against {c['live']['chain_steps']:.0f} live"
                      for w, c in d["live"].items() if w not in same) + "."]
    return "\n".join(out) + "\n"


# -- lm_eval_check.json -----------------------------------------------------------------------------------------

def lm_eval_table() -> str:
    out = [table_row(["harness", "swarm", "requests", "accuracy (swarm / local)", "largest log-likelihood difference",
                      "greedy flags equal", "wall"]), table_row(["---"] * 7)]
    commands = []
    for name in ("lm_eval_check.json", "lm_eval_check_batch8.json"):
        d = load(name)
        batches = "one prompt per request" if d["batch_size"] == 1 else f"{d['batch_size']} prompts per request"
        out.append(table_row([f"`{d['lm_eval']}`, `local-completions`, token-id prompts, {batches}, "
                              f"{d['num_concurrent']} concurrent", f"{d['model']}, {d['swarm']}", str(d["requests"]),
                              f"{d['accuracy_through_swarm']:.2f} / {d['accuracy_local_transformers']:.2f}",
                              sci(d["max_abs_loglikelihood_difference"]),
                              f"{d['greedy_flags_equal']} of {d['requests']}", f"{d['wall_s']:.0f} s"]))
        commands.append(f"`{d['command']}` ([{name}](results/{name}))")
    return "\n".join(out) + "\n\n" + "; ".join(commands) + "\n"
