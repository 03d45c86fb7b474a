"""What a reload of an orchestrated node depends on (used by :mod:`server.node`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from swarm.trust.records import Assignment


def _layout(assignment: Optional[Assignment]) -> Optional[tuple]:
    """What a reload depends on: everything but the plan id."""
    if assignment is None:
        return None
    return (assignment.start, assignment.end, assignment.cache_slots, assignment.max_length,
            assignment.prefix_cache_tokens, assignment.slot_size)


def _served_in_place(new: Assignment, current: Optional[Assignment]) -> Optional[Assignment]:
    """``new`` as this server can serve it without reloading, or None when a reload is needed
    (:meth:`Assignment.in_place_of`: the orchestrator's make-before-break waves use the same rule)."""
    return new.in_place_of(current)


@dataclasses.dataclass(frozen=True)
class AssignmentMemory:
    """The memory an assignment takes on this node: ``block_bytes`` per block plus its KV cache."""

    block_bytes: int
    cache_bytes_per_token: int

    def cache_bytes(self, assignment: Assignment) -> int:
        """KV cache pool for the assignment: ``cache_slots`` block-slots of ``slot_size`` tokens (a session takes
        its own KV need of the pool on each block; petals shares the pool across the server's blocks) plus the
        prefix budget on every block."""
        return self.session_cache_bytes(assignment) + self.prefix_cache_bytes(assignment)

    def session_cache_bytes(self, assignment: Assignment) -> int:
        """The part of :meth:`cache_bytes` that petals' session pool gets (the rest is the prefix store's, kept
        apart so that cached prefixes never take a planned session slot)."""
        return self.cache_bytes_per_token * assignment.cache_slots * assignment.slot_size

    def prefix_cache_bytes(self, assignment: Assignment) -> int:
        return self.cache_bytes_per_token * assignment.prefix_cache_tokens * assignment.num_blocks

    def needed(self, assignment: Assignment) -> int:
        return self.block_bytes * assignment.num_blocks + self.cache_bytes(assignment)

    def problems(self, assignment: Assignment, budget_bytes: int) -> list[str]:
        """Why the assignment would serve badly here (it is loaded anyway: the orchestrator planned it)."""
        out = []
        if assignment.num_blocks and assignment.cache_slots == 0 and assignment.prefix_cache_tokens == 0:
            out.append("has blocks but no cache slots")
        need = self.needed(assignment)
        if need > budget_bytes:
            out.append(f"needs {need / 2**30:.3f} GiB, more than the {budget_bytes / 2**30:.3f} GiB budget")
        return out
