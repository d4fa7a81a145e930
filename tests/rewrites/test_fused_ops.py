"""The fused ops' definition: gradients are the composite's, fake shapes are the real ones, whatever the kernel."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxforge.rewrites.fused_ops import ACTIVATIONS, conv_pointwise, linear_pointwise

SCALARS = {"hardtanh": [-0.5, 0.5], "leaky_relu": [0.2]}


def conv_args(dims: int, residual: bool):
    torch.manual_seed(dims)
    x = torch.randn(2, 6, *([7] * dims))
    w, b = torch.randn(4, 6, *([3] * dims)), torch.randn(4)
    out = torch.randn(2, 4, *([5] * dims)) if residual else None
    return x, w, b, [1] * dims, [0] * dims, [1] * dims, 1, out


@pytest.mark.parametrize("kernel", ["composite", "mkldnn"])
def test_gradients_are_the_composites(kernel):
    x, w, b, *conf, other = conv_args(2, True)
    leaves = [t.double().requires_grad_() for t in (x, w, b, other)]
    assert torch.autograd.gradcheck(
        lambda x, w, b, o: conv_pointwise(x, w, b, *conf, o, "sub", "silu", [], kernel), leaves)
    xl, wl = torch.randn(2, 3, dtype=torch.double, requires_grad=True), torch.randn(4, 3, dtype=torch.double,
                                                                                   requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, o: linear_pointwise(x, w, None, o, "add", "gelu", [], kernel),
                                   [xl, wl, torch.randn(2, 4, dtype=torch.double, requires_grad=True)])


def test_fake_implementation_gives_shapes():
    with FakeTensorMode():
        x, w = torch.empty(2, 6, 9, 9), torch.empty(4, 6, 3, 3)
        y = conv_pointwise(x, w, None, [2, 2], [1, 1], [1, 1], 1, None, "add", "relu", [], "mkldnn")
        z = linear_pointwise(torch.empty(5, 8), torch.empty(3, 8), None, None, "add", "tanh", [], "mkldnn")
    assert y.shape == (2, 4, 5, 5) and z.shape == (5, 3)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("channels_last", [False, True])
def test_fake_result_has_the_real_results_shape_strides_and_dtype(activation, channels_last):
    # The fake implementation skips the activation: it must not change what the result looks like.
    x, w, b = torch.randn(2, 6, 9, 9), torch.randn(4, 6, 3, 3), torch.randn(4)
    other = torch.randn(2, 4, 5, 5)
    if channels_last:
        x, other = x.contiguous(memory_format=torch.channels_last), other.contiguous(memory_format=torch.channels_last)
    scalars = {"hardtanh": [0.0, 6.0], "leaky_relu": [0.1]}.get(activation, [])
    conf = ([2, 2], [1, 1], [1, 1], 1)
    mode = FakeTensorMode()
    for extra in (None, other):
        real = conv_pointwise(x, w, b, *conf, extra, "add", activation, scalars, "composite")
        with mode:
            fake_args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in (x, w, b, extra)]
            fake = conv_pointwise(*fake_args[:3], *conf, fake_args[3], "add", activation, scalars, "composite")
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    xl, wl = torch.randn(3, 5, 8), torch.randn(7, 8)
    real = linear_pointwise(xl, wl, None, None, "add", activation, scalars, "composite")
    with mode:
        fake = linear_pointwise(mode.from_tensor(xl), mode.from_tensor(wl), None, None, "add", activation, scalars,
                               "composite")
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
