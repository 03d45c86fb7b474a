"""What a session's servers were sent and returned, kept for a later spot check (:mod:`swarm.control.spot_checks`).

The orchestrator's client sees every hop of a chain: the batched path relays each server's output to the next
(:class:`swarm.engine.multi_client.ChainBatch`), and petals' per-session path steps every server session in turn
(:class:`swarm.engine.routing.ChainswarmInferenceSession`). A :class:`SpanRecorder` attached to a session
keeps, for the spans chosen for checking, the input and output hidden states of every position, step by step.
Recording changes nothing the servers see. A recording that stops being contiguous (the session failed over
to another server, or went past ``max_tokens``) is dropped: the check needs the exact inputs.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

RouteSpan = tuple[str, int, int]


@dataclass
class SpanTrace:
    """One span's hidden states: inputs and outputs ``(t, H)`` for positions ``offset … offset + t``."""

    span: RouteSpan
    offset: int = 0  # positions before the first recorded one (a reused prompt prefix)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    tokens: int = 0

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.inputs), torch.cat(self.outputs)


class SpanRecorder:
    """Records the spans ``targets`` of one session (thread-safe; every tensor is copied to CPU float32)."""

    def __init__(self, route: Sequence[RouteSpan], targets: Sequence[RouteSpan], max_tokens: int = 4096):
        self.route = tuple(tuple(s) for s in route)
        self.traces = {tuple(t): SpanTrace(tuple(t)) for t in targets}
        self.max_tokens = max_tokens
        self.valid = bool(self.traces)
        self.reason: Optional[str] = None
        self.prefix_tokens = 0
        self._lock = threading.Lock()

    def wants(self, span: RouteSpan) -> bool:
        return self.valid and tuple(span) in self.traces

    def skip_prefix(self, tokens: int) -> None:
        """The first step sends only the positions after a reused prefix of ``tokens`` positions."""
        with self._lock:
            self.prefix_tokens = int(tokens)
            for trace in self.traces.values():
                trace.offset = int(tokens)

    def add(self, span: RouteSpan, inputs: torch.Tensor, outputs: torch.Tensor) -> None:
        """One step of ``span``: ``inputs``/``outputs`` ``(1, t, H)`` (or ``(t, H)``) of the new positions."""
        span = tuple(span)
        with self._lock:
            trace = self.traces.get(span)
            if trace is None or not self.valid:
                return
            inputs, outputs = inputs.reshape(-1, inputs.shape[-1]), outputs.reshape(-1, outputs.shape[-1])
            if inputs.shape != outputs.shape:
                return self._drop(f"{span}: {tuple(inputs.shape)} inputs, {tuple(outputs.shape)} outputs")
            if trace.tokens + inputs.shape[0] > self.max_tokens:
                return self._drop(f"longer than {self.max_tokens} positions")
            trace.inputs.append(inputs.detach().to("cpu", torch.float32, copy=True))
            trace.outputs.append(outputs.detach().to("cpu", torch.float32, copy=True))
            trace.tokens += inputs.shape[0]

    def rollback(self, positions: int) -> None:
        """The servers forgot the session's last ``positions`` positions (rejected drafts): so does the recording."""
        with self._lock:
            for trace in self.traces.values():
                left = int(positions)
                while left > 0 and trace.inputs:
                    last = trace.inputs[-1].shape[0]
                    if last <= left:
                        trace.inputs.pop(), trace.outputs.pop()
                    else:
                        trace.inputs[-1], trace.outputs[-1] = trace.inputs[-1][:-left], trace.outputs[-1][:-left]
                        last = left
                    trace.tokens -= last
                    left -= last

    def route_changed(self, why: str) -> None:
        """The session left its route (a failover): the recording no longer shows one server's whole work."""
        with self._lock:
            self._drop(why)

    def _drop(self, why: str) -> None:
        self.valid, self.reason = False, why
        self.traces.clear()

    def complete(self, tokens: int) -> bool:
        """Whether every target span recorded all ``tokens`` positions of the session."""
        with self._lock:
            return self.valid and all(t.offset + t.tokens == tokens for t in self.traces.values())
