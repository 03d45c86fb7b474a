"""A node's inbox of assignments: its own record, signed by the orchestrator it obeys, checked against the model.

:class:`AssignmentInbox` is what :class:`server.node.ChainswarmServer` asks "what should I serve now?". It reads
the ``assignments`` subkeys of the swarm's DHT prefix, keeps only the entry under this node's name whose owner is
the orchestrator key (given, or pinned on first use: :mod:`server.trust`), and returns it as an
:class:`swarm.trust.records.Assignment` when it is well formed and within the model's blocks. A malformed record is
logged once and ignored; one that needs more memory than the node's budget, or has blocks but neither KV slots nor a
prefix store (:meth:`server.layout.AssignmentMemory.problems`), is warned about once and still returned (the
orchestrator may know better: the warning is for the volunteer reading the log). An assignment whose blocks failed
to load is not returned again until the orchestrator changes it (:meth:`AssignmentInbox.failed`).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from server.layout import AssignmentMemory
from swarm.trust import records
from swarm.trust.identity import fetch_owned
from swarm.trust.records import Assignment, RecordError

logger = logging.getLogger(__name__)


class AssignmentInbox:
    """This node's current, valid assignment, read from the DHT on every :meth:`fetch`.

    ``num_layers`` is the model's block count (blocks past it are refused); ``memory`` and ``memory_bytes`` size
    the warnings of :meth:`check`.
    """

    def __init__(self, dht: Any, dht_prefix: str, node_id: str, trust: Any, *, num_layers: int,
                 memory: Optional[AssignmentMemory] = None, memory_bytes: int = 0):
        self.dht, self.dht_prefix, self.node_id, self.trust = dht, dht_prefix, node_id, trust
        self.num_layers, self.memory, self.memory_bytes = num_layers, memory, memory_bytes
        self._failed: Optional[Assignment] = None  # the last assignment whose blocks failed to load
        self._logged: set = set()  # malformed records and assignments already warned about

    def fetch(self) -> Optional[Assignment]:
        """The assignment to serve, or None when there is none (absent, expired, malformed, under another key, or
        the one that failed to load)."""
        key = self.trust.key(self.dht, self.dht_prefix)
        try:
            owned = [] if key is None else fetch_owned(self.dht, f"{self.dht_prefix}.{records.ASSIGNMENTS}")
        except Exception as exc:
            logger.warning("node %s could not read assignments: %s", self.node_id, exc)
            return None
        for name, owner, raw, _ in owned:
            if name != self.node_id or owner != key:
                continue
            try:
                assignment = Assignment.from_dict(raw)
                self.check(assignment)
            except (RecordError, TypeError, ValueError) as exc:
                self._log_once(repr(raw), "node %s ignores a malformed assignment %r: %s", self.node_id, raw, exc)
                return None
            return None if assignment == self._failed else assignment
        return None

    def check(self, assignment: Assignment) -> None:
        """Refuse blocks past the model's end; warn (once per assignment) of one this node cannot serve well."""
        if assignment.end > self.num_layers:
            raise RecordError(f"blocks {assignment.start}:{assignment.end} exceed the model's "
                              f"{self.num_layers} blocks")
        if self.memory is None:
            return
        for problem in self.memory.problems(assignment, self.memory_bytes):
            self._log_once(("feasible", repr(assignment), problem), "node %s: assignment %s %s", self.node_id,
                           assignment, problem)

    def failed(self, assignment: Assignment) -> None:
        """``assignment``'s blocks failed to load: wait for the orchestrator to assign something else."""
        self._failed = assignment

    def _log_once(self, fingerprint: Any, message: str, *args: Any) -> None:
        if fingerprint not in self._logged:
            self._logged.add(fingerprint)
            logger.warning(message, *args)
