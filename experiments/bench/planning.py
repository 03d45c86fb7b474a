"""Planner benchmark (``make bench``): planning time versus swarm size, and JFFC decisions per second.

Swarms follow the paper's BLOOM-176B simulation settings (spec §10.1): L = 70 blocks of 1.32 GB, 0.11 GB of
KV cache per block per job, a fraction η = 0.2 of high-performance servers (40 GB, τp = 108.9 ms) and the
rest low-performance (20 GB, τp = 175.2 ms), τc = l̄_O·(RTT + 18 ms) with l̄_O = 20 and RTT uniform in
[17, 55] ms (the range of per-anchor median RTTs in the RIPE Atlas file), λ = 0.01·J req/s (the paper's
default J = 20, λ = 0.2) and ρ̄ = 0.7. Planning uses the default tuning (Theorem 3.7 lower bound over all
c in [c_max] = 1..351).

It also times ``placement="auto"`` (planner/auto.py: every candidate, scoring and the local search;
target < 1 s at J = 1,000) at the sizes given by ``--auto-sizes``, and one churn step of the incremental
re-planner (planner/replan.py: 10% of the servers leave, as many join; it plans auto from scratch to compare,
then repairs) at ``--replan-sizes``.

    python -m experiments.bench.planning [--sizes 10 100 1000 10000] [--repeats 3] [--auto-sizes 10 100 1000]
                                        [--replan-sizes 100 1000]
"""
from __future__ import annotations

import argparse
import math
import random
import time

import numpy as np
from tqdm import tqdm

from planner.dispatch import JFFC
from planner.model import ModelSpec, Server
from planner.plan import plan

BLOOM = ModelSpec(num_blocks=70, block_size_gb=1.32, cache_slot_gb=0.11)
TAU_P_HIGH = (1 + 5 / 120 * 2000 + 1.32 / 1.02 * 19) / 1000  # footnote 11, seconds
TAU_P_LOW = (1 + 5 / 80 * 2000 + 1.32 / 0.51 * 19) / 1000


def bloom_swarm(num_servers: int, seed: int = 0, eta: float = 0.2) -> list[Server]:
    rng = random.Random(seed)
    high = set(rng.sample(range(num_servers), int(eta * num_servers)))
    servers = []
    for j in range(num_servers):
        rtt = rng.uniform(0.017, 0.055)
        fast = j in high
        servers.append(
            Server(
                id=f"s{j:05d}",
                memory_gb=40.0 if fast else 20.0,
                comm_time_s=20 * (rtt + 0.018),
                compute_time_s=TAU_P_HIGH if fast else TAU_P_LOW,
            )
        )
    return servers


def time_plan(num_servers: int, repeats: int, placement: str = "gbp-cr") -> tuple[float, object]:
    servers = bloom_swarm(num_servers)
    best, result = math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = plan(BLOOM, servers, 0.01 * num_servers, target_load=0.7, placement=placement)
        best = min(best, time.perf_counter() - t0)
    return best, result


def time_replan(num_servers: int, seed: int = 0):
    """One churn step: auto plan on J servers, then the first 10% of the placed servers leave and 10% new
    servers join; the incremental re-plan is timed."""
    from planner.auto import auto_placement
    from planner.replan import incremental_replan

    pool = bloom_swarm(num_servers + num_servers // 10, seed)
    servers, joiners = pool[:num_servers], pool[num_servers:]
    lam = 0.01 * num_servers
    start = auto_placement(BLOOM, servers, lam, 0.7).best
    current = {s.id: span for s, span in zip(servers, start.placement.spans)}
    placed = [s.id for s, span in zip(servers, start.placement.spans) if span is not None]
    gone = set(placed[:: 10][: max(1, num_servers // 10)])
    now = [s for s in servers if s.id not in gone] + joiners
    t0 = time.perf_counter()
    r = incremental_replan(BLOOM, now, current, start.allocation.chains, lam, 0.7)
    return time.perf_counter() - t0, r


def jffc_decisions_per_second(num_chains: int = 1000, decisions: int = 1_000_000, seed: int = 0) -> float:
    """Drive JFFC with a random arrive/complete stream near saturation; count both kinds of decision."""
    rng = np.random.default_rng(seed)
    rates = np.sort(rng.uniform(0.05, 0.5, num_chains))[::-1]
    caps = rng.integers(1, 30, num_chains)
    jffc = JFFC(rates.tolist(), caps.tolist())
    total = int(caps.sum())
    # fill to ~90% so arrivals find free chains deep in the list and some queueing occurs
    running: list[int] = []
    for n in range(int(0.9 * total)):
        running.append(jffc.arrive(n))
    coin = rng.random(decisions) < 0.5
    picks = rng.random(decisions)
    arrive, complete = jffc.arrive, jffc.complete
    t0 = time.perf_counter()
    job = 0
    for is_arrival, u in zip(coin.tolist(), picks.tolist()):
        if is_arrival or not running:
            k = arrive(job)
            job += 1
            if k is not None:
                running.append(k)
        else:
            i = int(u * len(running))
            k = running[i]
            running[i] = running[-1]
            running.pop()
            started = complete(k)
            if started is not None:
                running.append(started.chain)
    return decisions / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--repeats", type=int, default=3, help="best of N for sizes <= 1000")
    parser.add_argument("--chains", type=int, default=1000)
    parser.add_argument("--auto-sizes", type=int, nargs="*", default=[10, 100, 1000])
    parser.add_argument("--replan-sizes", type=int, nargs="*", default=[100, 1000])
    args = parser.parse_args(argv)

    print(f"Planning time, BLOOM-176B swarm, lambda = 0.01*J, default tuning (lower bound over c = 1..351)")
    print(f"{'J':>7} {'time (s)':>10} {'c*':>4} {'chains':>7} {'placed':>7} {'nu (1/s)':>9} {'T lower':>8} {'T upper':>8}")
    sizes, times = [], []
    for n in tqdm(args.sizes, desc="planning", unit="swarm", leave=False):
        seconds, result = time_plan(n, args.repeats if n <= 1000 else 1)
        placed = sum(1 for s in result.servers if s.span is not None)
        lo = "inf" if result.bounds is None else f"{result.bounds.lower:.3f}"
        up = "inf" if result.bounds is None else f"{result.bounds.upper:.3f}"
        tqdm.write(
            f"{n:>7} {seconds:>10.3f} {result.c:>4} {len(result.chains):>7} {placed:>7} "
            f"{result.total_rate:>9.3f} {lo:>8} {up:>8}"
        )
        sizes.append(n)
        times.append(seconds)
    if len(sizes) >= 2:
        slope = np.polyfit(np.log(sizes), np.log(times), 1)[0]
        print(f"growth exponent (log-log slope of time vs J, least squares): {slope:.2f}")
        for (n0, t0), (n1, t1) in zip(zip(sizes, times), zip(sizes[1:], times[1:])):
            print(f"  slope J={n0}->{n1}: {math.log(t1 / t0) / math.log(n1 / n0):.2f}")
    if 1000 in sizes:
        t1000 = times[sizes.index(1000)]
        print(f"target 1000 servers < 1 s: {'met' if t1000 < 1 else 'MISSED'} ({t1000:.3f} s)")

    if args.auto_sizes:
        print("placement=auto (candidates, score, local search), same swarms; best of --repeats")
        print(f"{'J':>7} {'time (s)':>10} {'gbp-cr lower':>12} {'auto lower':>10}  winner")
    for n in args.auto_sizes:
        seconds, result = time_plan(n, args.repeats, "auto")
        _, star = time_plan(n, 1)
        fmt = lambda p: "inf" if p.bounds is None else f"{p.bounds.lower:.3f}"  # noqa: E731
        print(f"{n:>7} {seconds:>10.3f} {fmt(star):>12} {fmt(result):>10}  {result.tuning}")
        if n == 1000:
            print(f"target auto at 1000 servers < 1 s: {'met' if seconds < 1 else 'MISSED'} ({seconds:.3f} s)")

    if args.replan_sizes:
        print("incremental re-plan after 10% leave and 10% join (includes the fresh auto plan it compares with)")
        print(f"{'J':>7} {'time (s)':>10} {'decision':>9} {'blocks loaded':>14} {'fresh would load':>17}")
    for n in args.replan_sizes:
        seconds, r = time_replan(n)
        print(f"{n:>7} {seconds:>10.3f} {r.strategy:>9} {r.blocks_loaded:>14} {r.fresh_blocks_loaded:>17}")

    rate = jffc_decisions_per_second(args.chains)
    print(f"JFFC with {args.chains} chains: {rate:,.0f} decisions/s "
          f"(target >= 100,000: {'met' if rate >= 100_000 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
