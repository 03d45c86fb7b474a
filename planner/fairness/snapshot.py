"""A scheduler's fairness state as a JSON-safe document, and back (pure: no I/O, no clock of its own).

What survives a restart of the orchestrator is what a client has been *charged*: per client its first-seen
order, actual service (system and client view), output-length estimate, the policy's counters (DLPM deficits
and refill counts, VTC virtual counters and the last client to leave the queue) and the per-chain stickiness
quanta. Requests queued or running at the snapshot are not part of it: their charges so far are in the
counters, and a client that retries is charged again for the retry, as for any new request.

Client and chain ids are kept as JSON values (strings in the orchestrator), every mapping as a list of
pairs, so the document is independent of dict-key coercion.
"""
from __future__ import annotations

from typing import Any, Hashable

VERSION = 1


def _pairs(mapping: dict) -> list[list]:
    return [[key, value] for key, value in mapping.items()]


def _key(value: Any) -> Hashable:
    """A JSON value back to a hashable id (lists from tuples become tuples)."""
    return tuple(_key(v) for v in value) if isinstance(value, list) else value


def export_state(scheduler) -> dict[str, Any]:
    """The scheduler's per-client fairness state (see the module docstring)."""
    quanta = scheduler.quanta
    return {
        "version": VERSION,
        "policy": scheduler.policy_name,
        "clients": list(scheduler._clients),
        "service": _pairs(scheduler._service),
        "client_view_service": _pairs(scheduler._client_view_service),
        "output_estimate": _pairs(scheduler._output_estimate),
        "quanta": None if quanta is None else [[client, chain, value] for client, row in quanta._d.items()
                                               for chain, value in row.items()],
        "counters": scheduler._export_counters(),
    }


def import_state(scheduler, doc: dict[str, Any], now: float) -> None:
    """Restore ``doc`` (from :func:`export_state`) into ``scheduler``, which must have no request queued or
    running. Every restored client counts as seen at ``now``. Raises ValueError on a document of another
    version or policy, or a malformed one; the scheduler is unchanged then."""
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"fairness state of version {doc.get('version') if isinstance(doc, dict) else None!r}, "
                         f"expected {VERSION}")
    if doc.get("policy") != scheduler.policy_name:
        raise ValueError(f"fairness state saved under policy {doc.get('policy')!r}, this scheduler runs "
                         f"{scheduler.policy_name!r}")
    if scheduler._requests:
        raise ValueError("import_state needs a scheduler with no request queued or running")
    try:
        clients = [_key(c) for c in doc["clients"]]
        service = {_key(c): float(v) for c, v in doc["service"]}
        client_view = {_key(c): float(v) for c, v in doc["client_view_service"]}
        estimates = {_key(c): float(v) for c, v in doc["output_estimate"]}
        quanta = None if doc["quanta"] is None else [(_key(c), _key(k), float(v)) for c, k, v in doc["quanta"]]
        counters = doc["counters"]
        scheduler._check_counters(counters, clients)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed fairness state: {type(exc).__name__}: {exc}") from None
    scheduler._clients = {c: i for i, c in enumerate(clients)}
    scheduler._queues = {c: {} for c in clients}
    scheduler._client_last_seen = {c: now for c in clients}
    scheduler._service = {c: service.get(c, 0.0) for c in clients}
    scheduler._client_view_service = {c: client_view.get(c, 0.0) for c in clients}
    scheduler._output_estimate = {c: v for c, v in estimates.items() if c in scheduler._clients}
    for client in clients:
        scheduler._register_client(client)
    if scheduler.quanta is not None and quanta is not None:
        scheduler.quanta._d = {}
        for client, chain, value in quanta:
            scheduler.quanta.set(client, chain, value)
    scheduler._import_counters(counters)
