"""What an orchestrator keeps across a restart, and when (the files are :class:`swarm.state.store.StateDir`'s).

* **Before the DHT starts** (:func:`prepare`): the identity key, the ports bound last time, the prefix
  secret and the API keys turn the options into the ones of the previous run; the DHT peer dials the servers
  it was connected to last (their addresses are saved every ten rounds), so it finds their records at once
  instead of waiting until their DHT peers call it again (their backoff after failed calls can take tens of
  seconds).
* **Before the control loop starts** (:meth:`Persistence.restore`): the saved plan is rebuilt exactly — GCA
  over the saved block ranges with the saved planner inputs — and re-adopted with its plan id and
  assignments, so servers see the assignment they hold and do not reload; the fairness counters are imported
  into the scheduler; the node id → key pins (:class:`swarm.trust.identity.KeyPins`) are restored and held for
  ``assignment_ttl_s`` while the servers' records come back, so nobody can claim a live node's id under
  another key in the moments after a restart. :meth:`Persistence.await_servers` then waits (bounded) until the planned servers'
  profile records are back — republishing the orchestrator's record meanwhile so they re-measure their RTT —
  because a first refresh without them would re-plan.
* **While running** (:meth:`Persistence.run`): the plan is saved whenever its id or assignments change, the
  fairness counters and the pins whenever they change, at most once per ``min_interval_s``; once more on a
  clean stop.
  After a SIGKILL the counters are those of the last snapshot (at most ``min_interval_s`` old).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from planner.model import Placement
from planner.plan import parse_swarm, plan_for_placement
from swarm.runtime.bounded import BoundedCall, CallTimeout
from swarm.trust import records
from swarm.state.store import StateDir, StateError

__all__ = ["prepare", "Persistence", "StateError"]

logger = logging.getLogger(__name__)


def prepare(options, store: StateDir):
    """``options`` (OrchestratorOptions) with the saved ports (when the options leave them to chance) and the
    saved or given API keys."""
    node = store.node()
    changes: dict[str, Any] = {"api_keys": store.api_keys(dict(options.api_keys))}
    if not options.dht_port and node["dht_port"]:
        changes["dht_port"] = node["dht_port"]
    if not options.http_port and node["http_port"]:
        changes["http_port"] = node["http_port"]
    return dataclasses.replace(options, **changes)


PEER_LIST_S = 5.0  # the longest the DHT process waits for its libp2p daemon's peer list


async def _connected_peers(dht, node) -> list[tuple[str, list[str]]]:
    """(peer id, multiaddrs) of every peer the DHT's libp2p daemon is connected to (runs in the DHT process), or
    ``TimeoutError`` after ``PEER_LIST_S``: hivemind asks the daemon on a control connection of its own and waits
    for its answer without a bound, and in about one run in six of ``tests/test_restart.py`` one never came (the
    daemon answers the next connection)."""
    peers = await asyncio.wait_for(node.p2p.list_peers(), PEER_LIST_S)
    return [(info.peer_id.to_base58(), [str(a) for a in info.addrs]) for info in peers]


def bound_tcp_port(maddrs) -> int | None:
    """The TCP port of the first multiaddr that has one."""
    for addr in maddrs:
        parts = str(addr).split("/")
        if "tcp" in parts:
            return int(parts[parts.index("tcp") + 1])
    return None


class Persistence:
    """Saves and restores one orchestrator's plan and fairness counters."""

    DHT_CALL_S = 15.0  # the longest one DHT call of the saver or of a restart's wait for the servers is waited for

    def __init__(self, store: StateDir, orchestrator, *, min_interval_s: float = 1.0):
        self.store = store
        self.orchestrator = orchestrator
        self.min_interval_s = min_interval_s
        self._saved: dict[str, dict] = {}  # file name -> the document saved last
        self._saved_at = 0.0
        self._peers_call = BoundedCall("reading the DHT's connected peers", self.DHT_CALL_S)

    @property
    def scheduler(self):
        return getattr(self.orchestrator.router, "scheduler", None)  # ws-rr keeps no fairness counters

    # -- snapshots -----------------------------------------------------------------------------------
    def plan_document(self) -> dict[str, Any]:
        view = self.orchestrator.view
        if view.plan is None:
            return {"plan_id": None}
        return {
            "plan_id": view.plan_id,
            "num_blocks": self.orchestrator.config.num_blocks,
            "placement_method": view.plan.placement_method,
            "c": view.plan.c,
            "inputs": view.plan_inputs,
            "spans": {sp.id: None if sp.span is None else list(sp.span) for sp in view.plan.servers},
            "assignments": {node: a.to_dict() for node, a in sorted(view.assignments.items())},
        }

    def pins_document(self) -> dict[str, Any]:
        return {"pins": {node: key.decode() for node, key in sorted(self.orchestrator.pins.pins.items())}}

    def documents(self) -> dict[str, dict]:
        """Every document kept, as it would be saved now (file name -> document)."""
        docs = {StateDir.PLAN: self.plan_document(), StateDir.PINS: self.pins_document()}
        if self.scheduler is not None:
            docs[StateDir.FAIRNESS] = {"policy": self.orchestrator.config.policy,
                                       "scheduler": self.scheduler.export_state()}
        return docs

    def changes(self, *, force: bool = False) -> list[tuple[str, dict]]:
        """The documents changed since the last save, as (file name, document); none when saved less than
        ``min_interval_s`` ago (unless ``force``). Runs on the orchestrator's loop (it reads its state)."""
        if not force and time.monotonic() - self._saved_at < self.min_interval_s:
            return []
        return [(name, doc) for name, doc in self.documents().items() if doc != self._saved.get(name)]

    def write(self, changed: list[tuple[str, dict]]) -> bool:
        """Write :meth:`changes`' documents (any thread); whether anything was written."""
        for name, doc in changed:
            self.store.write(name, doc)
            self._saved[name] = doc
        if changed:
            self._saved_at = time.monotonic()
        return bool(changed)

    def save(self, *, force: bool = False) -> bool:
        """:meth:`changes` written at once; whether anything was written."""
        return self.write(self.changes(force=force))

    async def record_peers(self) -> None:
        """Save the multiaddrs of the servers' DHT peers this orchestrator is connected to (asked of its DHT
        process within ``DHT_CALL_S``: :class:`~swarm.runtime.bounded.CallTimeout` when it does not answer)."""
        servers = {p.peer_id for p in self.orchestrator.view.profiles.values()}
        connected = await self._peers_call(self.orchestrator.dht.run_coroutine, _connected_peers)
        peers = [f"{addr}/p2p/{peer}" for peer, addrs in connected if peer in servers for addr in addrs]
        if peers:
            await asyncio.to_thread(self.store.record_peers, peers)

    async def run(self, peers_every: int = 10) -> None:
        """Save every ``min_interval_s`` while the orchestrator runs, and the servers' addresses every
        ``peers_every`` of those periods beside it (a slow DHT process delays only them, never a snapshot of the
        counters); a last save when cancelled."""
        peers = asyncio.ensure_future(self._record_peers_every(self.min_interval_s * peers_every))
        try:
            while True:
                await asyncio.sleep(self.min_interval_s)
                try:
                    await asyncio.to_thread(self.write, self.changes())  # fsync off the event loop
                except OSError as exc:  # a full disk must not stop the control plane; say so every time
                    logger.error("cannot save the orchestrator state to %s: %s", self.store.path, exc)
        finally:
            peers.cancel()
            try:
                self.save(force=True)
            except OSError as exc:
                logger.error("cannot save the orchestrator state to %s: %s", self.store.path, exc)

    async def _record_peers_every(self, period_s: float) -> None:
        """:meth:`record_peers` every ``period_s``; after a failure, again in ``min_interval_s``."""
        await asyncio.sleep(self.min_interval_s)
        while True:
            try:
                await self.record_peers()
                wait_s = period_s
            except Exception as exc:  # the DHT did not answer (a call still running answers the next round)
                logger.warning("the servers' addresses were not saved: %s", exc or repr(exc))
                wait_s = self.min_interval_s
            await asyncio.sleep(wait_s)

    # -- restore -------------------------------------------------------------------------------------
    def restore(self) -> dict[str, Any]:
        """Re-adopt the saved plan and fairness counters (before the orchestrator starts); what was restored."""
        restored: dict[str, Any] = {"plan_id": self._restore_plan(), "clients": self._restore_fairness(),
                                    "pins": self._restore_pins()}
        self._saved = self.documents()
        return restored

    def _restore_pins(self) -> list[str]:
        """The saved node id → key pins, held ``assignment_ttl_s`` until the servers' records are seen again."""
        from swarm.trust.identity import BadKeyError, parse_public_key

        doc = self.store.read(StateDir.PINS)
        if doc is None:
            return []
        pins = doc.get("pins")
        try:
            if not isinstance(pins, dict) or not all(isinstance(n, str) and isinstance(k, str)
                                                     for n, k in pins.items()):
                raise ValueError("no node id -> key object")
            for key in pins.values():  # a key as the claims' subkeys spell it (kept as saved, never a path)
                if not key.startswith("ssh-rsa ") or parse_public_key(key.encode()) is None:
                    raise ValueError(f"not an ssh-rsa key: {key[:24]!r}")
            keys = {node: key.encode() for node, key in pins.items()}
        except (ValueError, BadKeyError) as exc:
            raise StateError(f"state file {self.store.file(StateDir.PINS)} is corrupt ({exc})") from None
        self.orchestrator.pins.restore(keys, hold_s=self.orchestrator.config.assignment_ttl_s)
        return sorted(keys)

    def _restore_plan(self) -> str | None:
        doc = self.store.read(StateDir.PLAN)
        if doc is None or doc.get("plan_id") is None:
            return None
        path, config, view = self.store.file(StateDir.PLAN), self.orchestrator.config, self.orchestrator.view
        try:
            if doc["num_blocks"] != config.num_blocks:
                raise StateError(f"state file {path} holds a plan for {doc['num_blocks']} blocks, the model has "
                                 f"{config.num_blocks} (a state directory of another model?)")
            model, servers, rate, target_load = parse_swarm(doc["inputs"])
            spans = {node: None if span is None else (int(span[0]), int(span[1]))
                     for node, span in doc["spans"].items()}
            layout = Placement(tuple(spans.get(s.id) for s in servers))
            plan = plan_for_placement(model, servers, layout, rate, target_load=target_load,
                                      method=doc["placement_method"], c=doc.get("c"))
            assignments = {node: records.Assignment.from_dict(a) for node, a in doc["assignments"].items()}
        except StateError:
            raise
        except (KeyError, TypeError, ValueError, records.RecordError) as exc:
            raise StateError(f"state file {path} is corrupt ({type(exc).__name__}: {exc})") from None
        view.plan, view.plan_id, view.plan_kept_ranges, view.plan_error = plan, doc["plan_id"], True, None
        view.plan_inputs, view.assignments = doc["inputs"], assignments
        view.published = dict(assignments)
        return doc["plan_id"]

    def _restore_fairness(self) -> list:
        doc = self.store.read(StateDir.FAIRNESS)
        if doc is None or self.scheduler is None:
            return []
        if doc.get("policy") != self.orchestrator.config.policy:
            logger.warning("fairness counters in %s were saved under policy %r; this orchestrator runs %r: its "
                           "clients start afresh", self.store.file(StateDir.FAIRNESS), doc.get("policy"),
                           self.orchestrator.config.policy)
            return []
        try:
            self.scheduler.import_state(doc["scheduler"], now=time.monotonic())
        except (KeyError, ValueError) as exc:
            raise StateError(f"state file {self.store.file(StateDir.FAIRNESS)} is corrupt ({exc})") from None
        return self.scheduler.clients()

    async def await_servers(self, timeout_s: float, poll_s: float = 0.5) -> set[str]:
        """Wait until every server of the restored plan publishes a plannable profile again (at most
        ``timeout_s``); the servers still missing (empty when all are back, or when nothing was restored)."""
        orch = self.orchestrator
        planned = set(orch.view.assignments) if orch.view.plan is not None else set()
        if not planned:
            return set()
        prefix = orch.config.dht_prefix
        info = records.OrchestratorInfo(orch.dht.peer_id.to_base58(), orch.http_url, orch.view.plan_id)
        deadline = time.monotonic() + timeout_s
        call = BoundedCall("reading the restored plan's server records", self.DHT_CALL_S)

        def look() -> dict:
            records.publish_orchestrator(orch.dht, prefix, info, orch.config.assignment_ttl_s, orch.identity.public)
            return records.fetch_profiles(orch.dht, prefix, orch.pins)

        while True:
            try:
                profiles = await call(look)
            except CallTimeout as exc:  # asked again (the same call) until the deadline; a hung DHT ends the wait
                logger.warning("%s", exc)
                profiles = {}
            missing = {node for node in planned if node not in profiles or profiles[node].rtt_s is None}
            if not missing or time.monotonic() >= deadline:
                return missing
            await asyncio.sleep(poll_s)
