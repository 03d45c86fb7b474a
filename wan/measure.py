"""RTT measurement through the emulator: echo servers, timed echoes, configured-vs-achieved report."""
from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from wan.config import Endpoint, WanConfig, WanError, check_loopback
from wan.proxy import CHUNK
from wan.service import ServiceProcess


class EchoService:
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


class EchoServers:
    """TCP echo servers in their own process, one per ``{name: (ip, port)}`` (port 0 = any)."""

    def __init__(self, binds: Mapping[str, tuple[str, int]], start_timeout: float = 10.0) -> None:
        self.binds = [(n, check_loopback(ip), int(port)) for n, (ip, port) in binds.items()]
        self.start_timeout = start_timeout
        self.ports: dict[str, int] = {}
        self._proc: ServiceProcess | None = None

    def start(self) -> dict[str, int]:
        binds = self.binds
        self._proc = ServiceProcess("wan-echo", lambda: EchoService(binds))
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
    check_loopback(host)
    if source_ip is not None:
        check_loopback(source_ip)
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
    Returns one row per (src, dst): configured, achieved median / min / p95, first exchange, error, and
    ``direct_ms``: the same echo straight to the real port (no emulator), this machine's own share of the error.
    """
    sources = [config.client] + ([h for h in endpoints if h != config.client] if pairs else [])
    rows = []
    for src in sources:
        for dst, ep in endpoints.items():
            if src == dst:
                continue
            m = measure_rtt(ep.ip, ep.port, n, source_ip=config.ip(src))
            direct = measure_rtt(ep.ip, ep.real_port, max(3, n // 2), source_ip=config.ip(src))
            configured = config.rtt(src, dst)
            rows.append({
                "src": src, "dst": dst, "configured_ms": round(configured, 3),
                "achieved_ms": round(m.median_ms, 3), "min_ms": round(m.min_ms, 3),
                "p95_ms": round(m.p95_ms, 3), "first_exchange_ms": round(m.first_exchange_ms, 3),
                "error_ms": round(m.median_ms - configured, 3), "direct_ms": round(direct.median_ms, 3), "n": n,
            })
    return rows


def format_report(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows of :func:`measure_wan` as a fixed-width table."""
    head = (f"{'src':>8} {'dst':>8} {'configured':>11} {'achieved':>9} {'min':>8} {'p95':>8} {'first':>8} {'error':>8}"
            f" {'direct':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['src']:>8} {r['dst']:>8} {r['configured_ms']:>11.2f} {r['achieved_ms']:>9.2f} "
            f"{r['min_ms']:>8.2f} {r['p95_ms']:>8.2f} {r['first_exchange_ms']:>8.2f} {r['error_ms']:>+8.2f}"
            f" {r['direct_ms']:>8.2f}"
        )
    lines.append("(ms; achieved = median of echo round trips through the emulator; first = connect + first echo;")
    lines.append(" direct = the same echo without the emulator: this machine's own part of the error)")
    return "\n".join(lines)
