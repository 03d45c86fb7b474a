"""The orchestrator's status document (``GET /v1/swarm``, the dashboard, the metrics).

The public view leaves out what names clients and leases — the per-client queue, service and service history,
and the events (lease ids, client names) — and keeps the total waiting; operators (an admin client's key) see
all of it.
"""
from __future__ import annotations

from typing import Any

PRIVATE = ("clients", "events", "service_history")  # they name clients and leases


def swarm_status(orch: Any, detail: bool = True) -> dict[str, Any]:
    """The status document of ``orch`` (a :class:`swarm.control.orchestrator.Orchestrator`; it calls this
    function, so the annotation stays a plain ``Any`` and no import points back up)."""
    view = orch.view
    active = orch.router.active_sessions()
    kv = orch.router.kv_tokens()  # token admission: (held, budget) KV tokens per block

    def kv_of(chain_id) -> dict[str, int | None]:  # None for both where the chain admits by slots
        held, budget = kv.get(chain_id, (None, None))
        return {"kv_tokens": budget, "kv_tokens_held": held}

    free = orch.router.free_slots()  # c'_k - active: less than c_k - active while servers hold KV no chain counts
    kv_used = orch.occupancy.per_server()
    status = {
        "dht_prefix": orch.config.dht_prefix,
        "orchestrator_key": orch.identity.public.decode(),  # give it to servers: --orchestrator-key
        "num_blocks": orch.config.num_blocks,
        "torch_dtype": orch.config.torch_dtype,
        "policy": orch.config.policy,
        "router": orch.config.router,
        "plan": None if view.plan is None else {"plan_id": view.plan_id, "kept_ranges": view.plan_kept_ranges,
                                                "replans": orch.replans, "inputs": view.plan_inputs,
                                                "longest_session_tokens": orch.reservations.longest(view.chains),
                                                **view.plan.to_dict()},
        "plan_error": view.plan_error,
        "transition": orch.transition.status(view),  # make-before-break: who still serves the replaced plan
        "servers": [
            {**p.to_dict(), "suspect": node in orch.suspects, "kv_block_slots_used": kv_used.get(node, 0),
             "banned": orch.is_banned(node),
             "assignment": None if node not in view.published else view.published[node].to_dict(),
             "target": None if node not in view.assignments else view.assignments[node].to_dict()}
            for node, p in sorted(view.profiles.items())
        ],
        "chains": [
            {"id": c.chain_id, "servers": list(c.servers), "spans": [list(s) for s in c.spans],
             "route": [list(r) for r in c.route], "capacity": c.capacity, "active": active.get(c.chain_id, 0),
             "free": free.get(c.chain_id, 0), **kv_of(c.chain_id),
             "ready": c.ready, "service_time": c.service_time, "cached_prefix_tokens": orch.chain_cached_tokens(c)}
            for c in view.chains
        ],
        "prefix": orch.prefix.status(),
        "verification": orch.ledger.status(),  # spot checks: rates, counts, per-server passes/strikes, bans
        **orch.router.status(),  # queue and clients (and the ws-rr block)
        "leases": len(orch.leases),
        "events": list(orch.events)[-30:],
        "service_history": orch.service_history.to_dict(),
    }
    if not detail:
        queue = status.pop("queue", {})
        for key in PRIVATE:
            status.pop(key, None)
        status["waiting"] = sum(queue.values())
    return status
