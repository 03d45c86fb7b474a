"""The batch term of the service model (:mod:`planner.service_model`) against committed live measurements.

Two checks, both on data already in ``experiments/results`` (no new run):

* **Table 1 replay** (``live_table1.json``): each served request's service time predicted with and without the
  batch term. The CPU part of each decode step is taken as sequential, g(n) = n, on D_j = m_j·decode_cpu·(l_O − 1)
  (the CPU decode time the run measured): the largest term it can have, whether the run's servers ran petals' own
  pool or the batching pool; the emulated GPU time is a sleep per session and does not batch. With the batch term the request runs at speed
  T(1)/T(n(t)), n_j(t) = the requests its server j was serving at t (from the same run's records), and the
  prediction is the τ with ∫_start^{start+τ} T(1)/T(n(t)) dt = T(1), exactly as the simulator runs it
  (:func:`ps_service_time`).
* **Batching benchmark** (``bench_batching.json``): per-token latency of n concurrent sessions on two SmolLM2
  servers, vanilla petals (sequential steps) and batched Chainswarm servers. The model: the one-session latency
  L(1) measured, plus on every server the extra step time of n sessions from the in-process step profile,
  (blocks/15)·(t(n) − t(1)) with t the sequential (vanilla) or batched (bound 8, rounds beyond) step of 15 blocks;
  without the batch term the model is L(1) at every n.
"""
from __future__ import annotations

import bisect
from collections import defaultdict

import numpy as np

from planner.service_model import BATCH_SIZES, BatchCurve


def occupancy(rows: list[dict]) -> dict[str, tuple[list[float], list[int]]]:
    """Per server: the times its number of requests in service changes and that number after each change."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for r in rows:
        for s in r["servers"]:
            events[s] += [(r["started"], 1), (r["completed"], -1)]
    out = {}
    for s, ev in events.items():
        ev.sort(key=lambda e: (e[0], e[1]))  # a departure before an arrival at the same instant
        times, counts, level = [], [], 0
        for t, d in ev:
            level += d
            times.append(t)
            counts.append(level)
        out[s] = (times, counts)
    return out


def _held(steps: tuple[list[float], list[int]], t: float) -> int:
    times, counts = steps
    i = bisect.bisect_right(times, t) - 1
    return counts[i] if i >= 0 else 0


def ps_service_time(start: float, solo: float, terms: list[tuple[str, float, BatchCurve]],
                    steps: dict[str, tuple[list[float], list[int]]]) -> float:
    """τ such that a job alone for ``solo`` s, started at ``start``, ends at start + τ when it runs at speed
    solo/T(n(t)), T(n) = solo + Σ w·(g(n_j) − 1) over ``terms`` (server, w, g), n_j(t) from ``steps`` (at least 1:
    the job itself); past the last recorded change the occupancy stays as it was."""
    cuts = sorted({t for s, _, _ in terms for t in steps[s][0] if t > start})
    t, work = start, solo
    for nxt in cuts + [float("inf")]:
        n = {s: max(1, _held(steps[s], t)) for s, _, _ in terms}
        time = solo + sum(w * (g(n[s]) - 1.0) for s, w, g in terms)
        speed = solo / time
        if work <= (nxt - t) * speed:
            return t + work / speed - start
        work -= (nxt - t) * speed
        t = nxt
    raise AssertionError("unreachable")


def table1_with_batch(rows: list[dict], cpu_decode_s: float) -> None:
    """Add ``predicted_batch`` to each row of :func:`experiments.live.validation.predictions` (see the module doc;
    occupancy is counted per method, i.e. per run)."""
    seq = BatchCurve.sequential()
    for method in {r["method"] for r in rows}:
        sel = [r for r in rows if r["method"] == method]
        steps = occupancy(sel)
        for r in sel:
            terms = [(s, m * cpu_decode_s * (r["output"] - 1), seq) for s, m in zip(r["servers"], r["blocks"])]
            r["predicted_batch"] = ps_service_time(r["started"], r["predicted"], terms, steps)


def bench_check(bench: dict, blocks_per_profile: int = 15) -> list[dict]:
    """Per server kind, client and session count: measured per-token latency (median) against L(1) and
    L(1) + the batch term (see the module doc)."""
    step = bench["step_profile"]["step_s"]
    chain = bench["results"].get("chainswarm_chain") or {}
    blocks = sum(e - s for s, e in chain.get("spans", [])) or blocks_per_profile * int(bench.get("servers", 2))
    scale = blocks / blocks_per_profile
    bound = int(bench.get("max_batch", 8))
    batched = BatchCurve.from_step_times([step[str(b)]["batched"] for b in BATCH_SIZES], max_batch=bound)
    sequential = BatchCurve.from_step_times([step[str(b)]["sequential"] for b in BATCH_SIZES])
    curves = {"vanilla_petals": (sequential, step["1"]["sequential"]), "chainswarm_batched": (batched, step["1"]["batched"]),
              "chainswarm_multi": (batched, step["1"]["batched"])}  # ChainGenerator: n sessions in every step
    out = []
    for kind, (curve, t1) in curves.items():
        rows = [r for r in bench["results"].get(kind, []) if isinstance(r, dict)]
        for client in sorted({r["client"] for r in rows}):
            by_n = {r["sessions"]: r for r in rows if r["client"] == client}
            if 1 not in by_n:
                continue
            base = by_n[1]["per_token_ms_median"]
            for n, r in sorted(by_n.items()):
                model = base + 1e3 * scale * t1 * (curve(n) - 1.0)
                out.append({"servers": kind, "client": client, "sessions": n,
                            "measured_ms": r["per_token_ms_median"], "model_ms": model, "model_no_batch_ms": base,
                            "ratio": r["per_token_ms_median"] / model, "ratio_no_batch": r["per_token_ms_median"] / base})
    return out


def summary(rows: list[dict], bench: list[dict]) -> dict:
    """Medians of measured/model with and without the batch term (Table 1), and the benchmark's ratios at n > 1."""
    out: dict = {}
    with_batch = [r for r in rows if "predicted_batch" in r]
    if with_batch:
        m = np.array([r["measured"] for r in with_batch])
        out["table1"] = {"n": len(with_batch),
                         "ratio_median_no_batch": float(np.median(m / np.array([r["predicted"] for r in with_batch]))),
                         "ratio_median_batch": float(np.median(m / np.array([r["predicted_batch"] for r in with_batch]))),
                         "batch_term_median": float(np.median([r["predicted_batch"] / r["predicted"] for r in with_batch]))}
    multi = [b for b in bench if b["sessions"] > 1]
    for kind in sorted({b["servers"] for b in multi}):
        sel = [b for b in multi if b["servers"] == kind]
        out[f"bench {kind}"] = {"n": len(sel), "ratio_median": float(np.median([b["ratio"] for b in sel])),
                                "ratio_median_no_batch": float(np.median([b["ratio_no_batch"] for b in sel]))}
    return out
