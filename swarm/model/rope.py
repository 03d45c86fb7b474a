"""Rotary position embeddings with the ``linear``, ``dynamic`` and ``llama3`` scalings, in float32 always.

The frequencies and the rotation are computed in float32 whatever the serving dtype (a float16 ``position ×
inv_freq`` loses whole radians at a few thousand positions); the rotated q/k are cast back at the end.

* ``default``: ``inv_freq_i = θ^(-2i/d)``.
* ``linear`` (position interpolation): ``inv_freq / factor``.
* ``dynamic`` (NTK-aware): past ``original_max`` tokens the base grows with the sequence length ``L`` of the
  step, ``θ' = θ · (factor·L/original_max − (factor − 1))^(d/(d−2))`` — the positions of a step all use the
  ``L`` of that step, and cached keys keep the rotation they were written with (as transformers does).
* ``llama3``: wavelengths longer than ``original_max / low_freq_factor`` are divided by ``factor``, shorter
  than ``original_max / high_freq_factor`` kept, and the band between interpolated smoothly.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from swarm.model.arch import RopeSpec


def inv_freq(rope: RopeSpec, dim: int, seq_len: int = 0, device=None) -> torch.Tensor:
    """The ``dim/2`` inverse frequencies of ``rope`` (float32) for a step whose sequence ends at ``seq_len``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    theta = rope.theta
    if rope.kind == "dynamic" and seq_len > rope.original_max:
        theta = theta * (rope.factor * seq_len / rope.original_max - (rope.factor - 1)) ** (dim / (dim - 2))
    freq = 1.0 / (theta ** exponents)
    if rope.kind == "linear":
        freq = freq / rope.factor
    elif rope.kind == "llama3":
        low_wavelen = rope.original_max / rope.low_freq_factor
        high_wavelen = rope.original_max / rope.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
        smooth = (rope.original_max / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freq = torch.where(medium, smoothed, scaled)
    return freq


class Rotary:
    """Applies ``rope`` to (rows, heads, dim) tensors at given positions; caches the static frequencies and the
    last positions' cos and sin. The blocks of a model share one instance per (rope, dim) (:meth:`shared`), so a
    step's cos and sin are computed once for all its blocks, not once per block."""

    def __init__(self, rope: RopeSpec, dim: int):
        self.rope, self.dim = rope, dim
        self._freq: dict[torch.device, torch.Tensor] = {}
        self._last: Optional[tuple] = None  # (positions, (seq_len, inference mode), cos, sin) of the last call

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def shared(rope: RopeSpec, dim: int) -> "Rotary":
        """The process's one :class:`Rotary` for ``rope`` and ``dim``."""
        return Rotary(rope, dim)

    def _frequencies(self, device, seq_len: int) -> torch.Tensor:
        if self.rope.kind == "dynamic":
            return inv_freq(self.rope, self.dim, seq_len, device)
        freq = self._freq.get(device)
        if freq is None:
            freq = self._freq[device] = inv_freq(self.rope, self.dim, 0, device)
        return freq

    def cos_sin(self, positions: torch.Tensor, seq_len: int, key=None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(rows, 1, dim)`` cos and sin at ``positions`` (a step whose sequence ends at ``seq_len``); the
        last call's, when ``positions`` is that call's tensor or equal to it (the next block of the same step) —
        or, if the caller gives a hashable ``key`` that determines the positions, when the key is the last one's
        (no device tensors compared: on a GPU that comparison waits for the device)."""
        last, inference = self._last, torch.is_inference_mode_enabled()  # one read: another thread may replace it
        if (last is not None and last[1] == (seq_len, inference) and (
                (key is not None and last[4] == key) or last[0] is positions or (
                key is None and last[0].shape == positions.shape and last[0].device == positions.device
                and torch.equal(last[0], positions)))):
            return last[2], last[3]  # (inference tensors are never handed to autograd: the mode is in the key)
        angles = positions.to(torch.float32)[:, None] * self._frequencies(positions.device, seq_len)[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        self._last = (positions, (seq_len, inference), cos, sin, key)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        half = x32.shape[-1] // 2
        rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
        return (x32 * cos + rotated * sin).to(x.dtype)
