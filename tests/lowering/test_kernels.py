"""The fused ops' oneDNN kernels: every kernel equals the composite, refuses what it cannot run, keeps the layout."""

from __future__ import annotations

import pytest
import torch

from fxforge.lowering import kernels
from fxforge.lowering.kernels import mkldnn_available
from fxforge.rewrites.fused_ops import ACTIVATIONS, conv_pointwise, linear_pointwise
from tests.rewrites.test_fused_ops import SCALARS, conv_args

needs_mkldnn = pytest.mark.skipif(not mkldnn_available(), reason="this torch build has no oneDNN")


@needs_mkldnn
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_mkldnn_conv_equals_composite(activation, dims):
    for residual in (False, True):
        args = conv_args(dims, residual)
        scalars = SCALARS.get(activation, [])
        expected = conv_pointwise(*args, activation, scalars, "composite")
        got = conv_pointwise(*args, activation, scalars, "mkldnn")  # falls back where oneDNN cannot
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_mkldnn_refuses_what_it_cannot_run():
    x, w, _, *_ = conv_args(2, False)
    other = torch.randn(2, 4, 5, 5)
    assert kernels.mkldnn_conv_supported(x, w, other, "silu") == (
        "oneDNN's fused convolution + add takes relu or no activation, not silu")
    assert "float32 or bfloat16" in kernels.mkldnn_conv_supported(x.double(), w.double(), None, "relu")


@needs_mkldnn
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "tanh", "hardtanh"])
def test_mkldnn_linear_equals_composite(activation):
    x, w, b = torch.randn(3, 5, 8), torch.randn(16, 8), torch.randn(16)
    scalars = SCALARS.get(activation, [])
    torch.testing.assert_close(linear_pointwise(x, w, b, activation, scalars, "mkldnn"),
                               linear_pointwise(x, w, b, activation, scalars, "composite"), rtol=1e-4, atol=1e-5)


def test_prepacked_weights_follow_in_place_updates():
    x, w, b, *conf = conv_args(2, False)
    before = conv_pointwise(x, w, b, *conf, "relu", [], "mkldnn")
    with torch.no_grad():
        w.mul_(2)
    after = conv_pointwise(x, w, b, *conf, "relu", [], "mkldnn")
    torch.testing.assert_close(after, conv_pointwise(x, w, b, *conf, "relu", [], "composite"), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, after)


@needs_mkldnn
@pytest.mark.parametrize("channels_last", [False, True])
def test_mkldnn_output_keeps_the_layout_the_composite_has(channels_last):
    x, w, b, *conf, _ = conv_args(2, False)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    expected = conv_pointwise(x, w, b, *conf, None, "relu", [], "composite")
    got = conv_pointwise(x, w, b, *conf, None, "relu", [], "mkldnn")
    assert got.stride() == expected.stride()
