"""Per-run metrics of the fairness simulations and the issue-6 claims over seeds.

``compute_metrics`` turns one token-level simulation result into the §9 metrics
(service rates, Jain's index over the all-active window, throughput, latency of
well-behaved clients, hit rate, prefill share, the largest backlogged service gap
against the §14.8 bound); ``add_common_window`` adds the throughput over the
window shared by every policy of a (scenario, seed); ``aggregate`` summarises a
point over seeds and ``evaluate_claims`` decides the claims on the means and per
seed.  Nothing here runs a simulation or writes a file.
"""

from __future__ import annotations

import math

import numpy as np

from planner.fairness_metrics import jain_index, percentile, swarm_bound

from experiments.sim.token_sim import SwarmSetup
from experiments.sim.workloads import Workload

FAIR_LOCAL = ("dlpm", "swarm", "bfio")
PREFIX_HEAVY = ("ldqa", "tot", "judge")
LATENCY_METRIC = {"ldqa": "ttft", "tot": "program_e2e", "judge": "program_e2e", "chat": "program_e2e"}
TPUT_KEY = "throughput_common_su_s"  # claims compare throughput over the common window
# thresholds of the issue-6 claims
JAIN_CLOSE = 0.05  # "close to VTC's": within 0.05
TPUT_CLOSE = 0.85  # "close to LPM's": at least 85 %
TPUT_ABOVE = 1.2  # "well above VTC's": at least 1.2x
STARVE = 3.0  # "many times higher": at least 3x


def max_backlogged_gap_fast(events, backlog) -> tuple:
    """Same result as ``planner.fairness_metrics.max_backlogged_gap`` (max over client
    pairs and common backlog intervals of max D - min D, D = W_f - W_g from 0 at
    the interval start, events at equal times in recorded order), via prefix sums."""
    clients = sorted(backlog, key=repr)
    worst, where = 0.0, ()
    for i, f in enumerate(clients):
        for g in clients[i + 1:]:
            sel = [(t, a if c == f else -a) for t, c, a in events if c == f or c == g]
            if not sel:
                continue
            times = np.array([t for t, _ in sel])
            d = np.cumsum([a for _, a in sel])
            for s1, e1 in backlog[f]:
                for s2, e2 in backlog[g]:
                    s, e = max(s1, s2), min(e1, e2)
                    if s > e:
                        continue
                    lo_i = int(np.searchsorted(times, s, side="left"))
                    hi_i = int(np.searchsorted(times, e, side="right"))
                    if hi_i <= lo_i:
                        continue
                    base = d[lo_i - 1] if lo_i > 0 else 0.0
                    seg = d[lo_i:hi_i] - base
                    gap = max(0.0, float(seg.max())) - min(0.0, float(seg.min()))
                    if gap > worst:
                        worst, where = gap, (f, g, (s, e))
    return worst, where


def _window_sums(events, clients, t1, t2) -> dict:
    out = {c: 0.0 for c in clients}
    for t, c, a in events:
        if t1 <= t <= t2 and c in out:
            out[c] += a
    return out


def _series(events, clients, t_end, bins: int) -> dict:
    width = max(t_end, 1e-9) / bins
    out = {c: [0.0] * bins for c in clients}
    for t, c, a in events:
        if c in out:
            out[c][min(bins - 1, int(t / width))] += a / width
    return {"bin_width_s": width, "t": [width * (i + 0.5) for i in range(bins)], "rate": out}


def compute_metrics(res, w: Workload, setup: SwarmSetup, cfg, policy: str, quantum: float) -> dict:
    clients = list(w.clients)
    # all-active window: every client has started its first program and not yet
    # finished its last one (unfinished programs run to the end of the simulation)
    first = {c: min((p.start for p in w.programs if p.client == c), default=math.inf) for c in clients}
    last = {c: max((res.program_end.get(p.program_id, res.end_time) for p in w.programs if p.client == c),
                   default=-math.inf) for c in clients}
    t1 = max(first.values())
    t2 = min(last.values())
    span = max(t2 - t1, 1e-9)
    actual = _window_sums(res.service_events, clients, t1, t2)
    view = _window_sums(res.client_view_events, clients, t1, t2)
    tok = sum(n for t, n in res.token_events if t1 <= t <= t2)
    lat_kind = LATENCY_METRIC[w.kind]
    end = res.end_time

    def latencies(client_set):
        vals, cens = [], 0
        if lat_kind == "ttft":
            for r in res.records.values():
                if r.call.client in client_set:
                    if math.isnan(r.first_token):
                        cens += 1
                        vals.append(end - r.ready)
                    else:
                        vals.append(r.first_token - r.ready)
            missing = [c for p in w.programs if p.client in client_set for c in p.calls if c.call_id not in res.records]
            for c in missing:
                cens += 1
        else:
            for p in w.programs:
                if p.client not in client_set:
                    continue
                if p.program_id in res.program_end:
                    vals.append(res.program_end[p.program_id] - p.start)
                else:
                    cens += 1
                    vals.append(max(0.0, end - p.start))
        return vals, cens

    wb, wb_cens = latencies(set(w.well_behaved))
    mb, mb_cens = latencies({w.misbehaving})
    calls = w.calls()
    l_input = max(c.input_tokens for c in calls)
    l_output = max(c.max_new_tokens for c in calls)
    bound = swarm_bound(setup.capacities, l_input, l_output, quantum)
    gap, where = max_backlogged_gap_fast(res.service_events, res.backlog)
    series = _series(res.service_events, clients, max(end, w.horizon), 40)
    series_view = _series(res.client_view_events, clients, max(end, w.horizon), 40)
    ttft_wb = [r.first_token - r.ready for r in res.records.values()
               if r.call.client in w.well_behaved and not math.isnan(r.first_token)]
    # where slot time goes (granted calls): prefill of the non-cached tokens vs decode; the
    # cold share is the prefill share had nothing been cached (it bounds any locality gain)
    specs = {c.chain_id: c for c in setup.chains}
    pre = dec = cold = 0.0
    for r in res.records.values():
        if r.chain is None:
            continue
        sp = specs[r.chain]
        pre += sp.prefill_time * (r.call.input_tokens - r.reused)
        cold += sp.prefill_time * r.call.input_tokens
        dec += sp.decode_time * r.call.output_tokens
    # cumulative service curves (kept in memory only) for throughput over a common window
    cum = {}
    for name, ev in (("view", res.client_view_events), ("actual", res.service_events)):
        ts = np.fromiter((e[0] for e in ev), float, len(ev))
        order = np.argsort(ts, kind="stable")
        cum[name] = (ts[order], np.cumsum(np.fromiter((e[2] for e in ev), float, len(ev))[order]))
    return {
        "policy": policy,
        "quantum": quantum if policy in FAIR_LOCAL else None,
        "window_s": [t1, t2],
        "service_rate_actual": {c: actual[c] / span for c in clients},
        "service_rate_client_view": {c: view[c] / span for c in clients},
        "jain_actual": jain_index([actual[c] for c in clients]),
        "jain_client_view": jain_index([view[c] for c in clients]),
        "throughput_su_s": sum(view.values()) / span,
        "throughput_actual_su_s": sum(actual.values()) / span,
        "output_tokens_s": tok / span,
        "latency_metric": lat_kind,
        "wb_latency_p50": percentile(wb, 50) if wb else math.nan,
        "wb_latency_p99": percentile(wb, 99) if wb else math.nan,
        "wb_latency_mean": float(np.mean(wb)) if wb else math.nan,
        "wb_censored": wb_cens,
        "wb_count": len(wb),
        "wb_ttft_p50": percentile(ttft_wb, 50) if ttft_wb else math.nan,
        "wb_ttft_p99": percentile(ttft_wb, 99) if ttft_wb else math.nan,
        "mis_latency_p50": percentile(mb, 50) if mb else math.nan,
        "mis_latency_p99": percentile(mb, 99) if mb else math.nan,
        "mis_censored": mb_cens,
        "hit_rate": res.reused_tokens / res.input_tokens if res.input_tokens else 0.0,
        "prefill_share": pre / (pre + dec) if pre + dec else 0.0,
        "cold_prefill_share": cold / (cold + dec) if cold + dec else 0.0,
        "tokens_saved": res.reused_tokens,
        "max_gap": gap,
        "max_gap_where": [where[0], where[1], list(where[2])] if where else None,
        "bound": bound,
        "bound_terms": {"L_input": l_input, "L_output": l_output, "sum_c": sum(setup.capacities), "Q_u": quantum},
        "within_bound": gap <= bound,
        "violations": res.violations,
        "batches": res.batches,
        "censored_calls": res.censored,
        "end_time_s": end,
        "calls": len(calls),
        "series_actual": series,
        "series_client_view": series_view,
        "_cum": cum,
    }


# ----------------------------------------------------------------- over seeds and policies
SCALAR_KEYS = ("jain_actual", "jain_client_view", "throughput_su_s", "throughput_common_su_s",
               "throughput_actual_su_s", "throughput_common_actual_su_s", "output_tokens_s",
               "wb_latency_p50", "wb_latency_p99", "wb_latency_mean", "wb_ttft_p50", "wb_ttft_p99",
               "mis_latency_p50", "mis_latency_p99", "hit_rate", "prefill_share", "cold_prefill_share",
               "max_gap", "bound", "wb_censored", "violations")


def aggregate(runs: list) -> dict:
    out = {}
    for k in SCALAR_KEYS:
        vals = [r[k] for r in runs if r.get(k) is not None and not (isinstance(r[k], float) and math.isnan(r[k]))]
        if vals:
            out[k] = {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                      "min": float(np.min(vals)), "max": float(np.max(vals))}
    out["within_bound_all"] = all(r["within_bound"] for r in runs)
    out["runs"] = len(runs)
    return out


def _rate_between(cum, t1: float, t2: float) -> float:
    """Service per second in [t1, t2] from a cumulative curve (events at t1..t2 inclusive)."""
    ts, cs = cum
    lo = int(np.searchsorted(ts, t1, side="left"))
    hi = int(np.searchsorted(ts, t2, side="right"))
    total = (cs[hi - 1] if hi > 0 else 0.0) - (cs[lo - 1] if lo > 0 else 0.0)
    return float(total) / max(t2 - t1, 1e-9)


def add_common_window(main_runs: dict, extra_runs: list) -> None:
    """Throughput of every run of one (scenario, seed) over the *common* window: from the
    latest start of the all-active windows to the earliest end among the main policies, so
    every policy is measured over the same seconds of the same arrivals (a policy's own
    window may include a drain phase, which changes its request mix; §9.5 asks for
    completed work per second, which is only comparable over the same interval)."""
    if not main_runs:
        return
    t1 = max(m["window_s"][0] for m in main_runs.values())
    t2 = min(m["window_s"][1] for m in main_runs.values())
    for m in [*main_runs.values(), *extra_runs]:
        m["common_window_s"] = [t1, t2]
        m["throughput_common_su_s"] = _rate_between(m["_cum"]["view"], t1, t2)
        m["throughput_common_actual_su_s"] = _rate_between(m["_cum"]["actual"], t1, t2)


def mean_of(entry, policy, key):
    """Mean over seeds of ``key`` for ``policy`` in a scenario entry (None where absent)."""
    try:
        return entry["policies"][policy]["summary"][key]["mean"]
    except KeyError:
        return None


def sd_of(entry, policy, key):
    """Standard deviation over seeds of ``key`` for ``policy`` (None where absent)."""
    try:
        return entry["policies"][policy]["summary"][key]["std"]
    except KeyError:
        return None


def worst_gap(entry, policy) -> tuple:
    """(max gap, bound) of the seed closest to its bound."""
    runs = entry["policies"][policy]["runs"]
    r = max(runs, key=lambda r: r["max_gap"] / r["bound"])
    return r["max_gap"], r["bound"]


def m0_share(entry: dict, policy: str) -> float:
    """Mean over seeds of the misbehaving client's fraction of actual service (all-active window)."""
    runs = entry["policies"][policy]["runs"]
    fr = [r["service_rate_actual"]["m0"] / max(1e-12, sum(r["service_rate_actual"].values())) for r in runs]
    return float(np.mean(fr))


# ----------------------------------------------------------------- claims
def _claim_values(scenario: str, get) -> dict:
    """The issue-6 claims of one scenario from ``get(policy, key)`` (a mean or one seed's value)."""
    kind = scenario.split("-")[0]
    out: dict = {}
    vtc_j = get("vtc", "jain_actual")
    lpm_t, vtc_t = get("lpm", TPUT_KEY), get("vtc", TPUT_KEY)
    for p in FAIR_LOCAL:
        j, t = get(p, "jain_actual"), get(p, TPUT_KEY)
        if j is None:
            continue
        c: dict = {"jain": j, "throughput": t}
        if vtc_j is not None:
            c["jain_vs_vtc"] = j - vtc_j
            c["jain_close_to_vtc"] = j >= vtc_j - JAIN_CLOSE
        if lpm_t:
            c["throughput_vs_lpm"] = t / lpm_t
            c["throughput_close_to_lpm"] = t / lpm_t >= TPUT_CLOSE
        if vtc_t:
            c["throughput_vs_vtc"] = t / vtc_t
            c["throughput_well_above_vtc"] = t / vtc_t >= TPUT_ABOVE if kind in PREFIX_HEAVY else None
        out[p] = c
    ref = get("dlpm", "wb_latency_p99")
    for p in ("lpm", "fcfs"):
        v = get(p, "wb_latency_p99")
        if v is not None and ref:
            out[f"{p}_starves"] = {"p99": v, "dlpm_p99": ref, "ratio": v / ref, "holds": v / ref >= STARVE}
    return out


BOOL_CLAIMS = ("jain_close_to_vtc", "throughput_close_to_lpm", "throughput_well_above_vtc")


def evaluate_claims(scenario: str, entry: dict) -> dict:
    """Claims on the means over seeds, with how many seeds each holds in (``seeds``: [held, n])."""
    out = _claim_values(scenario, lambda p, k: mean_of(entry, p, k))
    n = min((len(e["runs"]) for e in entry["policies"].values()), default=0)
    per_seed = []
    for i in range(n):
        def get(p, k, i=i):
            try:
                v = entry["policies"][p]["runs"][i][k]
            except (KeyError, IndexError):
                return None
            return None if v is None or (isinstance(v, float) and math.isnan(v)) else v
        per_seed.append(_claim_values(scenario, get))
    for p in FAIR_LOCAL:
        if p not in out:
            continue
        c = out[p]
        for k in BOOL_CLAIMS:
            if c.get(k) is not None:
                c.setdefault("seeds", {})[k] = [sum(1 for ps in per_seed if ps.get(p, {}).get(k)), n]
        runs = entry["policies"][p]["runs"]
        c["within_bound"] = entry["policies"][p]["summary"]["within_bound_all"]
        c["seeds"] = {**c.get("seeds", {}), "within_bound": [sum(1 for r in runs if r["within_bound"]), len(runs)]}
        c["max_gap"], c["bound"] = worst_gap(entry, p)  # the seed closest to its bound
    for p in ("lpm", "fcfs"):
        k = f"{p}_starves"
        if k in out:
            out[k]["seeds"] = [sum(1 for ps in per_seed if ps.get(k, {}).get("holds")), n]
    return out
