"""The swarm's DHT: the bootstrap peer every server and client joins.

(Chainswarm's own DHT records — server profiles and block assignments — are added here by the runtime.)
"""
from __future__ import annotations

import os
import re

from swarm.runtime.process import remove_stale_sockets


def bootstrap_dht_main(host: str, port: int, launcher_pid: int, report, dht_prefix: str | None = None) -> None:
    """Child-process entry point: run a bootstrap hivemind DHT peer until SIGTERM.

    Sends ``("ready", [multiaddr, ...])`` through ``report`` once the peer listens. It runs the swarm's record
    validators (:mod:`swarm.trust.identity`: signatures, and Chainswarm's schemas under ``dht_prefix``), so it stores
    no forged control-plane record either.
    """
    from swarm.runtime.process import become_group_leader, share_tensors_by_descriptor

    become_group_leader(launcher_pid)
    quiet_p2p_noise()
    import hivemind

    share_tensors_by_descriptor()  # a DHT peer passes no tensors: no torch_shm_manager for it

    from hivemind.dht.crypto import RSASignatureValidator

    from swarm.trust.identity import Identity
    from swarm.trust.validation import swarm_validators

    validators = (swarm_validators(Identity.generate(), dht_prefix) if dht_prefix is not None
                  else [RSASignatureValidator()])
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/{port}"], client_mode=False,
                       record_validators=validators)
    try:
        report.send(("ready", [str(addr) for addr in dht.get_visible_maddrs()]))
        while dht.is_alive():
            dht.join(1.0)
    finally:
        stop_dht(dht)
        os._exit(0)


def stop_dht(dht) -> None:
    """Stop a started ``hivemind.DHT``: hivemind's graceful shutdown, cut short the moment its libp2p daemon is gone.

    A terminal's Ctrl-C reaches every process of the group: the daemon exits on it, and hivemind's shutdown then
    waits for the daemon's answer to removing the DHT's handlers, which never comes (the control connection is
    gone and nothing fails the pending call): every Ctrl-C of a command cost the 3 s grace period and a WARN
    "DHT did not shut down within the grace period; terminating it the hard way". So the shutdown runs in a thread
    while this one watches the daemon, before and during it (it may exit at any moment of it): once it is gone,
    nothing of the DHT is left to close and the DHT's process is ended. Then the socket files the stop left unbound
    are removed (a daemon that exits on SIGINT removes its own; one killed outright, or a DHT process ended here,
    cannot)."""
    import contextlib
    import threading

    import psutil

    if not dht.is_alive():
        return
    try:
        process = psutil.Process(dht.pid)
        daemons = process.children()
    except psutil.Error:
        return
    closing = threading.Thread(target=dht.shutdown, name="dht-shutdown", daemon=True)
    closing.start()
    while closing.is_alive() and (any(_running(d) for d in daemons) or not _running(process)):
        closing.join(0.05)
    if closing.is_alive():  # the daemon is gone and the DHT's process waits for its answer
        with contextlib.suppress(psutil.Error):
            process.terminate()  # SIGTERM: a forked child takes its default (process.leave_stop_signals_to_parent)
            closing.join(5.0)
            if closing.is_alive():
                process.kill()
        closing.join()
    remove_stale_sockets(process.create_time())  # (psutil.Process read it already)


def _running(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class StartupError(RuntimeError):
    """A peer that could not start for a reason its operator can fix (a port in use, unreachable initial peers):
    the message is one line that says which."""


class PeersUnreachable(StartupError):
    """The libp2p daemon would not start because none of the initial peers answered."""


SERVER_HINT = "is the orchestrator running, and is the address right? (it prints it; its dashboard shows the server command)"


def p2p_start_failure(exc: BaseException, initial_peers=(), option: str = "--port",
                      hint: str = SERVER_HINT) -> StartupError | None:
    """The one-line :class:`StartupError` for hivemind's ``P2PDaemonError`` when the libp2p daemon would not start
    (``None`` for any other exception). ``option`` names the flag that chose the port; ``hint`` follows a failure
    to reach ``initial_peers``."""
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    if not isinstance(exc, P2PDaemonError) or "Daemon failed to start" not in str(exc):
        return None  # not a start failure (a daemon error later, in a call, keeps its traceback)
    text = " ".join(str(exc).split()).split("Daemon failed to start:", 1)[-1].strip()
    text = re.sub(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d(\.\d+)? ", "", text)  # the daemon's log timestamp
    if "failed to connect to bootstrap peers" in text:
        peers = ", ".join(str(p) for p in initial_peers) or "none given"
        return PeersUnreachable(f"cannot reach any initial peer ({peers}): {hint}")
    if "address already in use" in text:
        where = re.search(r"listen tcp[46]? (\S+?): bind", text)
        return StartupError(f"cannot listen on {where.group(1) if where else 'its address'}: the address is "
                            f"already in use (choose another {option})")
    return StartupError(f"the libp2p daemon did not start: {text}")


_P2PD_SHUTDOWN_NOISE = "use of closed network connection"
_PEER_GONE = (ConnectionResetError, BrokenPipeError)


def _not_p2p_noise(record) -> bool:
    """False for two lines that are no fault of this process: the ERROR libp2p's daemon logs as its listener
    closes on every normal shutdown, and hivemind's WARNING with a traceback when a peer resets a stream it was
    sending requests on (hivemind returns quietly when the peer closes the stream cleanly; a reset is the same
    event: the peer cancelled or died, and a live peer retries on its side)."""
    if _P2PD_SHUTDOWN_NOISE in record.getMessage():
        return False
    return not (record.exc_info and isinstance(record.exc_info[1], _PEER_GONE)
                and record.getMessage().startswith("Exception while receiving requests"))


def quiet_p2p_noise() -> None:
    """Drop those two lines (see :func:`_not_p2p_noise`), relayed by hivemind's logger, in this process and the ones
    it forks from now on: an operator reads an ERROR or a traceback as something to act on. Other messages pass."""
    import logging

    logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_not_p2p_noise)


def reachable_maddrs(maddrs, timeout_s: float = 1.0) -> list[str]:
    """The multiaddrs among ``maddrs`` whose TCP endpoint accepts a connection within ``timeout_s`` (probed all at
    once; one that names no IP and TCP port is kept as it is): a fast filter before the libp2p daemon, which
    refuses to start when none of its bootstrap peers answers and waits for each on its own."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    def answers(maddr: str) -> bool:
        parts = str(maddr).split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            return True
        try:
            with socket.create_connection((parts[2], int(parts[4])), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            return False

    maddrs = [str(m) for m in maddrs]
    if not maddrs:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(maddrs))) as pool:
        return [m for m, ok in zip(maddrs, pool.map(answers, maddrs)) if ok]


def join_with_retries(start, initial_peers, *, timeout_s: float, what: str = "the swarm", first_wait_s: float = 2.0,
                      max_wait_s: float = 30.0, sleep=None, log=None):
    """``start()`` (which starts a DHT peer joining ``initial_peers``), tried again while none of those peers
    answers, for at most ``timeout_s`` seconds (0: once), waiting ``first_wait_s`` then twice as long each time (at
    most ``max_wait_s``), with one log line a try. Returns what ``start`` returns; the last failure past the
    deadline, as the one-line :class:`PeersUnreachable`. Any other failure is raised at once."""
    import logging
    import time

    sleep = sleep or time.sleep
    log = log or logging.getLogger(__name__)
    deadline = time.monotonic() + max(0.0, timeout_s)
    wait_s = first_wait_s
    while True:
        try:
            return start()
        except Exception as exc:
            failure = p2p_start_failure(exc, initial_peers)
            if not isinstance(failure, PeersUnreachable):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise failure from None
            wait_s = min(wait_s, max_wait_s, left)
            log.warning("cannot reach %s yet (no initial peer answers: %s); trying again in %.0f s, giving up in "
                        "%.0f s", what, ", ".join(map(str, initial_peers)), wait_s, left)
            sleep(wait_s)
            wait_s *= 2
