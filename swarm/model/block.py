"""Chainswarm's transformer block: one config-driven decoder layer for every supported family, plain torch.

:class:`DecoderBlock` covers Llama 1/2/3.x, Mistral, Qwen2/2.5, Qwen3 and Gemma 3 (text) from an
:class:`~swarm.model.arch.ArchSpec`: RMSNorm (``w·x̂``, or Gemma's ``(1 + w)·x̂``), grouped-query attention with
an explicit ``head_dim``, optional q/k/v biases and per-head q/k norms, RoPE in float32
(:mod:`swarm.model.rope`), sliding windows that admit exactly ``W`` keys (the query's own and the ``W − 1``
before it), SwiGLU or GELU-tanh MLPs and Gemma's sandwich norms. Parameters carry the checkpoints' own names
(``self_attn.q_proj.weight``, ``mlp.gate_proj.weight``, ``pre_feedforward_layernorm.weight``, ...), so a
block's ``state_dict`` loads strictly from ``model.layers.<i>.*``.

There is one attention code path, :meth:`DecoderBlock.step`: the new tokens of several sequences at once (a
"ragged" batch of :class:`Segment` s — decode steps and prefills mixed), each over its own KV cache. The
servers' batched cohort pass calls it with many segments; the single-session path (petals' ``forward``
with ``layer_past``, :mod:`swarm.model.petals_block`) calls it with one. The attention itself is a strategy of
:mod:`swarm.model.attention` (per sequence over each cache where it lies on CPU, one padded pass on CUDA), with
the same arithmetic either way. Matrix products go through
:func:`swarm.model.kernels.linear` (for several float32 rows on CPU, MKL or oneDNN, whichever it measured faster
for the shape on this host; ``F.linear`` everywhere else, CUDA included).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from swarm.model.arch import ArchSpec, LayerSpec
from swarm.model.attention import AttentionKernel, attention_for
from swarm.model.kernels import module_linear
from swarm.model.rope import Rotary


class RMSNorm(nn.Module):
    """``w · x / rms(x)`` (Llama, Mistral, Qwen) or, with ``offset=1``, Gemma's ``(1 + w) · x / rms(x)``;
    normalised in float32."""

    def __init__(self, size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.to(torch.float32))).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """The attention projections (and q/k norms) of one block; the attention itself is :meth:`DecoderBlock.step`'s."""

    def __init__(self, spec: ArchSpec):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_key_value_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, spec.norm_offset)


class MLP(nn.Module):
    def __init__(self, spec: ArchSpec):
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=spec.mlp_bias)
        self.gelu = spec.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = module_linear(x, self.gate_proj)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return module_linear(gate * module_linear(x, self.up_proj), self.down_proj)


@dataclass
class Segment:
    """One entry of a step: ``b`` sequences of ``t`` new tokens each (rows ``b·t`` of the flat hidden states,
    sequence-major), their block cache — keys ``(b, kv_heads, head_dim, L)``, values ``(b, kv_heads, L,
    head_dim)``: petals' layout — and ``pos``, where their new tokens go (the cached length)."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: int
    b: int
    t: int


def token_positions(segments: Sequence[Segment]) -> torch.Tensor:
    """The position of every token row of a step (its segment's ``pos`` + its index among the new tokens)."""
    return torch.cat([torch.arange(s.pos, s.pos + s.t).repeat(s.b) for s in segments])


class DecoderBlock(nn.Module):
    """One decoder layer of any supported family; ``layer`` (a :class:`LayerSpec`: window and rope) may be
    bound after construction with :meth:`bind_layer` (petals builds blocks without their index)."""

    def __init__(self, spec: ArchSpec, layer: Optional[int] = None):
        super().__init__()
        self.spec = spec
        h, eps, off = spec.hidden_size, spec.rms_norm_eps, spec.norm_offset
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(h, eps, off)
        self.post_attention_layernorm = RMSNorm(h, eps, off)
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, off)
            self.post_feedforward_layernorm = RMSNorm(h, eps, off)
        self.layer_spec: Optional[LayerSpec] = None
        self.attention_kernel: Optional[AttentionKernel] = None  # None: the device's (attention_for)
        self._rotary: Optional[Rotary] = None
        if layer is not None:
            self.bind_layer(layer)
        elif spec.layers and spec.uniform_layers:
            self._bind(spec.layers[0])

    def bind_layer(self, index: int) -> "DecoderBlock":
        self._bind(self.spec.layer(index))
        return self

    def _bind(self, layer: LayerSpec) -> None:
        self.layer_spec, self._rotary = layer, Rotary.shared(layer.rope, self.spec.head_dim)

    # -- the one forward path ----------------------------------------------------------------------------

    def step(self, hidden: torch.Tensor, segments: Sequence[Segment],
             token_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer over the new tokens of several sequences: ``hidden`` is ``(N, H)``, every segment's ``b·t``
        rows one after the other. Projections, norms and the MLP run over all N rows at once; RoPE at each
        token's own position; each segment's new keys/values written at its positions, then the attention of every
        new token over its sequence's cache (causal, windowed) by the device's strategy
        (:mod:`swarm.model.attention`: per sequence on CPU, one padded pass on CUDA)."""
        if self._rotary is None:
            raise RuntimeError("this block's layer index is unknown: call bind_layer(index) after loading it")
        spec, attn = self.spec, self.self_attn
        n, heads, kv_heads, d = hidden.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        x = self.input_layernorm(hidden)
        q = module_linear(x, attn.q_proj).view(n, heads, d)
        k = module_linear(x, attn.k_proj).view(n, kv_heads, d)
        v = module_linear(x, attn.v_proj).view(n, kv_heads, d)
        if spec.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        token_pos = token_positions(segments) if token_pos is None else token_pos
        token_pos = token_pos.to(hidden.device, non_blocking=True)  # (no wait for the device: the rows are on the
        q, k = self._rotate(q, k, segments, token_pos)                # host, copied to a staging buffer at once)
        out = torch.empty(n, heads, d, dtype=hidden.dtype, device=hidden.device)
        starts = list(itertools.accumulate([0, *(s.b * s.t for s in segments)]))
        kernel = self.attention_kernel or attention_for(hidden.device)
        kernel(q, k, v, out, segments, starts, spec.scale, self.layer_spec.window)
        attended = module_linear(out.view(n, heads * d), attn.o_proj)
        if spec.sandwich_norms:
            hidden = hidden + self.post_attention_layernorm(attended)
            return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def _rotate(self, q, k, segments, token_pos):
        rotary = self._rotary
        if rotary.rope.kind != "dynamic":  # one set of frequencies for every row; q and k rotated in one pass
            key = (token_pos.device, tuple((s.pos, s.t, s.b) for s in segments))  # the step's rows, told apart on
            cos, sin = rotary.cos_sin(token_pos, 0, key=key)  # the host: comparing device tensors would wait
            rotated = rotary.apply(torch.cat((q, k), dim=1), cos, sin)
            return rotated[:, :q.shape[1]], rotated[:, q.shape[1]:]
        q_out, k_out, start = torch.empty_like(q), torch.empty_like(k), 0
        for s in segments:  # dynamic NTK: each sequence's step uses its own length
            rows = slice(start, start + s.b * s.t)
            cos, sin = rotary.cos_sin(token_pos[rows], s.pos + s.t)
            q_out[rows], k_out[rows] = rotary.apply(q[rows], cos, sin), rotary.apply(k[rows], cos, sin)
            start += s.b * s.t
        return q_out, k_out

    # -- a whole sequence, with or without a cache ---------------------------------------------------------

    def run(self, hidden: torch.Tensor, past: Optional[tuple[torch.Tensor, torch.Tensor]] = None
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``hidden`` ``(b, t, H)`` after ``past`` (keys ``(b, kv, d, L)``, values ``(b, kv, L, d)``, or None):
        returns the outputs and the cache extended by the t new tokens (same layout)."""
        b, t, h = hidden.shape
        kv, d = self.spec.num_kv_heads, self.spec.head_dim
        length = 0 if past is None else past[0].shape[-1]
        keys = hidden.new_empty(b, kv, d, length + t)
        values = hidden.new_empty(b, kv, length + t, d)
        if length:
            keys[..., :length], values[:, :, :length] = past
        segment = Segment(keys, values, length, b, t)
        out = self.step(hidden.reshape(b * t, h), [segment])
        return out.view(b, t, h), (keys, values)

