"""Lower bounds on the mean response time that ANY placement can reach in a scenario (issue 20, item 2).

Two bounds, both over every placement, every chain set and every cache allocation of the full instance:

* **Service bound** (exact, cheap): every job runs on one chain, and no chain whose servers hold cache for
  at least one job is faster than T_min (planner/fastest_chain.py, an exact DP over the servers). In the
  simulator's model a job of size r served by chain k takes r·T_k ≥ r·T_min, so on a given job sample the
  mean response of any placement is at least T_min × (mean size of the measured jobs).
  :func:`service_bound` returns both factors.

* **Queue-aware bound** (a MILP relaxation, expensive): under JFFC with Poisson(λ) arrivals and Exp(1)
  sizes the number of jobs in the system is dominated by a birth–death process whose death rate with n
  jobs is the largest total service rate ν*_n that n jobs running at once could have (Theorem 3.7's
  argument, with the rates maximized over placements instead of taken from one). ν*_n is bounded from
  above by a MILP over n jobs: job i processes m_ij blocks on server j (Σ_j m_ij = L), takes
  T_i = Σ_j τc_j·[m_ij > 0] + τp_j·m_ij, and every server holds the blocks it hosts plus the jobs' cache,
  s_m·max_i m_ij + s_c·Σ_i m_ij ≤ M_j (block ranges need not be contiguous: a relaxation). The objective
  Σ_i 1/T_i is bounded with levels θ_0 = T_min < θ_1 < …: a job at level l earns 1/θ_l and must have
  T_i ≤ θ_{l+1}. HiGHS' dual bound is used, so a solve stopped by its time limit still gives a valid
  bound. For n > n0 the bound grows by at most 1/T_min per extra job. E[N]/λ of that birth–death process
  (planner.bounds.birth_death_mean) is then a lower bound on the steady-state mean response time of
  every placement. :func:`queue_bound` computes it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from planner.bounds import birth_death_mean
from planner.fastest_chain import fastest_chain
from planner.model import ModelSpec, Server, max_blocks

LEVEL_RATIO = 1.01
"""θ_{l+1}/θ_l: the queue-aware bound's rate levels overstate a job's rate by at most 1%."""
LEVEL_TOP = 1.8
"""Levels run from T_min to LEVEL_TOP·T_min; slower jobs are credited 1/(LEVEL_TOP·T_min)."""


def service_bound(model: ModelSpec, servers: Sequence[Server]) -> float:
    """T_min: the fastest chain any placement can form (cache for ≥ 1 job on every block it processes)."""
    return fastest_chain(model, servers, 1).time


def measured_size_mean(sizes: np.ndarray, warmup: float) -> float:
    """Mean size of the jobs a simulation summary counts (the first ``warmup`` share left out)."""
    skip = int(len(sizes) * warmup)
    return float(np.mean(sizes[skip:]))


@dataclass(frozen=True)
class QueueBound:
    value: float
    """Lower bound on the steady-state mean response time (s) of every placement."""
    rates: tuple[float, ...]
    """Upper bounds on ν*_1..ν*_n0 (jobs/s)."""
    gaps: tuple[float, ...]
    """HiGHS' relative MIP gap of each solve (0: proven optimal)."""
    tmin: float


def max_rate_bound(model: ModelSpec, servers: Sequence[Server], n: int, tmin: float, *,
                   time_limit: float = 20.0) -> tuple[float, float]:
    """An upper bound on the largest total rate Σ 1/T_i of ``n`` jobs running at once on any placement
    (see the module docstring), and the solver's relative gap."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    J, L = len(servers), model.num_blocks
    thetas = [tmin]
    while thetas[-1] < LEVEL_TOP * tmin:
        thetas.append(thetas[-1] * LEVEL_RATIO)
    K = len(thetas)
    om, oy, oh, oz = 0, n * J, 2 * n * J, 2 * n * J + J  # m_ij, y_ij, h_j, z_il
    size = oz + n * K
    cost = np.zeros(size)
    cost[oz:] = np.tile(-1.0 / np.asarray(thetas), n)
    rows, cols, vals, lo, hi = [], [], [], [], []

    def row(entries, lower, upper):
        for col, v in entries:
            rows.append(len(lo))
            cols.append(col)
            vals.append(float(v))
        lo.append(lower)
        hi.append(upper)

    caps = [max_blocks(s, model, 1) for s in servers]
    for i in range(n):
        for j in range(J):
            row([(om + i * J + j, 1), (oy + i * J + j, -caps[j])], -np.inf, 0)  # m_ij ≤ cap_j·y_ij
            row([(om + i * J + j, 1), (oh + j, -1)], -np.inf, 0)  # m_ij ≤ h_j (blocks hosted)
        row([(om + i * J + j, 1) for j in range(J)], L, L)
        big = 10 * LEVEL_TOP * tmin  # T_i ≤ Σ_l θ_{l+1} z_il
        row([(oy + i * J + j, s.comm_time_s) for j, s in enumerate(servers)]
            + [(om + i * J + j, s.compute_time_s) for j, s in enumerate(servers)]
            + [(oz + i * K + l, -(thetas[l + 1] if l + 1 < K else big)) for l in range(K)], -np.inf, 0)
        row([(oz + i * K + l, 1) for l in range(K)], 1, 1)
        if i + 1 < n:  # symmetry: jobs sorted by level
            row([(oz + i * K + l, l) for l in range(K)] + [(oz + (i + 1) * K + l, -l) for l in range(K)], -np.inf, 0)
    for j, s in enumerate(servers):
        row([(oh + j, model.block_bytes)] + [(om + i * J + j, model.slot_bytes) for i in range(n)],
            -np.inf, s.memory_bytes)
    A = coo_matrix((vals, (rows, cols)), shape=(len(lo), size)).tocsr()
    upper = np.full(size, 1.0)
    upper[om:oy] = L
    upper[oh:oz] = L
    res = milp(cost, constraints=LinearConstraint(A, lo, hi), integrality=np.ones(size),
               bounds=Bounds(np.zeros(size), upper), options={"time_limit": time_limit, "mip_rel_gap": 1e-4})
    dual = getattr(res, "mip_dual_bound", None)
    if dual is None or not math.isfinite(dual):
        return n / tmin, math.inf  # no bound from the solver: every job at most 1/T_min
    return min(-float(dual), n / tmin), float(res.mip_gap if res.mip_gap is not None else math.inf)


def queue_bound(model: ModelSpec, servers: Sequence[Server], arrival_rate: float, *, n0: int = 6,
                time_limit: float = 20.0) -> QueueBound:
    """The queue-aware lower bound (module docstring) with MILPs for n = 1..``n0``."""
    tmin = service_bound(model, servers)
    rates, gaps = [], []
    for n in range(1, n0 + 1):
        v, gap = max_rate_bound(model, servers, n, tmin, time_limit=time_limit)
        prev = rates[-1] if rates else 0.0
        # nondecreasing (a placement with fewer slots than n runs at most its ν*_C),
        # and ν*_n ≤ ν*_{n−1} + 1/T_min
        rates.append(min(max(v, prev), prev + 1.0 / tmin))
        gaps.append(gap)
    # beyond n0 the rate grows by at most 1/T_min per job; the array is cut where the birth–death process's
    # mass is negligible (λ/ν_n < 1/20 from there on)
    extra = max(200, int(20 * arrival_rate * tmin))
    deaths = np.concatenate((rates, rates[-1] + np.arange(1, extra + 1) / tmin))
    value = birth_death_mean(arrival_rate, deaths) / arrival_rate
    return QueueBound(float(value), tuple(rates), tuple(gaps), tmin)
