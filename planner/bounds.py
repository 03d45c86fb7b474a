"""Response-time analysis of JFFC (spec §8): Theorem 3.7 bounds and the exact CTMC occupancy.

Model (§8.1): Poisson(λ) arrivals, chain k serves at rate μ_k = 1/T_k on each of its c_k job servers,
exponential service. Under JFFC the total occupancy N = Z_0 + Σ_l Z_l behaves like a birth–death process
with birth rate λ and state-dependent death rates ν_n bracketed by

* ν⁺_n: the n jobs sit on the fastest chains (eq. 28) → a **lower** bound on E[N] (eq. 31),
* ν⁻_n: the n jobs sit on the slowest chains (eq. 29) → an **upper** bound on E[N] (eq. 32).

Mean response time is E[N]/λ by Little's law (eq. 24). All functions take chain rates and capacities in
any order and sort them fastest first (stable: equal rates keep their given order).

With batching servers the rates a plan passes here are μ_k = 1/T_k(n^cap), each chain's rate when every
chain is full (GCA, :mod:`planner.service_model`): the bounds are then those of a system no faster than the
real one in any state (conservative; exact at saturation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class ResponseTimeBounds:
    """Theorem 3.7 bounds on mean occupancy and mean response time at arrival rate λ."""

    lower_occupancy: float
    upper_occupancy: float
    lower: float
    """Lower bound on the mean response time (s), eq. (31)/λ."""
    upper: float
    """Upper bound on the mean response time (s), eq. (32)/λ."""


def _sorted_chains(rates: Sequence[float], capacities: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    mu = np.asarray(rates, dtype=np.float64)
    cap = np.asarray(capacities, dtype=np.int64)
    if mu.shape != cap.shape or mu.ndim != 1:
        raise ValueError("rates and capacities must be 1-D and of equal length")
    if mu.size and (not np.all(np.isfinite(mu)) or np.any(mu <= 0)):
        raise ValueError("chain rates must be finite and > 0")
    if np.any(cap < 0):
        raise ValueError("capacities must be >= 0")
    keep = cap > 0
    mu, cap = mu[keep], cap[keep]
    order = np.argsort(-mu, kind="stable")
    return mu[order], cap[order]


def death_rates(rates: Sequence[float], capacities: Sequence[int], *, fastest_first: bool) -> np.ndarray:
    """ν⁺_n (``fastest_first=True``, eq. 28) or ν⁻_n (eq. 29) for n = 1..C, as an array of length C.

    The n-th job occupies the n-th job server in fastest-first (resp. slowest-first) order, so the death
    rate is a cumulative sum of per-slot rates: O(C).
    """
    mu, cap = _sorted_chains(rates, capacities)
    per_slot = np.repeat(mu, cap)
    if not fastest_first:
        per_slot = per_slot[::-1]
    return np.cumsum(per_slot)


def birth_death_mean(arrival_rate: float, deaths: np.ndarray) -> float:
    """E[Φ] for a birth–death process with birth λ, death ν_n (n = 1..C) and ν_n = ν_C beyond C.

    Implements eqs. (30)–(32) in log space: log w_n = Σ_{i≤n} log(λ/ν_i), normalized with log-sum-exp
    including the geometric tail w_C/(1−ρ), ρ = λ/ν_C. Returns +inf if λ ≥ ν_C, 0 if λ = 0.
    """
    C = len(deaths)
    if C == 0:
        return math.inf
    nu = float(deaths[-1])
    if arrival_rate <= 0:
        return 0.0
    if arrival_rate >= nu:
        return math.inf
    rho = arrival_rate / nu
    log_w = np.concatenate(([0.0], np.cumsum(math.log(arrival_rate) - np.log(deaths))))  # n = 0..C
    head = log_w[:C]  # n = 0..C-1
    log_tail = log_w[C] - math.log1p(-rho)  # Σ_{n≥C} w_n = w_C/(1−ρ)
    top = max(float(head.max()), log_tail)
    norm = float(np.exp(head - top).sum()) + math.exp(log_tail - top)
    log_norm = top + math.log(norm)
    phi = np.exp(head - log_norm)
    phi_c = math.exp(log_w[C] - log_norm)
    mean = float(np.dot(np.arange(C, dtype=np.float64), phi))
    return mean + phi_c * (rho / (1.0 - rho) ** 2 + C / (1.0 - rho))


def occupancy_bounds(
    rates: Sequence[float], capacities: Sequence[int], arrival_rate: float
) -> tuple[float, float]:
    """(lower, upper) bounds on E_π[Σ_l Z_l] (eqs. 31, 32); (inf, inf) if λ ≥ ν."""
    lower = birth_death_mean(arrival_rate, death_rates(rates, capacities, fastest_first=True))
    upper = birth_death_mean(arrival_rate, death_rates(rates, capacities, fastest_first=False))
    return lower, upper


def response_time_bounds(
    rates: Sequence[float], capacities: Sequence[int], arrival_rate: float
) -> ResponseTimeBounds | None:
    """Theorem 3.7 bounds on the mean response time under JFFC; None when λ ≥ ν (unstable) or no chain.

    At λ = 0 the bounds are their limits λ→0: 1/μ_1 (the job takes the fastest chain) and 1/μ_K (ν⁻_1 is
    the slowest chain's rate).
    """
    if arrival_rate < 0 or not math.isfinite(arrival_rate):
        raise ValueError("arrival_rate must be finite and >= 0")
    mu, cap = _sorted_chains(rates, capacities)
    if mu.size == 0:
        return None
    nu = float(np.dot(mu, cap))
    if arrival_rate >= nu:
        return None
    if arrival_rate == 0:
        return ResponseTimeBounds(0.0, 0.0, 1.0 / float(mu[0]), 1.0 / float(mu[-1]))
    lo, up = occupancy_bounds(mu, cap, arrival_rate)
    return ResponseTimeBounds(lo, up, lo / arrival_rate, up / arrival_rate)


def exact_mean_occupancy(
    rates: Sequence[float],
    capacities: Sequence[int],
    arrival_rate: float,
    *,
    max_states: int = 200_000,
) -> float:
    """Exact E_π[Σ_l Z_l] of the JFFC CTMC (§8.2) by the censored-chain method of §8.6.

    States z ∈ Π_l {0..c_l} (mixed radix, chain 0 the least significant digit). Arrival (rate λ) goes to the
    fastest non-full chain; the arrival out of the full state f is omitted (censoring the queue
    excursions); departures from chain l at rate z_l·μ_l. Solve p·Q̂ = 0, Σp = 1, then
    E[N] = [Σ|z|·p_z + p_f·(C·ρ/(1−ρ) + ρ/(1−ρ)²)] / (1 + p_f·ρ/(1−ρ)).

    Returns +inf if λ ≥ ν. Raises ValueError if Π(c_l + 1) > ``max_states``.
    """
    import scipy.sparse as sp
    import scipy.sparse.linalg as spla

    mu, cap = _sorted_chains(rates, capacities)
    if mu.size == 0:
        return math.inf
    nu = float(np.dot(mu, cap))
    if arrival_rate >= nu:
        return math.inf
    if arrival_rate <= 0:
        return 0.0
    sizes = cap + 1
    n_states = int(np.prod(sizes.astype(object)))
    if n_states > max_states:
        raise ValueError(f"{n_states} CTMC states exceed max_states={max_states}")
    K = mu.size
    strides = np.ones(K, dtype=np.int64)
    for l in range(1, K):
        strides[l] = strides[l - 1] * sizes[l - 1]
    index = np.arange(n_states, dtype=np.int64)
    z = (index[:, None] // strides[None, :]) % sizes[None, :]  # (n_states, K)
    rows, cols, vals = [], [], []
    # departures
    for l in range(K):
        has = z[:, l] > 0
        src = index[has]
        rows.append(src)
        cols.append(src - strides[l])
        vals.append(z[has, l] * mu[l])
    # arrivals to the fastest non-full chain
    not_full = z < cap[None, :]
    any_free = not_full.any(axis=1)
    first_free = np.argmax(not_full, axis=1)
    src = index[any_free]
    rows.append(src)
    cols.append(src + strides[first_free[any_free]])
    vals.append(np.full(src.size, float(arrival_rate)))
    rows_a = np.concatenate(rows)
    cols_a = np.concatenate(cols)
    vals_a = np.concatenate(vals)
    Q = sp.csr_matrix((vals_a, (rows_a, cols_a)), shape=(n_states, n_states))
    out = np.asarray(Q.sum(axis=1)).ravel()
    Q = Q - sp.diags(out)
    # p Q = 0  <=>  Q^T p^T = 0; replace the last equation by normalization Σ p = 1.
    A = Q.T.tolil()
    A[n_states - 1, :] = np.ones(n_states)
    b = np.zeros(n_states)
    b[-1] = 1.0
    p = spla.spsolve(A.tocsc(), b) if n_states > 1 else np.array([1.0])
    occupancy = z.sum(axis=1)
    C = int(cap.sum())
    p_full = float(p[-1])  # the full state is the highest index
    rho = arrival_rate / nu
    numer = float(np.dot(occupancy, p)) + p_full * (C * rho / (1 - rho) + rho / (1 - rho) ** 2)
    return numer / (1.0 + p_full * rho / (1 - rho))


def exact_mean_response_time(
    rates: Sequence[float], capacities: Sequence[int], arrival_rate: float, *, max_states: int = 200_000
) -> float:
    """Exact mean response time E[N]/λ under JFFC (λ = 0: the fastest chain's 1/μ_1)."""
    if arrival_rate == 0:
        mu, _ = _sorted_chains(rates, capacities)
        return 1.0 / float(mu[0]) if mu.size else math.inf
    return exact_mean_occupancy(rates, capacities, arrival_rate, max_states=max_states) / arrival_rate
