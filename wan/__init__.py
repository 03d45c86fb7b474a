"""WAN emulation for a swarm that runs on one machine's loopback interface.

Every emulated host gets its own loopback address: the client / orchestrator (and the bootstrap DHT)
stay on ``127.0.0.1`` and server ``k`` lives on ``127.0.0.k`` (k >= 2). A :class:`WanConfig` holds the
host -> address map and a symmetric round-trip-time matrix in milliseconds. Two backends apply it:

``userspace`` (default, works everywhere)
    One proxy process (asyncio, uvloop when installed) listens on ``127.0.0.k:proxy_port`` for every
    emulated host and forwards to ``127.0.0.k:real_port``. The delay of an accepted connection is picked
    from the *peer's source address*: a connection from ``127.0.0.a`` to host ``b`` delays every chunk in
    both directions by ``RTT[a][b] / 2``, in order, through one queue of ``(due_time, bytes)`` per
    direction. A server therefore listens on the real port (petals ``host_maddrs``) and announces the
    proxy port (``announce_maddrs``), so that everybody who learns of it from the DHT goes through the
    proxy. go-libp2p dials from its listen address, so server-to-server traffic is keyed by the
    dialling server's address and sees the pairwise RTT.

    Optional bandwidth term: with ``bandwidth_mbps`` set, every chunk also pays its serialization time on
    a per-direction "link free at" clock shared by all connections of that ordered host pair.

    Optional handshake term (``connect_rtt``, on by default): a real TCP connect costs one RTT before the
    first byte can be sent, but a proxy on loopback accepts instantly. Nothing is delivered on a new
    connection before ``accept + RTT + RTT/2``, which makes the first exchange of a fresh connection cost
    2 RTT, as it would over a WAN.

``netem``
    Linux ``tc``: an ``htb`` tree on ``lo`` with one ``netem delay RTT/2`` leaf per ordered pair of
    addresses, selected by ``u32`` source/destination filters. Needs root and the ``sch_netem`` kernel
    module; when either is missing it fails with a clear :class:`BackendUnavailable`. Servers then
    announce their real port (there is no proxy).

The RTT matrix either comes straight from the caller (:meth:`WanConfig.from_matrix`) or is built from the
RIPE Atlas EU dataset (:meth:`WanConfig.from_ripe_atlas`, chain-composition spec §13.3).

Typical use by a swarm launcher (server k on 127.0.0.k; the client and bootstrap DHT on 127.0.0.1)::

    config = WanConfig.from_ripe_atlas(num_servers=3, seed=0)   # or WanConfig.load("wan.json")
    with WanEmulator(config) as emulator:                       # start it before the servers
        for name, ep in emulator.endpoints.items():
            start_server(host_maddrs=[ep.host_maddr],           # /ip4/127.0.0.k/tcp/<real port>
                         announce_maddrs=[ep.announce_maddr])   # /ip4/127.0.0.k/tcp/<proxy port>
        ...                                                     # run the experiment; stop servers first
    # CLI: chainswarm wan config --ripe-atlas --servers 3 --seed 0 --out wan.json
    #      chainswarm wan measure --config wan.json

This package must start fast: it imports neither torch nor petals, only the standard library and the
process helpers of :mod:`swarm.runtime.process` (and uvloop inside the proxy process when it is available).

Modules, one job each: :mod:`wan.config` (WanConfig, hosts and addresses, RIPE Atlas loading and the
RTT derivation), :mod:`wan.proxy` (the user-space delay proxy), :mod:`wan.netem` (the kernel netem
backend), :mod:`wan.service` (an asyncio service in a child process), :mod:`wan.emulator`
(:class:`WanEmulator`: starts and stops a backend), :mod:`wan.measure` (echo servers, RTT measurement,
the report) and :mod:`wan.cli` (``chainswarm wan``).
"""
from __future__ import annotations

from wan.config import (
    CLIENT,
    CLIENT_IP,
    Anchor,
    BackendUnavailable,
    Endpoint,
    WanConfig,
    WanError,
    default_ripe_atlas_csv,
    host_ip,
    load_ripe_atlas_anchors,
    ripe_pair_rtt_ms,
)
from wan.emulator import BACKENDS, WanEmulator
from wan.ports import free_port
from wan.measure import EchoServers, RttMeasurement, format_report, measure_rtt, measure_wan
from wan.netem import netem_available, netem_commands

__all__ = [
    "BACKENDS",
    "CLIENT",
    "CLIENT_IP",
    "Anchor",
    "BackendUnavailable",
    "EchoServers",
    "Endpoint",
    "RttMeasurement",
    "WanConfig",
    "WanEmulator",
    "WanError",
    "default_ripe_atlas_csv",
    "format_report",
    "free_port",
    "host_ip",
    "load_ripe_atlas_anchors",
    "measure_rtt",
    "measure_wan",
    "netem_available",
    "netem_commands",
    "ripe_pair_rtt_ms",
]
