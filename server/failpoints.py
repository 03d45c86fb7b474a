"""Failpoints: a node that dies at an exact phase of its work, as a crash would (tests and chaos drills).

A node started with ``failpoint_file=PATH`` (a :class:`server.node.ChainswarmServer` option; ``LocalSwarm.add_node``
passes it) looks at PATH each time its work reaches one of :data:`PHASES`. When the file's first word names that phase, the node removes the file
and SIGKILLs its whole process group — the server process, its handler processes, its DHT — at that instant.
Without the option nothing is looked at. The processes of a server node share one process group that the node
leads (:func:`swarm.runtime.process.become_group_leader`); :func:`arm` refuses anything else, so a failpoint can
never take down the process that started the node.

Phases:

* ``prefill``: a session's first step (its prompt) is about to run;
* ``decode``: a one-token step of a running session is about to run;
* ``verify``: a step with drafted tokens (speculative decoding) is about to run;
* ``between_steps``: a step's answer has been sent and the session's next step has not come yet;
* ``probe``: a prefix-cache probe arrived;
* ``drain``: the node starts draining before it moves to a new range;
* ``load``: the node starts loading the range of a new assignment.
"""
from __future__ import annotations

import os
import signal
from typing import Optional

PHASES = ("prefill", "decode", "verify", "between_steps", "probe", "drain", "load")

_path: Optional[str] = None
_group: Optional[int] = None


def arm(path: Optional[str]) -> None:
    """Watch ``path`` from now on in this process and the processes it forks (None: disarm)."""
    global _path, _group
    if path is None:
        _path = _group = None
        return
    if os.getpgrp() != os.getpid():
        raise ValueError("a failpoint needs a node that leads its own process group (a node process, not a "
                         "server run inside another program)")
    _path, _group = str(path), os.getpgrp()


def armed() -> bool:
    """Whether this process watches a failpoint file (callers skip preparing a phase when not)."""
    return _path is not None


def hit(phase: str) -> None:
    """The node's work reached ``phase``: die here if the failpoint file names it."""
    if _path is None:
        return
    try:
        with open(_path) as f:
            words = f.read().split()
    except OSError:
        return
    if not words or words[0] != phase:
        return
    try:
        os.unlink(_path)  # a node restarted with the same file does not die again
    except OSError:
        pass
    os.killpg(_group, signal.SIGKILL)


def step_phase(position: int, tokens: int) -> str:
    """The phase of a step of ``tokens`` new positions on a session that holds ``position`` already."""
    if position == 0:
        return "prefill"
    return "decode" if tokens <= 1 else "verify"
