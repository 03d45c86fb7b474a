"""LPM (§4), DLPM (§6) and the combined swarm policy (§14) on the central queue."""

from __future__ import annotations

from typing import Hashable, Mapping

from .base import CentralQueueScheduler
from .counters import DeficitCounters
from .selectors import EstimatedTime, LongestPrefixMatch


class LPMScheduler(CentralQueueScheduler):
    """Longest prefix match (SGLang): the waiting request with the longest match on a
    free chain goes first; ties keep arrival order (key (-m, seq)).  No fairness:
    a client that keeps a prefix hot starves the others (E1b).  The per-client
    window replaces SGLang's FCFS fallback above 128 queued requests; in-batch
    deduplication is not done (pending inserts are the caller's business)."""

    policy_name = "lpm"
    default_selector = LongestPrefixMatch

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

    def _export_counters(self):
        return {"deficit": [[c, q] for c, q in self.deficits.deficit.items()],
                "refills": [[c, k] for c, k in self.deficits.refills.items()],
                "refill_rounds": self.deficits.refill_rounds}

    def _check_counters(self, counters, clients):
        [(c, float(q)) for c, q in counters["deficit"]], [(c, int(k)) for c, k in counters["refills"]]
        int(counters["refill_rounds"])

    def _import_counters(self, counters):
        from .snapshot import _key

        for client, value in counters["deficit"]:
            self.deficits.set(_key(client), value)
        for client, count in counters["refills"]:
            if _key(client) in self.deficits.refills:
                self.deficits.refills[_key(client)] = int(count)
        self.deficits.refill_rounds = int(counters["refill_rounds"])

    def _forget_client(self, client):
        self.deficits.forget(client)

    def _begin_round(self, matches):
        self._round_matches = matches
        self._round_pending: dict = {}  # client -> worst-case settlement still pending this round

    def _select_next(self, candidates, best, now):
        """Next pick of the round, in LPM order, subject to the deficit.

        A client's first pick in a round needs q > 0 (provisional charge at the
        best-case extend, as in §14.4).  A further pick of the same client in the
        same round needs q - pending > 0, where pending is the worst-case
        settlement of its earlier picks (best match minus the smallest match over
        the free chains it fits): without this, several best-case picks could be
        settled to much larger extends and overdraw q below -U (a gap in §14.4's
        pseudocode; it never changes single-slot rounds nor E9).  A refill happens
        only when every client with a candidate has q <= 0 (the DRR rule the
        bounds rest on).  When a client still has q > 0 but only pessimistic
        credit <= 0, the round ends instead, and ``dispatch`` runs another round
        with settled counters, so no slot stays idle.
        """
        deficit, pending = self.deficits.deficit, self._round_pending
        order = sorted(candidates, key=lambda r: (-best[r.request_id], r.seq))
        for attempt in range(2):
            for r in order:
                if deficit[r.client_id] - pending.get(r.client_id, 0.0) > 0:
                    return r
            clients = {r.client_id for r in candidates}
            if attempt or any(deficit[c] > 0 for c in clients):
                return None  # someone still has (unsettled) credit: settle first
            self.deficits.refill_until_credit(clients)
        return None

    def _charge_pick(self, req, best_match, now):
        if req.recompute_free:
            self._round_pending.setdefault(req.client_id, 0.0)
            return 0.0
        amount = self.weights.extend * (req.input_tokens - best_match)
        self.deficits.charge(req.client_id, amount)
        row = self._round_matches.get(req.request_id) or {None: best_match}
        worst_extra = self.weights.extend * (best_match - min(row.values()))
        self._round_pending[req.client_id] = self._round_pending.get(req.client_id, 0.0) + worst_extra
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
    min-sum matching of expected time T_k(r) (``EstimatedTime``, JFFC tie-break)
    or by another ``ChainSelector`` (``lpm`` / ``jffc`` / ``bfio``); per-client per-chain stickiness quanta Q^w
    (DoubleQ) penalise chains where the client has used its quantum, bounding
    how sticky a client's requests get.  Defaults from §14.6.
    """

    policy_name = "swarm"
    default_selector = EstimatedTime

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
