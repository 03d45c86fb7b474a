"""The report section of ``chainswarm simulate kv-lengths`` (``sections/kv_lengths.md``). Every number and every
conclusion is computed from ``kv_lengths.json`` (:mod:`experiments.figures.kv_lengths`)."""
from __future__ import annotations

KNEE = 2.0
"""A mode "holds" a rate while its mean response is at most KNEE × its mean at the lowest rate."""


def _pct(a: float, b: float) -> str:
    """a against b: '12.3% lower' / '4.5% higher'."""
    r = 100.0 * (1.0 - a / b)
    return f"{abs(r):.1f}% {'lower' if r >= 0 else 'higher'}"


def planned_point(data: dict) -> dict:
    """The point at the planned rate (else the nearest rate)."""
    return min(data["points"], key=lambda p: abs(p["rate"] - data["plan_rate"]))


def held_rate(rates: list, means: list) -> float | None:
    """The highest rate up to which every mean is at most KNEE × the mean at the lowest rate."""
    best = None
    for rate, mean in zip(rates, means):
        if mean > KNEE * means[0]:
            break
        best = rate
    return best


def series(data: dict, mode: str, key: str = "mean") -> tuple[list, list]:
    return [p["rate"] for p in data["points"]], [p["stats"][mode][key] for p in data["points"]]


def sweep_series(data: dict, key: str) -> dict[int, tuple[list, list]]:
    """{c: (rates, values of ``key``)} of token admission for every c: the tokens mode's c and the sweep's."""
    c_fit = data["config"]["plans"]["tokens"]["c"]
    out: dict = {c_fit: ([p["rate"] for p in data["points"]], [p["stats"]["tokens"][key] for p in data["points"]])}
    for p in data["points"]:
        for c, st in p["stats"]["sweep"].items():
            xs, ys = out.setdefault(int(c), ([], []))
            xs.append(p["rate"])
            ys.append(st[key])
    return dict(sorted(out.items()))


def best_sweep(data: dict) -> tuple[int, dict] | None:
    """(c, stats) of the token plan with the lowest mean response at the planned rate, the tokens mode's c
    included."""
    point = planned_point(data)
    cands = {data["config"]["plans"]["tokens"]["c"]: point["stats"]["tokens"]}
    cands.update({int(c): st for c, st in point["stats"]["sweep"].items()})
    return min(cands.items(), key=lambda kv: kv[1]["mean"]) if cands else None


def headline(data: dict) -> dict:
    """The numbers the docs page states (``scripts/docs/results.py`` renders the same ones from the JSON)."""
    point = planned_point(data)
    st = point["stats"]
    c_best, best = best_sweep(data)
    return {"rate": point["rate"], "max": st["max-length slots"], "expected": st["expected-length slots"],
            "tokens": st["tokens"], "c_best": c_best, "best": best}


def conclusions(data: dict) -> list[str]:
    cfg, point = data["config"], planned_point(data)
    st, rate = point["stats"], point["rate"]
    a, b, c = st["max-length slots"], st["expected-length slots"], st["tokens"]
    tuned, plans, trace = cfg["tuned_token_plan"], cfg["plans"], cfg["trace"]
    lines = [
        f"* **The plans.** Max-length slots: c = {plans['max-length']['c']}, {len(plans['max-length']['chains'])} "
        f"chains, {plans['max-length']['total_slots']} slots of {cfg['max_length']:,} tokens. Token plan: the tuned "
        f"c = {tuned['c']} gives a largest chain budget of {tuned['largest_budget']:,} tokens, and the orchestrator "
        f"would refuse {100 * tuned['refused_by_tuned_plan']:.1f}% of the trace's requests (larger than any "
        f"budget). The orchestrator's rule, used here, tunes c only over the plans with a chain that holds a session "
        f"of {cfg['max_length']:,} tokens (c_k ≥ c_min = {cfg.get('min_c', '?')}): c = {plans['tokens']['c']}, "
        f"{len(plans['tokens']['chains'])} chain{'s' if len(plans['tokens']['chains']) > 1 else ''} of budget"
        f"{'s' if len(plans['tokens']['chains']) > 1 else ''} "
        f"{', '.join(format(ch['budget_tokens'], ',') for ch in plans['tokens']['chains'])} tokens.",
        f"* **At the planned rate (λ = {rate:g} req/s), token admission against max-length slots:** mean response "
        f"{c['mean']:.1f} s against {a['mean']:.1f} s ({_pct(c['mean'], a['mean'])}); P95 {c['p95']:.1f} s against "
        f"{a['p95']:.1f} s ({_pct(c['p95'], a['p95'])}).",
        f"* **Short and long requests.** Requests of at most one slot ({cfg['slot_tokens']:,} tokens, "
        f"{100 * trace['short_share']:.0f}% of the trace) wait {c['waiting_short']:.2f} s on average at λ = {rate:g} "
        f"with tokens, {'less' if c['waiting_short'] < a['waiting_short'] else 'no less'} than with max-length slots "
        f"({a['waiting_short']:.2f} s); longer ones wait {c['waiting_long']:.2f} s with tokens and "
        f"{a['waiting_long']:.2f} s with max-length slots"
        + (": with tokens the short ones pass the long ones, which wait for room in a budget." if
           c['waiting_short'] < c['waiting_long'] else "."),
    ]
    worst_b = max(data["points"], key=lambda p: p["stats"]["expected-length slots"]["over_budget_starts"])
    worst = worst_b["stats"]["expected-length slots"]["over_budget_starts"]
    peak_b = max(p["stats"]["expected-length slots"]["peak_kv_ratio"] for p in data["points"])
    if worst > 0:
        lines.append(
            f"* **Expected-length slots (the papers' model) over-commit KV.** They give {b['mean']:.1f} s mean at "
            f"λ = {rate:g}, but {100 * b['over_budget_starts']:.1f}% of the sessions start into a chain whose "
            f"sessions then need more KV than it has ({100 * worst:.1f}% at λ = {worst_b['rate']:g}), and a chain "
            f"holds up to {peak_b:.2f}× its KV. On the servers the paged pool would fail those sessions (\"KV pool "
            "full\"); the simulator lets them run, so these times are not reachable.")
    peak_c = max(p["stats"]["tokens"]["peak_kv_ratio"] for p in data["points"])
    over_c = max(p["stats"]["tokens"]["over_budget_starts"] for p in data["points"])
    lines.append(
        f"* **Token admission {'stays in' if peak_c <= 1.0 else 'EXCEEDS'} its budgets**: at most {peak_c:.3f}× a "
        f"chain's KV, and at most {100 * over_c:.1f}% of sessions start over budget, over every rate. It uses "
        f"{100 * c['kv_use']:.0f}% of the token plan's KV on average at λ = {rate:g}. Max-length slots use "
        f"{100 * a['kv_use']:.0f}% of theirs: each session reserves {cfg['max_length']:,} tokens and needs "
        f"{trace['mean_need']:,.0f} on average.")
    holds = []
    for mode in data["modes"]:
        r = held_rate(*series(data, mode))
        holds.append(f"{mode} {r:g}" if r is not None else f"{mode} none")
    lines.append(f"* **Rate held** (the highest λ up to which the mean response stays within {KNEE:g}× its value at "
                 f"λ = {data['rates'][0]:g}): {', '.join(holds)} req/s.")
    found = best_sweep(data)
    if found and point["stats"]["sweep"]:
        c_best, best = found
        sw = cfg["sweep"][str(c_best)]
        by_c = {int(k): v for k, v in point["stats"]["sweep"].items()}
        by_c[cfg["plans"]["tokens"]["c"]] = point["stats"]["tokens"]  # the token plan's own c is the tokens mode
        others = ", ".join(f"c = {k}: {v['mean']:.1f} s" for k, v in sorted(by_c.items()))
        xs, ys = sweep_series(data, "mean")[c_best]
        r = held_rate(xs, ys)
        c_fit, c_least = cfg["plans"]["tokens"]["c"], min(int(k) for k in cfg["sweep"])
        means = [v["mean"] for _, v in sorted(by_c.items())]
        monotone = all(x >= y for x, y in zip(means, means[1:]))
        lines.append(
            f"* **The token plan's c.** The planner tunes c by bounds for sessions of one length; the orchestrator's "
            f"rule chose c = {c_fit}. Token admission on the plans of c = {c_least}…"
            f"{max(int(k) for k in cfg['sweep'])} (from the least whose chains hold a max-length session) at "
            f"λ = {rate:g}: {others}. The best is c = {c_best} "
            f"({sw['chains']} chain{'s' if sw['chains'] > 1 else ''}, budget{'s' if sw['chains'] > 1 else ''} "
            f"{', '.join(f'{x:,}' for x in sw['budgets'])} tokens): mean {best['mean']:.1f} s "
            f"({_pct(best['mean'], a['mean'])} than max-length slots), P95 {best['p95']:.1f} s "
            f"({_pct(best['p95'], a['p95'])}); it holds up to λ = {'none' if r is None else f'{r:g}'} req/s. "
            f"Chains per c: {', '.join(str(k) + ': ' + str(v['chains']) for k, v in cfg['sweep'].items())}"
            + ("; the mean falls as c grows." if monotone else "; the mean is not monotone in c, since GBP-CR forms "
               "other chains at each c."))
    return lines


def section(data: dict) -> str:
    cfg = data["config"]
    load = data.get("load_average_at_start")
    trace = cfg["trace"]
    modes = data["modes"]
    lines = [
        "## KV memory by the token: the Azure trace's own lengths",
        "",
        f"`chainswarm simulate kv-lengths`. {cfg['scenario']}. Jobs take the (prompt, output) lengths of Azure code "
        f"trace rows drawn at random ({trace['requests']:,} rows; need per request, prompt + output in "
        f"{cfg['page_tokens']}-token pages: mean {trace['mean_need']:,.0f}, median {trace['median_need']:,.0f}, P95 "
        f"{trace['p95_need']:,.0f}, max {trace['max_need']:,}; {100 * trace['longer_than_2048']:.0f}% longer than "
        f"2,048). They arrive as a Poisson process. A job runs for the time its own lengths take on its chain, "
        f"slowed by the sessions its servers hold. The same jobs are run under every admission, and the same job "
        f"sequence at every rate. {data['runs']} runs × {data['num_jobs']:,} jobs per point (the first "
        f"{100 * data['warmup']:.0f}% left out), {data['elapsed_s']:.0f} s"
        + (f" (load average {load[0]:.1f} at the start, 2 shared cores)" if load else "") + ".",
        "",
        f"Admissions: **max-length slots**: the plan of {cfg['max_length']:,}-token slots, c_k sessions per chain "
        f"(`--kv-admission slots --max-length {cfg['max_length']}`). **Expected-length slots**: the plan of "
        f"{cfg['slot_tokens']:,}-token slots (l̄_I + l̄_O in pages), c_k sessions per chain whatever their lengths. "
        "**Tokens**: the same plan, each request reserving its own need of its chain's c_k · slot_tokens budget "
        "(`--kv-admission tokens`, the default). max_length is the smallest power of two that holds every request "
        "of the trace.",
        "",
        "Mean / P95 response (s), mean concurrent sessions:",
        "",
        "| λ (req/s) | " + " | ".join(modes) + " | " + " | ".join(f"sessions, {m}" for m in modes) + " |",
        "|---|" + "---|" * (2 * len(modes)),
    ]
    for p in data["points"]:
        st = p["stats"]
        lines.append(f"| {p['rate']:g} | " + " | ".join(f"{st[m]['mean']:.1f} / {st[m]['p95']:.1f}" for m in modes)
                     + " | " + " | ".join(f"{st[m]['sessions']:.2f}" for m in modes) + " |")
    lines += ["", "What the data show (computed from the JSON):", "", *conclusions(data), "",
              "![KV memory by the token on the Azure trace's lengths](kv_lengths.png)", ""]
    return "\n".join(lines)
