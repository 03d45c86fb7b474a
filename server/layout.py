"""What a reload of an orchestrated node depends on (used by :mod:`server.node`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from swarm.records import Assignment


def _layout(assignment: Optional[Assignment]) -> Optional[tuple]:
    """What a reload depends on: everything but the plan id."""
    if assignment is None:
        return None
    return (assignment.start, assignment.end, assignment.cache_slots, assignment.max_length,
            assignment.prefix_cache_tokens)


def _served_in_place(new: Assignment, current: Optional[Assignment]) -> Optional[Assignment]:
    """``new`` as this server can serve it without reloading, or None when a reload is needed.

    Same blocks, session length and prefix budget, and no more KV slots than the loaded pool holds: the
    node keeps its (larger) pool, so the returned assignment carries the loaded slot count.
    """
    if current is None or (new.start, new.end, new.max_length, new.prefix_cache_tokens) != (
            current.start, current.end, current.max_length, current.prefix_cache_tokens):
        return None
    if new.cache_slots > current.cache_slots:
        return None
    return dataclasses.replace(new, cache_slots=current.cache_slots)
