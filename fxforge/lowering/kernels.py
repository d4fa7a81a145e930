"""The fast kernels of fxforge's fused ops: oneDNN (CPU, prepacked weights) and cuDNN (CUDA).

:mod:`fxforge.rewrites.fused_ops` defines ``fxforge::conv_pointwise`` and ``fxforge::linear_pointwise``
by their composite (plain torch ops); this module registers the kernels that run them faster, each with the
reason it refuses a call it cannot run (the op then runs its composite):

- ``"mkldnn"``: oneDNN's fused convolution (+ add) + activation and fused linear + activation, with the
  weight prepacked once per weight, version and call configuration (:data:`PACKED`);
- ``"cudnn"``: cuDNN's fused 2d convolution + bias (+ add) + relu.

Lowering (:mod:`fxforge.lowering.lower`) emits these calls straight into the graph; autotune
(:mod:`fxforge.lowering.autotune`) times them.

Example:
    >>> x, w = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 1, 1)
    >>> conv_kernel_call("cudnn", x, w, None, [1, 1], [0, 0], [1, 1], 1, None, "relu", [])
    'cuDNN fused convolution runs on CUDA (input on cpu)'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.fx import Node

from fxforge.core.tensor_cache import TensorCache
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
    # Prepacked weights make oneDNN write channels-last output; the op's output must keep the input's
    # layout (as the composite does), so they are used for channels-last inputs only.
    if weight.dim() == 4 and value.is_contiguous(memory_format=torch.channels_last) and not value.is_contiguous():
        shape = list(value.shape)
        key = (tuple(padding), tuple(stride), tuple(dilation), groups, tuple(shape))
        weight = PACKED.get(weight, (weight._version, *key), lambda: ops._reorder_convolution_weight(
            weight.detach(), padding, stride, dilation, groups, shape))
    conv = (list(padding), list(stride), list(dilation), groups)
    if other is None:
        return ops._convolution_pointwise.default, (input, weight, bias, *conv, attr, list(scalars), algorithm)
    unary = None if activation == "none" else attr
    return ops._convolution_pointwise.binary, (input, other, weight, bias, *conv, "add", None, unary, list(scalars),
                                               algorithm)


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
    return None


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
        rows = _value(input).numel() // _value(input).shape[-1]
        packed = PACKED.get(weight, (weight._version, "linear", rows),
                            lambda: ops._reorder_linear_weight(weight.detach(), rows))
        return ops._linear_pointwise.default, (input, packed, bias, attr, list(scalars), algorithm)
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
    return None


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
