"""The WAN emulator: applies a :class:`~wan.config.WanConfig` with one backend and stops it again."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from wan.config import Endpoint, WanConfig, WanError
from wan.ports import free_port
from wan.netem import NetemBackend, netem_available
from wan.proxy import DelayProxy, Route
from wan.service import ServiceProcess

BACKENDS = ("userspace", "netem", "auto")


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
        self._proc: ServiceProcess | None = None
        self._netem: NetemBackend | None = None
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
            self._netem = NetemBackend(self.config, self.dev)
            self._netem.install()
            self.endpoints = {h: Endpoint(h, self.config.ip(h), r, r) for h, (r, _) in wanted.items()}
        else:
            routes = [Route(h, self.config.ip(h), proxy, real) for h, (real, proxy) in wanted.items()]
            config = self.config
            self._proc = ServiceProcess("wan-proxy", lambda: DelayProxy(config, routes))
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

    def set_delay_scale(self, scale: float) -> None:
        """Scale every emulated delay at once, open connections included (userspace backend): 0 turns the WAN off
        and 1 restores the configuration. For a measurement that needs the same swarm with and without its delays
        (what a token costs beyond the network), or an RTT sweep without restarting the swarm."""
        if self._proc is None:
            raise WanError("set_delay_scale needs the running userspace backend")
        self._proc.call("set_delay_scale", float(scale))

    def stats(self) -> dict[str, Any]:
        """Per-link counters ``"src->dst"`` (connections, active, failed, bytes_to_dst, bytes_to_src), the delay
        scale and the proxy's delivery lateness (``lateness_ms``: how long after their due time recent chunks left)."""
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
