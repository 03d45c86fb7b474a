"""The matrix-product kernel for batched CPU steps: oneDNN for several rows, MKL's gemv for one.

A decode step of k sessions multiplies a k-row activation matrix by every weight matrix of a block (and the
client's LM head). On CPU, PyTorch sends float32 ``F.linear`` to MKL, whose small-row sgemm scales badly: on
the development machine (AMD EPYC, AVX-512, one thread) an 8-row product with SmolLM2's MLP weights takes 4.2×
the one-row time, the 49,152-row LM head 1.9×. oneDNN's inner product on the same dense weights (no copy,
no re-layout) takes 35% less time at 8 rows and half at the head; at one row MKL's gemv is as fast or faster.
In a real step (15 blocks' weights streamed from memory) oneDNN already wins at 2 rows: 21.6 ms against 24.8
for a 2-session step. :func:`linear` picks per call; results agree with ``F.linear`` to float32 rounding.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

MIN_ROWS = 2  # from this many rows on, oneDNN beats MKL here (measured: see the module doc)
_ONEDNN = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
_ENABLED = _ONEDNN is not None and torch.backends.mkldnn.is_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN when ``x`` has at least :data:`MIN_ROWS` rows of float32
    on CPU (any leading shape)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (not _ENABLED or rows < MIN_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != "cpu" or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = _ONEDNN(flat, weight.contiguous(), bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


def module_linear(x: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
    """A ``torch.nn.Linear`` applied with :func:`linear` (its forward hooks are not run)."""
    return linear(x, module.weight, module.bias)
