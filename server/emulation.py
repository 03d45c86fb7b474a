"""Accelerator emulation for experiments on CPU-only machines: a "fast GPU" and a "slow GPU" that differ in time.

A volunteer's GPU makes a server's inference steps take a certain time per block and token; on a CPU box every
server runs at the same (CPU) speed. :class:`EmulatedCompute` adds the time a chosen accelerator would spend to
every inference step a server answers: ``prefill_s`` per block per token for a step that carries several new
tokens (the prompt; compute-bound on a GPU) and ``decode_s`` per block for a one-token step (memory-bound).
The model: a step over ``n`` new tokens through ``m`` blocks takes ``m · n · prefill_s`` if ``n > 1`` and
``m · decode_s`` if ``n == 1`` (chain-composition spec §5, footnote 11, without the per-block constant).

The delay is an ``asyncio.sleep`` in the handler, after the real (small) CPU computation and before the step's
output is sent or pushed. It does not take CPU, and concurrent sessions on one server overlap: the emulated
accelerator runs the steps of different sessions in parallel, as a GPU batches memory-bound decode steps.
That is the planner's service model (a chain's time per job does not depend on how many of its ``c_k`` slots
are busy); petals 2.2 on a real GPU runs one step at a time, which this emulation does not reproduce.

:func:`install` wraps ``petals.server.handler.iterate_rpc_inference`` in the server process, before the
handler processes are forked. Use it for orchestrated nodes and vanilla petals servers alike, so every method
of an experiment runs on the same emulated hardware. Only inference (``rpc_inference``) steps are delayed;
``rpc_forward`` / ``rpc_backward`` (training, and petals' one-shot forward) are not.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class EmulatedCompute:
    """Seconds an emulated accelerator spends per block: per prompt token (prefill) and per decoded token."""

    prefill_s: float
    decode_s: float

    def __post_init__(self):
        for name in ("prefill_s", "decode_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"emulated {name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "EmulatedCompute":
        unknown = set(doc) - {"prefill_s", "decode_s"}
        if unknown or not {"prefill_s", "decode_s"} <= set(doc):
            raise ValueError(f"emulated compute needs exactly prefill_s and decode_s, got {sorted(doc)}")
        return cls(float(doc["prefill_s"]), float(doc["decode_s"]))

    @classmethod
    def parse(cls, text: str) -> "EmulatedCompute":
        """``"PREFILL_MS,DECODE_MS"`` (milliseconds per block per token), as on the command line."""
        try:
            prefill_ms, decode_ms = (float(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"expected PREFILL_MS,DECODE_MS (e.g. 2.7,5.2), got {text!r}") from None
        return cls(prefill_ms / 1e3, decode_ms / 1e3)

    def to_dict(self) -> dict:
        return asdict(self)

    def step_delay(self, blocks: int, tokens: int) -> float:
        """Emulated time of one inference step over ``tokens`` new tokens through ``blocks`` blocks."""
        if blocks <= 0 or tokens <= 0:
            return 0.0
        return blocks * (tokens * self.prefill_s if tokens > 1 else self.decode_s)


_installed: Optional[EmulatedCompute] = None


def installed() -> Optional[EmulatedCompute]:
    """The emulation installed in this process, if any."""
    return _installed


def _step_tokens(output_tensors) -> int:
    """New tokens of a step, from its serialized output hidden states ``[batch, tokens, hidden]``."""
    if not output_tensors:
        return 0
    size = list(output_tensors[0].size)
    return int(size[1]) if len(size) >= 2 else 0


def install(emulated: EmulatedCompute | Mapping[str, Any]) -> EmulatedCompute:
    """Delay every inference step answered by this process's petals handlers by ``emulated.step_delay``.

    Call it in the server process before ``Server.run()`` (the handlers are forked from it). Installing a
    second time replaces the emulated times instead of stacking delays.
    """
    global _installed
    import petals.server.handler as handler_module

    emulated = emulated if isinstance(emulated, EmulatedCompute) else EmulatedCompute.from_dict(emulated)
    original = getattr(handler_module.iterate_rpc_inference, "__wrapped_by_chainswarm__",
                       handler_module.iterate_rpc_inference)

    async def iterate_rpc_inference(*args, requested_backends, **kwargs):
        async for output_tensors, can_push in original(*args, requested_backends=requested_backends, **kwargs):
            delay = emulated.step_delay(len(requested_backends), _step_tokens(output_tensors))
            if delay > 0:
                await asyncio.sleep(delay)
            yield output_tensors, can_push

    iterate_rpc_inference.__wrapped_by_chainswarm__ = original
    handler_module.iterate_rpc_inference = iterate_rpc_inference
    _installed = emulated
    return emulated
