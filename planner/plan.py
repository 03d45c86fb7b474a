"""The planner facade: one call from a swarm description to everything the runtime needs (spec §6.7).

    plan(model, servers, arrival_rate) -> Plan

runs the chosen placement (GBP-CR with c tuned by the Theorem 3.7 lower bound by default), GCA over it,
and the Theorem 3.7 bounds at the planning λ. ``Plan.to_dict()`` is exactly the JSON printed by
``chainswarm plan --json``. ``Plan.dispatcher()`` builds the online JFFC dispatcher over its chains.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from planner.allocation import Allocation, gca
from planner.auto import auto_placement
from planner.baselines import bprr_reservation, cg_bp, petals_placement, random_order, whole_model_placement
from planner.batch_bounds import allocation_bounds
from planner.bounds import ResponseTimeBounds
from planner.dispatch import Dispatcher, make_dispatcher
from planner.model import Chain, ModelSpec, Placement, Server, Span, validate_servers
from planner.placement import DEFAULT_TARGET_LOAD, SwarmArrays, validate_load
from planner.service_model import BatchCurve
from planner.tuning import TUNINGS, Candidate, InfeasibleError, evaluate_c, tune_c

PLACEMENTS = ("gbp-cr", "petals", "bprr", "whole-model", "random", "auto")


@dataclass(frozen=True)
class ServerPlan:
    """One server's part of the plan: its hosted span and its KV-slot accounting."""

    id: str
    span: Span | None
    """0-based half-open hosted blocks [a_j − 1, a_j − 1 + m_j), or None if unused."""
    slots_total: int
    """M̃_j = ⌊(M_j − s_m·m_j)/s_c⌋ (for PETALS: its fixed pool)."""
    slots_allocated: int
    """Σ over chains k through j of c_k·m_ij: the KV slots the server must configure."""

    @property
    def start(self) -> int | None:
        return None if self.span is None else self.span[0]

    @property
    def end(self) -> int | None:
        return None if self.span is None else self.span[1]

    @property
    def slots_free(self) -> int:
        """Slots left after allocation."""
        return self.slots_total - self.slots_allocated

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "start": self.start,
            "end": self.end,
            "slots_free": self.slots_free,
            "slots_allocated": self.slots_allocated,
        }


def chain_to_dict(chain: Chain) -> dict[str, Any]:
    """A chain as JSON; with batching servers also ``solo_time``, T_k(1) (``service_time`` is T_k(n^cap))."""
    doc = {
        "servers": list(chain.servers),
        "spans": [list(span) for span in chain.spans],
        "capacity": chain.capacity,
        "service_time": chain.service_time,
        "rate": chain.rate,
    }
    if chain.solo_time is not None:
        doc["solo_time"] = chain.solo_time
    return doc


@dataclass(frozen=True)
class Plan:
    """The planner's output contract (§6.7)."""

    model: ModelSpec
    placement_method: str
    """One of PLACEMENTS."""
    c: int | None
    """The cache reservation used (R for BPRR); None for placements without one (PETALS, whole-model)."""
    tuning: str | None
    """How c was chosen: "lower-bound", "surrogate", "upper-bound", "fixed", "bprr-heuristic",
    "auto: <candidate>" or None."""
    candidates: tuple[Candidate, ...]
    """The c-tuning table (one row for a fixed c; empty when there is no c)."""
    placement: Placement
    servers: tuple[ServerPlan, ...]
    """Per server, in input order."""
    chains: tuple[Chain, ...]
    """GCA's chains, fastest first: index 0 is JFFC's first choice."""
    arrival_rate: float
    target_load: float
    bounds: ResponseTimeBounds | None
    """Theorem 3.7 bounds at ``arrival_rate``; None when λ ≥ ν (overloaded)."""

    @property
    def total_rate(self) -> float:
        """ν = Σ c_k/T_k (eq. 4)."""
        return sum(ch.capacity * ch.rate for ch in self.chains)

    @property
    def total_capacity(self) -> int:
        """C = Σ c_k."""
        return sum(ch.capacity for ch in self.chains)

    @property
    def overloaded(self) -> bool:
        """λ ≥ ν: no stable operation at the planning arrival rate."""
        return self.bounds is None

    def dispatcher(self, policy: str = "jffc", *, seed: int = 0) -> Dispatcher:
        """A fresh online dispatcher (default JFFC) over this plan's chains; chain index = ``chains`` index."""
        return make_dispatcher(
            policy, [ch.rate for ch in self.chains], [ch.capacity for ch in self.chains], seed=seed
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``chainswarm plan --json`` document (JSON-safe: no NaN/inf, ∞ is null)."""
        return {
            "c": self.c,
            "tuning": self.tuning,
            "candidates": [cand.to_dict() for cand in self.candidates],
            "servers": [s.to_dict() for s in self.servers],
            "chains": [chain_to_dict(ch) for ch in self.chains],
            "total_rate": self.total_rate,
            "total_capacity": self.total_capacity,
            "bounds": None
            if self.bounds is None
            else {"lower": self.bounds.lower, "upper": self.bounds.upper},
        }


def plan(
    model: ModelSpec,
    servers: Sequence[Server],
    arrival_rate: float,
    *,
    target_load: float | None = None,
    c: int | None = None,
    tuning: str = "lower-bound",
    placement: str = "gbp-cr",
    seed: int = 0,
    min_c: int = 1,
) -> Plan:
    """Plan a swarm: placement, chains with capacities (GCA), and the Theorem 3.7 bounds.

    * ``placement="gbp-cr"`` (default): GBP-CR with ``c`` fixed, or tuned over [c_max] by ``tuning`` ∈
      {"lower-bound" (default), "surrogate", "upper-bound"}, over the c whose chains include one of capacity ≥
      ``min_c`` where any does (:func:`planner.tuning.tune_c`).
    * ``"random"``: GBP-CR's loop over a ``seed``-ed random server order (§12.5), same c handling.
    * ``"petals"``: petals 2.2 block selection in input order; GCA limited to each server's fixed pool.
    * ``"bprr"``: CG-BP with R = ``c`` or the §12.2 heuristic.
    * ``"whole-model"``: every server that can hosts all blocks ("JFFC only").
    * ``"auto"``: the candidate (GBP-CR for every c, hop-min, PETALS-style, whole-model, local-search
      moves) with the lowest predicted mean response time (:mod:`planner.auto`); ``tuning`` reads
      ``"auto: <winning candidate>"``.

    ``target_load`` ρ̄ defaults to 0.7. Raises ValueError on bad input and InfeasibleError (a ValueError)
    when no chain can be formed.
    """
    servers = validate_servers(servers)
    rho = DEFAULT_TARGET_LOAD if target_load is None else target_load
    validate_load(arrival_rate, rho)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if tuning not in TUNINGS:
        raise ValueError(f"tuning must be one of {', '.join(TUNINGS)}, got {tuning!r}")
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
        raise ValueError(f"c must be an integer >= 1, got {c!r}")

    candidates: tuple[Candidate, ...] = ()
    chosen_c: int | None = None
    how: str | None = None
    if placement in ("gbp-cr", "random"):
        order = None if placement == "gbp-cr" else random_order(seed)
        arrays = SwarmArrays(model, servers)
        if c is None:
            result = tune_c(model, servers, arrival_rate, rho, tuning=tuning, order=order, arrays=arrays,
                            min_c=min_c)
        else:
            result = evaluate_c(model, servers, c, arrival_rate, rho, order=order, arrays=arrays)
        chosen_c, how, candidates = result.c, result.tuning, result.candidates
        layout, allocation = result.gbp_cr.placement, result.allocation
    elif placement == "bprr":
        chosen_c = c if c is not None else bprr_reservation(model, servers, arrival_rate)
        how = "fixed" if c is not None else "bprr-heuristic"
        layout = cg_bp(model, servers, chosen_c).placement
        allocation = gca(model, servers, layout)
    elif placement == "auto":
        _no_c(c, placement)
        best = auto_placement(model, servers, arrival_rate, rho).best
        chosen_c, how = best.c, f"auto: {best.label}"
        layout, allocation = best.placement, best.allocation
    elif placement == "petals":
        _no_c(c, placement)
        petals = petals_placement(model, servers)
        layout = petals.placement
        allocation = gca(model, servers, layout, slot_budget=petals.slot_pool)
    else:
        _no_c(c, placement)
        layout = whole_model_placement(model, servers)
        allocation = gca(model, servers, layout)
    if not allocation.chains:
        raise InfeasibleError(f"the {placement} placement forms no complete chain with a free cache slot")
    return _assemble(model, servers, placement, chosen_c, how, candidates, layout, allocation, arrival_rate, rho)


def plan_for_placement(
    model: ModelSpec,
    servers: Sequence[Server],
    placement: Placement,
    arrival_rate: float,
    *,
    target_load: float | None = None,
    method: str = "kept",
    c: int | None = None,
) -> Plan:
    """GCA and the bounds over a *given* placement (no block moves): what a running swarm can do with
    the ranges its servers already hold. Used to rebuild chains at once when a server vanishes, and to
    decide whether a fresh plan is worth moving blocks for.

    Raises ValueError if a server's blocks no longer fit its memory and InfeasibleError when the
    placement forms no complete chain.
    """
    servers = validate_servers(servers)
    rho = DEFAULT_TARGET_LOAD if target_load is None else target_load
    validate_load(arrival_rate, rho)
    allocation = gca(model, servers, placement)
    if not allocation.chains:
        raise InfeasibleError("the current placement forms no complete chain with a free cache slot")
    return _assemble(model, servers, method, c, "kept" if c is not None else None, (), placement, allocation,
                     arrival_rate, rho)


def _no_c(c: int | None, placement: str) -> None:
    if c is not None:
        raise ValueError(f"--c does not apply to the {placement} placement")


def _assemble(
    model: ModelSpec,
    servers: Sequence[Server],
    method: str,
    c: int | None,
    tuning: str | None,
    candidates: tuple[Candidate, ...],
    layout: Placement,
    allocation: Allocation,
    arrival_rate: float,
    target_load: float,
) -> Plan:
    per_server = tuple(
        ServerPlan(s.id, layout.spans[i], allocation.slots_total[i], allocation.slots_allocated[i])
        for i, s in enumerate(servers)
    )
    bounds = allocation_bounds(allocation.chains, servers, arrival_rate)
    return Plan(
        model=model,
        placement_method=method,
        c=c,
        tuning=tuning,
        candidates=candidates,
        placement=layout,
        servers=per_server,
        chains=allocation.chains,
        arrival_rate=arrival_rate,
        target_load=target_load,
        bounds=bounds,
    )


def parse_swarm(doc: Mapping[str, Any]) -> tuple[ModelSpec, tuple[Server, ...], float, float]:
    """Parse the swarm document of ``chainswarm plan --swarm`` (already JSON-decoded).

    ``{"model": {"num_blocks", "block_size_gb", "cache_slot_gb"}, "servers": [{"id", "memory_gb",
    "comm_time_s", "compute_time_s"}, ...], "arrival_rate", "target_load"}``; ``target_load`` is optional
    (default 0.7), and so is a batching server's ``"decode_time_s"`` (D_j) with its ``"batch": {"factors",
    "max_batch", "sizes"}`` (:class:`planner.service_model.BatchCurve`). Returns (model, servers, arrival_rate, target_load); raises ValueError with a one-line
    message on any problem.
    """
    if not isinstance(doc, Mapping):
        raise ValueError("the swarm file must hold a JSON object")
    model_doc = _field(doc, "model", "swarm")
    if not isinstance(model_doc, Mapping):
        raise ValueError("'model' must be an object")
    num_blocks = _field(model_doc, "num_blocks", "model")
    if isinstance(num_blocks, float) and num_blocks.is_integer():
        num_blocks = int(num_blocks)
    model = ModelSpec(
        num_blocks=num_blocks,
        block_size_gb=_field(model_doc, "block_size_gb", "model"),
        cache_slot_gb=_field(model_doc, "cache_slot_gb", "model"),
    )
    server_docs = _field(doc, "servers", "swarm")
    if not isinstance(server_docs, list) or not server_docs:
        raise ValueError("'servers' must be a non-empty list")
    servers = []
    for n, sdoc in enumerate(server_docs):
        where = f"servers[{n}]"
        if not isinstance(sdoc, Mapping):
            raise ValueError(f"{where} must be an object")
        sid = _field(sdoc, "id", where)
        if isinstance(sid, bool) or not isinstance(sid, (str, int)):
            raise ValueError(f"{where}.id must be a string")
        batch = sdoc.get("batch")
        try:
            curve = None if batch is None else BatchCurve.from_dict(batch)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}.batch: {exc}") from None
        servers.append(
            Server(
                id=str(sid),
                memory_gb=_field(sdoc, "memory_gb", where),
                comm_time_s=_field(sdoc, "comm_time_s", where),
                compute_time_s=_field(sdoc, "compute_time_s", where),
                decode_time_s=sdoc.get("decode_time_s", 0.0),
                batch=curve,
            )
        )
    arrival_rate = _field(doc, "arrival_rate", "swarm")
    target_load = doc.get("target_load", DEFAULT_TARGET_LOAD)
    validate_load(arrival_rate, target_load)
    return model, validate_servers(servers), float(arrival_rate), float(target_load)


def _field(doc: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in doc:
        raise ValueError(f"missing field '{key}' in {where}")
    return doc[key]
