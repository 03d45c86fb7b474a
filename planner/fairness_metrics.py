"""Fairness metrics (fairness-locality.md §9) and the bounds they are checked against.

Pure functions over plain data: service events are (time, client, amount)
tuples of actual service (w_e * extend + w_q * output, §1.2); backlog
intervals are (start, end) pairs during which a client had a queued request.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Iterable, Mapping, Sequence

__all__ = [
    "jain_index",
    "cumulative_service",
    "service_in_interval",
    "service_difference",
    "max_service_gap",
    "intersect_intervals",
    "max_backlogged_gap",
    "service_rates",
    "vtc_bound",
    "dlpm_bound",
    "doubleq_bound",
    "swarm_bound",
    "percentile",
]


def jain_index(values: Sequence[float]) -> float:
    """J(x) = (sum x)^2 / (n * sum x^2); 1 for equal shares, 1/n when one takes all (§9.2).
    All-zero input is perfectly fair (1.0)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("jain_index needs at least one value")
    if any(v < 0 for v in xs):
        raise ValueError("service values must be non-negative")
    square_sum = sum(v * v for v in xs)
    if square_sum == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * square_sum)


def cumulative_service(events: Iterable[tuple[float, Hashable, float]]) -> dict:
    """{client: (times, cumulative)}: W_i(0, t) after all events at times <= t."""
    per: dict = defaultdict(list)
    for time, client, amount in sorted(events, key=lambda e: e[0]):
        per[client].append((time, amount))
    out = {}
    for client, items in per.items():
        times, cum, total = [], [], 0.0
        for time, amount in items:
            total += amount
            if times and times[-1] == time:
                cum[-1] = total
            else:
                times.append(time)
                cum.append(total)
        out[client] = (times, cum)
    return out


def service_in_interval(events, client, t1: float, t2: float) -> float:
    """W_client over [t1, t2]: events with t1 <= time <= t2."""
    return sum(a for time, c, a in events if c == client and t1 <= time <= t2)


def service_difference(events, f, g, t1: float, t2: float) -> float:
    """|W_f(t1, t2) - W_g(t1, t2)| (§9.4)."""
    return abs(service_in_interval(events, f, t1, t2) - service_in_interval(events, g, t1, t2))


def max_service_gap(events, f, g, t1: float, t2: float) -> float:
    """max over sub-intervals of [t1, t2] of |W_f - W_g| = max D - min D, where
    D = W_f - W_g is tracked event by event (events at equal times keep their
    recorded order, e.g. a decode token before the admission that follows it)
    over the events with t1 <= time <= t2, starting from D = 0 at t1."""
    d = 0.0
    lo = hi = 0.0
    for time, client, amount in sorted(events, key=lambda e: e[0]):
        if time < t1 or time > t2 or client not in (f, g):
            continue
        d += amount if client == f else -amount
        lo, hi = min(lo, d), max(hi, d)
    return hi - lo


def intersect_intervals(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> list:
    out = []
    for s1, e1 in a:
        for s2, e2 in b:
            s, e = max(s1, s2), min(e1, e2)
            if s <= e:
                out.append((s, e))
    return sorted(out)


def max_backlogged_gap(events, backlog: Mapping[Hashable, Sequence[tuple[float, float]]]) -> tuple[float, tuple]:
    """The largest service gap between any two clients over any interval in which
    both were continuously backlogged (P1 check).  Returns (gap, (f, g, interval))."""
    clients = sorted(backlog, key=repr)
    worst, where = 0.0, ()
    for i, f in enumerate(clients):
        for g in clients[i + 1 :]:
            for s, e in intersect_intervals(backlog[f], backlog[g]):
                gap = max_service_gap(events, f, g, s, e)
                if gap > worst:
                    worst, where = gap, (f, g, (s, e))
    return worst, where


def service_rates(events, t1: float, t2: float, clients: Iterable[Hashable] | None = None) -> dict:
    """Service per unit time of each client over [t1, t2] (§9.1)."""
    if t2 <= t1:
        raise ValueError("empty window")
    names = set(clients) if clients is not None else {c for _, c, _ in events}
    return {c: service_in_interval(events, c, t1, t2) / (t2 - t1) for c in names}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of an empty sequence")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# --------------------------------------------------------------------- bounds
def vtc_bound(max_input: int, max_batch_tokens: int, w_input: float = 1.0, w_output: float = 2.0) -> float:
    """Thm 4.4: 2 * U_vtc, U_vtc = max(w_p * L_input, w_q * M)."""
    return 2.0 * max(w_input * max_input, w_output * max_batch_tokens)


def dlpm_bound(max_input: int, max_output_charge: int, quantum: float, w_extend: float = 1.0, w_output: float = 2.0) -> float:
    """Thm 4.1 with M_out (§15 Q10): 2 * (U + Q^u), U = w_e * L_input + w_q * M_out,
    where M_out bounds the output tokens a client's running requests can still be charged."""
    return 2.0 * (w_extend * max_input + w_output * max_output_charge + quantum)


def doubleq_bound(workers: int, max_input: int, max_output_charge: int, quantum: float, w_extend: float = 1.0, w_output: float = 2.0) -> float:
    """Thm 5.1: 2 * |W| * (U + Q^u)."""
    return workers * dlpm_bound(max_input, max_output_charge, quantum, w_extend, w_output)


def swarm_bound(
    capacities: Sequence[int],
    max_input: int,
    max_output: int,
    quantum: float,
    *,
    concurrency_cap: int | None = None,
    lease_output: bool = False,
    w_extend: float = 1.0,
    w_output: float = 2.0,
) -> float:
    """§14.8 P1/P2 bound 2 * (U_sw + Q^u) with U_sw = w_e * L_input + w_q * M_out,sw and
    M_out,sw = (sum_k c_k or the per-client cap kappa) * L_output; output charged
    only at lease release adds 2 * w_q * M_out,sw."""
    sessions = sum(capacities) if concurrency_cap is None else concurrency_cap
    m_out = sessions * max_output
    bound = 2.0 * (w_extend * max_input + w_output * m_out + quantum)
    if lease_output:
        bound += 2.0 * w_output * m_out
    return bound
