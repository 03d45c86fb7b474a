"""DoubleQ / D2LPM global dispatcher in its paper form (§7.2, Alg. 2).

Used by the simulator for the data-parallel baseline and by the E6 example.
Every request is routed at arrival to one worker's local queue (each worker then
runs a local scheduler, e.g. ``DLPMScheduler`` over a single chain).  The swarm
policy (``SwarmScheduler``) reuses the same ``StickinessQuanta`` but keeps one
central queue instead (§14.1).
"""

from __future__ import annotations

from typing import Hashable, Sequence

from .counters import StickinessQuanta
from .types import CostWeights, DuplicateRequestError, UnknownChainError, UnknownRequestError


class DoubleQRouter:
    """select_worker(G, i) with per-(client, worker) quanta d and loads s[w].

    G is the holder set of the deepest matched node of the request's pages in
    ``index`` (a ``PrefixIndex`` whose holders are worker ids; all workers when
    nothing matches).  Charges: d -= w_e * len at dispatch, d -= w_q * o at
    finish.  The request's pages are inserted for the chosen worker optimistically.
    """

    def __init__(self, workers: Sequence[Hashable], quantum: float, *, index=None, weights: CostWeights | None = None):
        if not workers:
            raise ValueError("DoubleQRouter needs at least one worker")
        self.workers = list(workers)
        self._order = {w: i for i, w in enumerate(self.workers)}
        self.quanta = StickinessQuanta(quantum)
        self.index = index
        self.weights = weights or CostWeights()
        self.load = {w: 0 for w in self.workers}  # s[w]: dispatched, not finished
        self._routed: dict[Hashable, tuple[Hashable, Hashable]] = {}

    def select_worker(self, holders, client) -> Hashable:
        avail = self.quanta.available(client, self.workers)
        cand = [w for w in avail if w in holders]
        pool = cand or avail
        return min(pool, key=lambda w: (self.load[w], self._order[w]))

    def route(self, request_id, client, input_tokens: int, page_hashes: Sequence = (), now: float = 0.0) -> Hashable:
        if request_id in self._routed:
            raise DuplicateRequestError(f"request {request_id!r} was already routed")
        holders = set(self.workers)
        if self.index is not None and page_hashes:
            pages, found = self.index.longest_match_holders(page_hashes)
            found = {h for h in found if h in self._order}
            if pages > 0 and found:
                holders = found
        worker = self.select_worker(holders, client)
        self.quanta.charge(client, worker, self.weights.extend * input_tokens)
        self.load[worker] += 1
        self._routed[request_id] = (client, worker)
        if self.index is not None and page_hashes:
            self.index.insert(worker, page_hashes, now)
        return worker

    def on_finish(self, request_id, output_tokens: int) -> None:
        try:
            client, worker = self._routed.pop(request_id)
        except KeyError:
            raise UnknownRequestError(request_id, "DoubleQRouter.on_finish") from None
        self.quanta.charge(client, worker, self.weights.output * output_tokens)
        self.load[worker] -= 1

    def on_eviction(self, worker, page_hashes: Sequence) -> None:
        if worker not in self._order:
            raise UnknownChainError(worker, "DoubleQRouter.on_eviction")
        if self.index is not None:
            self.index.remove(worker, page_hashes)
