"""Ports for emulated hosts: a free port that nothing else on the machine will be handed before it is bound.

Standard library only.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

from wan.config import CLIENT_IP, check_loopback

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
RESERVED_PORTS_LOW = 20000  # picked ports lie in [20000, start of the ephemeral range): above common services


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (``bind`` to port 0 and outgoing connections draw from it)."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(ip: str = CLIENT_IP, *, rng: random.Random | None = None, attempts: int = 200) -> int:
    """A TCP port that is free on ``ip`` now and that the kernel will not hand to anyone else meanwhile.

    The port is bound later by another process (a server's p2p daemon), so a port from the ephemeral range
    could be taken in between by any ``bind(0)`` or outgoing connection on the machine (this happened: a
    daemon failed with "address already in use"). The pick is therefore a random port below the ephemeral
    range that binds right now; only another explicit pick of the same port could still collide (1 in ~10⁴).
    Falls back to ``bind(0)`` where that range is empty or exhausted.
    """
    check_loopback(ip)
    rng = rng or random.SystemRandom()
    low, _ = ephemeral_range()
    if low - 1 > RESERVED_PORTS_LOW:
        for _ in range(attempts):
            port = rng.randint(RESERVED_PORTS_LOW, low - 1)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((ip, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]
