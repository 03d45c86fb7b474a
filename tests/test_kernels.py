"""The batched CPU matrix product (swarm/model/kernels.py): MKL or oneDNN per shape, measured on the calls.

Either kernel gives ``F.linear``'s result to float32 rounding, for any leading shape and with a bias; a key's
first calls alternate between the two and are timed, and the faster one is kept (oneDNN only with a clear lead);
one row, other dtypes and autograd always take ``F.linear``.
"""
import pytest
import torch
import torch.nn.functional as F

from swarm.model import kernels
from swarm.model.kernels import KernelChooser, linear

needs_onednn = pytest.mark.skipif(not kernels._ENABLED, reason="this torch has no oneDNN inner product")


class Fixed(KernelChooser):
    """A chooser decided in advance (``onednn``) that records which kernel each call used."""

    def __init__(self, onednn: bool):
        super().__init__()
        self.onednn, self.calls = onednn, []

    def chosen(self, key):
        self.calls.append(key)
        return self.onednn


@needs_onednn
@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("shape", [(2, 64), (8, 64), (3, 5, 64), (1, 40, 64)])
def test_both_kernels_give_f_linear_to_float32_rounding(onednn, shape):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(*shape), torch.randn(96, 64), torch.randn(96)
    chooser = Fixed(onednn)
    for b in (None, bias):
        out = linear(x, weight, b, chooser=chooser)
        assert out.shape == (*shape[:-1], 96)
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert len(chooser.calls) == 2  # both calls went through the chooser


def test_one_row_other_dtypes_and_autograd_take_f_linear():
    chooser = Fixed(True)
    weight = torch.randn(32, 16)
    linear(torch.randn(1, 16), weight, chooser=chooser)  # one row: MKL's gemv
    linear(torch.randn(1, 1, 16), weight, chooser=chooser)
    linear(torch.randn(4, 16, dtype=torch.float64), weight.double(), chooser=chooser)
    x = torch.randn(4, 16, requires_grad=True)
    out = linear(x, weight, chooser=chooser)
    out.sum().backward()  # the product stays differentiable
    assert x.grad is not None and chooser.calls == []


def test_the_faster_kernel_is_kept_after_its_trials():
    chooser = KernelChooser(trials=4, margin=0.95)
    key = (2, 96, 64)
    used = []
    for _ in range(8):  # alternate, MKL first, until each kernel has its trials
        assert chooser.chosen(key) is None
        onednn = chooser.next_trial(key)
        used.append(onednn)
        chooser.record(key, onednn, 1.0 if onednn else 2.0)  # oneDNN twice as fast
    assert used == [False, True] * 4
    assert chooser.chosen(key) is True and chooser.choices() == {key: "onednn"}
    # a lead inside the margin keeps MKL (F.linear's own kernel); the first call of each is not counted
    close = KernelChooser(trials=3, margin=0.95)
    for seconds in ((9.0, 0.1), (1.0, 0.97), (1.0, 0.97)):
        close.record(key, False, seconds[0])
        close.record(key, True, seconds[1])
    assert close.chosen(key) is False
    with pytest.raises(ValueError):
        KernelChooser(trials=1)


@needs_onednn
def test_real_calls_decide_each_key_once_and_agree_with_f_linear():
    chooser = KernelChooser(trials=3)
    weight = torch.randn(128, 64)
    for rows in (2, 6, 6, 6, 2, 6, 2, 6, 2, 6, 2, 2):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x, weight, chooser=chooser), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    # rows 2 and 6 fall in different buckets; each got its 3 + 3 timed calls and is decided
    assert set(chooser.choices()) == {(0, 128, 64), (2, 128, 64)}
    assert set(chooser.choices().values()) <= {"mkl", "onednn"}
