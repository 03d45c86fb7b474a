"""Process hygiene for swarm peers started as child processes.

A petals server owns a DHT process, its p2pd daemon, handler processes and threads. Each peer therefore
runs in its own process group, follows its launcher (a watchdog kills the whole group when the launcher
dies) and turns SIGTERM into a normal exit so that ``finally`` blocks shut petals down cleanly.

Peers forked from one parent (``server.local_swarm``'s forkserver, which has imported hivemind) also inherit
hivemind's process-wide ``MPFuture`` locks: one peer SIGKILLed while it held one (a failpoint, the chaos soak, a
crash) would block every other peer's DHT calls and every later peer's start, for good. Each peer therefore
takes locks of its own (:func:`own_mpfuture_locks`); its own DHT and handler processes share them.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import glob
import os
import signal
import stat
import sys
import threading
import time
from typing import Callable


def own_mpfuture_locks() -> None:
    """Replace the ``MPFuture`` locks this process inherited with its own (when hivemind is already imported: a
    fresh import makes fresh ones). Call it before the process makes any ``MPFuture`` (hivemind's
    ``MPFuture.reset_backend``)."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()


def share_tensors_by_descriptor() -> None:
    """Have this process share tensors between processes by file descriptor (torch's own default on Linux), not
    through files that a ``torch_shm_manager`` tracks (hivemind's default, set when ``hivemind`` is imported).

    For the bootstrap DHT peer: its only shared memory is hivemind's ``MPFuture`` state buffer, which its DHT process
    inherits at fork, and it makes no DHT calls of its own. Under hivemind's default it starts a ``torch_shm_manager``
    (a binary that loads libtorch: 0.3-0.4 CPU-s, measured 2026-11-30) for that one buffer. Every other peer keeps
    hivemind's choice: each DHT call pickles an ``MPFuture`` to the DHT process, where a descriptor would cost one
    more round trip to the sender per call, and a server's handler processes hand every step's tensors to its runtime.
    Call it after ``import hivemind`` and before the process makes its first ``MPFuture``."""
    import hivemind.utils.mpfuture  # noqa: F401  (its import sets hivemind's strategy: this call comes after it)
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_descriptor")


def freeze_imported_heap() -> None:
    """Move every object alive now to the garbage collector's permanent generation (``gc.freeze``), so that no later
    full collection walks them again. Call it once, when a peer has imported what it runs and before its own work.

    A peer's imports (torch, transformers, hivemind, petals) leave ~380k objects that live as long as the process. A
    full collection walks them all: 0.2 CPU-s each time (measured 2026-11-30 on the 2-core host), a pause of every
    thread of the peer in the middle of whatever step it was serving. transformers' ``from_pretrained`` and petals'
    ``Server.run`` each ask for one, and the collector starts one by itself as the heap grows. Frozen objects are never
    freed, which for modules is what happens anyway; no collection runs first (a peer forked from the forkserver
    would pay 0.2 s for nothing: its heap is the forkserver's, whose imports make little garbage)."""
    gc.freeze()


def become_group_leader(launcher_pid: int, poll_s: float = 1.0, *, child_of_launcher: bool = False) -> None:
    """Make this process a process-group leader that exits cleanly on SIGTERM and dies with its launcher.

    With ``child_of_launcher`` (the launcher forked this process) the watchdog watches the parent id
    instead, which changes the moment the launcher exits, before it is reaped (a zombie still answers
    ``kill(pid, 0)``).
    """
    os.setpgrp()
    own_mpfuture_locks()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:  # diagnostics never stop a peer from starting:
        # a crash (SIGSEGV, SIGBUS, SIGABRT ...) prints every thread's Python stack before the process dies, and
        # a launcher that gives up on it sees where it hung (SIGUSR1)
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, OSError, RuntimeError, ValueError):
        pass

    def launcher_gone() -> bool:
        if child_of_launcher:
            return os.getppid() != launcher_pid
        try:
            os.kill(launcher_pid, 0)
        except ProcessLookupError:
            return True
        return False

    def watchdog() -> None:
        while True:
            time.sleep(poll_s)
            if launcher_gone():
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watchdog, name="launcher-watchdog", daemon=True).start()


def children_die_with_me(poll_s: float = 1.0) -> None:
    """Make every process forked from now on (and its own forks) kill itself when its parent dies.

    hivemind's DHT runs in a forked child that outlives a SIGKILLed parent, with its p2pd still listening
    on the parent's port under the parent's identity (libp2p binds with SO_REUSEPORT, so a restarted
    orchestrator would share its port with the orphan). The orphan's p2pd exits with it.
    """
    def watch_parent() -> None:
        leave_stop_signals_to_parent()
        parent = os.getppid()

        def watchdog() -> None:
            while os.getppid() == parent:
                time.sleep(poll_s)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()

    os.register_at_fork(after_in_child=watch_parent)


def leave_stop_signals_to_parent() -> None:
    """In a forked child (a DHT, a connection handler): ignore SIGINT and take SIGTERM's default, instead of
    the parent's handlers that the fork copied.

    A terminal's Ctrl-C and systemd's stop reach every process of the group (the unit) at once. With the parent's
    handlers a forked child did what the parent does: under the orchestrator's event loop a SIGTERM woke
    nothing (the handler only writes to the parent's wakeup fd), so the DHT process outlived its
    ``terminate()`` and the orchestrator waited for it at exit for good; a server's DHT process raised
    ``SystemExit`` mid-loop and answered nothing after it. Now Ctrl-C is the parent's alone (it stops its
    children in order), and a SIGTERM ends a child at once, as ``terminate()`` expects. (A libp2p daemon exec'd
    from such a child still ends on Ctrl-C: Go installs its own SIGINT handler over an inherited SIG_IGN.)"""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # not the main thread of the main interpreter: nothing of the parent's to undo here
        pass


def stop_process_group(process, timeout: float = 10.0, *,
                       drain: Callable[[float], object] | None = None) -> None:
    """SIGTERM a peer started by ``become_group_leader``, wait up to ``timeout``, then SIGKILL what is left.

    ``drain(timeout)``, when given, runs right after the SIGTERM and before the wait, e.g. to read the
    last message the peer sends on a pipe as it shuts down.
    """
    if process.pid is None:
        return
    if process.is_alive():
        try:
            os.kill(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if drain is not None:
            drain(timeout)
        process.join(timeout)
    try:  # whatever is left of the group: handlers, DHT, p2pd
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.join(1.0)


def _hivemind_socket_prefix() -> str:
    try:
        from hivemind.p2p import P2P

        return P2P._UNIX_SOCKET_PREFIX.removeprefix("/unix")  # "/tmp/hivemind-"
    except (ImportError, AttributeError):
        return "/tmp/hivemind-"


_BIND_MARGIN_S = 0.1  # see remove_stale_sockets


def bound_unix_socket_paths() -> set[str] | None:
    """The paths of every unix socket bound on this machine now (``/proc/net/unix``), None where it cannot be read."""
    try:
        with open("/proc/net/unix") as f:
            return {parts[7] for parts in (line.split() for line in f.readlines()[1:]) if len(parts) >= 8}
    except OSError:
        return None


def remove_stale_sockets(since: float) -> int:
    """Unlink hivemind's unix sockets (each libp2p daemon's and its client's, in ``/tmp``) made by this user at or
    after ``since`` (``time.time()``) that no process has bound any more; return how many.

    hivemind removes them when a peer shuts down cleanly, but a peer killed with its group (a stopped or killed
    swarm peer, a crash) leaves both behind: a day of test runs left 15,000 in ``/tmp``. Without
    ``/proc/net/unix`` (not Linux) nothing is removed.

    Another swarm's peers may be starting meanwhile. A socket's file is made by its ``bind``, so the files are
    listed *before* the bound sockets are read: a file in the list whose socket is live is in that read. Files of
    the last ``_BIND_MARGIN_S`` are left alone all the same (the kernel makes the file a moment before it lists the
    socket's path, and file times come from a coarse clock). Until 2026-12-01 the read came first and every file
    under a second old was left, which kept the handler sockets of a server stopped within a second of its
    handlers' start (a CI-like run of ``tests/test_stop_signals.py`` left one).
    """
    young = time.time() - _BIND_MARGIN_S
    candidates = []
    for path in glob.glob(glob.escape(_hivemind_socket_prefix()) + "*.sock"):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISSOCK(info.st_mode) and info.st_uid == os.getuid() and since <= info.st_ctime < young:
            candidates.append(path)
    if not candidates:
        return 0
    bound = bound_unix_socket_paths()
    if bound is None:  # not Linux: which files are still bound is unknown (an empty set is a machine with none)
        return 0
    removed = 0
    for path in candidates:
        if path not in bound:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
    return removed
