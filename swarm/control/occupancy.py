"""Occupancy that survives re-plans: the KV block-slots every running session holds on every server.

The fairness scheduler counts sessions per chain, and chain ids change with every plan: after a join, a leave or
a failure the new chains look empty while the old plan's sessions still hold KV memory on their servers, and a
rerouted session holds memory on servers of a chain that never granted it. :class:`Occupancy` (the mechanism)
keeps what each running session holds — ``{node: blocks}`` times its ``weight``, the KV tokens it reserves on
each block it is served on (its own need with token admission; ``max_length`` with fixed-length slots), in the
unit of the servers' pools (cache_slots × slot tokens, Σ_k c_k·m_kj slots) — whatever its plan.
:func:`fit_capacities` (the policy) then gives the scheduler chain capacities c'_k ≤ c_k such that on every server j

    Σ_{k ∋ j} c'_k · m_kj  +  U_j  ≤  slots_j,

where U_j is what sessions the scheduler does not count on a current chain through j hold there (the old plan's,
and rerouted ones'): the slowest chains give up capacity first, and get it back as those sessions end. A reroute
takes a block-slot on each server of its new route (:meth:`Occupancy.can_take`) or waits for one. A finished
session whose close has not reached its servers yet (a batched session's close travels with its chain's next step)
is retired (:meth:`Occupancy.retire`): no chain counts it, so it is part of U_j until :meth:`Occupancy.release`.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence


class Occupancy:
    def __init__(self):
        self._held: dict[str, list[tuple[str, int, int]]] = {}  # request id -> [(node, start, end)]
        self._chain: dict[str, str] = {}  # request id -> the chain the scheduler counts it on
        self._weight: dict[str, int] = {}  # request id -> block-slots per block (its KV need in slots)
        self._retired = 0

    def hold(self, request_id: str, chain_id: str, servers: Sequence[str], spans: Sequence[tuple[int, int]],
             weight: int = 1) -> None:
        """A granted session on ``chain_id``: it holds ``weight × (end - start)`` on each of its servers
        (``weight``: the KV tokens it reserves per block; 1 counts block-slots)."""
        self._held[request_id] = [(node, a, b) for node, (a, b) in zip(servers, spans)]
        self._chain[request_id] = chain_id
        self._weight[request_id] = max(1, int(weight))

    def move(self, request_id: str, start: int, end: int, spans: Iterable[tuple[str, int, int]]) -> None:
        """A reroute of blocks [start, end): the session gives up what it held there and holds ``spans``
        ((node, start, end)) instead."""
        held = self._held.get(request_id)
        if held is None:
            return
        kept = []
        for node, a, b in held:  # keep the parts outside [start, end)
            kept += [(node, a, min(b, start))] if a < start else []
            kept += [(node, max(a, end), b)] if b > end else []
        self._held[request_id] = [seg for seg in kept if seg[2] > seg[1]] + list(spans)

    def reweigh(self, request_id: str, weight: int) -> None:
        """The session's reservation per block changed (an answer reserved in parts grew)."""
        if request_id in self._weight:
            self._weight[request_id] = max(1, int(weight))

    def retire(self, request_id: str) -> str | None:
        """The session ended but its servers may still hold its KV: it keeps holding it under a new key (returned;
        None for an unknown session), counted on no chain, until :meth:`release` of that key. The request id is
        free again at once (a preempted request is held again under it)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        self._retired += 1
        key = f"{request_id}#closing{self._retired}"
        self._held[key], self._weight[key] = held, self._weight.pop(request_id, 1)
        self._chain.pop(request_id, None)
        return key

    def release(self, request_id: str) -> bool:
        """The session ended; True when it was known."""
        self._chain.pop(request_id, None)
        self._weight.pop(request_id, None)
        return self._held.pop(request_id, None) is not None

    def holds(self, request_id: str) -> dict[str, int]:
        """{node: block-slots} the session holds."""
        weight = self._weight.get(request_id, 1)
        return {node: weight * blocks for node, blocks in blocks_of(self._held.get(request_id, ())).items()}

    def weight(self, request_id: str) -> int:
        """What the session takes per block (1 for an unknown one)."""
        return self._weight.get(request_id, 1)

    def per_server(self) -> dict[str, int]:
        """Block-slots held on each server by every running session."""
        out: dict[str, int] = {}
        for request_id, held in self._held.items():
            weight = self._weight.get(request_id, 1)
            for node, a, b in held:
                out[node] = out.get(node, 0) + weight * (b - a)
        return out

    def uncounted(self, chains: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
        """U_j: block-slots held on j by sessions the scheduler does not count there — those whose chain is not
        among ``chains`` ({chain id: {node: m_kj}}, the chains given to the scheduler) or holds more on j than
        the chain's own span (a reroute)."""
        out: dict[str, int] = {}
        for request_id in self._held:
            counted = chains.get(self._chain.get(request_id, ""), {})
            weight = self._weight.get(request_id, 1)
            for node, blocks in self.holds(request_id).items():
                extra = blocks - weight * counted.get(node, 0)
                if extra > 0:
                    out[node] = out.get(node, 0) + extra
        return out

    def can_take(self, taken: Mapping[str, int], slots: Mapping[str, int]) -> bool:
        """Whether every server of ``taken`` has that many block-slots free (servers without a known slot count
        are not limited)."""
        used = self.per_server()
        return all(used.get(node, 0) + blocks <= slots[node] for node, blocks in taken.items() if node in slots)

    def __len__(self) -> int:
        return len(self._held)


def blocks_of(spans: Iterable[tuple[str, int, int]]) -> dict[str, int]:
    """{node: blocks} of (node, start, end) spans."""
    out: dict[str, int] = {}
    for node, a, b in spans:
        out[node] = out.get(node, 0) + b - a
    return out


def fit_capacities(chains: Sequence[tuple[str, int, Mapping[str, int]]], slots: Mapping[str, int],
                   uncounted: Mapping[str, int]) -> dict[str, int]:
    """c'_k for ``chains`` ([(chain id, c_k, {node: m_kj})], fastest first) so that the servers' ``slots`` hold
    both the chains' sessions and the ``uncounted`` block-slots; the slowest chains through an overfull server
    give up capacity first."""
    capacity = {chain_id: c for chain_id, c, _ in chains}
    through: dict[str, list[tuple[str, int]]] = {}
    for chain_id, _, blocks in chains:
        for node, m in blocks.items():
            through.setdefault(node, []).append((chain_id, m))
    for node, members in through.items():
        if node not in slots:
            continue
        excess = sum(capacity[k] * m for k, m in members) + uncounted.get(node, 0) - slots[node]
        for chain_id, m in reversed(members):  # slowest first
            while excess > 0 and capacity[chain_id] > 0 and m > 0:
                capacity[chain_id] -= 1
                excess -= m
    return capacity
