"""Which of oneDNN's (and cuDNN's) fused post-ops treat NaN and infinities as eager does, probed on this machine.

oneDNN's relu and hardtanh post-ops turn NaN into 0, and its channels-last gelu turns +inf into NaN; a
fused kernel (:mod:`fxforge.lowering.kernels`) uses a post-op only where the probe here found it exact, once per
configuration, and otherwise runs the convolution (or linear layer) alone and lets torch apply the rest.

Example:
    >>> postop_keeps_specials("conv", "none", (), None, False, torch.float32)
    True
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from fxforge.rewrites import fused_ops

# activation name (fxforge.rewrites.fused_ops.ACTIVATIONS) -> (oneDNN's attribute name, oneDNN's algorithm)
ONEDNN_ACTIVATIONS: dict[str, tuple[str, str | None]] = {
    "none": ("none", None),
    "relu": ("relu", None),
    "hardtanh": ("hardtanh", None),
    "leaky_relu": ("leaky_relu", None),
    "gelu": ("gelu", "none"),
    "gelu_tanh": ("gelu", "tanh"),
    "silu": ("swish", None),
    "sigmoid": ("sigmoid", None),
    "tanh": ("tanh", None),
    "hardswish": ("hardswish", None),
    "hardsigmoid": ("hardsigmoid", None),
}

def mkldnn_available() -> bool:
    """Whether this build of torch has oneDNN's fused convolution and linear ops.

    Example:
        >>> isinstance(mkldnn_available(), bool)
        True
    """
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


# What a post-op must treat as eager does: NaN, both infinities, values whose activation overflows or
# underflows, both zeros, and ordinary values on each side of every activation's knee.
SPECIAL_VALUES = (float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 0.0, -0.0, 1.5, -2.5, 7.0)


def _channels_last(value: Any) -> bool:
    return (isinstance(value, Tensor) and value.dim() == 4 and value.is_contiguous(memory_format=torch.channels_last)
            and not value.is_contiguous())


def _same_specials(expected: Tensor, got: Tensor) -> bool:
    """NaN where eager has NaN, the same infinities, and the finite values equal up to rounding."""
    if expected.shape != got.shape or not torch.equal(torch.isnan(expected), torch.isnan(got)):
        return False
    finite = torch.isfinite(expected)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(expected[~finite & ~torch.isnan(expected)],
                                                                       got[~finite & ~torch.isnan(got)]):
        return False
    return torch.allclose(expected[finite].double(), got[finite].double(), rtol=1e-2, atol=1e-6)


@functools.cache
def postop_keeps_specials(op: str, activation: str, scalars: tuple, binary: str | None, channels_last: bool,
                          dtype: torch.dtype, dims: int = 2) -> bool:
    """Whether oneDNN's fused ``activation`` (after a convolution, ``binary`` ``"add"``/``"sub"`` with another
    tensor first where given; after a linear layer; after a transposed convolution, ``op="conv_transpose"``)
    gives eager's result on :data:`SPECIAL_VALUES`, on this machine; probed once per configuration.

    The probe is an identity convolution or linear layer whose other inputs are zero, so the post-op sees
    the special values themselves (``v * 1 + 0 * 0``); a configuration whose fused call raises counts as not
    proven (the convolution then runs alone, and torch applies the activation).

    Example:
        >>> postop_keeps_specials("conv", "relu", (), None, False, torch.float32)  # NaN -> 0 in oneDNN
        False
        >>> postop_keeps_specials("conv", "none", (), "sub", False, torch.float32)
        True
    """
    if not mkldnn_available():
        return False
    try:
        with torch.no_grad():
            expected, fused = _probe(op, activation, scalars, binary, channels_last, dtype, dims)
    except RuntimeError:  # e.g. an add the fused kernel does not take in this dtype
        return False
    return _same_specials(expected, fused)


def _probe(op: str, activation: str, scalars: tuple, binary: str | None, channels_last: bool,
           dtype: torch.dtype, dims: int = 2) -> tuple[Tensor, Tensor]:
    """(composite, fused oneDNN) of ``activation`` on :data:`SPECIAL_VALUES`, through a ``dims``-d convolution
    (oneDNN's 1d, 2d and 3d kernels differ)."""
    attr, algorithm = ONEDNN_ACTIVATIONS[activation]
    if op == "linear":
        values = torch.tensor(SPECIAL_VALUES, dtype=dtype)
        x, w = torch.stack([values, torch.zeros_like(values)], 1), torch.eye(2, dtype=dtype)
        fused = torch.ops.mkldnn._linear_pointwise.default(x, w, None, attr, list(scalars), algorithm)
        return fused_ops.linear_pointwise_composite(x, w, None, None, "add", activation, scalars), fused
    x, other, w = _identity_conv_probe(dtype, "cpu", binary is not None, channels_last, dims)
    zeros, ones = [0] * dims, [1] * dims
    conv = (zeros, ones, ones, 1)
    if op == "conv_transpose":
        fused = torch.ops.mkldnn._convolution_transpose_pointwise.default(x, w, None, zeros, zeros, ones, ones,
                                                                          1, attr, list(scalars), algorithm)
        expected = fused_ops.conv_transpose_pointwise_composite(x, w, None, ones, zeros, zeros, 1, ones,
                                                                activation, scalars)
        return expected, fused
    if binary is not None:
        fused = torch.ops.mkldnn._convolution_pointwise.binary(x, other, w, None, *conv, binary, None,
                                                              None if activation == "none" else attr,
                                                              list(scalars), algorithm)
    else:
        fused = torch.ops.mkldnn._convolution_pointwise.default(x, w, None, *conv, attr, list(scalars), algorithm)
    expected = fused_ops.conv_pointwise_composite(x, w, None, ones, zeros, ones, 1, other, binary or "add",
                                                  activation, scalars)
    return expected, fused


def _identity_conv_probe(dtype: torch.dtype, device: str, residual: bool, channels_last: bool, dims: int = 2
                         ) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(input, added tensor or None, weight)`` of a 1x1 identity convolution over :data:`SPECIAL_VALUES`:
    channel 0 holds the values, channel 1 zeros, so the identity weight adds only ``0 * 0`` to each value and
    a post-op sees the special values themselves (the added tensor holds them reversed)."""
    values = torch.tensor(SPECIAL_VALUES, dtype=dtype, device=device)
    shape = (1, 2, *[1] * (dims - 1), len(values))
    x = torch.stack([values, torch.zeros_like(values)]).view(shape)
    other = torch.stack([values.flip(0), torch.zeros_like(values)]).view(shape) if residual else None
    if channels_last and dims in (2, 3):
        layout = torch.channels_last if dims == 2 else torch.channels_last_3d
        x = x.contiguous(memory_format=layout)
        other = other.contiguous(memory_format=layout) if other is not None else None
    return x, other, torch.eye(2, dtype=dtype, device=device).view(2, 2, *[1] * dims)


@functools.cache
def cudnn_relu_keeps_specials(residual: bool, dtype: torch.dtype, device: str) -> bool:
    """Whether cuDNN's fused convolution (+ add) + relu gives eager's result on :data:`SPECIAL_VALUES` on
    ``device`` (probed once, as :func:`postop_keeps_specials` probes oneDNN's post-ops).

    Example:
        >>> cudnn_relu_keeps_specials(False, torch.float32, "cuda:0") if torch.cuda.is_available() else None
    """
    x, other, w = _identity_conv_probe(dtype, device, residual, channels_last=False)
    conv = ([1, 1], [0, 0], [1, 1], 1)
    try:
        with torch.no_grad():
            if residual:
                fused = torch.ops.aten.cudnn_convolution_add_relu.default(x, w, other, 1.0, None, *conv)
            else:
                fused = torch.ops.aten.cudnn_convolution_relu.default(x, w, None, *conv)
            expected = fused_ops.conv_pointwise_composite(x, w, None, [1, 1], [0, 0], [1, 1], 1, other, "add", "relu",
                                                          [])
    except RuntimeError:
        return False
    return _same_specials(expected.cpu(), fused.cpu())
