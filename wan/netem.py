"""The kernel netem backend: an htb tree of ``netem delay`` leaves on ``lo`` (Linux, root)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from wan.config import BackendUnavailable, WanConfig, WanError


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


class NetemBackend:
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
