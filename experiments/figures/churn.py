"""``chainswarm simulate churn``: re-planning while servers join and leave (issue 20, item 5).

A trace-driven run: jobs arrive with the Azure code trace's arrival process (its gaps rescaled to mean
1/λ, a seed-dependent rotation, Exp(1) sizes: :func:`experiments.figures.auto.azure_jobs`); the swarm starts
with J servers drawn from a pool of 2J (a Fig. 8 scenario of 2J servers: RIPE Atlas RTTs, a share η of
fast GPUs); every active server leaves at rate ``churn_per_min`` per minute and servers from the pool join
at ``churn_per_min``·J per minute, so about 10% of the servers leave and 10% join every minute.

At each change the strategy (experiments/sim/churn_strategies.py) gives the spans the servers should hold;
a server whose span changes drops its blocks at once and serves the new span only after loading it, at
``reload_s_per_block`` seconds per block (measured: experiments/bench/churn_load.py, the load path of a
petals/Chainswarm server at the bandwidth measured here, for a 1.32 GB BLOOM-176B block). The chains in
force at any time are GCA's over the spans that are loaded (experiments/sim/churn_sim.py runs JFFC over
them; a job on a chain that breaks restarts from the queue's head). Per strategy and run: blocks loaded,
blocks new to their server, servers reloading, the planner's decisions, mean/P95 response, restarted
jobs, and the response-time cost of churn: mean response minus the same strategy's static run (its
initial placement, same jobs, nobody leaves).

    chainswarm simulate churn [--runs N] [--quick] [--out DIR] [--replot]
"""
from __future__ import annotations

import heapq
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from experiments.figures.auto import azure_jobs
from experiments.figures.common import _jsonable
from experiments.paths import RESULTS
from experiments.report.churn import _findings, plot, section
from experiments.sim.churn_sim import EpochChain, simulate_epochs
from experiments.sim.churn_strategies import (STRATEGIES, Context, Incremental, IncrementalReserve,
                                              IncrementalStandby, PetalsRebalancing, Scratch)
from experiments.sim.scenarios import ScenarioConfig, build_scenario
from experiments.sim.simulator import DEFAULT_WARMUP
from planner.allocation import gca
from planner.model import Placement

@dataclass(frozen=True)
class ChurnConfig:
    num_servers: int = 20
    eta: float = 0.2
    arrival_rate: float = 0.2
    target_load: float = 0.7
    horizon_s: float = 3600.0
    churn_per_min: float = 0.1
    reload_s_per_block: float = 5.8
    tolerance: float = 0.05
    runs: int = 5
    quick: bool = False

    @classmethod
    def make(cls, *, runs: int | None = None, quick: bool = False) -> "ChurnConfig":
        reload_s = measured_reload_s()
        if quick:
            return cls(horizon_s=600.0, runs=runs or 1, quick=True, reload_s_per_block=reload_s)
        return cls(runs=runs or 5, reload_s_per_block=reload_s)


def measured_reload_s(block_gb: float = 1.32) -> float:
    """s_m / the load bandwidth measured by experiments/bench/churn_load.py (5.8 s if it was never run)."""
    path = RESULTS / "churn_load.json"
    if not path.exists():
        return 5.8
    return block_gb * 1e9 / json.loads(path.read_text())["bytes_per_second"]


def churn_events(cfg: ChurnConfig, pool: list[str], seed: int) -> tuple[list[str], list[tuple[float, str, str]]]:
    """The initial servers and the (time, "leave"|"join", server id) events up to the horizon."""
    rng = np.random.default_rng(10_000 + seed)
    order = [pool[i] for i in rng.permutation(len(pool))]
    active, idle = order[: cfg.num_servers], order[cfg.num_servers:]
    initial = list(active)
    events, t = [], 0.0
    join_rate = cfg.churn_per_min * cfg.num_servers / 60.0
    while True:
        leave_rate = cfg.churn_per_min * len(active) / 60.0
        t += rng.exponential(1.0 / (leave_rate + join_rate))
        if t >= cfg.horizon_s:
            return initial, events
        if rng.random() < leave_rate / (leave_rate + join_rate) and len(active) > 1:
            sid = active.pop(int(rng.integers(len(active))))
            idle.append(sid)
            events.append((t, "leave", sid))
        elif idle:
            sid = idle.pop(int(rng.integers(len(idle))))
            active.append(sid)
            events.append((t, "join", sid))


def _epoch_chains(ctx: Context, strategy, servers: dict, present: list[str], held: dict, ready_at: dict, t: float):
    serving = [sid for sid in present if held.get(sid) is not None and ready_at.get(sid, 0.0) <= t]
    if not serving:
        return []
    srv = [servers[sid] for sid in serving]
    spans = [held[sid] for sid in serving]
    alloc = gca(ctx.model, srv, Placement(tuple(spans)), slot_budget=strategy.slot_budget(ctx, srv, spans))
    return [EpochChain((ch.servers, ch.spans), ch.service_time, ch.capacity) for ch in strategy.serving(alloc.chains)]


def run_strategy(name: str, cfg: ChurnConfig, sc, initial: list[str], events, seed: int) -> dict:
    """One strategy over one churn sequence: the epochs of chains and the reload bookkeeping."""
    ctx = Context(sc.model, cfg.arrival_rate, cfg.target_load, cfg.tolerance)
    strategy = {"incremental": Incremental, "incremental + standby": IncrementalStandby,
                "incremental + reserve": IncrementalReserve,
                "scratch (auto)": lambda: Scratch("auto"),
                "scratch (gbp-cr)": lambda: Scratch("gbp-cr"),
                "petals rebalancing": lambda: PetalsRebalancing(seed)}[name]()
    servers = {s.id: s for s in sc.servers}
    present = list(initial)
    t0 = time.perf_counter()
    held = strategy.start(ctx, [servers[s] for s in present])
    ready_at = {sid: 0.0 for sid in present}
    gen = {sid: 0 for sid in servers}  # invalidates a pending "ready" when the span changes again
    life = {sid: 0 for sid in servers}  # invalidates a pending "check" of a server that left
    queue = [(t, 0, kind, sid, 0) for t, kind, sid in events]
    if strategy.periodic:
        queue += [(strategy.next_check(), 1, "check", sid, 0) for sid in present]
    heapq.heapify(queue)
    times, chains = [0.0], [_epoch_chains(ctx, strategy, servers, present, held, ready_at, 0.0)]
    loaded = new_blocks = reloads = 0

    def apply(target: dict, t: float, force: set[str] = frozenset()) -> None:
        nonlocal loaded, new_blocks, reloads
        for sid in present:
            old, new = held.get(sid), target.get(sid)
            if new == old and sid not in force:
                continue
            held[sid] = new
            gen[sid] += 1
            if new is None:
                continue
            n = new[1] - new[0]
            overlap = 0 if old is None else max(0, min(old[1], new[1]) - max(old[0], new[0]))
            loaded, new_blocks, reloads = loaded + n, new_blocks + n - overlap, reloads + 1
            ready_at[sid] = t + n * cfg.reload_s_per_block
            heapq.heappush(queue, (ready_at[sid], 2, "ready", sid, gen[sid]))

    while queue:
        t, _, kind, sid, g = heapq.heappop(queue)
        if t >= cfg.horizon_s and kind != "ready":  # no churn after the horizon; pending loads still finish
            continue
        if kind == "leave":
            present.remove(sid)
            held.pop(sid, None)
            gen[sid] += 1
            life[sid] += 1
            if not strategy.periodic:
                apply(strategy.change(ctx, [servers[s] for s in present], held, None), t)
        elif kind == "join":
            present.append(sid)
            held[sid], ready_at[sid] = None, t
            gen[sid] += 1
            life[sid] += 1
            apply(strategy.change(ctx, [servers[s] for s in present], held, sid), t)
            if strategy.periodic:
                heapq.heappush(queue, (t + strategy.next_check(), 1, "check", sid, life[sid]))
        elif kind == "ready" and g != gen[sid]:
            continue
        elif kind == "check":
            if g != life[sid]:
                continue
            heapq.heappush(queue, (t + strategy.next_check(), 1, "check", sid, g))
            ready = {s for s in present if held.get(s) is not None and ready_at[s] <= t}
            moved = strategy.check(ctx, servers[sid], [servers[s] for s in present], held, ready)
            if moved is False:
                continue
            apply({**held, sid: moved}, t, force={sid})
        times.append(t)
        chains.append(_epoch_chains(ctx, strategy, servers, present, held, ready_at, t))
    plan_s = time.perf_counter() - t0
    return {"times": times, "chains": chains, "blocks_loaded": loaded, "blocks_new": new_blocks, "reloads": reloads,
            "decisions": dict(strategy.decisions), "planning_s": plan_s,
            "initial_chains": chains[0]}


def _summary(run, warmup: float = DEFAULT_WARMUP) -> dict:
    skip = int(len(run.arrival) * warmup)
    resp = run.response[skip:]
    done = resp[np.isfinite(resp)]
    return {"mean": float(done.mean()) if done.size else None,
            "p95": float(np.percentile(done, 95)) if done.size else None,
            "unfinished": int((~np.isfinite(resp)).sum()), "restarted": int((run.restarts[skip:] > 0).sum()),
            "jobs": int(resp.size)}


def one_run(cfg: ChurnConfig, seed: int, strategies=STRATEGIES) -> dict:
    sc = build_scenario(ScenarioConfig(num_servers=2 * cfg.num_servers, eta=cfg.eta,
                                       arrival_rate=cfg.arrival_rate, target_load=cfg.target_load), seed)
    initial, events = churn_events(cfg, [s.id for s in sc.servers], seed)
    jobs = azure_jobs(cfg.arrival_rate, int(cfg.arrival_rate * cfg.horizon_s), seed=1000 + seed)
    keep = jobs.arrivals < cfg.horizon_s
    arrivals, sizes = jobs.arrivals[keep], jobs.sizes[keep]
    out = {"seed": seed, "leaves": sum(e[1] == "leave" for e in events), "joins": sum(e[1] == "join" for e in events),
           "jobs": int(arrivals.size), "strategies": {}}
    for name in strategies:
        tl = run_strategy(name, cfg, sc, initial, events, seed)
        churned = simulate_epochs(arrivals, sizes, tl["times"], tl["chains"])
        static = simulate_epochs(arrivals, sizes, [0.0], [tl["initial_chains"]])
        ends = [min(t, cfg.horizon_s) for t in tl["times"][1:]] + [cfg.horizon_s]
        broken = sum(max(0.0, b - a) for a, b, ch in zip(tl["times"], ends, tl["chains"]) if not ch)
        out["strategies"][name] = {
            **{k: tl[k] for k in ("blocks_loaded", "blocks_new", "reloads", "decisions", "planning_s")},
            "churn": _summary(churned), "static": _summary(static), "epochs": len(tl["times"]),
            "no_chain_s": broken,
            "capacity": [[t, sum(c.capacity / c.service_time for c in ch)] for t, ch in zip(tl["times"], tl["chains"])],
        }
    return out


def churn(cfg: ChurnConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    t0 = time.perf_counter()
    load = list(os.getloadavg())
    runs = [one_run(cfg, s) for s in tqdm(range(cfg.runs), desc="churn", disable=not progress)]
    agg = {}
    for name in STRATEGIES:
        rows = [r["strategies"][name] for r in runs]

        def stat(f):
            vals = [f(x) for x in rows if f(x) is not None]
            return {"mean": float(np.mean(vals)) if vals else None,
                    "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0}
        agg[name] = {
            "blocks_loaded": stat(lambda x: x["blocks_loaded"]), "blocks_new": stat(lambda x: x["blocks_new"]),
            "reloads": stat(lambda x: x["reloads"]), "mean": stat(lambda x: x["churn"]["mean"]),
            "p95": stat(lambda x: x["churn"]["p95"]), "static_mean": stat(lambda x: x["static"]["mean"]),
            "cost": stat(lambda x: None if x["churn"]["mean"] is None or x["static"]["mean"] is None
                         else x["churn"]["mean"] - x["static"]["mean"]),
            "restarted": stat(lambda x: x["churn"]["restarted"]), "no_chain_s": stat(lambda x: x["no_chain_s"]),
            "unfinished": stat(lambda x: x["churn"]["unfinished"]),
            "decisions": {k: int(sum(x["decisions"].get(k, 0) for x in rows))
                          for k in sorted({k for x in rows for k in x["decisions"]})},
        }
    return _jsonable({"figure": "churn", "config": asdict(cfg), "runs": runs, "aggregate": agg,
                      "elapsed_s": time.perf_counter() - t0, "load_average": [load, list(os.getloadavg())]})


def run_cli(args) -> int:
    """``chainswarm simulate churn [--runs N] [--quick] [--out DIR] [--replot]``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "churn.json"
    if getattr(args, "replot", False):
        if not path.exists():
            print(f"chainswarm simulate churn: --replot: no churn.json in {out}", file=sys.stderr)
            return 2
        data = json.loads(path.read_text())
    else:
        cfg = ChurnConfig.make(runs=args.runs, quick=args.quick)
        data = churn(cfg, progress=not getattr(args, "no_progress", False) and sys.stderr.isatty())
        path.write_text(json.dumps(data, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    plot(data, out / "churn.png")
    (out / "sections").mkdir(parents=True, exist_ok=True)
    (out / "sections" / "churn.md").write_text(section(data))
    for line in _findings(data["aggregate"], [n for n in STRATEGIES if n in data["aggregate"]]):
        print(line)
    print(f"churn: {path} ({data['elapsed_s']:.0f} s)")
    return 0
