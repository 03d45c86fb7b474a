"""Spot checks of the volunteers' arithmetic: the policy (how often a server is checked, what counts as a
mismatch, strikes and bans) and the ledger that remembers it. The mechanism that records sessions and runs the
checks on other servers is :mod:`swarm.control.spot_checks`.

**The comparison.** A check re-executes one server's span ``[a, b)`` of a finished session on another server
from the very inputs the first one received, and compares the two outputs position by position:
``d = max_t ‖y_t − y'_t‖₂ / ‖y'_t‖₂`` over sampled positions ``t`` (a non-finite value is infinitely far).

**The tolerance.** Two honest servers differ only by their arithmetic. ``scripts/spread_check.py`` measured,
on SmolLM2-135M's and Gemma 3 270M's own blocks with a real prompt, each dtype against CPU float32
(``experiments/results/verification_spread.json``, CPU, every span length 1–30 blocks;
``verification_spread_h100.json``, an H100): float32 differs by ≤ 2.6e-6 (CUDA; 0 on the same CPU kernels)
and 9.6e-4 with TF32 matmuls; float16 by ≤ 1.2e-2; bfloat16 by ≤ 6.3e-2 (SmolLM2's 30 blocks). Each dtype's
bound ``ε`` is about twice its worst measured spread, and two servers may differ by ``ε_a + ε_b``
(each is at most ``ε`` from exact float32). A device-independent rule: CPU and GPU spreads were the same size.

**Rates.** A server is checked on a fraction of the sessions it serves: ``new_rate`` until it has passed
``trusted_after`` checks, ``base_rate`` after, ``flagged_rate`` while it has a strike. A strike needs a third
opinion (a third server or the orchestrator itself): the server that disagrees with the two others is struck;
``strikes_to_ban`` strikes ban its node id and key for the orchestrator's life (kept in its state directory).
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

# ε per dtype (see the module doc for the measurements behind them)
EPSILON = {"float32": 2e-3, "float16": 2.5e-2, "bfloat16": 1.25e-1}


def tolerance(dtype_a: str, dtype_b: str) -> float:
    """How far two honest servers computing in these dtypes may be apart (relative L2 per position)."""
    try:
        return EPSILON[dtype_a] + EPSILON[dtype_b]
    except KeyError as exc:
        raise ValueError(f"no tolerance for dtype {exc.args[0]!r}; expected one of {tuple(EPSILON)}") from None


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest per-position ‖a − b‖ / ‖b‖ of two ``(t, H)`` outputs; inf where either is not finite."""
    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    if a.shape != b.shape:
        return math.inf
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).max()) if a.numel() else 0.0


@dataclass(frozen=True)
class CheckPolicy:
    """How often each server's work is re-executed, and when a server is banned."""

    base_rate: float = 0.05  # fraction of a trusted server's sessions that are checked
    new_rate: float = 0.25  # ... of a server that has not yet passed trusted_after checks
    flagged_rate: float = 1.0  # ... of a server with a strike
    trusted_after: int = 5
    strikes_to_ban: int = 2
    positions: int = 16  # positions compared per check (sampled; the last one always)

    def __post_init__(self):
        for name in ("base_rate", "new_rate", "flagged_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.strikes_to_ban < 1 or self.trusted_after < 0 or self.positions < 1:
            raise ValueError("strikes_to_ban and positions must be >= 1, trusted_after >= 0")

    @property
    def enabled(self) -> bool:
        return max(self.base_rate, self.new_rate, self.flagged_rate) > 0


@dataclass
class ServerCheckRecord:
    """One server's check history."""

    passed: int = 0
    strikes: int = 0
    last_passed_at: Optional[float] = None  # when the last session whose check it passed ended
    since_pass: deque = field(default_factory=lambda: deque(maxlen=10_000))  # request ids served since then


@dataclass
class RequestVerdict:
    """What is known about one answer: ``pending`` until every server that served it has passed a check of
    it or of a later session (``true``); ``false`` when one of them was struck on it, or banned before passing
    a check after it."""

    servers: frozenset
    ended_at: float
    vouched: set = field(default_factory=set)
    failed: bool = False

    @property
    def state(self) -> str:
        if self.failed:
            return "false"
        return "true" if self.servers <= self.vouched else "pending"


class Ledger:
    """Checks passed, strikes and bans per node; verdicts per request (the last ``keep_requests``). Bans are
    written to ``path`` (JSON) when given and read back at start. Thread-safe."""

    def __init__(self, policy: CheckPolicy, path: Optional[Path] = None, keep_requests: int = 20_000):
        self.policy, self.path = policy, Path(path) if path is not None else None
        self.servers: dict[str, ServerCheckRecord] = {}
        self.requests: OrderedDict[str, RequestVerdict] = OrderedDict()
        self.banned: dict[str, dict] = {}  # node id -> {"key", "reason", "at"}
        self.counts = {"recorded": 0, "checks": 0, "head_checks": 0, "passed": 0, "mismatches": 0, "strikes": 0,
                       "inconclusive": 0, "skipped": 0, "unchecked": 0, "dual_executions": 0, "served_block_tokens": 0,
                       "check_block_tokens": 0, "served_compute_s": 0.0, "check_compute_s": 0.0}
        self._keep = keep_requests
        self._lock = threading.Lock()
        if self.path is not None and self.path.exists():
            self.banned = json.loads(self.path.read_text()).get("banned", {})

    def record(self, node: str) -> ServerCheckRecord:
        return self.servers.setdefault(node, ServerCheckRecord())

    def rate(self, node: str) -> float:
        """The fraction of ``node``'s sessions to check now."""
        with self._lock:
            rec = self.record(node)
            if rec.strikes:
                return self.policy.flagged_rate
            return self.policy.new_rate if rec.passed < self.policy.trusted_after else self.policy.base_rate

    def is_banned(self, node: str, key: Optional[str] = None) -> bool:
        with self._lock:
            return node in self.banned or (key is not None and any(b.get("key") == key for b in self.banned.values()))

    def served(self, request_id: str, nodes: Iterable[str], block_tokens: int, compute_s: float = 0.0) -> None:
        """A request finished on ``nodes`` (``block_tokens``: positions × blocks the swarm computed for it;
        ``compute_s``: their compute time by the servers' profiles)."""
        nodes = frozenset(nodes)
        with self._lock:
            self.counts["served_block_tokens"] += int(block_tokens)
            self.counts["served_compute_s"] += float(compute_s)
            self.requests[request_id] = RequestVerdict(nodes, time.time(), failed=bool(nodes & set(self.banned)))
            while len(self.requests) > self._keep:
                self.requests.popitem(last=False)
            for node in nodes:
                self.record(node).since_pass.append(request_id)

    def verdict(self, request_id: str) -> Optional[str]:
        with self._lock:
            verdict = self.requests.get(request_id)
            return None if verdict is None else verdict.state

    def passed(self, node: str, request_id: str) -> None:
        """``node``'s span of ``request_id`` matched: it vouches for its sessions up to that one."""
        with self._lock:
            rec = self.record(node)
            rec.passed += 1
            self.counts["passed"] += 1
            checked = self.requests.get(request_id)
            ended = checked.ended_at if checked is not None else time.time()
            rec.last_passed_at = max(rec.last_passed_at or 0.0, ended)
            keep = deque(maxlen=rec.since_pass.maxlen)
            for rid in rec.since_pass:
                verdict = self.requests.get(rid)
                if verdict is None:
                    continue
                if verdict.ended_at <= ended:
                    verdict.vouched.add(node)
                else:
                    keep.append(rid)
            rec.since_pass = keep

    def strike(self, node: str, request_id: str, key: Optional[str], reason: str) -> bool:
        """``node`` disagreed with two others on ``request_id``. Returns True if that banned it."""
        with self._lock:
            rec = self.record(node)
            rec.strikes += 1
            self.counts["strikes"] += 1
            verdict = self.requests.get(request_id)
            if verdict is not None:
                verdict.failed = True
            if rec.strikes < self.policy.strikes_to_ban or node in self.banned:
                return False
            self.banned[node] = {"key": key, "reason": reason, "at": time.time(), "strikes": rec.strikes}
            for rid in rec.since_pass:  # its answers since its last passed check are not trusted
                verdict = self.requests.get(rid)
                if verdict is not None:
                    verdict.failed = True
            self._save()
            return True

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def _save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"banned": self.banned}, indent=1))
            tmp.replace(self.path)

    def status(self) -> dict:
        with self._lock:
            served = self.counts["served_block_tokens"]
            return {
                "policy": {"base_rate": self.policy.base_rate, "new_rate": self.policy.new_rate,
                           "flagged_rate": self.policy.flagged_rate, "trusted_after": self.policy.trusted_after,
                           "strikes_to_ban": self.policy.strikes_to_ban},
                "counts": dict(self.counts),
                "overhead": self.counts["check_block_tokens"] / served if served else 0.0,
                "compute_overhead": (self.counts["check_compute_s"] / self.counts["served_compute_s"]
                                     if self.counts["served_compute_s"] else 0.0),
                "servers": {node: {"passed": r.passed, "strikes": r.strikes, "banned": node in self.banned}
                            for node, r in sorted(self.servers.items())},
                "banned": dict(self.banned),
            }
