"""LPM (§4), DLPM (§6) and the combined swarm policy (§14) on the central queue."""

from __future__ import annotations

from typing import Hashable, Mapping

from .base import CentralQueueScheduler
from .counters import DeficitCounters


class LPMScheduler(CentralQueueScheduler):
    """Longest prefix match (SGLang): the waiting request with the longest match on a
    free chain goes first; ties keep arrival order (key (-m, seq)).  No fairness:
    a client that keeps a prefix hot starves the others (E1b).  The per-client
    window replaces SGLang's FCFS fallback above 128 queued requests; in-batch
    deduplication is not done (pending inserts are the caller's business)."""

    policy_name = "lpm"
    default_chain_mode = "lpm"

    def _select_next(self, candidates, best, now):
        return min(candidates, key=lambda r: (-best[r.request_id], r.seq))


class DLPMScheduler(CentralQueueScheduler):
    """Deficit longest prefix match with one global deficit per client.

    Each pick scans the candidates in LPM order (-m*(r), seq), where m*(r) is the
    best match over the free chains r fits; a request is admitted only while its
    client's deficit q > 0.  When no client with a candidate has credit, every
    known client with q <= 0 gets the quantum Q^u (times its optional weight,
    §15 Q20) in rounds until one eligible client has credit (loop form, §15 Q6).

    Charges (§1.2): w_e * extend at grant — provisional w_e*(len - m*) at pick,
    settled to the chosen chain's extend, reconciled on the prefill report — and
    w_q per output token.  Bound (Thm 4.1 / §14.8): two continuously backlogged
    clients differ in actual service by at most 2 * (U + Q^u),
    U = w_e * L_input + w_q * M_out.
    """

    policy_name = "dlpm"

    def __init__(self, *, quantum: float = 8192.0, client_weights: Mapping[Hashable, float] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.deficits = DeficitCounters(quantum, client_weights)

    @property
    def quantum(self) -> float:
        return self.deficits.quantum

    def deficit(self, client) -> float:
        return self.deficits[client]

    def refills(self, client) -> int:
        """K[i]: how many refill rounds credited this client."""
        self.deficits[client]  # raises UnknownClientError
        return self.deficits.refills[client]

    def set_deficit(self, client, value: float) -> None:
        """Restore a persisted deficit (or set up a test state); registers the client."""
        if client not in self._clients:
            self._clients[client] = len(self._clients)
            self._queues.setdefault(client, {})
            self._service.setdefault(client, 0.0)
            self._client_view_service.setdefault(client, 0.0)
        self.deficits.set(client, value)

    def _register_client(self, client):
        self.deficits.register(client)

    def _forget_client(self, client):
        self.deficits.forget(client)

    def _select_next(self, candidates, best, now):
        eligible = {r.client_id for r in candidates}
        self.deficits.refill_until_credit(eligible)
        for r in sorted(candidates, key=lambda r: (-best[r.request_id], r.seq)):
            if self.deficits.deficit[r.client_id] > 0:
                return r
        return None  # unreachable: the refill loop guarantees an eligible client with credit

    def _charge_pick(self, req, best_match, now):
        if req.recompute_free:
            return 0.0
        amount = self.weights.extend * (req.input_tokens - best_match)
        self.deficits.charge(req.client_id, amount)
        return amount

    def _refund_pick(self, req, amount):
        self.deficits.charge(req.client_id, -amount)

    def _settle(self, req, chain_id, matched, best_match, now):
        if not req.recompute_free and best_match != matched:
            self.deficits.charge(req.client_id, self.weights.extend * (best_match - matched))

    def _charge_output(self, req, count):
        self.deficits.charge(req.client_id, self.weights.output * count)

    def _charge_reconcile(self, req, amount):
        self.deficits.charge(req.client_id, amount)


class SwarmScheduler(DLPMScheduler):
    """The combined Chainswarm policy of §14.

    One global deficit per client (DLPM over the central queue); a freed chain
    slot goes to the waiting request with the longest match on that chain,
    subject to the deficit; requests picked in a round are placed jointly by
    min-sum matching of expected time T_k(r) (``est_time``, JFFC tie-break) or
    by ``lpm`` / ``jffc`` / ``bfio``; per-client per-chain stickiness quanta Q^w
    (DoubleQ) penalise chains where the client has used its quantum, bounding
    how sticky a client's requests get.  Defaults from §14.6.
    """

    policy_name = "swarm"
    default_chain_mode = "est_time"

    def __init__(self, *, quantum: float = 8192.0, chain_quantum: float | None = 16384.0, **kwargs):
        super().__init__(quantum=quantum, chain_quantum=chain_quantum, **kwargs)

    def stickiness(self, client, chain_id) -> float:
        """d[client][chain]."""
        self.deficits[client]
        return self.quanta.value(client, chain_id) if self.quanta is not None else 0.0

    def set_stickiness(self, client, chain_id, value: float) -> None:
        if self.quanta is None:
            raise ValueError("stickiness quanta are disabled (chain_quantum=None)")
        self.quanta.set(client, chain_id, value)
