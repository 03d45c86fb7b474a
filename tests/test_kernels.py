"""The batched CPU matrix product (swarm/model/kernels.py): MKL or oneDNN per weight shape and row bucket.

Either kernel gives ``F.linear``'s result to float32 rounding, for any leading shape and with a bias; a key's
kernel is fixed on its first call by timing both (oneDNN only with a clear lead), so identical products give
identical numbers afterwards; one row, other dtypes and autograd always take ``F.linear``.
"""
import pytest
import torch
import torch.nn.functional as F

from swarm.model import kernels
from swarm.model.kernels import KernelChooser, linear

needs_onednn = pytest.mark.skipif(not kernels._ENABLED, reason="this torch has no oneDNN inner product")


class Fixed(KernelChooser):
    """A chooser decided in advance (``use_onednn``) that records the keys it was asked about."""

    def __init__(self, use_onednn: bool):
        super().__init__()
        self.use_onednn, self.keys = use_onednn, []

    def decided(self, key):
        self.keys.append(key)
        return self.use_onednn


@needs_onednn
@pytest.mark.parametrize("use_onednn", [False, True])
@pytest.mark.parametrize("shape", [(2, 64), (8, 64), (3, 5, 64), (1, 40, 64), (2, 100, 64)])
def test_both_kernels_give_f_linear_to_float32_rounding(use_onednn, shape):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(*shape), torch.randn(96, 64), torch.randn(96)
    chooser = Fixed(use_onednn)
    for b in (None, bias):
        out = linear(x, weight, b, chooser=chooser)
        assert out.shape == (*shape[:-1], 96)
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert len(chooser.keys) == 2  # both calls went through the chooser


def test_one_row_other_dtypes_and_autograd_take_f_linear():
    chooser = Fixed(True)
    weight = torch.randn(32, 16)
    linear(torch.randn(1, 16), weight, chooser=chooser)  # one row: MKL's gemv
    linear(torch.randn(1, 1, 16), weight, chooser=chooser)
    linear(torch.randn(4, 16, dtype=torch.float64), weight.double(), chooser=chooser)
    x = torch.randn(4, 16, requires_grad=True)
    linear(x, weight, chooser=chooser).sum().backward()  # the product stays differentiable
    assert x.grad is not None and chooser.keys == []


@pytest.mark.parametrize("mkl_s, onednn_s, expected", [(2.0, 1.0, True), (1.0, 0.97, False), (1.0, 2.0, False)])
def test_a_key_is_decided_once_by_the_best_times(mkl_s, onednn_s, expected):
    """Each kernel runs once to warm up, then ``trials`` times alternating; the best times are compared, and
    oneDNN needs a lead beyond the margin. Later calls of the key run nothing more."""
    durations, runs = {"mkl": mkl_s, "onednn": onednn_s}, []
    now = [0.0]

    def clock():
        return now[0]

    def kernel(name):
        def run():
            runs.append(name)
            now[0] += durations[name] + (5.0 if runs.count(name) == 2 else 0.0)  # one slow timed run: not the best
        return run

    chooser = KernelChooser(trials=3, margin=0.95, clock=clock)
    key = (2, 96, 64)
    assert chooser.decided(key) is None
    assert chooser.decide(key, kernel("mkl"), kernel("onednn")) is expected
    assert runs == ["mkl", "onednn"] + ["mkl", "onednn"] * 3
    assert chooser.decided(key) is expected
    assert chooser.decide(key, kernel("mkl"), kernel("onednn")) is expected and len(runs) == 8  # not timed again
    assert chooser.choices() == {key: "onednn" if expected else "mkl"}
    with pytest.raises(ValueError):
        KernelChooser(trials=0)


@needs_onednn
def test_identical_products_give_identical_numbers_from_the_first_call():
    chooser = KernelChooser()
    weight = torch.randn(128, 64)
    for rows in (2, 6, 40, 300):
        x = torch.randn(rows, 64)
        first = linear(x, weight, chooser=chooser)  # decides the key
        torch.testing.assert_close(first, F.linear(x, weight), rtol=1e-5, atol=1e-5)
        assert all(torch.equal(linear(x, weight, chooser=chooser), first) for _ in range(3))
    assert set(chooser.choices()) == {(0, 128, 64), (2, 128, 64), (5, 128, 64), (6, 128, 64)}
