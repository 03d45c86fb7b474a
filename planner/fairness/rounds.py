"""Dispatch rounds (§14.4): which waiting requests get the free chain slots.

A round = (1) the policy picks, one at a time, which waiting requests get the
free slots (``_select_next``), each with a provisional fairness charge against
m*(r), its best prefix match m_k(r) over the free chains it fits
(``_charge_pick``); (2) the scheduler's ``ChainSelector`` places the picked
requests on the free slots; (3) unplaced picks are refunded and the placed ones
start (``CentralQueueScheduler._start`` settles the charge to the chosen
chain's extend_k(r) = len(r) - m_k(r)).  ``dispatch`` repeats rounds until one
grants nothing; ``pick_for_chain`` and ``choose_chain`` are the single-slot
rounds (F = {k}, or S = {r}).
"""

from __future__ import annotations

from typing import Hashable

from .types import ChainState, Grant, InvalidEventError, RequestState


class DispatchRounds:
    """Mixin of ``CentralQueueScheduler``: the round and the policy hooks it calls."""

    def dispatch(self, now: float) -> list[Grant]:
        """One dispatch round (§14.4): fill every free slot a waiting request fits."""
        grants: list[Grant] = []
        while True:
            got = self._round(now, only_chain=None, only_request=None, max_grants=None)
            grants.extend(got)
            if not got:
                return grants

    def pick_for_chain(self, chain_id: Hashable, now: float) -> Grant | None:
        """A slot freed on ``chain_id``: which waiting request goes there (at most one)?"""
        chain = self._chain(chain_id, "pick_for_chain")
        if chain.free <= 0:
            return None
        got = self._round(now, only_chain=chain_id, only_request=None, max_grants=1)
        return got[0] if got else None

    def choose_chain(self, request_id: Hashable, now: float) -> Grant | None:
        """Place this waiting request on the best free chain now (None if none fits).
        The request is charged as usual; fairness ordering is bypassed, so use it
        when the request is the only one waiting (the arrival-with-free-slot case)."""
        req = self._get(request_id, "choose_chain")
        if req.state != "queued":
            raise InvalidEventError(f"choose_chain for request {request_id!r} which is not queued")
        got = self._round(now, only_chain=None, only_request=req, max_grants=1)
        return got[0] if got else None

    def rank_chains(self, request_id: Hashable, now: float) -> list[Hashable]:
        """All fitting healthy chains (free or not) ranked for this request by the
        selector's single-slot key, quanta left out (e.g. for failover hints)."""
        req = self._get(request_id, "rank_chains")
        chains = [c for c in self._chains.values() if c.healthy and c.spec.fits(req.input_tokens, req.max_new_tokens)]
        matches = {req.request_id: {c.spec.chain_id: self._match(req, c.spec.chain_id) for c in chains}}
        key = self.selector.single_key
        return [c.spec.chain_id for c in sorted(chains, key=lambda c: key(self, req, c, matches, None, c.free))]

    def work_conserving(self) -> bool:
        """P3: no healthy chain has a free slot (and the KV room) a queued request fits."""
        for chain in self._chains.values():
            if chain.free <= 0:
                continue
            for q in self._queues.values():
                for r in q.values():
                    if chain.admits(r):
                        return False
        return True

    def _match(self, req: RequestState, chain_id: Hashable) -> int:
        if self.prefix_match is None:
            return 0
        m = int(self.prefix_match(req, chain_id))
        return max(0, min(m, req.input_tokens - 1))

    def _window(self, free: list[ChainState]) -> list[RequestState]:
        out = []
        for q in self._queues.values():
            taken = 0
            for r in q.values():
                if self.window_per_client is not None and taken >= self.window_per_client:
                    break
                taken += 1
                if any(c.admits(r) for c in free):
                    out.append(r)
        out.sort(key=lambda r: r.seq)
        return out

    def _round(self, now, only_chain, only_request, max_grants) -> list[Grant]:
        if only_chain is not None:
            free = [self._chains[only_chain]] if self._chains[only_chain].free > 0 else []
        else:
            free = [c for c in self._chains.values() if c.free > 0]
        if not free:
            return []
        slots = sum(c.free for c in free)
        if only_chain is not None:
            slots = 1
        if max_grants is not None:
            slots = min(slots, max_grants)
        if only_request is not None:
            candidates = [only_request] if any(c.admits(only_request) for c in free) else []
        else:
            candidates = self._window(free)
        if not candidates:
            return []
        matches: dict[Hashable, dict[Hashable, int]] = {}
        best: dict[Hashable, int] = {}
        for r in candidates:
            row = {c.spec.chain_id: self._match(r, c.spec.chain_id) for c in free if c.admits(r)}
            matches[r.request_id] = row
            best[r.request_id] = max(row.values()) if row else 0
        self._begin_round(matches)
        picked: list[RequestState] = []
        remaining = list(candidates)
        while len(picked) < slots and remaining:
            if only_request is not None:
                r = only_request
            else:
                r = self._select_next(remaining, best, now)
                if r is None:
                    break
            r.provisional = self._charge_pick(r, best[r.request_id], now)
            picked.append(r)
            remaining = [x for x in remaining if x is not r]
        if not picked:
            return []
        assignment = self.selector.assign(self, picked, free, matches)
        placed = {id(r) for r, _ in assignment}
        for r in picked:
            if id(r) not in placed:
                self._refund_pick(r, r.provisional)
                r.provisional = 0.0
        grants = []
        for r, chain in assignment:
            grants.append(self._start(r, chain, matches[r.request_id][chain.spec.chain_id], best[r.request_id], now))
        return grants

    # ------------------------------------------------------- policy hooks
    def _begin_round(self, matches: dict) -> None:
        """A dispatch round starts; ``matches[rid][chain]`` = m_k(r) over fitting free chains."""

    def _select_next(self, candidates: list[RequestState], best: dict, now: float) -> RequestState | None:
        raise NotImplementedError

    def _charge_pick(self, req: RequestState, best_match: int, now: float) -> float:
        """Provisional fairness charge at pick time; returns the amount for a refund."""
        return 0.0

    def _refund_pick(self, req: RequestState, amount: float) -> None:
        """The picked request could not be placed this round."""
