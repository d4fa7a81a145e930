"""The fused ops fxforge's rewrites emit, registered with ``torch.library``.

``fxforge::conv_pointwise`` is a convolution, optionally plus or minus a tensor (a residual, or one that
broadcasts onto the output: ``binary`` is ``"add"`` or ``"sub"``), then an activation;
``fxforge::linear_pointwise`` is the same for a linear layer; ``fxforge::conv_transpose_pointwise`` is a
transposed convolution then an activation. Each op has

- a composite implementation (the plain torch ops, which is also its definition),
- a fake implementation, so fake-tensor propagation and ``torch.export`` keep the op,
- autograd (gradients of the composite), so a model optimized in eval mode still backpropagates,
- a ``kernel`` argument that picks the implementation: ``"composite"``, ``"mkldnn"`` (oneDNN's fused
  convolution/linear with prepacked weights, CPU) or ``"cudnn"`` (cuDNN's fused conv+bias+relu and
  conv+bias+add+relu, CUDA). The kernel never changes what the op means; the ``conv_activation``
  rewrite chooses it by timing (see :mod:`fxforge.lowering.autotune`).

Activations (``activation`` and ``scalars``): ``none``, ``relu``, ``hardtanh`` (min, max),
``leaky_relu`` (slope), ``gelu``, ``gelu_tanh``, ``silu``, ``sigmoid``, ``tanh``, ``hardswish``,
``hardsigmoid``.

Example:
    >>> x, w, b = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    >>> y = torch.ops.fxforge.conv_pointwise(x, w, b, [1, 1], [1, 1], [1, 1], 1, None, "add", "relu", [],
    ...                                      "composite")
    >>> torch.equal(y, torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1)))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

# activation name -> its function of (y, scalars)
ACTIVATIONS: dict[str, Callable[[Tensor, Sequence[float]], Tensor]] = {
    "none": lambda y, s: y,
    "relu": lambda y, s: F.relu(y),
    "hardtanh": lambda y, s: F.hardtanh(y, s[0], s[1]),
    "leaky_relu": lambda y, s: F.leaky_relu(y, s[0]),
    "gelu": lambda y, s: F.gelu(y),
    "gelu_tanh": lambda y, s: F.gelu(y, approximate="tanh"),
    "silu": lambda y, s: F.silu(y),
    "sigmoid": lambda y, s: torch.sigmoid(y),
    "tanh": lambda y, s: torch.tanh(y),
    "hardswish": lambda y, s: F.hardswish(y),
    "hardsigmoid": lambda y, s: F.hardsigmoid(y),
}
# binary name -> ``(y, other) -> y op other``: what a fused op does with its ``other`` tensor
BINARIES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"add": torch.add, "sub": torch.sub}
_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}  # by the number of spatial dimensions
_CONV_TRANSPOSES = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def conv_pointwise_composite(input: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int],
                             padding: Sequence[int], dilation: Sequence[int], groups: int, other: Tensor | None,
                             binary: str, activation: str, scalars: Sequence[float]) -> Tensor:
    """``activation(conv(input, weight, bias) <binary> other)`` with plain torch ops: the op's definition.

    Example:
        >>> y = conv_pointwise_composite(torch.ones(1, 1, 3), torch.ones(1, 1, 1), None, [1], [0], [1], 1,
        ...                              torch.ones(1, 1, 3), "sub", "none", [])
        >>> y.tolist()
        [[[0.0, 0.0, 0.0]]]
    """
    y = _CONVS[len(stride)](input, weight, bias, stride, padding, dilation, groups)
    if other is not None:
        y = BINARIES[binary](y, other)
    return ACTIVATIONS[activation](y, scalars)


def linear_pointwise_composite(input: Tensor, weight: Tensor, bias: Tensor | None, other: Tensor | None,
                               binary: str, activation: str, scalars: Sequence[float]) -> Tensor:
    """``activation(linear(input, weight, bias) <binary> other)`` with plain torch ops: the op's definition.

    Example:
        >>> linear_pointwise_composite(torch.ones(1, 2), torch.ones(1, 2), None, None, "add", "relu", []).tolist()
        [[2.0]]
    """
    y = F.linear(input, weight, bias)
    if other is not None:
        y = BINARIES[binary](y, other)
    return ACTIVATIONS[activation](y, scalars)


def conv_transpose_pointwise_composite(input: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int],
                                       padding: Sequence[int], output_padding: Sequence[int], groups: int,
                                       dilation: Sequence[int], activation: str, scalars: Sequence[float]) -> Tensor:
    """``activation(conv_transpose(input, weight, bias))`` with plain torch ops: the op's definition
    (arguments in ``F.conv_transposeNd``'s order).

    Example:
        >>> conv_transpose_pointwise_composite(-torch.ones(1, 1, 2), torch.ones(1, 1, 1), None, [1], [0], [0], 1,
        ...                                    [1], "relu", []).tolist()
        [[[0.0, 0.0]]]
    """
    y = _CONV_TRANSPOSES[len(stride)](input, weight, bias, stride, padding, output_padding, groups, dilation)
    return ACTIVATIONS[activation](y, scalars)


# ---------------------------------------------------------------------------------------------- kernels

# A kernel call: ``(kernel, *op arguments) -> (function, args)`` such that ``function(*args)`` runs the op, or a
# string saying why that kernel cannot run these arguments. Arguments may be tensors or graph nodes whose
# ``meta["val"]`` stands for them (lowering emits the call into a graph).
KernelCall = Callable[..., "tuple[Callable, tuple] | str"]

# op name ("conv_pointwise", "linear_pointwise") -> kernel name -> its call; filled once, at import, by
# fxforge.lowering.kernels (configuration, not results: nothing writes here while fxforge runs).
_KERNELS: dict[str, dict[str, KernelCall]] = {"conv_pointwise": {}, "linear_pointwise": {}, "conv_transpose_pointwise": {}}


def register_kernel(op: str, kernel: str, call: KernelCall) -> None:
    """Make ``kernel`` runnable for fused op ``op`` (``"conv_pointwise"`` or ``"linear_pointwise"``).

    Example:
        >>> register_kernel("linear_pointwise", "demo", lambda kernel, *args: "demo runs nothing")
        >>> kernel_call("linear_pointwise", "demo", torch.ones(1, 2), torch.ones(3, 2), None, None, "add", "relu", [])
        'demo runs nothing'
        >>> del _KERNELS["linear_pointwise"]["demo"]
    """
    _KERNELS[op][kernel] = call


def registered_kernels(op: str) -> tuple[str, ...]:
    """The kernels that can be asked for ``op``, the composite first.

    Example:
        >>> registered_kernels("conv_pointwise")[0]
        'composite'
    """
    return ("composite", *_KERNELS[op])


def kernel_call(op: str, kernel: str, *args: Any) -> tuple[Callable, tuple] | str:
    """``(function, args)`` running ``op`` with ``kernel`` on ``args``, or why that kernel cannot run them.

    Example:
        >>> fn, args = kernel_call("linear_pointwise", "composite", torch.ones(1, 2), torch.ones(3, 2), None,
        ...                        None, "add", "relu", [])
        >>> fn(*args).tolist()
        [[2.0, 2.0, 2.0]]
        >>> kernel_call("linear_pointwise", "nonesuch", torch.ones(1, 2), torch.ones(3, 2), None, None, "add",
        ...             "relu", [])
        'no nonesuch kernel for linear_pointwise'
    """
    if kernel == "composite":
        return _COMPOSITES[op], args
    call = _KERNELS[op].get(kernel)
    return call(kernel, *args) if call is not None else f"no {kernel} kernel for {op}"


def kernel_or_composite(op: str, kernel: str, *args: Any) -> tuple[Callable, tuple]:
    """``kernel_call(op, kernel, *args)``, or the composite where that kernel cannot run these arguments.

    The composite defines the op, so falling back never changes what it computes.

    Example:
        >>> x, w = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 1, 1)
        >>> fn, _ = kernel_or_composite("conv_pointwise", "nonesuch", x, w, None, [1, 1], [0, 0], [1, 1], 1,
        ...                             None, "add", "relu", [])
        >>> fn is conv_pointwise_composite
        True
    """
    call = kernel_call(op, kernel, *args)
    return (_COMPOSITES[op], args) if isinstance(call, str) else call


_COMPOSITES = {"conv_pointwise": conv_pointwise_composite, "linear_pointwise": linear_pointwise_composite,
               "conv_transpose_pointwise": conv_transpose_pointwise_composite}


# ---------------------------------------------------------------------------------------------- the ops

@torch.library.custom_op("fxforge::conv_pointwise", mutates_args=())
def conv_pointwise(input: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int],
                   padding: Sequence[int], dilation: Sequence[int], groups: int, other: Tensor | None,
                   binary: str, activation: str, scalars: Sequence[float], kernel: str) -> Tensor:
    """``activation(conv(input, weight, bias) <binary> other)`` run by ``kernel`` (see the module docstring).

    Example:
        >>> x, w = torch.randn(1, 2, 5, 5), torch.randn(2, 2, 1, 1)
        >>> y = conv_pointwise(x, w, None, [1, 1], [0, 0], [1, 1], 1, x, "add", "relu", [], "composite")
        >>> torch.equal(y, torch.relu(torch.nn.functional.conv2d(x, w) + x))
        True
    """
    fn, args = kernel_or_composite("conv_pointwise", kernel, input, weight, bias, stride, padding, dilation, groups,
                                   other, binary, activation, scalars)
    return fn(*args)


@conv_pointwise.register_fake
def _conv_pointwise_fake(input, weight, bias, stride, padding, dilation, groups, other, binary, activation, scalars,
                         kernel):
    # The composite without its activation: every activation keeps the shape, dtype and strides of the
    # fresh tensor it is given, and running it on fake tensors would cost as much again as the convolution.
    return conv_pointwise_composite(input, weight, bias, stride, padding, dilation, groups, other, binary, "none", ())


@torch.library.custom_op("fxforge::linear_pointwise", mutates_args=())
def linear_pointwise(input: Tensor, weight: Tensor, bias: Tensor | None, other: Tensor | None, binary: str,
                     activation: str, scalars: Sequence[float], kernel: str) -> Tensor:
    """``activation(linear(input, weight, bias) <binary> other)`` run by ``kernel`` (see the module docstring).

    Example:
        >>> x, w = torch.randn(3, 4), torch.randn(5, 4)
        >>> torch.equal(linear_pointwise(x, w, None, None, "add", "tanh", [], "composite"), torch.tanh(x @ w.T))
        True
    """
    fn, args = kernel_or_composite("linear_pointwise", kernel, input, weight, bias, other, binary, activation,
                                   scalars)
    return fn(*args)


@linear_pointwise.register_fake
def _linear_pointwise_fake(input, weight, bias, other, binary, activation, scalars, kernel):
    return linear_pointwise_composite(input, weight, bias, other, binary, "none", ())  # as for conv_pointwise's


@torch.library.custom_op("fxforge::conv_transpose_pointwise", mutates_args=())
def conv_transpose_pointwise(input: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int],
                             padding: Sequence[int], output_padding: Sequence[int], groups: int,
                             dilation: Sequence[int], activation: str, scalars: Sequence[float], kernel: str) -> Tensor:
    """``activation(conv_transpose(input, weight, bias))`` run by ``kernel`` (see the module docstring).

    Example:
        >>> x, w = torch.randn(1, 2, 5, 5), torch.randn(2, 3, 2, 2)
        >>> y = conv_transpose_pointwise(x, w, None, [2, 2], [0, 0], [0, 0], 1, [1, 1], "silu", [], "composite")
        >>> torch.equal(y, torch.nn.functional.silu(torch.nn.functional.conv_transpose2d(x, w, stride=2)))
        True
    """
    fn, args = kernel_or_composite("conv_transpose_pointwise", kernel, input, weight, bias, stride, padding,
                                   output_padding, groups, dilation, activation, scalars)
    return fn(*args)


@conv_transpose_pointwise.register_fake
def _conv_transpose_pointwise_fake(input, weight, bias, stride, padding, output_padding, groups, dilation,
                                   activation, scalars, kernel):
    return conv_transpose_pointwise_composite(input, weight, bias, stride, padding, output_padding, groups, dilation,
                                              "none", ())


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
_backward, _setup = _gradients(linear_pointwise_composite, (0, 1, 2, 3))
linear_pointwise.register_autograd(_backward, setup_context=_setup)
_backward, _setup = _gradients(conv_transpose_pointwise_composite, (0, 1, 2))
conv_transpose_pointwise.register_autograd(_backward, setup_context=_setup)
