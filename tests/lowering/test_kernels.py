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
        for binary in ("add", "sub"):
            expected = conv_pointwise(*args, binary, activation, scalars, "composite")
            got = conv_pointwise(*args, binary, activation, scalars, "mkldnn")  # falls back where oneDNN cannot
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        if not residual:
            continue
        x, w, b, *conf, other = args
        gate = torch.randn(1, other.shape[1], *[1] * dims)  # broadcast onto the output: oneDNN's binary takes it
        expected = conv_pointwise(x, w, b, *conf, gate, "sub", activation, scalars, "composite")
        got = conv_pointwise(x, w, b, *conf, gate, "sub", activation, scalars, "mkldnn")
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_mkldnn_refuses_what_it_cannot_run():
    x, w, _, *_ = conv_args(2, False)
    other = torch.randn(2, 4, 5, 5)
    assert kernels.mkldnn_conv_supported(x, w, other[0], "silu") == (
        "the added tensor's dtype or rank differs from the convolution's")
    assert "float32 or bfloat16" in kernels.mkldnn_conv_supported(x.double(), w.double(), None, "relu")


@needs_mkldnn
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "tanh", "hardtanh"])
def test_mkldnn_linear_equals_composite(activation):
    x, w, b = torch.randn(3, 5, 8), torch.randn(16, 8), torch.randn(16)
    scalars = SCALARS.get(activation, [])
    for other, binary in ((None, "add"), (torch.randn(3, 5, 16), "add"), (torch.randn(3, 5, 16), "sub"),
                          (torch.randn(16), "add")):  # (the last broadcasts: oneDNN refuses, the composite runs)
        torch.testing.assert_close(linear_pointwise(x, w, b, other, binary, activation, scalars, "mkldnn"),
                                   linear_pointwise(x, w, b, other, binary, activation, scalars, "composite"),
                                   rtol=1e-4, atol=1e-5)


def test_prepacked_weights_follow_in_place_updates():
    x, w, b, *conf = conv_args(2, False)
    before = conv_pointwise(x, w, b, *conf, "add", "relu", [], "mkldnn")
    with torch.no_grad():
        w.mul_(2)
    after = conv_pointwise(x, w, b, *conf, "add", "relu", [], "mkldnn")
    torch.testing.assert_close(after, conv_pointwise(x, w, b, *conf, "add", "relu", [], "composite"), rtol=1e-4,
                               atol=1e-4)
    assert not torch.allclose(before, after)


@needs_mkldnn
@pytest.mark.parametrize("channels_last", [False, True])
def test_mkldnn_output_keeps_the_layout_the_composite_has(channels_last):
    x, w, b, *conf, _ = conv_args(2, False)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    expected = conv_pointwise(x, w, b, *conf, None, "add", "relu", [], "composite")
    got = conv_pointwise(x, w, b, *conf, None, "add", "relu", [], "mkldnn")
    assert got.stride() == expected.stride()


SPECIAL_SCALARS = {"hardtanh": [0.0, 6.0], "leaky_relu": [0.1]}


def _nan_and_inf_pattern(t: torch.Tensor) -> tuple:
    return torch.isnan(t), torch.isposinf(t), torch.isneginf(t)


def _same_pattern(expected: torch.Tensor, got: torch.Tensor) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_nan_and_inf_pattern(expected), _nan_and_inf_pattern(got)))


def _specials(*shape, dtype) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(*shape).to(dtype)
    flat = x.view(-1)
    for i, v in enumerate([float("nan"), float("inf"), float("-inf"), 1e30, -1e30]):
        flat[(i * 7) % flat.numel()] = v
    return x


@needs_mkldnn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_mkldnn_conv_keeps_nan_and_infinities_as_eager(activation, channels_last, dtype):
    """oneDNN's relu/hardtanh post-ops turn NaN into 0 and its channels-last gelu turns inf into NaN; where a
    post-op does not keep eager's semantics on this machine the kernel runs the convolution alone."""
    scalars = SPECIAL_SCALARS.get(activation, [])
    for other_shape in (None, (2, 4, 5, 5), (1, 4, 1, 5)):
        x, w, b = _specials(2, 6, 7, 7, dtype=dtype), torch.randn(4, 6, 3, 3).to(dtype), torch.randn(4).to(dtype)
        other = _specials(*other_shape, dtype=dtype) if other_shape else None
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
            other = other.contiguous(memory_format=torch.channels_last) if other is not None else None
        conf = ([1, 1], [0, 0], [1, 1], 1, other, "sub" if other_shape == (1, 4, 1, 5) else "add", activation, scalars)
        expected = conv_pointwise(x, w, b, *conf, "composite")
        got = conv_pointwise(x, w, b, *conf, "mkldnn")
        assert torch.isnan(expected).any() and _same_pattern(expected, got)
        finite = torch.isfinite(expected)
        torch.testing.assert_close(got[finite].float(), expected[finite].float(), rtol=2e-2, atol=2e-2)


@needs_mkldnn
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_mkldnn_linear_keeps_nan_and_infinities_as_eager(activation):
    scalars = SPECIAL_SCALARS.get(activation, [])
    x, w, b = _specials(4, 9, dtype=torch.float32), torch.randn(5, 9), torch.randn(5)
    for other in (None, _specials(4, 5, dtype=torch.float32)):
        expected = linear_pointwise(x, w, b, other, "sub", activation, scalars, "composite")
        got = linear_pointwise(x, w, b, other, "sub", activation, scalars, "mkldnn")
        assert torch.isnan(expected).any() and _same_pattern(expected, got)


@needs_mkldnn
def test_a_post_op_that_loses_nan_is_found_by_its_probe_and_replaced():
    x = torch.tensor([[[[float("nan"), -1.0, 2.0]]]])
    assert not kernels.postop_keeps_specials("conv", "relu", (), None, False, torch.float32)
    fn, args = kernels.conv_kernel_call("mkldnn", x, torch.ones(1, 1, 1, 1), None, [1, 1], [0, 0], [1, 1], 1, None,
                                        "add", "relu", [])
    assert fn is kernels.conv_then_activation
    assert torch.isnan(fn(*args)).view(-1).tolist() == [True, False, False]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudnn_fused_relu_keeps_nan_and_infinities_as_eager_or_is_refused():
    x = _specials(2, 6, 9, 9, dtype=torch.float32).cuda()
    w, b = torch.randn(4, 6, 3, 3).cuda(), torch.randn(4).cuda()
    expected = conv_pointwise(x, w, b, [1, 1], [1, 1], [1, 1], 1, None, "add", "relu", [], "composite")
    got = conv_pointwise(x, w, b, [1, 1], [1, 1], [1, 1], 1, None, "add", "relu", [], "cudnn")
    assert _same_pattern(expected, got)
