"""Service time of batching servers: a server's step time as a function of the sessions it holds (issue 19/20).

The paper's model (spec §2.6) gives every job on chain k the same mean service time T_k, whatever else runs on
its servers: a server's sessions never slow each other. Real servers do: petals 2.2 runs the decode steps of
its sessions one after another, and a batching Chainswarm server (``server/batching.py``) runs them in one
forward pass that is slower than one session's step but much faster than b of them. This module states the
model the planner and the simulators share.

**Per server j.** Its published curve gives the per-block time of one decode step of b sessions, t_j(b), at
b ∈ {1, 2, 4, 8, 16}. Normalised, ``g_j(n) = t_j(n)/t_j(1)`` is how much longer each session's decode step
takes when j holds n sessions (:class:`BatchCurve`): piecewise-linear between the published points,
linear past 16 with the last segment's slope; with a batch bound B (``max_batch``) n ≤ B sessions run in one
batch and more run in rounds, ``g(n) = ⌊n/B⌋·g(B) + g(n mod B)``. Special cases: the paper's model is
g ≡ 1 (``batch=None`` on a :class:`planner.model.Server`: today's behaviour); petals 2.2 is g(n) = n
(:meth:`BatchCurve.sequential`).

**Per job on chain k.** Only the decode part of τp_j depends on occupancy (prefill and communication do not):
with ``Server.decode_time_s`` = D_j, the decode share of τp_j (per block, whole job),

    T_k(n) = Σ_{j∈k} [ τc_j + m_kj·(τp_j − D_j + D_j·g_j(n_j)) ] = T_k(1) + Σ_{j∈k} m_kj·D_j·(g_j(n_j) − 1),

where n_j is the number of sessions j holds (on every chain through it). :class:`ChainService` evaluates it.
A job progresses at rate 1/T_k(n(t)) while the occupancy n(t) changes (the simulators,
:mod:`experiments.sim.batch_sim`): processor sharing between the sessions of a server, exactly.

**What the planner uses.** GCA (:mod:`planner.allocation`) rates chain k at the occupancy its capacities imply,
n_j = Σ_{k∋j} c_k — every chain through j full (:func:`capacity_occupancy`): μ_k = 1/T_k(n^cap). For
nondecreasing g this is the slowest T_k can ever be, so μ_k is a lower bound on the chain's rate in every state
and ν = Σ c_k μ_k is the swarm's exact throughput at saturation: λ < ν is the right stability test, and
``Retry-After`` and JFFC's fastest-first order use these rates (conservative: at light load a chain is faster).
The Theorem 3.7-style bounds (:mod:`planner.batch_bounds`, used by the plan and the c tuner) instead rate each
state n at the occupancy that n jobs, placed in dispatch order, imply — so a light load is predicted at the
light-load rates and capacity is charged only when it is used. (``placement="auto"`` scores its candidates
from the chains' rates, i.e. at capacity occupancy: planner/auto.py passes no more than rates.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

BATCH_SIZES = (1, 2, 4, 8, 16)
"""The batch sizes servers profile and publish (per-block decode step time at each)."""

MAX_BATCH_LIMIT = 4096
"""Largest batch bound a profile may declare."""


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class BatchCurve:
    """g(n) = t(n)/t(1): a server's per-session decode step time with n sessions, relative to one session.

    ``factors[i]`` is g at ``sizes[i]`` (``sizes[0] == 1``, ``factors[0] == 1``, both nondecreasing);
    ``max_batch`` is the server's batch bound B (None: unbounded). See the module doc for g between and past
    the points and beyond B.
    """

    factors: tuple[float, ...]
    max_batch: int | None = None
    sizes: tuple[int, ...] = BATCH_SIZES
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # g at integer n, on use

    def __post_init__(self) -> None:
        sizes, factors = tuple(self.sizes), tuple(float(f) for f in self.factors)
        if len(sizes) < 2 or len(sizes) != len(factors) or sizes[0] != 1:
            raise ValueError("a batch curve needs at least two points, the first at batch size 1")
        if any(isinstance(b, bool) or not isinstance(b, int) for b in sizes) or any(
                b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"batch sizes must be increasing integers, got {sizes}")
        for f in factors:
            _number(f, "a batch factor")
        if factors[0] != 1.0:
            raise ValueError("g(1) must be 1 (factors are step times relative to one session)")
        if any(b < a for a, b in zip(factors, factors[1:])):
            raise ValueError(f"batch factors must be nondecreasing, got {factors}")
        if self.max_batch is not None and (isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int)
                                           or not 1 <= self.max_batch <= MAX_BATCH_LIMIT):
            raise ValueError(f"max_batch must be an integer in [1, {MAX_BATCH_LIMIT}], got {self.max_batch!r}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "factors", factors)

    # -- constructors ------------------------------------------------------------------------------------
    @classmethod
    def from_step_times(cls, step_s: Sequence[float], max_batch: int | None = None,
                        sizes: Sequence[int] = BATCH_SIZES) -> "BatchCurve":
        """From measured step times t(b) (any unit) at ``sizes``: g(b) = t(b)/t(1), made nondecreasing
        (a running maximum: a larger batch is never modelled faster than a smaller one)."""
        times = [_number(t, "a step time") for t in step_s]
        if len(times) != len(sizes):
            raise ValueError(f"expected {len(sizes)} step times, got {len(times)}")
        factors, top = [], 0.0
        for t in times:
            top = max(top, t / times[0])
            factors.append(top)
        return cls(tuple(factors), max_batch, tuple(sizes))

    @classmethod
    def sequential(cls, sizes: Sequence[int] = BATCH_SIZES) -> "BatchCurve":
        """petals 2.2 (or ``--max-batch 1``): the steps of n sessions run one after another, g(n) = n."""
        return cls(tuple(float(b) for b in sizes), None, tuple(sizes))

    @classmethod
    def constant(cls, sizes: Sequence[int] = BATCH_SIZES) -> "BatchCurve":
        """The paper's model, g ≡ 1 (sessions never slow each other)."""
        return cls(tuple(1.0 for _ in sizes), None, tuple(sizes))

    # -- evaluation --------------------------------------------------------------------------------------
    def _within(self, n: float) -> float:
        """The curve itself at n ≥ 0: (0, 0), (1, 1), the published points, then the last segment's slope."""
        sizes, factors = self.sizes, self.factors
        if n <= 1.0:
            return max(0.0, n)
        for (a, fa), (b, fb) in zip(zip(sizes, factors), zip(sizes[1:], factors[1:])):
            if n <= b:
                return fa + (fb - fa) * (n - a) / (b - a)
        a, b, fa, fb = sizes[-2], sizes[-1], factors[-2], factors[-1]
        return fb + (fb - fa) * (n - b) / (b - a)

    def __call__(self, n: float) -> float:
        """g(n): 1 for n ≤ 1 (a session pays at least its own step), batches of ``max_batch`` beyond it."""
        value = self._memo.get(n)
        if value is not None:
            return value
        if n <= 1.0:
            value = 1.0
        elif self.max_batch is None or n <= self.max_batch:
            value = self._within(n)
        else:
            rounds, rest = divmod(n, self.max_batch)
            value = rounds * self._within(self.max_batch) + self._within(rest)
        if isinstance(n, int):
            self._memo[n] = value
        return value

    @property
    def is_constant(self) -> bool:
        """g ≡ 1: the paper's model (only when unbounded; a bound makes rounds)."""
        return self.max_batch is None and all(f == 1.0 for f in self.factors)

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "factors": list(self.factors), "max_batch": self.max_batch}

    @classmethod
    def from_dict(cls, doc: Mapping) -> "BatchCurve":
        if not isinstance(doc, Mapping):
            raise ValueError("a batch curve must be an object")
        return cls(tuple(doc.get("factors", ())), doc.get("max_batch"), tuple(doc.get("sizes", BATCH_SIZES)))


@dataclass(frozen=True)
class ChainService:
    """T_k(n) of one chain (or a request's path): ``solo`` = T_k(1) plus the occupancy-dependent terms.

    ``servers[i]`` is a server index (into the swarm's servers) with a batch curve, ``weights[i]`` = m_kj·D_j
    its blocks times its decode share, ``curves[i]`` its g. Servers without a curve (g ≡ 1) are in ``solo``
    only, so a chain of such servers takes exactly ``solo`` whatever the occupancy.
    """

    solo: float
    servers: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    curves: tuple[BatchCurve, ...] = ()

    @property
    def batched(self) -> bool:
        """Some server's sessions slow each other (T_k depends on occupancy)."""
        return bool(self.servers)

    def time(self, occupancy: Sequence[float] | Mapping[int, float]) -> float:
        """T_k(n) with ``occupancy[j]`` = sessions server j holds (the job itself included)."""
        extra = 0.0
        for j, w, g in zip(self.servers, self.weights, self.curves):
            extra += w * (g(occupancy[j]) - 1.0)
        return self.solo + extra


def path_service(servers: Sequence, hops: Sequence[int], blocks: Sequence[int], solo: float) -> ChainService:
    """The :class:`ChainService` of a path through ``servers[hops[i]]`` processing ``blocks[i]`` blocks each,
    whose time alone is ``solo`` (computed by the caller exactly as it always was)."""
    terms = [(j, m * servers[j].decode_time_s, servers[j].batch) for j, m in zip(hops, blocks)
             if servers[j].batch is not None and not servers[j].batch.is_constant and servers[j].decode_time_s > 0]
    return ChainService(float(solo), tuple(j for j, _, _ in terms), tuple(w for _, w, _ in terms),
                        tuple(g for _, _, g in terms))


def chain_services(chains: Iterable, servers: Sequence) -> list[ChainService]:
    """:class:`ChainService` of planner chains (``.servers`` ids, ``.spans``; T_k(1) = ``solo_time`` if set,
    else ``service_time``) over the swarm's ``servers`` (planner :class:`~planner.model.Server`)."""
    index = {s.id: i for i, s in enumerate(servers)}
    out = []
    for ch in chains:
        solo = getattr(ch, "solo_time", None)
        out.append(path_service(servers, [index[sid] for sid in ch.servers], [e - s for s, e in ch.spans],
                                ch.service_time if solo is None else solo))
    return out


def capacity_occupancy(paths: Sequence[Sequence[int]], capacities: Sequence[int], num_servers: int) -> list[int]:
    """n_j = Σ_{k∋j} c_k: the sessions each server holds when every chain is full (see the module doc)."""
    held = [0] * num_servers
    for path, cap in zip(paths, capacities):
        for j in path:
            held[j] += int(cap)
    return held


_LAST_CHECKED: list = [None, False]  # the last swarm checked by has_batching and its answer (the tuner's hot path)


def has_batching(servers: Sequence) -> bool:
    """Does any server's occupancy change its service time (a non-constant curve and a decode share)?

    The answer for the same tuple is remembered (GCA asks once per candidate placement)."""
    if _LAST_CHECKED[0] is servers:
        return _LAST_CHECKED[1]
    answer = any(s.batch is not None and not s.batch.is_constant and s.decode_time_s > 0 for s in servers)
    if isinstance(servers, tuple):
        _LAST_CHECKED[:] = [servers, answer]
    return answer
