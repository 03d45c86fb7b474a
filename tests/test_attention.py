"""The two attention strategies of a step (swarm/model/attention.py) give the same outputs and caches.

:class:`Padded` (CUDA's default: one masked pass over a padded copy of every short sequence's keys) must compute what
:class:`PerSequence` (CPU's: one product pair per sequence over its cache where it lies) computes, on every kind of
segment a server's batched pass mixes: decodes, verifications of drafted tokens, segments of several sequences,
prefills (attended per sequence by both), sliding windows, grouped-query heads and chunks cut by the budget.
"""
import copy

import pytest
import torch

from swarm.model.arch import ArchSpec, LayerSpec, RopeSpec
from swarm.model.attention import Padded, PerSequence, attention_for
from swarm.model.block import DecoderBlock, Segment


def _spec(heads: int, kv_heads: int, window) -> ArchSpec:
    return ArchSpec(family="llama", model_type="llama", hidden_size=64, intermediate_size=96, num_layers=1,
                    num_heads=heads, num_kv_heads=kv_heads, head_dim=16, vocab_size=100, rms_norm_eps=1e-5,
                    layers=(LayerSpec(window=window, rope=RopeSpec(theta=1e4)),))


def _segments(spec: ArchSpec, shapes, seed: int) -> list[Segment]:
    """Segments of ``(b, t, cached)`` with random caches that have room for their new tokens."""
    gen = torch.Generator().manual_seed(seed)
    kv, d = spec.num_kv_heads, spec.head_dim
    return [Segment(torch.randn(b, kv, d, cached + t + 3, generator=gen),
                    torch.randn(b, kv, cached + t + 3, d, generator=gen), cached, b, t) for b, t, cached in shapes]


SHAPES = [(1, 1, 40), (1, 1, 7), (2, 1, 19), (1, 5, 30), (1, 9, 0), (3, 4, 12), (1, 1, 0), (1, 40, 5)]


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (4, 4, None), (6, 2, 6), (4, 1, 25)])
@pytest.mark.parametrize("budget", [1 << 26, 3000])
def test_padded_equals_per_sequence(heads, kv_heads, window, budget):
    spec = _spec(heads, kv_heads, window)
    block = DecoderBlock(spec, 0)
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    segments = _segments(spec, SHAPES, seed=1)
    hidden = torch.randn(sum(b * t for b, t, _ in SHAPES), spec.hidden_size)
    outputs, caches = {}, {}
    for kernel in (PerSequence(), Padded(max_t=16, budget=budget)):
        mine = copy.deepcopy(segments)
        block.attention_kernel = kernel
        with torch.inference_mode():
            outputs[kernel.name] = block.step(hidden, mine)
        caches[kernel.name] = mine
    torch.testing.assert_close(outputs["padded"], outputs["per-sequence"], rtol=1e-5, atol=1e-5)
    for a, b in zip(caches["padded"], caches["per-sequence"]):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_padded_matches_each_sequence_run_alone():
    """A mixed padded step equals each sequence run alone through ``DecoderBlock.run`` (which attends per sequence
    on CPU): decodes at different lengths, a verification and a prefill."""
    spec = _spec(6, 2, None)
    block = DecoderBlock(spec, 0)
    torch.manual_seed(3)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    text = torch.randn(30, spec.hidden_size)
    alone, segments, rows = [], [], []
    with torch.inference_mode():
        for cached, t in ((10, 1), (21, 1), (14, 5), (0, 8)):
            past = block.run(text[None, :cached])[1] if cached else None
            alone.append(block.run(text[None, cached:cached + t], past)[0][0])
            keys = text.new_zeros(1, spec.num_kv_heads, spec.head_dim, cached + t)
            values = text.new_zeros(1, spec.num_kv_heads, cached + t, spec.head_dim)
            if past:
                keys[..., :cached], values[:, :, :cached] = past
            segments.append(Segment(keys, values, cached, 1, t))
            rows.append(text[cached:cached + t])
        block.attention_kernel = Padded(max_t=6)  # the prefill of 8 goes per sequence, the rest padded
        mixed = block.step(torch.cat(rows), segments)
    torch.testing.assert_close(mixed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_the_strategy_follows_the_device_and_the_override(monkeypatch):
    monkeypatch.delenv("CHAINSWARM_ATTENTION", raising=False)
    assert attention_for(torch.device("cpu")).name == "per-sequence"
    assert attention_for(torch.device("cuda")).name == "padded"
    monkeypatch.setenv("CHAINSWARM_ATTENTION", "padded")
    assert attention_for(torch.device("cpu")).name == "padded"
    with pytest.raises(ValueError, match="per-sequence, padded"):
        attention_for(torch.device("cpu"), "flash")


def test_gradients_flow_through_the_padded_pass_as_through_the_per_sequence_one():
    """petals' servers also run backward passes (rpc_backward): the padded pass records autograd like the other,
    also right after an inference-mode pass of the same shapes (whose memoised indices are inference tensors)."""
    spec = _spec(4, 2, None)
    block = DecoderBlock(spec, 0)
    torch.manual_seed(5)
    shapes = [(1, 1, 9), (1, 3, 4), (2, 2, 6)]
    hidden = torch.randn(sum(b * t for b, t, _ in shapes), spec.hidden_size)
    grads = {}
    for kernel in (PerSequence(), Padded()):
        block.attention_kernel = kernel
        with torch.inference_mode():
            block.step(hidden, _segments(spec, shapes, seed=2))
        x = hidden.clone().requires_grad_(True)
        block.step(x, _segments(spec, shapes, seed=2)).square().sum().backward()
        grads[kernel.name] = x.grad
    torch.testing.assert_close(grads["padded"], grads["per-sequence"], rtol=1e-5, atol=1e-5)
