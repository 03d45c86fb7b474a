"""An asyncio service (the delay proxy, the echo servers) in a child process of its own.

The child leads its own process group and dies with its parent (:func:`swarm.runtime.process.become_group_leader`);
it reports ``("ready", ports)`` on a pipe, answers ``"stats"`` and ``("call", method, args)`` (a setting, such as
the proxy's delay scale) and stops on SIGTERM, ``"stop"`` or EOF,
sending ``("stopped", stats)``. The parent stops it with :func:`swarm.runtime.process.stop_process_group`.
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any, Callable

from swarm.runtime.process import become_group_leader, stop_process_group
from wan.config import WanError


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
        elif isinstance(msg, tuple) and msg[0] == "call":  # ("call", method, args): a setting of the service
            try:
                conn.send(("result", getattr(service, msg[1])(*msg[2])))
            except Exception as exc:  # noqa: BLE001  (reported to the parent, the service goes on)
                conn.send(("error", f"{type(exc).__name__}: {exc}"))

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
    # own process group (the parent can killpg whatever is left), taken down when the parent dies
    become_group_leader(parent_pid, poll_s=0.5, child_of_launcher=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the loop installs its handlers
    loop = _new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(_serve_in_child(make_service, conn))
    finally:
        loop.close()


class ServiceProcess:
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
            proc = self.proc
            self.stop(timeout=1.0)
            raise WanError(f"{self.name} exited during startup (exit code {proc.exitcode})") from None
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
        return self._ask("stats", "a stats request", timeout)[1]

    def call(self, method: str, *args: Any, timeout: float = 5.0) -> Any:
        """Run ``service.method(*args)`` in the child; its result, or a :class:`WanError` with the child's error."""
        if not self.alive:
            raise WanError(f"{self.name} is not running")
        kind, payload = self._ask(("call", method, args), method, timeout)
        if kind != "result":
            raise WanError(f"{self.name}: {method}: {payload}")
        return payload

    def _ask(self, message: Any, what: str, timeout: float) -> tuple:
        """Send ``message`` to the child and return its ``(kind, payload)`` answer."""
        with self.lock:
            self.conn.send(message)
            if not self.conn.poll(timeout):
                raise WanError(f"{self.name} did not answer {what}")
            return self.conn.recv()

    def stop(self, timeout: float = 5.0) -> dict[str, Any] | None:
        proc, conn = self.proc, self.conn
        if proc is None:
            return self.final_stats
        # SIGTERM -> graceful close in the child, which sends its final counters; then SIGKILL the group
        stop_process_group(proc, timeout, drain=self._read_final_stats if conn is not None else None)
        if conn is not None:
            conn.close()
        self.proc = self.conn = None
        return self.final_stats

    def _read_final_stats(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with contextlib.suppress(EOFError, OSError):
            while self.conn.poll(max(0.0, deadline - time.monotonic())):
                kind, payload = self.conn.recv()
                if kind == "stopped":
                    self.final_stats = payload
                    break
