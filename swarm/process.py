"""Process hygiene for swarm peers started as child processes.

A petals server owns a DHT process, its p2pd daemon, handler processes and threads. Each peer therefore
runs in its own process group, follows its launcher (a watchdog kills the whole group when the launcher
dies) and turns SIGTERM into a normal exit so that ``finally`` blocks shut petals down cleanly.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time


def become_group_leader(launcher_pid: int, poll_s: float = 1.0) -> None:
    """Make this process a process-group leader that exits cleanly on SIGTERM and dies with its launcher."""
    os.setpgrp()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    def watchdog() -> None:
        while True:
            time.sleep(poll_s)
            try:
                os.kill(launcher_pid, 0)
            except ProcessLookupError:
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watchdog, name="launcher-watchdog", daemon=True).start()


def stop_process_group(process, timeout: float = 10.0) -> None:
    """SIGTERM a peer started by ``become_group_leader``, wait up to ``timeout``, then SIGKILL what is left."""
    if process.pid is None:
        return
    if process.is_alive():
        try:
            os.kill(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        process.join(timeout)
    try:  # whatever is left of the group: handlers, DHT, p2pd
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.join(1.0)
