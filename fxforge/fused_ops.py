"""The fused ops fxforge's rewrites emit, registered with ``torch.library``.

``fxforge::conv_pointwise`` is a convolution, optionally plus a same-shape tensor (a residual), then an
activation; ``fxforge::linear_pointwise`` is a linear layer then an activation. Each op has

- a composite implementation (the plain torch ops, which is also its definition),
- a fake implementation, so fake-tensor propagation and ``torch.export`` keep the op,
- autograd (gradients of the composite), so a model optimized in eval mode still backpropagates,
- a ``kernel`` argument that picks the implementation: ``"composite"``, ``"mkldnn"`` (oneDNN's fused
  convolution/linear with prepacked weights, CPU) or ``"cudnn"`` (cuDNN's fused conv+bias+relu and
  conv+bias+add+relu, CUDA). The kernel never changes what the op means; the ``conv_activation``
  rewrite chooses it by timing (see :mod:`fxforge.rewrites.autotune`).

Activations (``activation`` and ``scalars``): ``none``, ``relu``, ``hardtanh`` (min, max),
``leaky_relu`` (slope), ``gelu``, ``gelu_tanh``, ``silu``, ``sigmoid``, ``tanh``, ``hardswish``.

Example:
    >>> x, w, b = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    >>> y = torch.ops.fxforge.conv_pointwise(x, w, b, [1, 1], [1, 1], [1, 1], 1, None, "relu", [], "composite")
    >>> torch.equal(y, torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1)))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.fx import Node
from torch.nn import functional as F

from fxforge.tensor_cache import TensorCache

KERNELS = ("composite", "mkldnn", "cudnn")

# activation name -> (function of (y, scalars), oneDNN's attribute name, oneDNN's algorithm)
ACTIVATIONS: dict[str, tuple[Callable[[Tensor, Sequence[float]], Tensor], str, str | None]] = {
    "none": (lambda y, s: y, "none", None),
    "relu": (lambda y, s: F.relu(y), "relu", None),
    "hardtanh": (lambda y, s: F.hardtanh(y, s[0], s[1]), "hardtanh", None),
    "leaky_relu": (lambda y, s: F.leaky_relu(y, s[0]), "leaky_relu", None),
    "gelu": (lambda y, s: F.gelu(y), "gelu", "none"),
    "gelu_tanh": (lambda y, s: F.gelu(y, approximate="tanh"), "gelu", "tanh"),
    "silu": (lambda y, s: F.silu(y), "swish", None),
    "sigmoid": (lambda y, s: torch.sigmoid(y), "sigmoid", None),
    "tanh": (lambda y, s: torch.tanh(y), "tanh", None),
    "hardswish": (lambda y, s: F.hardswish(y), "hardswish", None),
}
_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}  # by the number of spatial dimensions


def conv_pointwise_composite(input: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int],
                             padding: Sequence[int], dilation: Sequence[int], groups: int, other: Tensor | None,
                             activation: str, scalars: Sequence[float]) -> Tensor:
    """``activation(conv(input, weight, bias) + other)`` with plain torch ops: the op's definition.

    Example:
        >>> y = conv_pointwise_composite(torch.ones(1, 1, 3), torch.ones(1, 1, 1), None, [1], [0], [1], 1,
        ...                              torch.ones(1, 1, 3), "none", [])
        >>> y.tolist()
        [[[2.0, 2.0, 2.0]]]
    """
    y = _CONVS[len(stride)](input, weight, bias, stride, padding, dilation, groups)
    if other is not None:
        y = y + other
    return ACTIVATIONS[activation][0](y, scalars)


def linear_pointwise_composite(input: Tensor, weight: Tensor, bias: Tensor | None, activation: str,
                               scalars: Sequence[float]) -> Tensor:
    """``activation(linear(input, weight, bias))`` with plain torch ops: the op's definition.

    Example:
        >>> linear_pointwise_composite(torch.ones(1, 2), torch.ones(1, 2), None, "relu", []).tolist()
        [[2.0]]
    """
    return ACTIVATIONS[activation][0](F.linear(input, weight, bias), scalars)


# ---------------------------------------------------------------------------------------------- kernels

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
    _, attr, algorithm = ACTIVATIONS[activation]
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
    return conv_pointwise_composite, args


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
        _, attr, algorithm = ACTIVATIONS[activation]
        ops = torch.ops.mkldnn
        rows = _value(input).numel() // _value(input).shape[-1]
        packed = PACKED.get(weight, (weight._version, "linear", rows),
                            lambda: ops._reorder_linear_weight(weight.detach(), rows))
        return ops._linear_pointwise.default, (input, packed, bias, attr, list(scalars), algorithm)
    if kernel != "composite":
        return f"no {kernel} kernel for linear"
    return linear_pointwise_composite, (input, weight, bias, activation, scalars)


def kernel_or_composite(kernel_call: Callable, kernel: str, *args: Any) -> tuple[Callable, tuple]:
    """``kernel_call(kernel, *args)``, or the composite where that kernel cannot run these arguments.

    The composite defines the op, so falling back never changes what it computes.

    Example:
        >>> x, w = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 1, 1)
        >>> fn, _ = kernel_or_composite(conv_kernel_call, "cudnn", x, w, None, [1, 1], [0, 0], [1, 1], 1, None,
        ...                             "relu", [])
        >>> fn is conv_pointwise_composite
        True
    """
    call = kernel_call(kernel, *args)
    return kernel_call("composite", *args) if isinstance(call, str) else call


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


# ---------------------------------------------------------------------------------------------- the ops

@torch.library.custom_op("fxforge::conv_pointwise", mutates_args=())
def conv_pointwise(input: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int],
                   padding: Sequence[int], dilation: Sequence[int], groups: int, other: Tensor | None,
                   activation: str, scalars: Sequence[float], kernel: str) -> Tensor:
    """``activation(conv(input, weight, bias) + other)`` run by ``kernel`` (see the module docstring).

    Example:
        >>> x, w = torch.randn(1, 2, 5, 5), torch.randn(2, 2, 1, 1)
        >>> y = conv_pointwise(x, w, None, [1, 1], [0, 0], [1, 1], 1, x, "relu", [], "composite")
        >>> torch.equal(y, torch.relu(torch.nn.functional.conv2d(x, w) + x))
        True
    """
    fn, args = kernel_or_composite(conv_kernel_call, kernel, input, weight, bias, stride, padding, dilation, groups,
                                   other, activation, scalars)
    return fn(*args)


@conv_pointwise.register_fake
def _conv_pointwise_fake(input, weight, bias, stride, padding, dilation, groups, other, activation, scalars,
                         kernel):
    # The composite without its activation: every activation keeps the shape, dtype and strides of the
    # fresh tensor it is given, and running it on fake tensors would cost as much again as the convolution.
    return conv_pointwise_composite(input, weight, bias, stride, padding, dilation, groups, other, "none", ())


@torch.library.custom_op("fxforge::linear_pointwise", mutates_args=())
def linear_pointwise(input: Tensor, weight: Tensor, bias: Tensor | None, activation: str,
                     scalars: Sequence[float], kernel: str) -> Tensor:
    """``activation(linear(input, weight, bias))`` run by ``kernel`` (``"composite"`` or ``"mkldnn"``).

    Example:
        >>> x, w = torch.randn(3, 4), torch.randn(5, 4)
        >>> torch.equal(linear_pointwise(x, w, None, "tanh", [], "composite"), torch.tanh(x @ w.T))
        True
    """
    fn, args = kernel_or_composite(linear_kernel_call, kernel, input, weight, bias, activation, scalars)
    return fn(*args)


@linear_pointwise.register_fake
def _linear_pointwise_fake(input, weight, bias, activation, scalars, kernel):
    return linear_pointwise_composite(input, weight, bias, "none", ())  # as for conv_pointwise's fake


# ---------------------------------------------------------------------------------------------- autograd

def _gradients(composite: Callable, tensor_slots: tuple[int, ...]):
    """Autograd for an op: its backward is the gradient of ``composite``, recomputed from the inputs."""

    def setup_context(ctx, inputs, output):
        ctx.inputs = inputs
        ctx.save_for_backward(*(inputs[i] for i in tensor_slots))

    def backward(ctx, grad):
        saved = dict(zip(tensor_slots, ctx.saved_tensors))
        wanted = [i for i in tensor_slots if saved[i] is not None and ctx.needs_input_grad[i]]
        args = list(ctx.inputs[:-1])  # all but the kernel
        with torch.enable_grad():
            for i in wanted:
                args[i] = saved[i].detach().requires_grad_()
            grads = torch.autograd.grad(composite(*args), [args[i] for i in wanted], grad)
        result: list = [None] * len(ctx.inputs)
        for i, g in zip(wanted, grads):
            result[i] = g
        return tuple(result)

    return backward, setup_context


_backward, _setup = _gradients(conv_pointwise_composite, (0, 1, 2, 7))
conv_pointwise.register_autograd(_backward, setup_context=_setup)
_backward, _setup = _gradients(linear_pointwise_composite, (0, 1, 2))
linear_pointwise.register_autograd(_backward, setup_context=_setup)
