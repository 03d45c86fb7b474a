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

This module must start fast: it imports neither torch nor petals, only the standard library (and
uvloop inside the proxy process when it is available).
"""
from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

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

CLIENT = "client"
CLIENT_IP = "127.0.0.1"
BACKENDS = ("userspace", "netem", "auto")
CONFIG_FORMAT = "chainswarm-wan/1"

# RIPE Atlas pairwise model, chain-composition spec §13.3 (the authors' construction)
RIPE_BASE_WEIGHT = 0.3  # RTT(i, j) = 0.3·base_i + 0.3·base_j + 0.01 ms/km · d(i, j)
RIPE_MS_PER_KM = 0.01
RIPE_DEFAULT_BASE_MS = 30.0
EARTH_RADIUS_KM = 6371.0

CHUNK = 1 << 16  # bytes read per chunk; each chunk is delayed as one unit
QUEUE_CHUNKS = 256  # per-direction queue bound (backpressure): at most 16 MiB in flight per direction


class WanError(RuntimeError):
    """Bad WAN configuration or a failure of the emulator."""


class BackendUnavailable(WanError):
    """The requested backend cannot run on this machine."""


# --------------------------------------------------------------------------------------------- utils


def host_ip(k: int) -> str:
    """Loopback address of emulated host ``k``: ``127.0.0.k`` (1 is the client, servers use k >= 2)."""
    if not 1 <= k <= 254:
        raise WanError(f"host index {k} out of range 1..254")
    return f"127.0.0.{k}"


def _check_loopback(ip: str) -> str:
    try:
        packed = socket.inet_aton(ip)
    except OSError:
        raise WanError(f"not an IPv4 address: {ip!r}") from None
    if packed[0] != 127 or socket.inet_ntoa(packed) != ip:
        raise WanError(f"only loopback addresses (127.0.0.0/8) may be used, got {ip!r}")
    return ip


def free_port(ip: str = CLIENT_IP) -> int:
    """A TCP port that is free on ``ip`` right now (bind to port 0, read it back, release it)."""
    _check_loopback(ip)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def default_ripe_atlas_csv() -> Path:
    """The project's copy of the RIPE Atlas EU RTT file (``experiments/data/``).

    Located next to the ``swarm`` package without importing ``experiments`` (swarm must not import it);
    this works for the source tree and for an installed wheel (``experiments/data/*`` is package data).
    """
    return Path(__file__).resolve().parent.parent / "experiments" / "data" / "ripe_atlas_eu_rtt_2024-07.csv"


# ------------------------------------------------------------------------------------ RIPE Atlas data


@dataclass(frozen=True)
class Anchor:
    """One RIPE Atlas anchor: location and base latency (median of all its measurements)."""

    anchor_id: int
    latitude: float
    longitude: float
    base_ms: float
    rows: int


def load_ripe_atlas_anchors(csv_path: str | os.PathLike | None = None) -> list[Anchor]:
    """Read the RIPE Atlas EU CSV and return one :class:`Anchor` per ``anchor_id``, sorted by id.

    ``base_ms`` is the median of all of the anchor's ``latency_m1..latency_m4`` values over all its
    rows, ignoring non-positive and non-finite values; 30 ms when none remain (spec §13.3 step 1).
    The location is the anchor's first row (it is constant per anchor in the file).
    """
    path = Path(csv_path) if csv_path is not None else default_ripe_atlas_csv()
    if not path.is_file():
        raise WanError(f"RIPE Atlas file not found: {path}")
    locations: dict[int, tuple[float, float]] = {}
    latencies: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        need = {"anchor_id", "latitude", "longitude", "latency_m1", "latency_m2", "latency_m3", "latency_m4"}
        missing = need - set(reader.fieldnames or ())
        if missing:
            raise WanError(f"{path}: not a RIPE Atlas RTT file (missing columns {sorted(missing)})")
        for line, row in enumerate(reader, start=2):
            try:
                aid = int(row["anchor_id"])
                if aid not in locations:
                    locations[aid] = (float(row["latitude"]), float(row["longitude"]))
            except (TypeError, ValueError):
                raise WanError(f"{path}:{line}: bad anchor_id/latitude/longitude") from None
            counts[aid] = counts.get(aid, 0) + 1
            values = latencies.setdefault(aid, [])
            for col in ("latency_m1", "latency_m2", "latency_m3", "latency_m4"):
                try:
                    v = float(row[col])
                except (TypeError, ValueError):
                    continue
                if math.isfinite(v) and v > 0:
                    values.append(v)
    if not locations:
        raise WanError(f"{path}: no rows")
    return [
        Anchor(
            anchor_id=aid,
            latitude=locations[aid][0],
            longitude=locations[aid][1],
            base_ms=statistics.median(latencies[aid]) if latencies[aid] else RIPE_DEFAULT_BASE_MS,
            rows=counts[aid],
        )
        for aid in sorted(locations)
    ]


def _haversine_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def ripe_pair_rtt_ms(a: Anchor, b: Anchor) -> float:
    """Modelled RTT between two anchors (the dataset has no anchor-to-anchor measurements).

    ``RTT(a, b) = 0.3·base_a + 0.3·base_b + 0.01 ms/km · haversine(a, b)`` with Earth radius 6371 km
    (chain-composition spec §13.3 step 2): each end contributes 30 % of its measured median latency
    (access network) and the path adds about 10 ms of round trip per 1000 km. RTT(a, a) is 0.
    """
    if a.anchor_id == b.anchor_id:
        return 0.0
    d = _haversine_km(a.latitude, a.longitude, b.latitude, b.longitude)
    return RIPE_BASE_WEIGHT * (a.base_ms + b.base_ms) + RIPE_MS_PER_KM * d


# ----------------------------------------------------------------------------------------- config


@dataclass
class WanConfig:
    """Hosts, their loopback addresses and the RTT matrix (ms) between them.

    ``hosts`` maps host name -> loopback IPv4 address, in matrix order. ``rtt_ms[i][j]`` is the round
    trip time between host i and host j; it must be symmetric and non-negative. ``client`` names the
    orchestrator / client host (conventionally on 127.0.0.1); every other host is a *server* and gets a
    proxy by default. Connections from an address that is not in ``hosts`` use the client's row, since
    any unlisted local process runs on the orchestrator's side.

    ``bandwidth_mbps`` (None = unlimited) adds serialization time per ordered host pair and direction.
    ``connect_rtt`` makes a new connection pay the TCP handshake RTT (userspace backend; netem delays
    the real handshake anyway). ``meta`` is free-form provenance (RIPE anchors, seed, ...).
    """

    hosts: dict[str, str]
    rtt_ms: list[list[float]]
    client: str = CLIENT
    bandwidth_mbps: float | None = None
    connect_rtt: bool = True
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hosts = {str(k): str(v) for k, v in dict(self.hosts).items()}
        self.rtt_ms = [[float(x) for x in row] for row in self.rtt_ms]
        self.validate()

    # -- checks and lookups
    def validate(self) -> None:
        n = len(self.hosts)
        if n < 1:
            raise WanError("a WAN config needs at least one host")
        seen: dict[str, str] = {}
        for name, ip in self.hosts.items():
            if not name:
                raise WanError("empty host name")
            _check_loopback(ip)
            if ip in seen:
                raise WanError(f"hosts {seen[ip]!r} and {name!r} share the address {ip}")
            seen[ip] = name
        if self.client not in self.hosts:
            raise WanError(f"client host {self.client!r} is not in hosts {list(self.hosts)}")
        if len(self.rtt_ms) != n or any(len(row) != n for row in self.rtt_ms):
            raise WanError(f"rtt_ms must be a {n}x{n} matrix (one row and column per host)")
        names = list(self.hosts)
        for i in range(n):
            for j in range(n):
                v = self.rtt_ms[i][j]
                if not math.isfinite(v) or v < 0:
                    raise WanError(f"RTT {names[i]}->{names[j]} must be finite and >= 0, got {v}")
                if abs(v - self.rtt_ms[j][i]) > 1e-6 * max(1.0, abs(v)):
                    raise WanError(
                        f"rtt_ms is not symmetric: {names[i]}->{names[j]} = {v} but "
                        f"{names[j]}->{names[i]} = {self.rtt_ms[j][i]}"
                    )
        if self.bandwidth_mbps is not None:
            self.bandwidth_mbps = float(self.bandwidth_mbps)
            if not (math.isfinite(self.bandwidth_mbps) and self.bandwidth_mbps > 0):
                raise WanError(f"bandwidth_mbps must be > 0 (or null), got {self.bandwidth_mbps}")

    @property
    def names(self) -> list[str]:
        return list(self.hosts)

    @property
    def servers(self) -> list[str]:
        """Every host but the client, in matrix order."""
        return [h for h in self.hosts if h != self.client]

    def ip(self, name: str) -> str:
        try:
            return self.hosts[name]
        except KeyError:
            raise WanError(f"unknown host {name!r} (hosts: {', '.join(self.hosts)})") from None

    def name_of_ip(self, ip: str) -> str | None:
        for name, addr in self.hosts.items():
            if addr == ip:
                return name
        return None

    def rtt(self, a: str, b: str) -> float:
        """RTT in ms between hosts ``a`` and ``b``."""
        names = self.names
        try:
            return self.rtt_ms[names.index(a)][names.index(b)]
        except ValueError:
            raise WanError(f"unknown host {a!r} or {b!r}") from None

    def rtt_from_ip(self, src_ip: str, dst: str) -> float:
        """RTT in ms for a connection from address ``src_ip`` to host ``dst`` (unknown -> client row)."""
        return self.rtt(self.name_of_ip(src_ip) or self.client, dst)

    def client_rtts(self) -> dict[str, float]:
        """RTT(o, j) for every server j: the input of the planner's communication-time model."""
        return {s: self.rtt(self.client, s) for s in self.servers}

    def comm_time_ms(self, server: str, mean_output_tokens: float, overhead_ms: float = 18.0,
                     per_token: bool = True) -> float:
        """τc_j of chain-composition spec §10.2: ``l̄_O·(RTT(o, j) + overhead)`` (or one round trip
        with ``per_token=False``). The overhead is PETALS' own and must not be emulated as delay."""
        one = self.rtt(self.client, server) + overhead_ms
        return mean_output_tokens * one if per_token else one

    def scaled(self, factor: float) -> "WanConfig":
        """A copy with every RTT multiplied by ``factor``."""
        if not (math.isfinite(factor) and factor >= 0):
            raise WanError(f"RTT scale must be >= 0, got {factor}")
        meta = dict(self.meta, rtt_scale=self.meta.get("rtt_scale", 1.0) * factor)
        return WanConfig(dict(self.hosts), [[v * factor for v in row] for row in self.rtt_ms], self.client,
                         self.bandwidth_mbps, self.connect_rtt, meta)

    # -- constructors
    @classmethod
    def from_matrix(
        cls,
        rtt_ms: Sequence[Sequence[float]],
        names: Sequence[str] | None = None,
        *,
        ips: Sequence[str] | None = None,
        client: str | None = None,
        bandwidth_mbps: float | None = None,
        connect_rtt: bool = True,
        meta: Mapping[str, Any] | None = None,
    ) -> "WanConfig":
        """Config from an explicit square RTT matrix (ms). Host 0 is the client.

        Default names are ``client, s0, s1, ...`` and default addresses ``127.0.0.1, 127.0.0.2, ...``
        (host i on ``127.0.0.(i+1)``, so server k of the swarm launcher is on ``127.0.0.k``).
        """
        n = len(rtt_ms)
        if n < 1:
            raise WanError("empty RTT matrix")
        names = list(names) if names is not None else [CLIENT] + [f"s{i}" for i in range(n - 1)]
        if len(names) != n or len(set(names)) != n:
            raise WanError(f"need {n} distinct host names, got {names}")
        ips = list(ips) if ips is not None else [host_ip(i + 1) for i in range(n)]
        if len(ips) != n:
            raise WanError(f"need {n} addresses, got {len(ips)}")
        return cls(
            hosts=dict(zip(names, ips)),
            rtt_ms=[list(row) for row in rtt_ms],
            client=client if client is not None else names[0],
            bandwidth_mbps=bandwidth_mbps,
            connect_rtt=connect_rtt,
            meta=dict(meta or {"source": "matrix"}),
        )

    @classmethod
    def from_client_rtts(cls, client_rtt_ms: Sequence[float], server_rtt_ms: float | Sequence[Sequence[float]] = 0.0,
                         **kwargs: Any) -> "WanConfig":
        """Shortcut: RTT(client, s_j) per server, and one value (or a matrix) between servers."""
        j = len(client_rtt_ms)
        m = [[0.0] * (j + 1) for _ in range(j + 1)]
        for a in range(j):
            m[0][a + 1] = m[a + 1][0] = float(client_rtt_ms[a])
            for b in range(j):
                if a != b:
                    m[a + 1][b + 1] = (float(server_rtt_ms) if isinstance(server_rtt_ms, (int, float))
                                       else float(server_rtt_ms[a][b]))
        return cls.from_matrix(m, **kwargs)

    @classmethod
    def from_ripe_atlas(
        cls,
        csv_path: str | os.PathLike | None = None,
        num_servers: int = 9,
        seed: int = 0,
        *,
        orchestrator: str | int = "random",
        eta: float | None = None,
        rtt_scale: float = 1.0,
        bandwidth_mbps: float | None = None,
        connect_rtt: bool = True,
    ) -> "WanConfig":
        """Config built from the RIPE Atlas EU dataset as chain-composition spec §13.3 recommends.

        * Anchor base latency: median of all its ``latency_m*`` values (:func:`load_ripe_atlas_anchors`).
        * Orchestrator: ``"random"`` (the paper) picks it uniformly among all anchors with
          ``random.Random(seed)``; ``"best"`` takes the anchor with the lowest base latency (the
          authors' MATLAB); an ``int`` picks that ``anchor_id``.
        * Servers: ``num_servers`` distinct anchors drawn uniformly (``rng.sample``) from the rest.
        * Every pairwise RTT, client-server *and* server-server, is modelled by
          :func:`ripe_pair_rtt_ms` ``= 0.3·base_i + 0.3·base_j + 0.01 ms/km · haversine(i, j)``;
          the dataset has no anchor-to-anchor measurements. Diagonal 0. Then multiplied by
          ``rtt_scale``.
        * ``eta`` (optional): ``meta["high_performance"]`` lists ⌊eta·J⌋ servers, drawn uniformly
          with the same generator ("random"), or the ones closest to the orchestrator ("best").

        The same ``(csv, num_servers, seed, orchestrator, eta)`` always gives the same config. Hosts
        are ``client`` on 127.0.0.1 and ``s0..s{J-1}`` on 127.0.0.2..127.0.0.{J+1}.
        """
        anchors = load_ripe_atlas_anchors(csv_path)
        if not isinstance(num_servers, int) or num_servers < 1:
            raise WanError(f"num_servers must be a positive integer, got {num_servers!r}")
        if num_servers > min(len(anchors) - 1, 253):
            raise WanError(f"num_servers={num_servers} exceeds the {min(len(anchors) - 1, 253)} available")
        rng = random.Random(seed)
        if orchestrator == "random":
            o = rng.choice(anchors)
        elif orchestrator == "best":
            o = min(anchors, key=lambda a: (a.base_ms, a.anchor_id))
        else:
            try:
                wanted = int(orchestrator)
                o = next(a for a in anchors if a.anchor_id == wanted)
            except (ValueError, StopIteration):
                raise WanError(f"orchestrator must be 'random', 'best' or an anchor id, got {orchestrator!r}") from None
        rest = [a for a in anchors if a.anchor_id != o.anchor_id]
        chosen = rng.sample(rest, num_servers)
        picked = [o] + chosen
        matrix = [[ripe_pair_rtt_ms(a, b) * rtt_scale for b in picked] for a in picked]
        names = [CLIENT] + [f"s{i}" for i in range(num_servers)]
        meta: dict[str, Any] = {
            "source": "ripe_atlas",
            "csv": Path(csv_path).name if csv_path is not None else default_ripe_atlas_csv().name,
            "num_servers": num_servers,
            "seed": seed,
            "orchestrator": orchestrator,
            "rtt_scale": rtt_scale,
            "model": "RTT(i,j) = 0.3*base_i + 0.3*base_j + 0.01 ms/km * haversine(i,j); base = median latency",
            "anchors": {n: asdict(a) for n, a in zip(names, picked)},
        }
        if eta is not None:
            if not 0 <= eta <= 1:
                raise WanError(f"eta must be in [0, 1], got {eta}")
            k = math.floor(eta * num_servers)
            if orchestrator == "best":
                order = sorted(range(num_servers), key=lambda i: matrix[0][i + 1])[:k]
            else:
                order = rng.sample(range(num_servers), k)
            meta["eta"] = eta
            meta["high_performance"] = [names[i + 1] for i in sorted(order)]
        return cls.from_matrix(matrix, names, bandwidth_mbps=bandwidth_mbps, connect_rtt=connect_rtt, meta=meta)

    # -- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CONFIG_FORMAT,
            "client": self.client,
            "hosts": dict(self.hosts),
            "rtt_ms": [list(row) for row in self.rtt_ms],
            "bandwidth_mbps": self.bandwidth_mbps,
            "connect_rtt": self.connect_rtt,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "WanConfig":
        if not isinstance(data, Mapping):
            raise WanError("a WAN config must be a JSON object")
        fmt = data.get("format", CONFIG_FORMAT)
        if fmt != CONFIG_FORMAT:
            raise WanError(f"unsupported WAN config format {fmt!r} (expected {CONFIG_FORMAT!r})")
        try:
            return cls(
                hosts=dict(data["hosts"]),
                rtt_ms=data["rtt_ms"],
                client=data.get("client", CLIENT),
                bandwidth_mbps=data.get("bandwidth_mbps"),
                connect_rtt=bool(data.get("connect_rtt", True)),
                meta=dict(data.get("meta") or {}),
            )
        except KeyError as e:
            raise WanError(f"WAN config lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise WanError(f"malformed WAN config: {e}") from None

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "WanConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise WanError(f"WAN config is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "WanConfig":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise WanError(f"cannot read WAN config {path}: {e.strerror or e}") from None
        return cls.from_json(text)


@dataclass(frozen=True)
class Endpoint:
    """Where an emulated host listens and what it announces.

    A server binds ``real_port`` and announces ``port`` (the proxy port with the userspace backend,
    the real port itself with netem). Peers must only ever learn ``port``.
    """

    name: str
    ip: str
    real_port: int
    port: int

    @property
    def host_maddr(self) -> str:
        """For petals ``host_maddrs``."""
        return f"/ip4/{self.ip}/tcp/{self.real_port}"

    @property
    def announce_maddr(self) -> str:
        """For petals ``announce_maddrs``."""
        return f"/ip4/{self.ip}/tcp/{self.port}"


# ------------------------------------------------------------------------------------- proxy core


class _LinkCounters:
    __slots__ = ("connections", "active", "failed", "bytes_to_dst", "bytes_to_src")

    def __init__(self) -> None:
        self.connections = self.active = self.failed = self.bytes_to_dst = self.bytes_to_src = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class _LinkClock:
    """Serialization clock of one direction of one ordered host pair ("link free at")."""

    __slots__ = ("bits_per_s", "free_at")

    def __init__(self, mbps: float) -> None:
        self.bits_per_s = mbps * 1e6
        self.free_at = 0.0

    def transmit(self, ready: float, nbytes: int) -> float:
        """Schedule ``nbytes`` that are ready at ``ready``; return when their last bit has left."""
        start = max(ready, self.free_at)
        self.free_at = start + nbytes * 8 / self.bits_per_s
        return self.free_at


@dataclass(frozen=True)
class _Route:
    name: str
    ip: str
    listen_port: int  # 0 = pick one
    target_port: int


class _DelayProxy:
    """The asyncio side of the userspace backend (runs inside the proxy process)."""

    def __init__(self, config: WanConfig, routes: Sequence[_Route]) -> None:
        self.config = config
        self.routes = list(routes)
        self.servers: list[asyncio.base_events.Server] = []
        self.ports: dict[str, int] = {}
        self.links: dict[tuple[str, str], _LinkCounters] = {}
        self.clocks: dict[tuple[str, str], _LinkClock] = {}
        self.tasks: set[asyncio.Task] = set()  # connection handlers
        self.workers: set[asyncio.Task] = set()  # their per-direction tasks
        self.closing = False
        # How late the event loop's timers fire (uvloop/libuv timers have 1 ms granularity): a running
        # estimate that is subtracted from each sleep so that deliveries are unbiased.
        self.timer_lateness = 0.0005

    async def start(self) -> dict[str, int]:
        try:
            for route in self.routes:
                srv = await asyncio.start_server(
                    lambda r, w, route=route: self._handle(route, r, w),
                    route.ip, route.listen_port, reuse_address=True, backlog=512,
                )
                self.servers.append(srv)
                self.ports[route.name] = srv.sockets[0].getsockname()[1]
        except BaseException:
            await self.close()
            raise
        return dict(self.ports)

    def _clock(self, src: str, dst: str) -> _LinkClock | None:
        if self.config.bandwidth_mbps is None:
            return None
        key = (src, dst)
        if key not in self.clocks:
            self.clocks[key] = _LinkClock(self.config.bandwidth_mbps)
        return self.clocks[key]

    async def _handle(self, route: _Route, down_reader: asyncio.StreamReader,
                      down_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        peer = down_writer.get_extra_info("peername") or ("?", 0)
        src_ip = peer[0]
        src = self.config.name_of_ip(src_ip) or src_ip
        counters = self.links.setdefault((src, route.name), _LinkCounters())
        counters.connections += 1
        counters.active += 1
        up_writer: asyncio.StreamWriter | None = None
        workers: list[asyncio.Task] = []
        try:
            if self.closing:
                return
            rtt_s = self.config.rtt_from_ip(src_ip, route.name) / 1000.0
            accepted = time.monotonic()
            try:  # keep the peer's address as the upstream source when the kernel allows it
                up_reader, up_writer = await asyncio.open_connection(
                    route.ip, route.target_port, local_addr=(src_ip, 0))
            except OSError:
                try:
                    up_reader, up_writer = await asyncio.open_connection(route.ip, route.target_port)
                except OSError:
                    counters.failed += 1
                    return
            for w in (down_writer, up_writer):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hold = accepted + rtt_s if self.config.connect_rtt else accepted

            def to_dst(n: int) -> None:
                counters.bytes_to_dst += n

            def to_src(n: int) -> None:
                counters.bytes_to_src += n

            workers = [
                *self._direction(down_reader, up_writer, rtt_s / 2, hold, self._clock(src, route.name), to_dst),
                *self._direction(up_reader, down_writer, rtt_s / 2, hold, self._clock(route.name, src), to_src),
            ]
            self.workers.update(workers)
            if self.closing:
                return
            pending = set(workers)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if any(not t.cancelled() and t.exception() is not None for t in done):
                    break  # a reset or write error on either side ends the whole connection
        finally:
            for t in workers:
                t.cancel()
            if workers:
                await asyncio.gather(*workers, return_exceptions=True)
                self.workers.difference_update(workers)
            for w in (down_writer, up_writer):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()
            counters.active -= 1
            if task is not None:
                self.tasks.discard(task)

    def _direction(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, one_way_s: float,
                   hold_until: float, clock: _LinkClock | None,
                   count: Callable[[int], None]) -> list[asyncio.Task]:
        """Two tasks: one stamps each chunk read with its due time, one delivers chunks when due.

        Times come from ``time.monotonic`` (uvloop's ``loop.time()`` only has millisecond resolution).
        """
        queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_CHUNKS)

        async def intake() -> None:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                ready = max(time.monotonic(), hold_until)
                if clock is not None:
                    ready = clock.transmit(ready, len(data))
                await queue.put((ready + one_way_s, data))
            await queue.put(None)

        async def deliver() -> None:
            while True:
                item = await queue.get()
                if item is None:
                    break
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    if wait > self.timer_lateness:
                        await asyncio.sleep(wait - self.timer_lateness)
                        late = time.monotonic() - due
                        self.timer_lateness = min(0.002, max(0.0, self.timer_lateness + 0.05 * late))
                    else:
                        await asyncio.sleep(0)
                writer.write(data)
                await writer.drain()
                count(len(data))
            if writer.can_write_eof():  # half-close: the other direction may still be talking
                with contextlib.suppress(OSError):
                    writer.write_eof()

        return [asyncio.create_task(intake()), asyncio.create_task(deliver())]

    def stats(self) -> dict[str, Any]:
        return {
            "links": {f"{s}->{d}": c.as_dict() for (s, d), c in sorted(self.links.items())},
            "active_connections": sum(c.active for c in self.links.values()),
        }

    async def close(self, timeout: float = 2.0) -> None:
        self.closing = True
        for srv in self.servers:
            srv.close()
        for task in list(self.workers):  # handlers then close both sides and return normally
            task.cancel()
        if self.tasks:
            _, stuck = await asyncio.wait(list(self.tasks), timeout=timeout)
            for task in stuck:  # e.g. still dialling the real server
                task.cancel()
        for srv in self.servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), timeout)


class _EchoService:
    """Tiny TCP echo servers (the measurement target behind the proxy)."""

    def __init__(self, binds: Sequence[tuple[str, str, int]]) -> None:
        self.binds = list(binds)
        self.servers: list[asyncio.base_events.Server] = []
        self.tasks: set[asyncio.Task] = set()
        self.writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        self.bytes = 0

    async def start(self) -> dict[str, int]:
        ports = {}
        try:
            for name, ip, port in self.binds:
                srv = await asyncio.start_server(self._echo, ip, port, reuse_address=True, backlog=512)
                self.servers.append(srv)
                ports[name] = srv.sockets[0].getsockname()[1]
        except BaseException:
            await self.close()
            raise
        return ports

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        self.connections += 1
        self.writers.add(writer)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while data := await reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
                self.bytes += len(data)
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
            self.writers.discard(writer)
            if task is not None:
                self.tasks.discard(task)

    def stats(self) -> dict[str, Any]:
        return {"connections": self.connections, "bytes": self.bytes}

    async def close(self, timeout: float = 2.0) -> None:
        for srv in self.servers:
            srv.close()
        for writer in list(self.writers):
            writer.transport.abort()
        if self.tasks:
            _, stuck = await asyncio.wait(list(self.tasks), timeout=timeout)
            for task in stuck:
                task.cancel()


# ---------------------------------------------------------------------------- process lifecycle


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _serve_in_child(make_service: Callable[[], Any], conn: Any) -> None:
    """Start a service, report ``("ready", ports)``, answer ``"stats"``, stop on SIGTERM/``"stop"``/EOF."""
    loop = asyncio.get_running_loop()
    service = make_service()
    try:
        ports = await service.start()
    except OSError as e:
        conn.send(("error", f"cannot listen: {e.strerror or e} ({e.__class__.__name__})"))
        return
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)

    def on_command() -> None:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            loop.remove_reader(conn.fileno())
            stop.set()
            return
        if msg == "stats":
            conn.send(("stats", service.stats()))
        elif msg == "stop":
            stop.set()

    loop.add_reader(conn.fileno(), on_command)
    conn.send(("ready", ports))
    await stop.wait()
    with contextlib.suppress(Exception):
        loop.remove_reader(conn.fileno())
    await service.close()
    with contextlib.suppress(Exception):
        conn.send(("stopped", service.stats()))


def _child_entry(make_service: Callable[[], Any], conn: Any, parent_end: Any, parent_pid: int) -> None:
    parent_end.close()
    os.setpgrp()  # own process group, so the parent can killpg whatever is left

    def watchdog() -> None:  # the parent died without stopping us: take the whole group down
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watchdog, name="wan-watchdog", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the loop installs its handlers
    loop = _new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(_serve_in_child(make_service, conn))
    finally:
        loop.close()


class _ServiceProcess:
    """Fork a child running an asyncio service with the lifecycle of petals-integration §3.2."""

    def __init__(self, name: str, make_service: Callable[[], Any]) -> None:
        self.name = name
        self.make_service = make_service
        self.proc: mp.process.BaseProcess | None = None
        self.conn: Any = None
        self.lock = threading.Lock()
        self.final_stats: dict[str, Any] | None = None

    def start(self, timeout: float) -> dict[str, int]:
        ctx = mp.get_context("fork")
        parent_end, child_end = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_child_entry, name=self.name, daemon=False,
                                args=(self.make_service, child_end, parent_end, os.getpid()))
        self.proc.start()
        child_end.close()
        self.conn = parent_end
        if not parent_end.poll(timeout):
            self.stop(timeout=1.0)
            raise WanError(f"{self.name} did not come up within {timeout:.0f} s")
        try:
            kind, payload = parent_end.recv()
        except EOFError:
            self.stop(timeout=1.0)
            raise WanError(f"{self.name} exited during startup (exit code {self.proc.exitcode})") from None
        if kind != "ready":
            self.stop(timeout=1.0)
            raise WanError(f"{self.name}: {payload}")
        return payload

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def request_stats(self, timeout: float = 5.0) -> dict[str, Any]:
        if not self.alive:
            return self.final_stats or {}
        with self.lock:
            self.conn.send("stats")
            if not self.conn.poll(timeout):
                raise WanError(f"{self.name} did not answer a stats request")
            kind, payload = self.conn.recv()
        return payload

    def stop(self, timeout: float = 5.0) -> dict[str, Any] | None:
        proc, conn = self.proc, self.conn
        if proc is None:
            return self.final_stats
        if proc.is_alive():
            with contextlib.suppress(Exception):
                proc.terminate()  # SIGTERM -> graceful close in the child
            if conn is not None:
                deadline = time.monotonic() + timeout
                with contextlib.suppress(EOFError, OSError):
                    while conn.poll(max(0.0, deadline - time.monotonic())):
                        kind, payload = conn.recv()
                        if kind == "stopped":
                            self.final_stats = payload
                            break
            proc.join(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
        proc.join(1.0)
        if conn is not None:
            conn.close()
        self.proc = self.conn = None
        return self.final_stats


# ---------------------------------------------------------------------------------------- netem


def _run(cmd: Sequence[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


def netem_available() -> tuple[bool, str]:
    """Whether the netem backend can run here, and why not.

    Checks Linux, root, ``tc``, then adds a netem qdisc inside a throw-away network namespace
    (``unshare --net``), which touches nothing on the host.
    """
    if not sys.platform.startswith("linux"):
        return False, "the netem backend needs Linux (tc qdisc netem)"
    if os.geteuid() != 0:
        return False, "the netem backend needs root (tc qdisc on lo)"
    tc = shutil.which("tc")
    if tc is None:
        return False, "the netem backend needs 'tc' (iproute2), which is not installed"
    unshare = shutil.which("unshare")
    if unshare is not None:
        try:
            res = _run([unshare, "--net", tc, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"])
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"cannot probe netem: {e}"
        if res.returncode == 0:
            return True, "netem available"
        err = (res.stderr or res.stdout).strip().splitlines()
        msg = err[-1] if err else f"exit code {res.returncode}"
        if "unknown" in msg.lower():
            return False, f"this kernel has no netem qdisc (sch_netem): tc says {msg!r}"
        if "unshare" not in msg.lower():
            return False, f"netem probe failed: tc says {msg!r}"
    if Path("/sys/module/sch_netem").exists():
        return True, "netem available (sch_netem loaded)"
    return False, "this kernel has no netem qdisc (sch_netem is not loaded)"


def netem_commands(config: WanConfig, dev: str = "lo") -> list[list[str]]:
    """The ``tc`` commands that install ``config`` on ``dev`` (the netem backend).

    An htb root whose default class is unshaped; for every ordered pair of distinct hosts (a, b) a
    class with a ``netem delay RTT(a,b)/2 ms`` leaf (plus ``rate`` when ``bandwidth_mbps`` is set),
    selected by a u32 filter on source a and destination b. Every packet crosses ``lo`` egress once,
    so each direction pays RTT/2 and a round trip pays the RTT. Unlisted addresses are not delayed.
    """
    cmds: list[list[str]] = [
        ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"],
        ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit"],
    ]
    names = config.names
    minor = 0x10
    for a in names:
        for b in names:
            if a == b:
                continue
            one_way = config.rtt(a, b) / 2
            rate = f"{config.bandwidth_mbps:g}mbit" if config.bandwidth_mbps else "100gbit"
            cid = f"1:{minor:x}"
            cmds.append(["tc", "class", "add", "dev", dev, "parent", "1:", "classid", cid, "htb", "rate", rate])
            leaf = ["tc", "qdisc", "add", "dev", dev, "parent", cid, "handle", f"{minor:x}:", "netem",
                    "delay", f"{one_way:.3f}ms", "limit", "100000"]
            if config.bandwidth_mbps:
                leaf += ["rate", rate]
            cmds.append(leaf)
            cmds.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                         "match", "ip", "src", f"{config.ip(a)}/32", "match", "ip", "dst", f"{config.ip(b)}/32",
                         "flowid", cid])
            minor += 1
    return cmds


class _NetemBackend:
    def __init__(self, config: WanConfig, dev: str) -> None:
        self.config, self.dev, self.installed = config, dev, False

    def install(self) -> None:
        ok, why = netem_available()
        if not ok:
            raise BackendUnavailable(f"netem backend unavailable: {why}; use the userspace backend (the default)")
        shown = _run(["tc", "qdisc", "show", "dev", self.dev])
        if shown.returncode != 0:
            raise WanError(f"tc cannot see device {self.dev!r}: {shown.stderr.strip()}")
        roots = [ln.split() for ln in shown.stdout.splitlines() if " root " in f" {ln} "]
        if any(len(r) > 1 and r[1] != "noqueue" for r in roots):
            raise WanError(f"{self.dev} already has a root qdisc; refusing to replace it:\n{shown.stdout.strip()}")
        self.installed = True
        for cmd in netem_commands(self.config, self.dev):
            res = _run(cmd)
            if res.returncode != 0:
                self.remove()
                raise WanError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")

    def remove(self) -> None:
        if self.installed:
            _run(["tc", "qdisc", "del", "dev", self.dev, "root"])
            self.installed = False


# ------------------------------------------------------------------------------------ emulator API


class WanEmulator:
    """Apply a :class:`WanConfig` to loopback traffic; use as a context manager or start()/stop().

    ``ports`` maps a host to its real port or to ``(real_port, proxy_port)``; anything missing is
    allocated (real: a free port on the host's address; proxy: bound by the proxy itself). ``hosts``
    lists the hosts to emulate (default: every server). ``backend`` is ``"userspace"`` (default),
    ``"netem"`` or ``"auto"`` (netem when available, else userspace).

    :meth:`start` returns ``{host: Endpoint}``; the server of host ``h`` must listen on
    ``endpoints[h].real_port`` and announce ``endpoints[h].port``. Start the emulator before the
    servers and stop it after them.
    """

    def __init__(self, config: WanConfig, *, backend: str = "userspace",
                 ports: Mapping[str, int | tuple[int, int]] | None = None,
                 hosts: Iterable[str] | None = None, dev: str = "lo",
                 start_timeout: float = 10.0, stop_timeout: float = 5.0) -> None:
        if backend not in BACKENDS:
            raise WanError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
        self.config = config
        self.requested_backend = backend
        self.backend: str | None = None
        self.hosts = list(hosts) if hosts is not None else config.servers
        for h in self.hosts:
            config.ip(h)
        self.ports = dict(ports or {})
        for h in self.ports:
            config.ip(h)
        self.dev = dev
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.endpoints: dict[str, Endpoint] = {}
        self._proc: _ServiceProcess | None = None
        self._netem: _NetemBackend | None = None
        self.final_stats: dict[str, Any] = {}

    def _resolve_backend(self) -> str:
        if self.requested_backend == "auto":
            return "netem" if netem_available()[0] else "userspace"
        return self.requested_backend

    def start(self) -> dict[str, Endpoint]:
        if self.endpoints:
            raise WanError("WAN emulator already started")
        backend = self._resolve_backend()
        wanted: dict[str, tuple[int, int]] = {}
        for h in self.hosts:
            p = self.ports.get(h)
            real, proxy = (p, 0) if isinstance(p, int) else (p if p is not None else (0, 0))
            wanted[h] = (int(real) or free_port(self.config.ip(h)), int(proxy))
        if backend == "netem":
            self._netem = _NetemBackend(self.config, self.dev)
            self._netem.install()
            self.endpoints = {h: Endpoint(h, self.config.ip(h), r, r) for h, (r, _) in wanted.items()}
        else:
            routes = [_Route(h, self.config.ip(h), proxy, real) for h, (real, proxy) in wanted.items()]
            config = self.config
            self._proc = _ServiceProcess("wan-proxy", lambda: _DelayProxy(config, routes))
            ports = self._proc.start(self.start_timeout)
            self.endpoints = {h: Endpoint(h, self.config.ip(h), real, ports[h]) for h, (real, _) in wanted.items()}
        self.backend = backend
        return dict(self.endpoints)

    @property
    def pid(self) -> int | None:
        """The proxy process id (userspace backend), for diagnostics."""
        return self._proc.proc.pid if self._proc is not None and self._proc.proc is not None else None

    @property
    def alive(self) -> bool:
        """True while the emulation is in place (the proxy process runs, or the netem tree is installed)."""
        if self._proc is not None:
            return self._proc.alive
        return self._netem is not None and self._netem.installed

    def stats(self) -> dict[str, Any]:
        """Per-link counters ``"src->dst"``: connections, active, failed, bytes_to_dst, bytes_to_src."""
        return self._proc.request_stats() if self._proc is not None else {}

    def stop(self) -> dict[str, Any]:
        """Stop the emulation (idempotent); returns the proxy's final counters."""
        final: dict[str, Any] = {}
        if self._proc is not None:
            final = self._proc.stop(self.stop_timeout) or {}
            self.final_stats = final
            self._proc = None
        if self._netem is not None:
            self._netem.remove()
            self._netem = None
        self.endpoints = {}
        return final

    def __enter__(self) -> "WanEmulator":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EchoServers:
    """TCP echo servers in their own process, one per ``{name: (ip, port)}`` (port 0 = any)."""

    def __init__(self, binds: Mapping[str, tuple[str, int]], start_timeout: float = 10.0) -> None:
        self.binds = [(n, _check_loopback(ip), int(port)) for n, (ip, port) in binds.items()]
        self.start_timeout = start_timeout
        self.ports: dict[str, int] = {}
        self._proc: _ServiceProcess | None = None

    def start(self) -> dict[str, int]:
        binds = self.binds
        self._proc = _ServiceProcess("wan-echo", lambda: _EchoService(binds))
        self.ports = self._proc.start(self.start_timeout)
        return dict(self.ports)

    @property
    def pid(self) -> int | None:
        return self._proc.proc.pid if self._proc is not None and self._proc.proc is not None else None

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop(3.0)
            self._proc = None

    def __enter__(self) -> "EchoServers":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------- measurement


@dataclass
class RttMeasurement:
    """Round trips of small echoes on one connection (the first exchange is reported apart)."""

    host: str
    port: int
    source_ip: str | None
    samples_ms: list[float]
    connect_ms: float
    first_exchange_ms: float

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def p95_ms(self) -> float:
        s = sorted(self.samples_ms)
        return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise WanError("connection closed during an RTT measurement")
        buf += part
    return bytes(buf)


def measure_rtt(host: str, port: int, n: int = 20, *, source_ip: str | None = None,
                payload_size: int = 64, timeout: float = 10.0) -> RttMeasurement:
    """Measure the RTT to an echo server at ``host:port`` (normally through the proxy).

    Opens one TCP connection (from ``source_ip`` when given, which is how the proxy tells hosts
    apart), does one exchange that includes connection setup (``first_exchange_ms``; about 2 RTT
    with ``connect_rtt``), then ``n`` timed echo round trips of ``payload_size`` bytes.
    """
    _check_loopback(host)
    if source_ip is not None:
        _check_loopback(source_ip)
    if n < 1:
        raise WanError("n must be >= 1")
    payload = bytes(range(256)) * (payload_size // 256 + 1)
    payload = payload[:payload_size]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if source_ip is not None:
            s.bind((source_ip, 0))
        t0 = time.perf_counter()
        s.connect((host, port))
        t1 = time.perf_counter()
        s.sendall(payload)
        if _recv_exact(s, payload_size) != payload:
            raise WanError("echo mismatch")
        t2 = time.perf_counter()
        samples = []
        for _ in range(n):
            a = time.perf_counter()
            s.sendall(payload)
            if _recv_exact(s, payload_size) != payload:
                raise WanError("echo mismatch")
            samples.append((time.perf_counter() - a) * 1000)
    return RttMeasurement(host, port, source_ip, samples, (t1 - t0) * 1000, (t2 - t0) * 1000)


def measure_wan(config: WanConfig, endpoints: Mapping[str, Endpoint], n: int = 20, *,
                pairs: bool = True) -> list[dict[str, Any]]:
    """Measure configured vs achieved RTT for every emulated host (and every ordered server pair).

    Echo servers must already listen on each endpoint's real port (see :class:`EchoServers`).
    Returns one row per (src, dst): configured, achieved median / min / p95, first exchange, error.
    """
    sources = [config.client] + ([h for h in endpoints if h != config.client] if pairs else [])
    rows = []
    for src in sources:
        for dst, ep in endpoints.items():
            if src == dst:
                continue
            m = measure_rtt(ep.ip, ep.port, n, source_ip=config.ip(src))
            configured = config.rtt(src, dst)
            rows.append({
                "src": src, "dst": dst, "configured_ms": round(configured, 3),
                "achieved_ms": round(m.median_ms, 3), "min_ms": round(m.min_ms, 3),
                "p95_ms": round(m.p95_ms, 3), "first_exchange_ms": round(m.first_exchange_ms, 3),
                "error_ms": round(m.median_ms - configured, 3), "n": n,
            })
    return rows


def format_report(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows of :func:`measure_wan` as a fixed-width table."""
    head = f"{'src':>8} {'dst':>8} {'configured':>11} {'achieved':>9} {'min':>8} {'p95':>8} {'first':>8} {'error':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['src']:>8} {r['dst']:>8} {r['configured_ms']:>11.2f} {r['achieved_ms']:>9.2f} "
            f"{r['min_ms']:>8.2f} {r['p95_ms']:>8.2f} {r['first_exchange_ms']:>8.2f} {r['error_ms']:>+8.2f}"
        )
    lines.append("(ms; achieved = median of echo round trips through the emulator; first = connect + first echo)")
    return "\n".join(lines)
