"""The fastest chain any placement can form, exactly (issue 20: the lower bound behind placement="auto").

A chain is a set of servers that process consecutive parts of blocks 0..L−1; server j processing m_j
blocks costs τc_j + τp_j·m_j (eq. 2), so the chain time T = Σ_j (τc_j + τp_j·m_j) does not depend on
the order of its servers. To process m_j blocks for ``sessions`` concurrent jobs, j must host at least
those m_j blocks and hold m_j cache slots per job: m_j·(s_m + sessions·s_c) ≤ M_j, i.e. m_j ≤ m_j(sessions)
of eq. (8). Hence

    T_min(sessions) = min Σ_{j∈S} (τc_j + τp_j·m_j)  s.t.  Σ_{j∈S} m_j = L,  1 ≤ m_j ≤ m_j(sessions),

a knapsack over the servers solved exactly by dynamic programming over block counts (a shortest path
over the block boundaries 0..L, each server usable once): F_j(b) = min(F_{j−1}(b), min_m F_{j−1}(b − m)
+ τc_j + τp_j·m). Every job of every placement runs on some chain, so with sessions = 1 no job of any
placement can be served faster than T_min(1) (its size times T_min(1) in the simulator's model).

Pure (numpy only); O(J·L·max_j m_j) vectorized per server.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from planner.model import ModelSpec, Server, Span, validate_servers
from planner.placement import SwarmArrays


@dataclass(frozen=True)
class FastestChain:
    """T_min and one chain reaching it."""

    time: float
    """T_min (s); +inf when the servers cannot cover the model."""
    parts: tuple[tuple[int, int], ...]
    """(server index, blocks processed), in server index order; empty when time is inf."""

    def spans(self) -> tuple[tuple[int, Span], ...]:
        """Consecutive processed spans covering [0, L): the parts in the given order, largest first
        (ties by index), as (server index, span)."""
        out, start = [], 0
        for j, m in sorted(self.parts, key=lambda p: (-p[1], p[0])):
            out.append((j, (start, start + m)))
            start += m
        return tuple(out)


def fastest_chain(model: ModelSpec, servers: Sequence[Server], sessions: int = 1, *,
                  arrays: SwarmArrays | None = None, allowed: np.ndarray | None = None) -> FastestChain:
    """The fastest chain whose servers hold cache for ``sessions`` concurrent jobs on every block they
    process (see the module docstring); ``allowed`` (bool per server) restricts the servers used."""
    if sessions < 1:
        raise ValueError("sessions must be >= 1")
    arrays = arrays or SwarmArrays(model, validate_servers(servers))
    caps = arrays.max_blocks(int(sessions))
    return fastest_chain_caps(arrays, caps if allowed is None else np.where(allowed, caps, 0))


def fastest_chain_caps(arrays: SwarmArrays, caps: np.ndarray) -> FastestChain:
    """T_min over servers that may process at most ``caps[j]`` blocks each (0: unused)."""
    L = arrays.num_blocks
    idx = np.flatnonzero(caps > 0)
    f = np.full(L + 1, np.inf)
    f[0] = 0.0
    choice = np.zeros((idx.size, L + 1), dtype=np.int64)
    x = np.arange(L + 1, dtype=np.float64)
    for r, j in enumerate(idx.tolist()):
        cap = int(caps[j])
        a, b = float(arrays.comm[j]), float(arrays.compute[j])
        # F(x) = min(F(x), a + b·x + min_{x−cap ≤ y ≤ x−1} (F(y) − b·y));
        # windows[x] holds y = x−cap .. x−1
        h = np.concatenate((np.full(cap, np.inf), f - b * x))
        windows = sliding_window_view(h, cap)[: L + 1]
        k = cap - 1 - np.argmin(windows[:, ::-1], axis=1)  # the largest y on ties: the fewest blocks
        via = a + b * x + windows[np.arange(L + 1), k]
        better = via < f
        f = np.where(better, via, f)
        choice[r] = np.where(better, cap - k, 0)
    if not math.isfinite(f[L]):
        return FastestChain(math.inf, ())
    parts, left = [], L
    for r in range(idx.size - 1, -1, -1):
        m = int(choice[r, left])
        if m:
            parts.append((int(idx[r]), m))
            left -= m
    return FastestChain(float(f[L]), tuple(sorted(parts)))
