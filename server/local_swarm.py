"""Start a whole swarm on this machine: petals servers, an orchestrator and their DHT, in child processes.

This is the launcher behind the demo, the multi-process tests and the live experiments. Children come
from a *forkserver* that has already imported torch and petals, so a server starts without paying for the
imports again, and servers can be added or killed at any point — also after the launching process has
started client threads, which a plain ``fork`` would not survive. Every peer runs in its own process
group with a watchdog on the launcher, so nothing outlives the swarm, even when the launcher is killed.

Environment variables that should reach the servers must be set before the first swarm starts (the
forkserver keeps the environment it was started with).

With ``wan=`` (a :class:`wan.WanConfig`) the swarm runs behind the WAN emulator: the emulator starts
with the DHT, every server or node takes the next server host of the config (``127.0.0.k``; or the one named
by ``wan_host=``), listens on its real port and announces the emulator's proxy port, and the orchestrator's
DHT peer sits on the client host (127.0.0.1) behind a proxy of its own, so that every path — orchestrator
or client → server, server → server and server → orchestrator (the nodes' RTT probes) — pays the
configured RTT. The bootstrap DHT and the HTTP API stay undelayed on 127.0.0.1.

Who the others join: an orchestrator started before any server is the swarm's bootstrap peer, as in a deployment
where volunteers join with the orchestrator's address; otherwise the first server or node started (or
:meth:`LocalSwarm.start_dht`) starts a bootstrap DHT peer of its own, which a WAN-emulated swarm always has. A
peer fewer (its DHT process and libp2p daemon: ~1.5 CPU-s over a test module) for every swarm that starts its
orchestrator first.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.model.checkpoint import dht_prefix_for
from swarm.runtime.process import remove_stale_sockets, stop_process_group

# What the forkserver imports once, so that every peer forked from it starts without importing it again
# (petals.utils.peft: petals' backend imports it inside TransformerBackend.__init__, ~0.3 s in every server).
_PRELOAD = ["swarm.model.compat", "torch._dynamo", "petals.server.server", "petals.utils.peft", "server.runner",
            "swarm.runtime.dht", "server.node", "swarm.service"]

# ChainswarmServer keyword arguments (the rest of add_node's options are petals Server kwargs).
_NODE_OPTIONS = ("check_period", "assignment_poll", "drain_timeout", "profile_ttl_factor", "rtt_period",
                 "profile_cache_dir", "declared_profile", "emulated_compute", "identity_key", "orchestrator_key",
                 "open_sessions", "failpoint_file")


class SwarmStartError(RuntimeError):
    """A peer of a local swarm failed to start; the message carries the peer's own error."""


@dataclass
class Peer:
    """A running child peer (bootstrap DHT or server)."""

    name: str
    process: Any
    peer_id: str | None = None
    start: int | None = None
    end: int | None = None
    info: dict = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def dump_stacks(self, wait_s: float = 1.0) -> None:
        """Have the peer write every thread's Python stack to its stderr (``faulthandler`` on SIGUSR1, set up by
        :func:`swarm.runtime.process.become_group_leader`) and give it ``wait_s`` to do so."""
        with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
            os.kill(self.process.pid, signal.SIGUSR1)
            time.sleep(wait_s)


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _await_report(peer: Peer, conn, timeout: float) -> tuple:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            message = conn.recv()
            if message[0] == "error":
                raise SwarmStartError(f"{peer.name} failed to start: {message[1]}")
            return message
        if not peer.process.is_alive():
            raise SwarmStartError(f"{peer.name} exited with code {peer.process.exitcode} before it was ready")
    _give_up_on(peer)
    raise SwarmStartError(f"{peer.name} was not ready after {timeout:.0f} s (its Python stacks are dumped to stderr)")


def _give_up_on(peer: Peer) -> None:
    """A child that never came up: dump its Python stacks to stderr (``faulthandler`` on SIGUSR1, set up by
    :func:`swarm.runtime.process.become_group_leader`) so the report shows where it hung, kill its process
    group, and retire the forkserver, so that the next peer is forked from a fresh one (two CI runs saw every
    peer start after some point hang; a fresh forkserver bounds that to one test. The likely cause, peers that
    shared hivemind's MPFuture locks, is fixed: :func:`swarm.runtime.process.own_mpfuture_locks`)."""
    from multiprocessing import forkserver

    pid = peer.process.pid
    peer.dump_stacks()
    with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
        os.killpg(pid, signal.SIGKILL)  # the whole group, whatever the leader's state
    server_pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if server_pid:
        try:
            os.kill(server_pid, signal.SIGKILL)
            deadline = time.monotonic() + 10.0
            # dead but not reaped (WNOWAIT): multiprocessing reaps it and starts a fresh one at the next start
            while os.waitid(os.P_PID, server_pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        except (ProcessLookupError, ChildProcessError):
            pass


class LocalSwarm:
    """Any number of petals servers for one model and their DHT, on loopback.

    >>> with LocalSwarm("models/tiny") as swarm:
    ...     swarm.add_server((0, 2)); swarm.add_server((2, 4))   # the first one starts a bootstrap DHT peer
    ...     peers = swarm.initial_peers   # give these to clients
    """

    def __init__(self, model_dir: str | Path, *, dht_prefix: str | None = None, host: str = "127.0.0.1",
                 wan: Any = None, wan_backend: str = "userspace", open_sessions: bool = False):
        """``open_sessions``: nodes serve sessions without orchestrator tickets (vanilla petals clients);
        by default they are secure: the swarm's orchestrator key (:attr:`orchestrator_identity`, created here
        and handed to the orchestrator) is given to every node, which then serves only ticketed sessions."""
        from swarm.trust.identity import Identity

        self.open_sessions = open_sessions
        self._created_at = time.time()  # the hivemind sockets its killed peers leave are removed from then on
        self.orchestrator_identity = Identity.generate()
        self.model_dir = str(model_dir)
        self.dht_prefix = dht_prefix or dht_prefix_for(model_dir)
        self.host = host
        self.dht: Peer | None = None
        self.orchestrator: Peer | None = None
        self.servers: list[Peer] = []
        self._ctx = _context()
        self.wan = wan  # wan.WanConfig or None
        self.wan_backend = wan_backend
        self.emulator = None  # wan.WanEmulator while running
        self._wan_taken: set[str] = set()
        if wan is not None and wan.ip(wan.client) != host:
            raise ValueError(f"the WAN config's client host is {wan.ip(wan.client)}, the swarm's host {host}")

    # -- lifecycle -----------------------------------------------------------------------------------
    def __enter__(self) -> "LocalSwarm":
        if self.wan is not None:  # the emulator starts with the DHT, before any peer
            self.start_dht()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start_dht(self, port: int = 0, timeout: float = 60.0) -> list[str]:
        """Start the bootstrap DHT peer; return its multiaddrs (what clients and servers join with)."""
        from swarm.runtime.dht import bootstrap_dht_main

        if self.dht is not None:
            return self.initial_peers
        if self.wan is not None and self.emulator is None:
            from wan import WanEmulator

            # the client host gets a proxy too: the orchestrator's DHT peer announces it (see the module doc)
            self.emulator = WanEmulator(self.wan, backend=self.wan_backend,
                                        hosts=self.wan.servers + [self.wan.client])
            self.emulator.start()
        receive, send = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=bootstrap_dht_main, args=(self.host, port, os.getpid(), send, self.dht_prefix), name="dht",
            daemon=False,
        )
        process.start()
        self.dht = Peer("dht", process)
        _, maddrs = _await_report(self.dht, receive, timeout)
        self.dht.info["maddrs"] = maddrs
        return maddrs

    @property
    def initial_peers(self) -> list[str]:
        """The multiaddrs a new peer joins with: the bootstrap orchestrator's DHT peer, or the bootstrap DHT peer
        (started now if the swarm has neither yet)."""
        if self.dht is None:
            if self.orchestrator is not None and self.orchestrator.info.get("bootstrap"):
                return list(self.orchestrator.info["maddrs"])  # the orchestrator's own DHT peer
            self.start_dht()
        return list(self.dht.info["maddrs"])

    # -- WAN emulation ---------------------------------------------------------------------------------
    @property
    def wan_endpoints(self) -> dict:
        """``{host: wan.Endpoint}`` of the running emulator (empty without ``wan``)."""
        return dict(self.emulator.endpoints) if self.emulator is not None else {}

    def _network_options(self, wan_host: str | None, options: dict) -> tuple[dict, str | None]:
        """``host``/``port``/``announce_port`` for the next server (its WAN host's endpoint)."""
        if self.wan is None:
            if wan_host is not None:
                raise ValueError("wan_host needs a LocalSwarm(wan=...)")
            return {"host": options.pop("host", self.host)}, None
        if self.emulator is None:
            raise RuntimeError("start the DHT (and with it the WAN emulator) before adding servers")
        if wan_host is None:
            free = [h for h in self.wan.servers if h not in self._wan_taken]
            if not free:
                raise ValueError(f"all {len(self.wan.servers)} server hosts of the WAN config are taken")
            wan_host = free[0]
        elif wan_host not in self.wan.servers:
            raise ValueError(f"{wan_host!r} is not a server host of the WAN config ({self.wan.servers})")
        for key in ("host", "port", "announce_port"):
            if key in options:
                raise ValueError(f"{key} is set by the WAN emulator; do not pass it with wan=")
        self._wan_taken.add(wan_host)
        ep = self.emulator.endpoints[wan_host]
        return {"host": ep.ip, "port": ep.real_port, "announce_port": ep.port}, wan_host

    def add_server(
        self,
        blocks: tuple[int, int] | None = None,
        *,
        num_blocks: int | None = None,
        name: str | None = None,
        timeout: float = 120.0,
        wait: bool = True,
        wan_host: str | None = None,
        **options: Any,
    ) -> Peer:
        """Start a petals server serving ``blocks = (start, end)`` (or ``num_blocks`` chosen by petals).

        ``options`` go to :func:`server.runner.offline_server_kwargs` (``cache_tokens``, ``max_length``,
        ``port``, ``announce_port``, any petals ``Server`` kwarg ...). With ``wait`` (the default) this
        returns once the server's blocks answer requests. With a WAN config the server takes host
        ``wan_host`` (default: the next free server host of the config).
        """
        from server.runner import offline_server_kwargs, server_process_main

        network, wan_host = self._network_options(wan_host, options)
        kwargs = offline_server_kwargs(
            self.model_dir, dht_prefix=self.dht_prefix, initial_peers=self.initial_peers,
            block_indices=blocks, num_blocks=num_blocks, **network, **options,
        )
        name = name or f"server{len(self.servers)}"
        receive, send = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=server_process_main, args=(kwargs, os.getpid(), send), name=name, daemon=False
        )
        process.start()
        peer = Peer(name, process, info={"kwargs": kwargs, "report": receive, "wan_host": wan_host,
                                         "ip": network["host"]})
        self.servers.append(peer)
        if wait:
            self.wait_ready(peer, timeout)
        return peer

    def wait_ready(self, peer: Peer, timeout: float = 120.0) -> Peer:
        """Block until ``peer`` reports that its blocks serve requests."""
        if peer.peer_id is None:
            _, peer.peer_id, peer.start, peer.end = _await_report(peer, peer.info["report"], timeout)
        return peer

    # -- orchestrated nodes (server.node.ChainswarmServer) ---------------------------------------------
    def add_node(
        self,
        *,
        node_id: str | None = None,
        memory_gb: float | None = None,
        wait: bool = True,
        timeout: float = 120.0,
        update_period: float = 2.0,
        wan_host: str | None = None,
        process_main=None,
        **options: Any,
    ) -> Peer:
        """Start an orchestrated server node that profiles itself and waits for its assignment.

        ``process_main`` replaces :func:`server.node.node_process_main` as the child's entry point (same
        arguments; a picklable callable: the spot checks' hostile volunteers, ``experiments.live.adversaries``).
        ``options`` are :class:`server.node.ChainswarmServer` arguments (``check_period``,
        ``drain_timeout``, ``profile_cache_dir`` ...) or petals ``Server`` kwargs via
        :func:`server.runner.offline_server_kwargs` (``device``, ``torch_dtype``, ``port``, ...).
        ``update_period`` is the profile heartbeat (petals announces blocks every max(it, 10) s). With ``wait`` (the
        default) this returns once the node has published its profile; ``peer.info["profile"]`` holds it.
        """
        from server.node import node_process_main
        from server.runner import offline_server_kwargs

        node_options = {key: options.pop(key) for key in _NODE_OPTIONS if key in options}
        node_options.setdefault("orchestrator_key", self.orchestrator_identity.public)  # None: trust on first use
        node_options.setdefault("open_sessions", self.open_sessions)
        network, wan_host = self._network_options(wan_host, options)
        kwargs = offline_server_kwargs(
            self.model_dir, dht_prefix=self.dht_prefix, initial_peers=self.initial_peers,
            block_indices=(0, 1), update_period=update_period, **network, **options,
        )
        del kwargs["block_indices"]  # the orchestrator's assignment decides
        node_id = node_id or f"node{sum(1 for s in self.servers if 'node_id' in s.info)}"
        kwargs.update(node_options, node_id=node_id, memory_gb=memory_gb)
        receive, send = self._ctx.Pipe(duplex=False)
        pushes = self._ctx.Value("q", 0)
        process = self._ctx.Process(
            target=process_main or node_process_main, args=(kwargs, os.getpid(), send, pushes), name=node_id,
            daemon=False
        )
        process.start()
        peer = Peer(node_id, process, info={"kwargs": kwargs, "report": receive, "node_id": node_id,
                                            "pushes": pushes, "state": None, "plan_id": None,
                                            "wan_host": wan_host, "ip": network["host"]})
        self.servers.append(peer)
        if wait:
            self.wait_profiled(peer, timeout)
        return peer

    @property
    def nodes(self) -> list[Peer]:
        """The orchestrated nodes among :attr:`servers`."""
        return [peer for peer in self.servers if "node_id" in peer.info]

    def _node_message(self, peer: Peer, message: tuple) -> None:
        kind = message[0]
        if kind == "error":
            raise SwarmStartError(f"{peer.name} failed: {message[1]}")
        if kind == "profiled":
            _, _node_id, peer.peer_id, peer.info["profile"] = message
            peer.info["state"] = peer.info["profile"]["state"]
        elif kind == "timings":
            peer.info["timings"] = message[1]
        elif kind == "state":
            _, state, plan_id, start, end, slots = message
            peer.info.update(state=state, plan_id=plan_id, cache_slots=slots)
            peer.start, peer.end = start, end
            peer.info.setdefault("history", []).append((state, plan_id, start, end, slots))

    def _await_node(self, peer: Peer, done, timeout: float, what: str) -> Peer:
        conn = peer.info["report"]
        deadline = time.monotonic() + timeout
        while True:
            while conn.poll(0):
                self._node_message(peer, conn.recv())
            if done():
                return peer
            if not peer.process.is_alive():
                while conn.poll(0):
                    self._node_message(peer, conn.recv())
                raise SwarmStartError(f"{peer.name} exited with code {peer.process.exitcode} before {what}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if what == "profiled":  # it never came up (see _give_up_on)
                    _give_up_on(peer)
                raise SwarmStartError(f"{peer.name} was not {what} after {timeout:.0f} s "
                                      f"(state {peer.info.get('state')}, plan {peer.info.get('plan_id')})")
            conn.poll(min(0.1, remaining))

    def wait_profiled(self, peer: Peer, timeout: float = 120.0) -> Peer:
        """Block until the node has published its profile (``peer.peer_id`` is set then)."""
        return self._await_node(peer, lambda: "profile" in peer.info, timeout, "profiled")

    def wait_state(self, peer: Peer, state: str, plan_id: str | None = None, timeout: float = 120.0) -> Peer:
        """Block until the node reports ``state`` (under ``plan_id``, if given)."""
        return self._await_node(
            peer,
            lambda: peer.info.get("state") == state and (plan_id is None or peer.info.get("plan_id") == plan_id),
            timeout, state if plan_id is None else f"{state} under plan {plan_id}",
        )

    def wait_serving(self, peer: Peer, plan_id: str | None = None, timeout: float = 120.0) -> Peer:
        """Block until the node serves its assigned blocks (of ``plan_id``, if given); ``peer.start/end``
        then hold its range."""
        return self.wait_state(peer, "serving", plan_id, timeout)

    def kill(self, peer: Peer, sig: int = signal.SIGKILL) -> None:
        """Kill a server abruptly (with its whole process group), as a vanished volunteer would."""
        try:
            os.killpg(peer.process.pid, sig)
        except ProcessLookupError:
            pass
        peer.process.join(10)

    def stop_server(self, peer: Peer, timeout: float = 10.0) -> None:
        """Stop a server gracefully (it announces OFFLINE), then reap its process group."""
        stop_process_group(peer.process, timeout)

    # -- the orchestrator ------------------------------------------------------------------------------
    def add_orchestrator(self, *, timeout: float = 120.0, bootstrap: bool | None = None, **options: Any) -> Peer:
        """Start an orchestrator (``swarm.service``) that joins this swarm's DHT; return its peer.

        ``options`` are :class:`swarm.service.OrchestratorOptions` fields (``policy``, ``expected_rate``,
        ``api_keys``, ``http_port`` ...). ``peer.info["url"]`` is its HTTP API. Start it before the nodes
        or after: nodes wait for their assignments either way. With ``bootstrap`` the orchestrator's DHT peer is
        the swarm's (no :meth:`start_dht`): nodes added later join with its multiaddrs, ``peer.info["maddrs"]``
        (start it first then; a restart with the same ``state_dir`` keeps them). By default it is when it is the
        swarm's first peer (no DHT peer, no server yet) and the swarm has no WAN emulation; a later orchestrator
        joins the servers through :attr:`initial_peers` (a test that stops a bootstrap orchestrator and starts
        another one, with the servers kept, restarts it with ``bootstrap=True`` and the same ``state_dir``, or
        starts the swarm with :meth:`start_dht`).
        """
        from swarm.service import OrchestratorOptions, orchestrator_process_main

        if bootstrap is None:  # its first peer: with servers already joined, a fresh DHT would be a swarm apart
            bootstrap = self.dht is None and self.wan is None and not self.servers
        options.setdefault("http_port", 0)
        started = sum(1 for p in self.nodes if p.alive)
        if started:  # the first plan as soon as the nodes started so far are live (settle_s is for unknown fleets)
            options.setdefault("expect_servers", started)
        if "identity_key" not in options:  # the swarm's orchestrator key, which the nodes were given
            import tempfile

            self._key_dir = getattr(self, "_key_dir", None) or tempfile.mkdtemp(prefix="chainswarm-keys-")
            options["identity_key"] = os.path.join(self._key_dir, f"orchestrator-{os.getpid()}.der")
            if not os.path.exists(options["identity_key"]):
                with open(os.open(options["identity_key"], os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                    f.write(self.orchestrator_identity.private_key.to_bytes())
        if self.emulator is not None:  # the orchestrator's DHT peer behind the client host's proxy
            ep = self.emulator.endpoints[self.wan.client]
            options.update(dht_port=ep.real_port, dht_announce_port=ep.port)
        opts = OrchestratorOptions(model_dir=self.model_dir, initial_peers=[] if bootstrap else self.initial_peers,
                                   dht_prefix=self.dht_prefix, dht_host=self.host, http_host=self.host, **options)
        receive, send = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(target=orchestrator_process_main, args=(opts, os.getpid(), send),
                                    name="orchestrator", daemon=False)
        process.start()
        peer = Peer("orchestrator", process, info={"options": opts, "bootstrap": bootstrap})
        _, peer.info["url"], peer.info["maddrs"] = _await_report(peer, receive, timeout)
        self.orchestrator = peer
        return peer

    def wait_chains_ready(self, nodes: list[str] | None = None, timeout: float = 120.0) -> dict:
        """Block until the orchestrator's plan covers ``nodes`` (default: every node started) and every chain
        of it is served; return the orchestrator's ``/v1/swarm`` status at that moment."""
        import httpx

        if self.orchestrator is None:
            raise RuntimeError("the swarm has no orchestrator")
        wanted = set(nodes if nodes is not None else (p.info["node_id"] for p in self.nodes))
        url = self.orchestrator.info["url"]
        deadline = time.monotonic() + timeout
        status: dict = {}
        with httpx.Client(timeout=30) as http:  # one client for the polls (each httpx.get builds an SSL context)
            while time.monotonic() < deadline:
                status = http.get(f"{url}/v1/swarm").json()
                planned = status["plan"] and {s["id"] for s in status["plan"]["servers"]} >= wanted
                if planned and status["chains"] and all(c["ready"] for c in status["chains"]):
                    return status
                if not self.orchestrator.process.is_alive():
                    raise SwarmStartError("the orchestrator exited")
                time.sleep(0.25)
        raise SwarmStartError(f"chains not ready after {timeout:.0f} s: {status.get('plan_error') or status.get('chains')}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the orchestrator, every server, then the DHT. Safe to call twice."""
        if self.orchestrator is not None and self.orchestrator.process.pid is not None:
            stop_process_group(self.orchestrator.process, timeout)
        for peer in self.servers:
            if peer.process.pid is not None:
                stop_process_group(peer.process, timeout)
        if self.dht is not None:
            stop_process_group(self.dht.process, timeout)
        if self.emulator is not None:  # after the servers (spec: start it before them, stop it after)
            self.emulator.stop()
            self.emulator = None
        remove_stale_sockets(self._created_at)
        if getattr(self, "_key_dir", None):
            import shutil

            shutil.rmtree(self._key_dir, ignore_errors=True)
            self._key_dir = None
