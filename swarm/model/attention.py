"""How a step's new tokens attend over their sequences' caches: two strategies with the same arithmetic.

A step (:meth:`swarm.model.block.DecoderBlock.step`) carries the new tokens of several sequences (decode steps,
speculative verifications, prefills), each with its own KV cache in petals' layout: keys ``(b, kv, d, L)``, values
``(b, kv, L, d)``. For every sequence and KV head the ``g = heads / kv`` query heads of its ``t`` new tokens form one
``(g·t, d)`` block; the attention is ``softmax(s·Q·K)·V`` (``s`` the family's scale, 1/√d or Gemma's own) over the
keys each query may see (causal, and within the layer's window ``W`` if it has one), the softmax in float32.

* :class:`PerSequence` runs that as one product pair per sequence, reading each cache where it lies: no cache is
  copied. On a CPU the step is bound by memory traffic, and copying caches costs what the step needs (a padded pass
  made a 16-session step over 15 blocks at 1,000 cached positions take 336–412 ms against 153–159: docs/batching.md).
* :class:`Padded` gathers every short segment's sequences (decodes and verifications, ``t ≤ max_t``) into one
  padded block and runs one masked product pair for all of them: its number of kernel launches does not grow with
  the number of sequences, where :class:`PerSequence` launches about seven small kernels per sequence and block —
  on a GPU that launch cost, not the arithmetic, bounds a batched decode step. Longer segments (prefills) are
  attended per sequence, so a prompt never pads the others' queries to its length. The padded block is split into
  chunks of at most ``budget`` elements (sequences in order of length, so chunks pad little).

:func:`attention_for` picks :class:`Padded` on CUDA and :class:`PerSequence` elsewhere;
``CHAINSWARM_ATTENTION=padded|per-sequence`` overrides it (the GPU check times both).
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence


def _visible(queries: torch.Tensor, keys: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """``(..., q, k)`` mask of the keys each query position may attend: causal, and within ``window`` if set."""
    mask = keys.unsqueeze(-2) <= queries.unsqueeze(-1)
    if window is not None:
        mask &= keys.unsqueeze(-2) > queries.unsqueeze(-1) - window
    return mask


def first_key(pos: int, window: Optional[int]) -> int:
    """The first cached position the first new token (at ``pos``) may see."""
    return 0 if window is None else max(0, pos + 1 - window)


def _new_kv(k: torch.Tensor, v: torch.Tensor, s, start: int, stop: int) -> tuple:
    """One segment's cache slots for its new tokens and the step's rows ``start:stop`` that go there, in the
    cache's layouts: ``(key slots, new keys, value slots, new values)``."""
    kv, d, end = k.shape[1], k.shape[2], s.pos + s.t
    return (s.keys[:, :, :, s.pos:end], k[start:stop].view(s.b, s.t, kv, d).permute(0, 2, 3, 1),
            s.values[:, :, s.pos:end, :], v[start:stop].view(s.b, s.t, kv, d).transpose(1, 2))


def write_new(k: torch.Tensor, v: torch.Tensor, s, start: int, stop: int) -> None:
    """Write one segment's new keys/values (token rows ``start:stop`` of the step) at its positions."""
    key_slots, keys, value_slots, values = _new_kv(k, v, s, start, stop)
    key_slots.copy_(keys)
    value_slots.copy_(values)


def write_all(k: torch.Tensor, v: torch.Tensor, segments: Sequence, starts: Sequence[int]) -> None:
    """:func:`write_new` for every segment in one call per tensor kind (``torch._foreach_copy_``: one dispatch for
    all sequences instead of two per sequence, which is what a GPU step pays for; it has no autograd, so a pass
    that records gradients, as petals' backward does, writes per segment)."""
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        for i, s in enumerate(segments):
            write_new(k, v, s, starts[i], starts[i + 1])
        return
    key_slots, keys, value_slots, values = zip(*(_new_kv(k, v, s, starts[i], starts[i + 1])
                                                 for i, s in enumerate(segments)))
    torch._foreach_copy_(list(key_slots), list(keys))
    torch._foreach_copy_(list(value_slots), list(values))


class _Sequence(NamedTuple):
    """One sequence of a padded pass: its visible keys ``(kv, d, L)`` and values ``(kv, L, d)`` (from ``first``,
    its window's first key, to its new tokens' end), its first row in the step, its new tokens ``t`` and their
    first position ``pos``."""

    keys: torch.Tensor
    values: torch.Tensor
    row: int
    t: int
    pos: int
    first: int

    @property
    def length(self) -> int:
        return self.pos + self.t - self.first


class AttentionKernel:
    """A strategy for the attention of a step; the new keys/values are written into the caches first."""

    name = "?"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 segments: Sequence, starts: Sequence[int], scale: float, window: Optional[int]) -> None:
        """``q`` ``(n, heads, d)``, ``k``/``v`` ``(n, kv, d)``: the step's rotated rows, segment after segment
        (``starts``: each segment's first row and the end); writes ``out`` ``(n, heads, d)``."""
        raise NotImplementedError


class PerSequence(AttentionKernel):
    """One ``(g·t, d) @ (d, keys)`` product per sequence and KV head, over the cache where it lies."""

    name = "per-sequence"

    def __call__(self, q, k, v, out, segments, starts, scale, window):
        for i, s in enumerate(segments):
            write_new(k, v, s, starts[i], starts[i + 1])
            self.attend(q, out, s, starts[i], starts[i + 1], scale, window)

    @staticmethod
    def attend(q, out, s, start: int, stop: int, scale: float, window: Optional[int]) -> None:
        """One segment's queries over its own cache (its new keys already written): batch dimensions equal to the
        cache's, so no broadcast copies the cache, and only the keys some query may see (a window's start)."""
        kv_heads, d = s.keys.shape[1], s.keys.shape[2]
        heads, end = q.shape[1], s.pos + s.t
        groups, first = heads // kv_heads, first_key(s.pos, window)
        rows = groups * s.t
        if s.t == 1:
            q_s = q[start:stop].view(s.b, kv_heads, groups, d)
        else:  # (b, kv, g·t, d): query row g·t + i is head g's query of new token i
            q_s = q[start:stop].view(s.b, s.t, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(
                s.b, kv_heads, rows, d)
        scores = torch.matmul(q_s, s.keys[:, :, :, first:end]) * scale  # (b, kv, g·t, keys)
        if s.t > 1 or (window is not None and end - first > window):
            device = q.device
            visible = _visible(torch.arange(s.pos, end, device=device), torch.arange(first, end, device=device),
                               window)  # (t, keys)
            scores = scores.masked_fill(~visible.repeat(groups, 1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        attended = torch.matmul(probs, s.values[:, :, first:end])  # (b, kv, g·t, d)
        if s.t == 1:
            out[start:stop] = attended.view(s.b, heads, d)
        else:
            out[start:stop] = attended.view(s.b, kv_heads, groups, s.t, d).permute(0, 3, 1, 2, 4).reshape(
                s.b * s.t, heads, d)


class Padded(AttentionKernel):
    """Every sequence of ``t ≤ max_t`` new tokens in one masked pass over a padded copy of their visible keys."""

    name = "padded"

    def __init__(self, max_t: int = 32, budget: int = 1 << 26):
        self.max_t, self.budget = max_t, budget
        self._memo: dict[tuple, tuple] = {}  # a step's indices and masks, for the next blocks of its span

    def __call__(self, q, k, v, out, segments, starts, scale, window):
        write_all(k, v, segments, starts)
        short: list[_Sequence] = []
        for i, s in enumerate(segments):
            if s.t > self.max_t:
                PerSequence.attend(q, out, s, starts[i], starts[i + 1], scale, window)
                continue
            first, end = first_key(s.pos, window), s.pos + s.t
            for b in range(s.b):
                short.append(_Sequence(s.keys[b, :, :, first:end], s.values[b, :, first:end], starts[i] + b * s.t,
                                       s.t, s.pos, first))
        for chunk in self._chunks(short, q.shape[1], q.shape[2]):
            self._attend(q, out, chunk, scale, window)

    def _chunks(self, short: list[_Sequence], heads: int, d: int) -> list[list[_Sequence]]:
        """Sequences by length, cut where the padded keys or the scores would pass ``budget`` elements."""
        chunks, chunk, longest, widest = [], [], 0, 0
        for seq in sorted(short, key=lambda x: x.length):
            size = (len(chunk) + 1) * max(longest, seq.length) * max(heads * max(widest, seq.t),
                                                                     seq.keys.shape[0] * d)
            if chunk and size > self.budget:
                chunks.append(chunk)
                chunk, longest, widest = [], 0, 0
            chunk.append(seq)
            longest, widest = max(longest, seq.length), max(widest, seq.t)
        return chunks + [chunk] if chunk else chunks

    def _indices(self, chunk: list[_Sequence], width: int, length: int, window: Optional[int],
                 device: torch.device) -> tuple:
        """The chunk's gather/scatter rows and its visibility mask, built on the host and sent in one transfer —
        once per step (without waiting for the device: the host's rows go to a staging buffer at once), and every
        block of a span sees the same shapes, so the next blocks reuse them."""
        key = (tuple((x.row, x.t, x.pos, x.first) for x in chunk), width, length, window, device,
               torch.is_inference_mode_enabled())  # inference tensors must not reach a pass that records autograd
        found = self._memo.get(key)
        if found is not None:
            return found
        rows = [x.row + min(i, x.t - 1) for x in chunk for i in range(width)]  # (S·T) rows of q, padding repeats
        dest = [x.row + i for x in chunk for i in range(x.t)]  # the step's rows of the real queries...
        src = [j * width + i for j, x in enumerate(chunk) for i in range(x.t)]  # ...and where they are padded
        shapes = [v for x in chunk for v in (x.t, x.pos, x.first, x.length)]
        rows, dest, src, shapes = torch.tensor(rows + dest + src + shapes).to(device, non_blocking=True).split(
            [len(rows), len(dest), len(src), len(shapes)])
        t, pos, first, keys = shapes.view(len(chunk), 4).unbind(1)
        i, j = torch.arange(width, device=device), torch.arange(length, device=device)
        visible = _visible(pos[:, None] + i, first[:, None] + j, window) & (j < keys[:, None])[:, None, :]
        visible |= (i[None, :] >= t[:, None])[:, :, None] & (j == 0)  # a padding row sees one key (no NaN)
        if len(self._memo) >= 16:
            self._memo.clear()
        self._memo[key] = found = (rows, dest, src, visible)
        return found

    def _attend(self, q, out, chunk: list[_Sequence], scale: float, window: Optional[int]) -> None:
        device, heads, d = q.device, q.shape[1], q.shape[2]
        kv_heads = chunk[0].keys.shape[0]
        groups, n = heads // kv_heads, len(chunk)
        keys = pad_sequence([x.keys.permute(2, 0, 1) for x in chunk], batch_first=True)  # (S, L, kv, d)
        values = pad_sequence([x.values.transpose(0, 1) for x in chunk], batch_first=True)  # (S, L, kv, d)
        width = max(x.t for x in chunk)
        rows, dest, src, visible = self._indices(chunk, width, keys.shape[1], window, device)
        q_s = q.index_select(0, rows).view(n, width, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(
            n, kv_heads, groups * width, d)
        scores = torch.matmul(q_s, keys.permute(0, 2, 3, 1)) * scale  # (S, kv, g·T, L)
        mask = visible[:, None, None].expand(n, 1, groups, width, keys.shape[1]).reshape(n, 1, groups * width, -1)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        attended = torch.matmul(probs, values.transpose(1, 2))  # (S, kv, g·T, d)
        attended = attended.view(n, kv_heads, groups, width, d).permute(0, 3, 1, 2, 4).reshape(n * width, heads, d)
        out.index_copy_(0, dest, attended.index_select(0, src))


KERNELS = {kernel.name: kernel for kernel in (PerSequence, Padded)}


def attention_for(device: torch.device, name: Optional[str] = None) -> AttentionKernel:
    """The strategy for a step on ``device``: ``name`` or ``$CHAINSWARM_ATTENTION`` if given, else :class:`Padded`
    on CUDA and :class:`PerSequence` elsewhere."""
    name = name or os.environ.get("CHAINSWARM_ATTENTION") or ("padded" if device.type == "cuda" else "per-sequence")
    if name not in KERNELS:
        raise ValueError(f"unknown attention strategy {name!r}: choose one of {', '.join(KERNELS)}")
    return _INSTANCES.setdefault(name, KERNELS[name]())


_INSTANCES: dict[str, AttentionKernel] = {}
