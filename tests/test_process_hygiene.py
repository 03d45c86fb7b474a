"""Process hygiene of peers forked from one parent (swarm.runtime.process): a peer SIGKILLed while it held one of
hivemind's process-wide ``MPFuture`` locks blocks no other peer.

The locks are class attributes made when hivemind is imported, so every process forked after that import (the
LocalSwarm forkserver's peers) shares them. A failpoint run caught it: a joining server killed as it loaded its range
left the orchestrator's DHT reads and writes hanging for minutes, and the next test's DHT never started.
"""
import contextlib
import multiprocessing as mp
import os
import signal
import time

from hivemind.utils.mpfuture import MPFuture

from swarm.runtime.process import become_group_leader


def _die_holding_the_lock() -> None:
    MPFuture._update_lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def _try_the_lock(own: bool, launcher: int, answer) -> None:
    if own:
        become_group_leader(launcher)  # what every peer process does first
    answer.send(MPFuture._update_lock.acquire(timeout=2.0))


def _peer_after_a_killed_one(own: bool) -> bool:
    ctx = mp.get_context("fork")
    MPFuture._update_lock = ctx.Lock()  # the lock both children inherit (a fresh one each time)
    victim = ctx.Process(target=_die_holding_the_lock)
    victim.start()
    victim.join(10)
    assert victim.exitcode == -signal.SIGKILL
    receive, send = ctx.Pipe(duplex=False)
    peer = ctx.Process(target=_try_the_lock, args=(own, os.getpid(), send))
    peer.start()
    try:
        assert receive.poll(10)
        return receive.recv()
    finally:
        peer.join(10)
        if peer.is_alive():
            peer.kill()


def test_a_peer_killed_holding_an_mpfuture_lock_blocks_no_other_peer():
    saved = MPFuture._update_lock  # this process's own lock is never taken by a victim
    try:
        assert _peer_after_a_killed_one(own=True)  # a peer takes locks of its own: not blocked
        assert not _peer_after_a_killed_one(own=False)  # the hazard itself: the inherited lock stays held
    finally:
        MPFuture._update_lock = saved


def test_a_node_that_crashes_leaves_no_process_behind(tiny_model):
    """A node's main process dies alone (a crash: SIGKILL to it, not to its group): its DHT process, p2pd daemons
    and connection handlers go with it (a node that died of SIGSEGV once left its DHT process running, orphaned)."""
    import psutil

    from helpers import wait_for
    from server.local_swarm import LocalSwarm

    with LocalSwarm(tiny_model) as swarm:
        swarm.start_dht()  # what the first node would start
        # the bootstrap DHT peer shares no tensors: no torch_shm_manager beside its DHT process and daemon
        # (swarm.runtime.process.share_tensors_by_descriptor), where every server keeps hivemind's manager
        bootstrap = {p.name() for p in psutil.Process(swarm.dht.process.pid).children(recursive=True)}
        assert "p2pd" in bootstrap and not any(n.startswith("torch_shm_manag") for n in bootstrap), bootstrap
        node = swarm.add_node(node_id="n0", memory_gb=0.5, num_handlers=1)
        family = psutil.Process(node.process.pid).children(recursive=True)
        assert len(family) >= 2  # its DHT process and p2pd at least
        # one libp2p daemon, its DHT's: petals' reachability probe (a second daemon per server) is not started
        # (server.handler.NoReachabilityProbe); petals starts it as the server is built, seconds before the profile
        for _ in range(8):
            daemons = [p for p in psutil.Process(node.process.pid).children(recursive=True) if p.name() == "p2pd"]
            assert len(daemons) == 1, [" ".join(p.cmdline()) for p in daemons]
            time.sleep(0.25)
        os.kill(node.process.pid, signal.SIGKILL)
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family), 15,
                 what="the crashed node's processes gone", explain=lambda: [
                     (p.pid, p.name()) for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE])


def test_a_killed_server_leaves_no_socket_behind_once_the_swarm_stops(tiny_model):
    """A server killed with its whole group (SIGKILL, as the failure tests kill) cannot remove the unix sockets in
    /tmp that hivemind removes on a clean shutdown (its libp2p daemon's, its connection handlers'): a day of test
    runs left 15,000 there. The swarm removes the stale ones when it stops (``remove_stale_sockets``)."""
    import psutil

    from server.local_swarm import LocalSwarm

    with LocalSwarm(tiny_model, open_sessions=True) as swarm:
        server = swarm.add_server((0, 4), num_handlers=1)
        processes = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]
        bound = {c.laddr for p in processes for c in p.net_connections(kind="unix") if "/hivemind-" in c.laddr}
        assert any("/hivemind-p2pclient-" in path for path in bound), bound  # a handler's, and the daemon's
        swarm.kill(server)
    assert not [path for path in bound if os.path.exists(path)]


@contextlib.contextmanager
def hivemind_socket_file(monkeypatch, kind: str, listen: bool):
    """A unix socket bound at a hivemind-style path in /tmp (listening, or closed at once: a stale file), old
    enough for ``remove_stale_sockets`` to judge it, and the only file it looks at (other workers' live sockets
    must not be judged by a test's made-up bound set); removed at the end."""
    import socket
    import uuid

    from swarm.runtime import process

    path = f"{process._hivemind_socket_prefix()}{kind}-test-{uuid.uuid4().hex[:12]}.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    if listen:
        sock.listen()
    else:
        sock.close()  # the file stays, bound by nobody
    try:
        monkeypatch.setattr(process.glob, "glob", lambda pattern: [path])
        time.sleep(2 * process._BIND_MARGIN_S)  # files younger than the margin are left alone
        yield path, sock
    finally:
        sock.close()
        if os.path.exists(path):
            os.unlink(path)


def test_stale_sockets_are_removed_on_a_machine_where_none_is_bound(monkeypatch):
    """An unbound hivemind socket file goes whether or not any other unix socket is bound on the machine (a
    minimal container binds none: the stale files stayed there, since an empty /proc/net/unix read as "cannot
    tell"); where /proc/net/unix cannot be read, nothing is removed."""
    from swarm.runtime import process

    since = time.time() - 1.0
    with hivemind_socket_file(monkeypatch, "p2pd", listen=False) as (path, _):
        monkeypatch.setattr(process, "bound_unix_socket_paths", lambda: None)
        assert process.remove_stale_sockets(since) == 0 and os.path.exists(path)
        monkeypatch.setattr(process, "bound_unix_socket_paths", set)
        assert process.remove_stale_sockets(since) == 1 and not os.path.exists(path)


def test_a_live_socket_is_kept_and_goes_once_closed(monkeypatch):
    """A socket still bound (another swarm's live peer) is never removed, however old; the moment it is closed its
    file is stale and goes — a server stopped a fraction of a second after its handlers started left their files
    while files under a second old were all kept."""
    from swarm.runtime import process

    since = time.time() - 1.0
    with hivemind_socket_file(monkeypatch, "p2pclient", listen=True) as (path, sock):
        assert process.remove_stale_sockets(since) == 0 and os.path.exists(path)
        sock.close()
        assert process.remove_stale_sockets(since) == 1 and not os.path.exists(path)
