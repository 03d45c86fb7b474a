"""From measured server profiles to a plan, assignments and routable chains (no I/O).

The orchestrator turns each server's per-token measurements into the planner's per-job times with its
expected request lengths (chain-composition spec §2.7 footnote 11 and §10.2):

    τp_j = t_o + prefill_s·l̄_I + decode_s·(l̄_O − 1)        τc_j = l̄_O·(RTT_j + per-hop overhead)

and, from a server's published batch curve (``ServerProfile.batch_step_s``), the decode share
D_j = decode_s·(l̄_O − 1) of τp_j and g_j (:mod:`planner.service_model`: GCA then rates each chain at the
occupancy its capacities imply); servers without a curve are planned with g ≡ 1. It
runs the planner (GBP-CR with c tuned by the Theorem 3.7 lower bound, then GCA, by default), and keeps
plans stable: when membership changes it compares the best fresh plan with GCA over the *current*
placement (restricted to the servers still present) and keeps the current block ranges unless the fresh
plan is better by more than a tolerance — so servers reload only when it pays off, and a vanished server
only costs a GCA rebuild.
"""
from __future__ import annotations

import contextlib
import math
import uuid
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from planner.model import ModelSpec, Placement, Server, free_slots, largest_capacity
from planner.plan import Plan, plan, plan_for_placement
from planner.replan import incremental_replan
from planner.standby import add_standby_chains
from planner.tuning import InfeasibleError
from swarm.control.options import OrchestratorOptions
from swarm.trust.records import SERVING, Assignment, ServerProfile

BYTES_PER_GB = 10**9
KV_PAGE = 16  # tokens: the unit a session's KV reservation is rounded up to (token admission)


@dataclass(frozen=True)
class Expectations:
    """What the orchestrator plans for: request lengths, arrival rate and planner settings (the planner
    settings' defaults are the options', :class:`swarm.control.options.OrchestratorOptions`)."""

    max_length: int  # tokens per session (prompt + output); one KV slot holds this many tokens
    input_tokens: float  # l̄_I, mean prompt length
    output_tokens: float  # l̄_O, mean generated tokens
    arrival_rate: float  # λ, requests per second
    target_load: float = OrchestratorOptions.target_load  # ρ̄
    hop_overhead_s: float = 0.018  # per relayed round trip (petals' per-hop serialisation constant)
    block_overhead_s: float = 0.001  # t_o, per block per job
    placement: str = OrchestratorOptions.placement
    tuning: str = OrchestratorOptions.tuning
    c: int | None = OrchestratorOptions.c
    replan_tolerance: float = OrchestratorOptions.replan_tolerance  # keep ranges unless a fresh plan is better
    prefix_cache_tokens: int = OrchestratorOptions.prefix_cache_tokens  # prefix store per served block, tokens
    standby_chains: int = OrchestratorOptions.standby_chains  # extra chains on idle servers (-1: all they form)
    kv_admission: str = OrchestratorOptions.kv_admission  # "tokens": sessions reserve their own need; "slots"

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"the session length (--max-length) must be at least 2 tokens, got {self.max_length}")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError("the expected lengths (--expected-input-tokens, --expected-output-tokens) must be at "
                             f"least 1 token, got {self.input_tokens:g} and {self.output_tokens:g}")
        if self.input_tokens + self.output_tokens > self.max_length:
            raise ValueError("expected input + output tokens exceed max_length")
        if self.arrival_rate <= 0:
            raise ValueError("the expected arrival rate must be > 0")
        if self.prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be >= 0")
        if self.kv_admission not in ("tokens", "slots"):
            raise ValueError(f"kv_admission must be tokens or slots, got {self.kv_admission!r}")

    @property
    def slot_tokens(self) -> int:
        """Tokens one planned KV slot holds: the expected session l̄_I + l̄_O in whole pages (token admission; a
        session then takes its own need of its chain's c_k·slot_tokens budget), or ``max_length`` (slots)."""
        if self.kv_admission == "slots":
            return self.max_length
        expected = -(-int(math.ceil(self.input_tokens + self.output_tokens)) // KV_PAGE) * KV_PAGE
        return min(self.max_length, max(KV_PAGE, expected))

    @property
    def min_c(self) -> int:
        """c_min: the slots one chain needs for a ``max_length`` session, ⌈max_length / slot_tokens⌉ (1 with
        slots). The planner prefers plans (and values of c) with a chain of c_k ≥ c_min, so
        that a request the swarm allows is never refused for want of a chain that can hold it."""
        return -(-self.max_length // self.slot_tokens)

    def kv_need(self, input_tokens: int, max_new_tokens: int) -> int:
        """KV tokens a session of this prompt and output cap reserves on every block it runs on."""
        if self.kv_admission == "slots":
            return self.max_length
        return min(self.max_length, -(-max(1, input_tokens + max_new_tokens) // KV_PAGE) * KV_PAGE)


def expectations(options: OrchestratorOptions, model_config) -> Expectations:
    """What an orchestrator with these options plans for on this model (a transformers config): the session
    length defaults to the model's context, at most 2,048 tokens; the mean request lengths follow the Azure code
    trace (2,048 input / 28 output tokens), clipped to the session length."""
    def given(value, default):  # a 0 given is refused by Expectations, not read as "the default"
        return default if value is None else value

    max_length = given(options.max_length, min(getattr(model_config, "max_position_embeddings", 2048), 2048))
    output_tokens = given(options.expected_output_tokens, min(28.0, max(1.0, max_length / 8)))
    input_tokens = given(options.expected_input_tokens, min(2048.0, max(1.0, max_length / 2)))
    return Expectations(
        max_length=max_length, input_tokens=input_tokens, output_tokens=output_tokens,
        arrival_rate=options.expected_rate, target_load=options.target_load, placement=options.placement,
        tuning=options.tuning, c=options.c, replan_tolerance=options.replan_tolerance,
        prefix_cache_tokens=options.prefix_cache_tokens, standby_chains=options.standby_chains,
        kv_admission=options.kv_admission,
    )


def planner_inputs(
    profiles: Sequence[ServerProfile], num_blocks: int, expect: Expectations
) -> tuple[ModelSpec, list[Server]]:
    """The planner's model and servers for these profiles (servers sorted by node id, deterministic)."""
    if not profiles:
        raise InfeasibleError("no servers have joined the swarm yet")
    # The prefix store takes prefix_cache_tokens of KV on every block a server holds: charging it to the block
    # size makes the planner count session slots only in the memory that is left, so sessions keep them.
    block_bytes = max(p.block_bytes + p.cache_bytes_per_token * expect.prefix_cache_tokens for p in profiles)
    slot_bytes = max(p.cache_bytes_per_token for p in profiles) * expect.slot_tokens
    model = ModelSpec(num_blocks, block_bytes / BYTES_PER_GB, slot_bytes / BYTES_PER_GB)
    servers = []
    for p in sorted(profiles, key=lambda p: p.node_id):
        rtt = p.rtt_s or 0.0
        decode = p.decode_s * (expect.output_tokens - 1)
        servers.append(Server(
            id=p.node_id,
            memory_gb=p.memory_bytes / BYTES_PER_GB,
            comm_time_s=expect.output_tokens * (rtt + expect.hop_overhead_s),
            compute_time_s=expect.block_overhead_s + p.prefill_s * expect.input_tokens + decode,
            decode_time_s=decode,
            batch=p.batch_curve(),
        ))
    return model, servers


def swarm_document(profiles: Sequence[ServerProfile], num_blocks: int, expect: Expectations) -> dict:
    """The planner input for these profiles as a ``chainswarm plan --swarm`` JSON document."""
    model, servers = planner_inputs(profiles, num_blocks, expect)
    return {
        "model": {"num_blocks": model.num_blocks, "block_size_gb": model.block_size_gb,
                  "cache_slot_gb": model.cache_slot_gb},
        "servers": [{"id": s.id, "memory_gb": s.memory_gb, "comm_time_s": s.comm_time_s,
                     "compute_time_s": s.compute_time_s,
                     **({} if s.batch is None else {"decode_time_s": s.decode_time_s, "batch": s.batch.to_dict()})}
                    for s in servers],
        "arrival_rate": expect.arrival_rate,
        "target_load": expect.target_load,
    }


def objective(p: Plan) -> float:
    """Lower is better: the Theorem 3.7 lower bound on mean response time, or 1/ν when overloaded."""
    if p.bounds is not None:
        return p.bounds.lower
    return math.inf if p.total_rate <= 0 else 1e9 / p.total_rate


def holds_longest(p: Plan, expect: Expectations) -> bool:
    """Some chain of ``p`` can hold a ``max_length`` session: c_k ≥ c_min (its budget c_k · slot_tokens)."""
    return largest_capacity(p.chains) >= expect.min_c


def choose_plan(
    profiles: Sequence[ServerProfile], num_blocks: int, expect: Expectations, current: Plan | None
) -> tuple[Plan, bool]:
    """The plan to run for ``profiles``; the flag says whether block ranges were kept from ``current``.

    A plan with a chain that holds a ``max_length`` session (:func:`holds_longest`) is preferred to one without:
    GBP-CR tunes c over the values whose chains hold it, kept ranges must hold it to be kept, and ``auto`` falls back to GBP-CR
    when its own choice does not (a baseline placement, ``petals``, ``bprr`` or ``whole-model``, and a fixed
    ``c`` are run as asked). When the servers' memory allows none, the best plan is run and the orchestrator
    warns. Raises InfeasibleError (a ValueError) when these servers cannot form a single chain.
    """
    model, servers = planner_inputs(profiles, num_blocks, expect)
    chosen, kept = _choose(model, servers, expect, current)
    if not holds_longest(chosen, expect) and expect.c is None and expect.placement == "auto":
        with contextlib.suppress(InfeasibleError):  # GBP-CR tuned over [c_min, c_max] may hold it
            fallback = plan(model, servers, expect.arrival_rate, target_load=expect.target_load,
                            tuning=expect.tuning, min_c=expect.min_c)
            if holds_longest(fallback, expect):
                chosen, kept = fallback, False
    if expect.standby_chains == 0:
        return chosen, kept
    placement = add_standby_chains(model, servers, chosen.placement,
                                   max_chains=None if expect.standby_chains < 0 else expect.standby_chains)
    if placement == chosen.placement:
        return chosen, kept
    with_standby = plan_for_placement(model, servers, placement, expect.arrival_rate,
                                      target_load=expect.target_load, method=chosen.placement_method)
    if holds_longest(chosen, expect) and not holds_longest(with_standby, expect):
        return chosen, kept
    return replace(with_standby, c=chosen.c, tuning=chosen.tuning, candidates=chosen.candidates), kept


def _choose(model, servers, expect: Expectations, current: Plan | None) -> tuple[Plan, bool]:
    """The plan by the placement method (before standby chains), and whether it kept ``current``'s ranges."""
    if current is not None and expect.placement == "auto":
        return _incremental(model, servers, expect, current)
    try:
        fresh = plan(model, servers, expect.arrival_rate, target_load=expect.target_load,
                     c=expect.c, tuning=expect.tuning, placement=expect.placement, min_c=expect.min_c)
    except InfeasibleError as exc:
        fresh, infeasible = None, exc
    kept = None
    if current is not None:
        old_spans = {sp.id: sp.span for sp in current.servers}
        layouts = [tuple(old_spans.get(s.id) for s in servers)]
        # servers that hold nothing now (a joiner, a rejoiner, an idle one) take ranges where that is better: it
        # moves nobody. Their ranges in the fresh plan, or, for those the fresh plan puts to use, ranges planned
        # for them alone (chains of their own): the fresh plan's ranges may only duplicate the kept ones (two
        # rejoiners whose old partners now form one chain together got the second half twice, and the swarm
        # stayed at one chain for good)
        choices, used = [], set()
        if fresh is not None:
            choices, used = [fresh], {sp.id for sp in fresh.servers if sp.span}
        idle = [s for s in servers if old_spans.get(s.id) is None and s.id in used]
        if idle and len(idle) < len(servers):
            with contextlib.suppress(InfeasibleError, ValueError):
                choices.append(plan(model, idle, expect.arrival_rate, target_load=expect.target_load, c=expect.c,
                                    tuning=expect.tuning, placement=expect.placement, min_c=expect.min_c))
        for choice in choices:
            new_spans = {sp.id: sp.span for sp in choice.servers}
            layouts.append(tuple(old_spans.get(s.id) or new_spans.get(s.id) for s in servers))
        for layout in dict.fromkeys(layouts):
            try:
                candidate = plan_for_placement(model, servers, Placement(layout), expect.arrival_rate,
                                               target_load=expect.target_load, method=current.placement_method)
            except ValueError:  # the old ranges no longer fit (memory changed) or form no chain
                continue
            if kept is None or objective(candidate) < objective(kept):
                kept = candidate
    if fresh is None:
        if kept is not None:
            return kept, True
        raise infeasible
    if kept is not None and (holds_longest(kept, expect) or not holds_longest(fresh, expect)) \
            and objective(kept) <= objective(fresh) * (1 + expect.replan_tolerance):
        return kept, True
    return fresh, False


def _incremental(model, servers, expect: Expectations, current: Plan) -> tuple[Plan, bool]:
    """``--placement auto`` after the first plan: planner.replan's incremental re-plan (keep the survivors' spans,
    repair the chains that lost servers from idle ones, a fresh auto plan only when it is clearly better by
    ``replan_tolerance`` and the swarm keeps serving while it loads)."""
    spans = {sp.id: sp.span for sp in current.servers}
    step = incremental_replan(model, servers, spans, current.chains, expect.arrival_rate, expect.target_load,
                              tolerance=expect.replan_tolerance)
    if not step.allocation.chains:
        raise InfeasibleError("these servers cannot form a single chain")
    chosen = plan_for_placement(model, servers, step.placement, expect.arrival_rate, target_load=expect.target_load,
                                method="auto")
    return replace(chosen, tuning=f"auto: incremental ({step.strategy})"), step.strategy == "kept"


def composer(profiles: Sequence[ServerProfile], num_blocks: int, expect: Expectations, method: str = "kept"):
    """GCA over a given placement of these servers, ``{node: (start, end) or None} -> Plan or None`` (None when
    it forms no chain): the chains a swarm in the middle of a re-plan can route on (:mod:`swarm.control.transition`)."""
    model, servers = planner_inputs(profiles, num_blocks, expect)

    def compose(spans: Mapping[str, tuple[int, int] | None]) -> Plan | None:
        layout = Placement(tuple(spans.get(s.id) for s in servers))
        try:
            return plan_for_placement(model, servers, layout, expect.arrival_rate, target_load=expect.target_load,
                                      method=method)
        except ValueError:  # no complete chain (InfeasibleError), or a range that no longer fits
            return None

    return compose


def new_plan_id() -> str:
    return uuid.uuid4().hex[:12]


def memory_slots(p: Plan, model: ModelSpec, servers: Sequence[Server]) -> dict[str, int]:
    """Block-slots each server of the plan holds when it fills its memory with KV: M̃_j = ⌊(M_j − s_m·m_j)/s_c⌋
    (what a router that does not use GCA's chain capacities, BPRR's WS-RR, lets a server keep)."""
    by_id = {s.id: s for s in servers}
    return {sp.id: max(0, free_slots(by_id[sp.id], model, sp.span[1] - sp.span[0]))
            for sp in p.servers if sp.span is not None and sp.id in by_id}


def assignments_for(p: Plan, plan_id: str, max_length: int, prefix_cache_tokens: int = 0,
                    slots: Mapping[str, int] | None = None, slot_tokens: int = 0) -> dict[str, Assignment]:
    """One Assignment per server of the plan (servers without blocks get an empty range).

    ``cache_slots`` is the planner's block-slot count Σ_k c_k·m_ij: petals keeps one KV pool per server,
    shared by its blocks, so exactly that many slots of ``slot_tokens`` tokens (0: ``max_length``) serve every
    chain through it; ``max_length`` is the longest session allowed.
    ``prefix_cache_tokens`` (per block) is the prefix store's budget, already reserved by :func:`planner_inputs`.
    ``slots`` overrides the block-slots per server (see :func:`memory_slots`).
    """
    result = {}
    for sp in p.servers:
        if sp.span is None:
            result[sp.id] = Assignment(plan_id, 0, 0, 0, max_length, slot_tokens=slot_tokens)
        else:
            result[sp.id] = Assignment(plan_id, sp.span[0], sp.span[1],
                                       sp.slots_allocated if slots is None else slots.get(sp.id, sp.slots_allocated),
                                       max_length, prefix_cache_tokens, slot_tokens=slot_tokens)
    return result


def server_matches(profile: ServerProfile | None, assignment: Assignment) -> bool:
    """True when a server serves what it was assigned (range, and at least the assigned KV slots)."""
    return (
        profile is not None
        and profile.state == SERVING
        and (profile.start, profile.end) == (assignment.start, assignment.end)
        and profile.cache_slots >= assignment.cache_slots
    )


@dataclass(frozen=True)
class RoutableChain:
    """A chain of the plan, with the petals peer of each hop."""

    chain_id: str
    index: int  # position in the plan (0 = fastest)
    servers: tuple[str, ...]  # node ids
    spans: tuple[tuple[int, int], ...]
    capacity: int
    service_time: float
    route: tuple[tuple[str, int, int], ...]  # (peer id, start, end)
    ready: bool  # every server serves its assignment


def routable_chains(
    p: Plan, plan_id: str, profiles: Mapping[str, ServerProfile], assignments: Mapping[str, Assignment]
) -> list[RoutableChain]:
    chains = []
    for index, ch in enumerate(p.chains):
        peers = [profiles.get(node) for node in ch.servers]
        ready = all(server_matches(profiles.get(node), assignments[node]) for node in ch.servers)
        route = tuple((prof.peer_id if prof else "", s, e) for prof, (s, e) in zip(peers, ch.spans))
        chains.append(RoutableChain(f"{plan_id}/{index}", index, tuple(ch.servers), tuple(ch.spans),
                                    ch.capacity, ch.service_time, route, ready))
    return chains


def chain_prefill_s(chain: RoutableChain, profiles: Mapping[str, ServerProfile]) -> float:
    """Measured prefill time of one prompt token through ``chain``: Σ_j blocks_j · prefill_s_j (the servers'
    per-block per-token prefill, summed over the chain's blocks like the planner's compute time)."""
    return sum((end - start) * profiles[node].prefill_s
               for node, (start, end) in zip(chain.servers, chain.spans) if node in profiles)


def planned_step_s(chain: RoutableChain, profiles: Mapping[str, ServerProfile],
                   assignments: Mapping[str, Assignment], tokens: int) -> float:
    """Planned time of one inference step of ``tokens`` positions through ``chain`` when each server also runs
    the steps of every other session it is planned for: prefills one after another (petals 2.2 serves a
    server's steps one at a time), a decode step as the server's published batch curve says (g_j(sessions_j);
    without a curve one at a time too):
    Σ_j blocks_j · (prefill_s · tokens · sessions_j  or  decode_s · g_j(sessions_j)) + rtt_j."""
    total = 0.0
    for node, (start, end) in zip(chain.servers, chain.spans):
        profile, assignment = profiles.get(node), assignments.get(node)
        if profile is None:
            continue
        held = max(1, (assignment.end - assignment.start) if assignment is not None else 1)
        sessions = max(1, (assignment.cache_slots if assignment is not None else 1) // held)
        curve = profile.batch_curve() if tokens <= 1 else None
        if curve is not None:
            step = profile.decode_s * curve(sessions)
        else:
            step = (profile.prefill_s if tokens > 1 else profile.decode_s) * max(1, tokens) * sessions
        total += (end - start) * step + (profile.rtt_s or 0.0)
    return total
