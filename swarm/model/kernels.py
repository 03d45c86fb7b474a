"""The matrix-product kernel for batched float32 CPU steps: MKL or oneDNN, whichever is faster on this host.

A decode step of k sessions (or one session verifying k - 1 drafted tokens) multiplies a k-row activation matrix
by every weight matrix of a block, and the client multiplies k rows by its LM head. PyTorch sends float32
``F.linear`` on CPU to MKL, and which library is faster for a few rows depends on the processor and the shape:

* on an AMD EPYC host (AVX-512, one thread) MKL's small-row sgemm scales badly: 8 rows by SmolLM2's MLP weights
  took 4.2× the one-row time, where oneDNN's inner product on the same dense weights (no copy, no re-layout)
  took 35% less, and half at the 49,152-row LM head; in a real step (15 blocks' weights streamed from memory)
  oneDNN already won at 2 rows, 21.6 ms against 24.8;
* on an Intel Xeon host with AMX (2026-11-29) it is the other way round for a block's weights: MKL's 15-block
  step of 2 / 4 / 8 / 16 rows took 36 / 53 / 70 / 74 ms (medians of 8 interleaved runs) against 52 / 64 / 88 /
  80 through oneDNN (4 runs in the other order: 37 / 49 / 66 / 75 against 54 / 67 / 78 / 103), while at the LM
  head MKL took 25-56 ms for 4 to 12 rows against oneDNN's 19-26 (and 12-14 against 19 for 2 or 3 rows).

So the choice is measured, not assumed: :class:`KernelChooser` times both kernels on the calls themselves (the
real products, weights as cold or warm as the step leaves them), :data:`TRIALS` calls each per weight shape and
row bucket, and then keeps oneDNN for that key only where its median time is below :data:`MARGIN` of MKL's. One
row always goes to MKL's gemv. Either kernel agrees with ``F.linear`` to float32 rounding.
"""
from __future__ import annotations

import bisect
import statistics
import time
from typing import Optional

import torch
import torch.nn.functional as F

MIN_ROWS = 2  # one row: MKL's gemv, as fast as oneDNN or faster on both hosts
TRIALS = 8  # timed calls per kernel and key before the choice is fixed (the first of each is not counted)
MARGIN = 0.95  # oneDNN is kept only where it takes under 95% of MKL's time: ties go to F.linear's own kernel
ROW_BUCKETS = (3, 5, 9, 17, 33, 65)  # keys: rows 2, 3-4, 5-8, 9-16, 17-32, 33-64, 65 and more
_ONEDNN = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
_ENABLED = _ONEDNN is not None and torch.backends.mkldnn.is_available()

Key = tuple  # (row bucket, out features, in features)


class KernelChooser:
    """Which kernel a product of a given key uses: alternate and time both for the first ``trials`` calls each,
    then the faster (oneDNN only below ``margin`` × MKL's median)."""

    def __init__(self, trials: int = TRIALS, margin: float = MARGIN):
        if trials < 2:
            raise ValueError("trials must be >= 2 (the first call of each kernel is not counted)")
        self.trials, self.margin = trials, margin
        self._times: dict[Key, tuple[list, list]] = {}  # key -> (MKL seconds, oneDNN seconds)
        self._chosen: dict[Key, bool] = {}  # key -> True: oneDNN

    def chosen(self, key: Key) -> Optional[bool]:
        """True (oneDNN) or False (MKL) once the key's trials are done; None while they run."""
        return self._chosen.get(key)

    def next_trial(self, key: Key) -> bool:
        """The kernel the next trial call of ``key`` uses: the one with fewer timings so far (MKL first)."""
        mkl, onednn = self._times.setdefault(key, ([], []))
        return len(onednn) < len(mkl)

    def record(self, key: Key, onednn: bool, seconds: float) -> None:
        mkl, dnn = self._times.setdefault(key, ([], []))
        (dnn if onednn else mkl).append(seconds)
        if len(mkl) >= self.trials and len(dnn) >= self.trials and key not in self._chosen:
            self._chosen[key] = statistics.median(dnn[1:]) < self.margin * statistics.median(mkl[1:])

    def choices(self) -> dict[Key, str]:
        """Every decided key and its kernel (``"onednn"`` or ``"mkl"``), for diagnostics."""
        return {key: ("onednn" if onednn else "mkl") for key, onednn in sorted(self._chosen.items())}


CHOOSER = KernelChooser()


def _onednn(flat: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return _ONEDNN(flat, weight.contiguous(), bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           chooser: Optional[KernelChooser] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; float32 products of at least :data:`MIN_ROWS` rows on CPU (any leading
    shape) go through the kernel ``chooser`` (default :data:`CHOOSER`) measured faster for their shape."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (not _ENABLED or rows < MIN_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != "cpu" or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    chooser = CHOOSER if chooser is None else chooser
    key = (bisect.bisect_right(ROW_BUCKETS, rows), weight.shape[0], weight.shape[1])
    onednn = chooser.chosen(key)
    timed = onednn is None
    if timed:
        onednn = chooser.next_trial(key)
    start = time.perf_counter() if timed else 0.0
    if onednn:
        flat = x.reshape(rows, x.shape[-1])
        out = _onednn(flat if flat.is_contiguous() else flat.contiguous(), weight, bias)
        out = out.reshape(*x.shape[:-1], weight.shape[0])
    else:
        out = F.linear(x, weight, bias)
    if timed:
        chooser.record(key, onednn, time.perf_counter() - start)
    return out


def module_linear(x: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
    """A ``torch.nn.Linear`` applied with :func:`linear` (its forward hooks are not run)."""
    return linear(x, module.weight, module.bias)
