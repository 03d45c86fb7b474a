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

So the choice is measured, not assumed: the first time a product of a given weight shape and row bucket comes,
:class:`KernelChooser` times both kernels on that very product (the call's own input and weights, each kernel once
to warm up and then :data:`TRIALS` times, alternating, the best time of each kept) and fixes the key's kernel:
oneDNN only where it takes under :data:`MARGIN` of MKL's time. Every result a caller gets comes from the fixed
kernel, so identical requests give identical numbers within a process. One row always goes to MKL's gemv. Either
kernel agrees with ``F.linear`` to float32 rounding.
"""
from __future__ import annotations

import bisect
import threading
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

MIN_ROWS = 2  # one row: MKL's gemv, as fast as oneDNN or faster on both hosts
TRIALS = 3  # timed runs of each kernel per key, after one warm-up run each; the best of each is compared
MARGIN = 0.95  # oneDNN is chosen only where it takes under 95% of MKL's time: ties go to F.linear's own kernel
ROW_BUCKETS = (3, 5, 9, 17, 33, 65)  # keys: rows 2, 3-4, 5-8, 9-16, 17-32, 33-64, 65 and more
_ONEDNN = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
_ENABLED = _ONEDNN is not None and torch.backends.mkldnn.is_available()

Key = tuple  # (row bucket, out features, in features)
Product = Callable[[], torch.Tensor]


class KernelChooser:
    """Which kernel the products of a key use, fixed by timing both on the key's first product."""

    def __init__(self, trials: int = TRIALS, margin: float = MARGIN, clock: Callable[[], float] = time.perf_counter):
        if trials < 1:
            raise ValueError("trials must be >= 1")
        self.trials, self.margin, self.clock = trials, margin, clock
        self._chosen: dict[Key, bool] = {}  # key -> True: oneDNN
        self._lock = threading.Lock()

    def decided(self, key: Key) -> Optional[bool]:
        """Whether ``key`` uses oneDNN, once :meth:`decide` has run for it; None before."""
        return self._chosen.get(key)

    def decide(self, key: Key, mkl: Product, onednn: Product) -> bool:
        """Fix ``key``'s kernel by running ``mkl`` and ``onednn`` (the two kernels on the same product) and timing
        them, unless another thread has just done so; returns whether it is oneDNN."""
        with self._lock:
            chosen = self._chosen.get(key)
            if chosen is None:
                chosen = self._chosen[key] = self._measure(mkl, onednn)
        return chosen

    def _measure(self, mkl: Product, onednn: Product) -> bool:
        best = {False: float("inf"), True: float("inf")}
        mkl(), onednn()  # warm-up: caches, and oneDNN's primitive for this shape
        for _ in range(self.trials):
            for use_onednn, run in ((False, mkl), (True, onednn)):
                start = self.clock()
                run()
                best[use_onednn] = min(best[use_onednn], self.clock() - start)
        return best[True] < self.margin * best[False]

    def choices(self) -> dict[Key, str]:
        """Every decided key and its kernel (``"onednn"`` or ``"mkl"``), for diagnostics."""
        return {key: ("onednn" if onednn else "mkl") for key, onednn in sorted(self._chosen.items())}


CHOOSER = KernelChooser()


def _onednn(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """oneDNN's inner product of a contiguous 2-D ``rows`` by ``weight`` (dense, no copy when contiguous)."""
    return _ONEDNN(rows, weight.contiguous(), bias, "none", [], "")


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
    flat = x.reshape(rows, x.shape[-1])
    flat = flat if flat.is_contiguous() else flat.contiguous()
    use_onednn = chooser.decided(key)
    if use_onednn is None:  # the key's first product: time both (a long prefill on its first rows only)
        sample = flat[:ROW_BUCKETS[-1]]
        use_onednn = chooser.decide(key, lambda: F.linear(sample, weight, bias),
                                    lambda: _onednn(sample, weight, bias))
    if use_onednn:
        return _onednn(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def module_linear(x: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
    """A ``torch.nn.Linear`` applied with :func:`linear` (its forward hooks are not run)."""
    return linear(x, module.weight, module.bias)
