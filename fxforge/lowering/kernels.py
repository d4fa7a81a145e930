"""The fast kernels of fxforge's fused ops: oneDNN (CPU, prepacked weights) and cuDNN (CUDA).

:mod:`fxforge.rewrites.fused_ops` defines ``fxforge::conv_pointwise`` and ``fxforge::linear_pointwise``
by their composite (plain torch ops); this module registers the kernels that run them faster, each with the
reason it refuses a call it cannot run (the op then runs its composite):

- ``"mkldnn"``: oneDNN's fused convolution (+ add) + activation and fused linear + activation, with the
  weight prepacked once per weight, version and call configuration (:data:`PACKED`);
- ``"cudnn"``: cuDNN's fused 2d convolution + bias (+ add) + relu.

A fused activation (a post-op) is used only where it treats NaN and infinities as eager does, which is
proven on the running machine (:func:`postop_keeps_specials`: special values through an identity
convolution, once per configuration): oneDNN's relu and hardtanh post-ops turn NaN into 0, and its
channels-last gelu turns +inf into NaN, so there oneDNN runs the convolution (or linear, or convolution +
add) alone and torch applies the activation to its fresh output (:func:`conv_then_activation`...).

Lowering (:mod:`fxforge.lowering.lower`) emits these calls straight into the graph; autotune
(:mod:`fxforge.lowering.autotune`) times them.

Example:
    >>> x, w = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 1, 1)
    >>> conv_kernel_call("cudnn", x, w, None, [1, 1], [0, 0], [1, 1], 1, None, "relu", [])
    'cuDNN fused convolution runs on CUDA (input on cpu)'
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.fx import Node
from torch.nn import functional as F

from fxforge.core.derived import DATA_TOUCHES
from fxforge.core.symbolic import hint
from fxforge.core.tensor_cache import TensorCache, version
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
}

# oneDNN-prepacked copies of weights, per weight, its version and the call's configuration.
PACKED = TensorCache()


def packing_key(weight: Tensor) -> tuple[int, int]:
    """What a packed copy of ``weight`` must be made again for: an in-place change (its version), or a touch
    of its ``.data`` (``p.data.mul_(2)`` changes it without a new version).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2)); before = packing_key(w)
        >>> with torch.no_grad():
        ...     _ = w.mul_(2)
        >>> packing_key(w) != before
        True
    """
    return version(weight), DATA_TOUCHES.touches(weight)


def mkldnn_available() -> bool:
    """Whether this build of torch has oneDNN's fused convolution and linear ops.

    Example:
        >>> isinstance(mkldnn_available(), bool)
        True
    """
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


def mkldnn_conv_supported(input: Tensor, weight: Tensor, other: Tensor | None, activation: str) -> str | None:
    """Why oneDNN's fused convolution cannot run this call, or None.

    Example:
        >>> x64 = torch.ones(1, 1, 4, 4, dtype=torch.float64)
        >>> mkldnn_conv_supported(x64, torch.ones(1, 1, 1, 1), None, "relu")
        'oneDNN fused convolution needs float32 or bfloat16 (got torch.float64)'
    """
    reason = _mkldnn_refusal("convolution", input, weight)
    if reason:
        return reason
    if other is not None and (other.dtype != input.dtype or other.dim() != input.dim()):
        return "the added tensor's dtype or rank differs from the convolution's"
    if other is not None and weight.dim() == 3:
        return "oneDNN's fused convolution + add runs 2d and 3d convolutions only"
    if other is not None and activation not in ("none", "relu"):
        return f"oneDNN's fused convolution + add takes relu or no activation, not {activation}"
    return None


def _conv_mkldnn(input, weight, bias, stride, padding, dilation, groups, other, activation, scalars):
    attr, algorithm = ONEDNN_ACTIVATIONS[activation]
    ops = torch.ops.mkldnn
    value = _value(input)
    exact = postop_keeps_specials("conv", activation, tuple(scalars), other is not None, _channels_last(value),
                                  value.dtype)
    # Prepacked weights make oneDNN write channels-last output; the op's output must keep the input's
    # layout (as the composite does), so they are used for channels-last inputs only.
    if _channels_last(value):
        shape = [hint(size) for size in value.shape]  # a shape-generic graph's: packed for the example's sizes
        key = (tuple(padding), tuple(stride), tuple(dilation), groups, tuple(shape))
        weight = PACKED.get(weight, (*packing_key(weight), *key), lambda: ops._reorder_convolution_weight(
            weight.detach(), padding, stride, dilation, groups, shape))
    conv = (list(padding), list(stride), list(dilation), groups)
    if other is None and exact:
        return ops._convolution_pointwise.default, (input, weight, bias, *conv, attr, list(scalars), algorithm)
    if other is None:
        return conv_then_activation, (input, weight, bias, *conv, activation, list(scalars))
    if exact:
        unary = None if activation == "none" else attr
        return ops._convolution_pointwise.binary, (input, other, weight, bias, *conv, "add", None, unary,
                                                   list(scalars), algorithm)
    return conv_add_then_activation, (input, other, weight, bias, *conv, activation, list(scalars))


def _conv_cudnn(input, weight, bias, stride, padding, dilation, groups, other, activation, scalars):
    conv = (list(stride), list(padding), list(dilation), groups)
    if other is None:
        return torch.ops.aten.cudnn_convolution_relu.default, (input, weight, bias, *conv)
    return torch.ops.aten.cudnn_convolution_add_relu.default, (input, weight, other, 1.0, bias, *conv)


def _value(x: Any) -> Any:
    """A tensor, or the (fake) value a graph node stands for."""
    return x.meta.get("val") if isinstance(x, Node) else x


def conv_kernel_call(kernel: str, input: Any, weight: Tensor, bias: Any, stride, padding, dilation, groups: int,
                     other: Any, activation: str, scalars) -> tuple[Callable, tuple] | str:
    """``(function, args)`` such that ``function(*args)`` is the op run by ``kernel``, or why it cannot be.

    ``weight`` must be the real weight (oneDNN gets a prepacked copy of it, made once and cached).
    ``input``, ``bias`` and ``other`` may be tensors or graph nodes with fake values; they are passed
    through into ``args`` as given. The runtime's lowering emits this call straight into the graph,
    without the custom op's dispatch; the custom op calls it too, so both run the same kernel.

    Example:
        >>> x, w = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 1, 1)
        >>> conv_kernel_call("cudnn", x, w, None, [1, 1], [0, 0], [1, 1], 1, None, "relu", [])
        'cuDNN fused convolution runs on CUDA (input on cpu)'
        >>> fn, args = conv_kernel_call("composite", x, w, None, [1, 1], [0, 0], [1, 1], 1, None, "relu", [])
        >>> torch.equal(fn(*args), torch.relu(torch.nn.functional.conv2d(x, w)))
        True
    """
    args = (input, weight, bias, stride, padding, dilation, groups, other, activation, scalars)
    if kernel == "mkldnn":
        reason = mkldnn_conv_supported(_value(input), weight, _value(other), activation)
        return reason or _conv_mkldnn(*args)
    if kernel == "cudnn":
        reason = cudnn_conv_supported(_value(input), weight, _value(other), activation)
        return reason or _conv_cudnn(*args)
    return fused_ops.conv_pointwise_composite, args


def cudnn_conv_supported(input: Tensor, weight: Tensor, other: Tensor | None, activation: str) -> str | None:
    """Why cuDNN's fused conv+bias(+add)+relu cannot run this call, or None.

    Example:
        >>> cudnn_conv_supported(torch.ones(1, 1, 4, 4), torch.ones(1, 1, 1, 1), None, "relu")
        'cuDNN fused convolution runs on CUDA (input on cpu)'
    """
    if input.device.type != "cuda" or not torch.backends.cudnn.is_available():
        return f"cuDNN fused convolution runs on CUDA (input on {input.device.type})"
    if activation != "relu" or weight.dim() != 4:
        return "cuDNN's fused convolution covers 2d convolution + bias (+ add) + relu only"
    if input.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"cuDNN fused convolution does not take {input.dtype}"
    if not cudnn_relu_keeps_specials(other is not None, input.dtype, str(input.device)):
        return "cuDNN's fused relu does not keep NaN and infinities as eager does (probed on this device)"
    return None


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
            expected = fused_ops.conv_pointwise_composite(x, w, None, [1, 1], [0, 0], [1, 1], 1, other, "relu", [])
    except RuntimeError:
        return False
    return _same_specials(expected.cpu(), fused.cpu())


def linear_kernel_call(kernel: str, input: Any, weight: Tensor, bias: Any, activation: str,
                       scalars) -> tuple[Callable, tuple] | str:
    """``(function, args)`` such that ``function(*args)`` is the linear op run by ``kernel``, or why not.

    Arguments as for :func:`conv_kernel_call`.

    Example:
        >>> fn, args = linear_kernel_call("composite", torch.ones(1, 2), torch.ones(3, 2), None, "relu", [])
        >>> fn(*args).tolist()
        [[2.0, 2.0, 2.0]]
    """
    if kernel == "mkldnn":
        reason = mkldnn_linear_supported(_value(input), weight)
        if reason:
            return reason
        attr, algorithm = ONEDNN_ACTIVATIONS[activation]
        ops = torch.ops.mkldnn
        rows = hint(_value(input).numel()) // hint(_value(input).shape[-1])  # a packing hint: any rows run
        packed = PACKED.get(weight, (*packing_key(weight), "linear", rows),
                            lambda: ops._reorder_linear_weight(weight.detach(), rows))
        if postop_keeps_specials("linear", activation, tuple(scalars), False, False, _value(input).dtype):
            return ops._linear_pointwise.default, (input, packed, bias, attr, list(scalars), algorithm)
        return linear_then_activation, (input, packed, bias, activation, list(scalars))
    if kernel != "composite":
        return f"no {kernel} kernel for linear"
    return fused_ops.linear_pointwise_composite, (input, weight, bias, activation, scalars)


def mkldnn_linear_supported(input: Tensor, weight: Tensor) -> str | None:
    """Why oneDNN's fused linear cannot run this call, or None.

    Example:
        >>> mkldnn_linear_supported(torch.ones(2, 3, dtype=torch.float64), torch.ones(4, 3))
        'oneDNN fused linear needs float32 or bfloat16 (got torch.float64)'
    """
    return _mkldnn_refusal("linear", input, weight)


def _mkldnn_refusal(what: str, input: Tensor, weight: Tensor) -> str | None:
    """What keeps any oneDNN fused ``what`` from running: the build, the device, the dtype."""
    if not mkldnn_available():
        return f"this torch build has no oneDNN fused {what}"
    if input.device.type != "cpu":
        return f"oneDNN fused {what} runs on CPU (input on {input.device.type})"
    if input.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != input.dtype:
        return f"oneDNN fused {what} needs float32 or bfloat16 (got {input.dtype})"
    if input.dtype == torch.bfloat16 and not mkldnn_bf16_supported():
        return f"this CPU has no oneDNN bfloat16 {what} (it needs avx512bw/vl/dq or avx_ne_convert)"
    return None


@functools.cache
def mkldnn_bf16_supported() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 kernels (without it they raise at the first call).

    Example:
        >>> isinstance(mkldnn_bf16_supported(), bool)
        True
    """
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


# ---------------------------------------------------------------------------------------------- special values

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
def postop_keeps_specials(op: str, activation: str, scalars: tuple, residual: bool, channels_last: bool,
                          dtype: torch.dtype) -> bool:
    """Whether oneDNN's fused ``activation`` (after a convolution, + add when ``residual``, or after a linear
    layer) gives eager's result on :data:`SPECIAL_VALUES`, on this machine; probed once per configuration.

    The probe is an identity convolution or linear layer whose other inputs are zero, so the post-op sees
    the special values themselves (``v * 1 + 0 * 0``); a configuration whose fused call raises counts as not
    proven (the convolution then runs alone, and torch applies the activation).

    Example:
        >>> postop_keeps_specials("conv", "relu", (), False, False, torch.float32)  # NaN -> 0 in oneDNN
        False
        >>> postop_keeps_specials("conv", "none", (), False, False, torch.float32)
        True
    """
    if not mkldnn_available():
        return False
    try:
        with torch.no_grad():
            expected, fused = _probe(op, activation, scalars, residual, channels_last, dtype)
    except RuntimeError:  # e.g. an add the fused kernel does not take in this dtype
        return False
    return _same_specials(expected, fused)


def _probe(op: str, activation: str, scalars: tuple, residual: bool, channels_last: bool,
           dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(composite, fused oneDNN) of ``activation`` on :data:`SPECIAL_VALUES`."""
    attr, algorithm = ONEDNN_ACTIVATIONS[activation]
    if op == "linear":
        values = torch.tensor(SPECIAL_VALUES, dtype=dtype)
        x, w = torch.stack([values, torch.zeros_like(values)], 1), torch.eye(2, dtype=dtype)
        fused = torch.ops.mkldnn._linear_pointwise.default(x, w, None, attr, list(scalars), algorithm)
        return fused_ops.linear_pointwise_composite(x, w, None, activation, scalars), fused
    x, other, w = _identity_conv_probe(dtype, "cpu", residual, channels_last)
    conv = ([0, 0], [1, 1], [1, 1], 1)
    if residual:
        fused = torch.ops.mkldnn._convolution_pointwise.binary(x, other, w, None, *conv, "add", None,
                                                              None if activation == "none" else attr,
                                                              list(scalars), algorithm)
    else:
        fused = torch.ops.mkldnn._convolution_pointwise.default(x, w, None, *conv, attr, list(scalars), algorithm)
    expected = fused_ops.conv_pointwise_composite(x, w, None, [1, 1], [0, 0], [1, 1], 1, other, activation, scalars)
    return expected, fused


def _identity_conv_probe(dtype: torch.dtype, device: str, residual: bool, channels_last: bool
                         ) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(input, added tensor or None, weight)`` of a 1x1 identity convolution over :data:`SPECIAL_VALUES`:
    channel 0 holds the values, channel 1 zeros, so the identity weight adds only ``0 * 0`` to each value and
    a post-op sees the special values themselves (the added tensor holds them reversed)."""
    values = torch.tensor(SPECIAL_VALUES, dtype=dtype, device=device)
    x = torch.stack([values, torch.zeros_like(values)]).view(1, 2, 1, len(values))
    other = torch.stack([values.flip(0), torch.zeros_like(values)]).view(1, 2, 1, len(values)) if residual else None
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        other = other.contiguous(memory_format=torch.channels_last) if other is not None else None
    return x, other, torch.eye(2, dtype=dtype, device=device).view(2, 2, 1, 1)


def _activate(y: Tensor, activation: str, scalars: Sequence[float]) -> Tensor:
    """``activation`` applied by torch to ``y``, a fresh tensor (in place where torch has the in-place form)."""
    inplace = _INPLACE.get(activation)
    return inplace(y, scalars) if inplace is not None else fused_ops.ACTIVATIONS[activation](y, scalars)


_INPLACE = {
    "none": lambda y, s: y,
    "relu": lambda y, s: torch.relu_(y),
    "hardtanh": lambda y, s: F.hardtanh_(y, s[0], s[1]),
    "leaky_relu": lambda y, s: F.leaky_relu_(y, s[0]),
}


def conv_then_activation(input: Tensor, weight: Tensor, bias: Tensor | None, padding: list, stride: list,
                         dilation: list, groups: int, activation: str, scalars: list) -> Tensor:
    """oneDNN's convolution alone, then torch's ``activation`` (where oneDNN's post-op is not eager's).

    Example:
        >>> x = torch.tensor([[[[float("nan"), -1.0]]]])
        >>> conv_then_activation(x, torch.ones(1, 1, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, "relu", []).tolist()
        [[[[nan, 0.0]]]]
    """
    y = torch.ops.mkldnn._convolution_pointwise.default(input, weight, bias, padding, stride, dilation, groups,
                                                         "none", [], None)
    return _activate(y, activation, scalars)


def conv_add_then_activation(input: Tensor, other: Tensor, weight: Tensor, bias: Tensor | None, padding: list,
                             stride: list, dilation: list, groups: int, activation: str, scalars: list) -> Tensor:
    """oneDNN's convolution + add (computed as eager does: the convolution, then the sum), then torch's
    ``activation``.

    Example:
        >>> x, other = torch.ones(1, 1, 1, 2), torch.tensor([[[[float("-inf"), float("nan")]]]])
        >>> conv_add_then_activation(x, other, torch.ones(1, 1, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, "relu",
        ...                          []).tolist()
        [[[[0.0, nan]]]]
    """
    y = torch.ops.mkldnn._convolution_pointwise.default(input, weight, bias, padding, stride, dilation, groups,
                                                         "none", [], None)
    return _activate(y.add_(other), activation, scalars)


def linear_then_activation(input: Tensor, weight: Tensor, bias: Tensor | None, activation: str,
                           scalars: list) -> Tensor:
    """oneDNN's linear layer alone (``weight`` prepacked), then torch's ``activation``.

    Example:
        >>> w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(1, 1), 1)
        >>> linear_then_activation(torch.tensor([[float("nan")]]), w, None, "relu", []).tolist()
        [[nan]]
    """
    y = torch.ops.mkldnn._linear_pointwise.default(input, weight, bias, "none", [], None)
    return _activate(y, activation, scalars)


# What a profile calls each of these kernels' nodes (as it calls oneDNN's fused ops): the fused op they run.
conv_then_activation.fxforge_op = "fxforge.conv_pointwise"
conv_add_then_activation.fxforge_op = "fxforge.conv_pointwise"
linear_then_activation.fxforge_op = "fxforge.linear_pointwise"


# ---------------------------------------------------------------------------------------------- registration

KERNELS_BY_OP: dict[str, Callable[..., Any]] = {"conv_pointwise": conv_kernel_call, "linear_pointwise": linear_kernel_call}


def kernels_for(device: torch.device) -> tuple[str, ...]:
    """The kernels worth timing on ``device`` (the composite is always a candidate).

    Example:
        >>> kernels_for(torch.device("cpu"))
        ('composite', 'mkldnn')
    """
    extra = {"cpu": ("mkldnn",), "cuda": ("cudnn",)}.get(device.type, ())
    return ("composite", *extra)


for _op, _call in KERNELS_BY_OP.items():
    for _kernel in ("mkldnn", "cudnn"):
        fused_ops.register_kernel(_op, _kernel, _call)
