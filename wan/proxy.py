"""The user-space backend's delay proxy: the asyncio side, run inside the proxy process.

A connection from ``127.0.0.a`` to host ``b`` delays every chunk in both directions by ``RTT[a][b] / 2``
(plus the optional handshake and bandwidth terms); see :mod:`wan` for the model.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from wan.config import WanConfig

CHUNK = 1 << 16  # bytes read per chunk; each chunk is delayed as one unit
QUEUE_CHUNKS = 256  # per-direction queue bound (backpressure): at most 16 MiB in flight per direction


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
class Route:
    name: str
    ip: str
    listen_port: int  # 0 = pick one
    target_port: int


class DelayProxy:
    """The asyncio side of the userspace backend (runs inside the proxy process)."""

    def __init__(self, config: WanConfig, routes: Sequence[Route]) -> None:
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
        # How late recent chunks left the proxy after their due time (s): the part of a measured delay that is
        # this machine's scheduling, not the emulated network (reported in stats()).
        self.lateness: collections.deque = collections.deque(maxlen=2048)
        self.delay_scale = 1.0  # every configured delay times this (set_delay_scale), read per chunk

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

    async def _handle(self, route: Route, down_reader: asyncio.StreamReader,
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
                await queue.put((ready + one_way_s * self.delay_scale, data))
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
                self.lateness.append(max(0.0, time.monotonic() - due))
                writer.write(data)
                await writer.drain()
                count(len(data))
            if writer.can_write_eof():  # half-close: the other direction may still be talking
                with contextlib.suppress(OSError):
                    writer.write_eof()

        return [asyncio.create_task(intake()), asyncio.create_task(deliver())]

    def set_delay_scale(self, scale: float) -> None:
        """Multiply every configured delay by ``scale`` from the next chunk on, open connections included (0: no
        delay at all; 1: the configuration). Chunks already queued keep their due times."""
        if not 0.0 <= scale < float("inf"):
            raise ValueError(f"a delay scale is a finite number >= 0, not {scale!r}")
        self.delay_scale = float(scale)

    def stats(self) -> dict[str, Any]:
        return {
            "delay_scale": self.delay_scale,
            "links": {f"{s}->{d}": c.as_dict() for (s, d), c in sorted(self.links.items())},
            "active_connections": sum(c.active for c in self.links.values()),
            "lateness_ms": self.lateness_ms(),
        }

    def lateness_ms(self) -> dict[str, float]:
        """The recent chunks' delivery lateness: how long after their due time they left (median, 90th
        percentile, max; ms). A chunk's one-way delay is its configured one plus this."""
        late = sorted(self.lateness)
        if not late:
            return {"chunks": 0, "p50": 0.0, "p90": 0.0, "max": 0.0}
        return {"chunks": len(late), "p50": statistics.median(late) * 1e3,
                "p90": late[int(0.9 * (len(late) - 1))] * 1e3, "max": late[-1] * 1e3}

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
