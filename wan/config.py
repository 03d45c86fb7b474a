"""WAN configuration: hosts and their loopback addresses, the RTT matrix, RIPE Atlas data and derivation.

A :class:`WanConfig` is plain data (JSON round trip, validation, lookups); :class:`Endpoint` says where
an emulated host listens and what it announces. Standard library only.
"""
from __future__ import annotations

import csv
import json
import math
import os
import random
import socket
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

CLIENT = "client"
CLIENT_IP = "127.0.0.1"
CONFIG_FORMAT = "chainswarm-wan/1"

# RIPE Atlas pairwise model, chain-composition spec §13.3 (the authors' construction)
RIPE_BASE_WEIGHT = 0.3  # RTT(i, j) = 0.3·base_i + 0.3·base_j + 0.01 ms/km · d(i, j)
RIPE_MS_PER_KM = 0.01
RIPE_DEFAULT_BASE_MS = 30.0
EARTH_RADIUS_KM = 6371.0


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


def check_loopback(ip: str) -> str:
    try:
        packed = socket.inet_aton(ip)
    except OSError:
        raise WanError(f"not an IPv4 address: {ip!r}") from None
    if packed[0] != 127 or socket.inet_ntoa(packed) != ip:
        raise WanError(f"only loopback addresses (127.0.0.0/8) may be used, got {ip!r}")
    return ip


def default_ripe_atlas_csv() -> Path:
    """The project's copy of the RIPE Atlas EU RTT file (``experiments/data/``).

    Located next to the ``wan`` package without importing ``experiments`` (wan must not import it);
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
            check_loopback(ip)
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
