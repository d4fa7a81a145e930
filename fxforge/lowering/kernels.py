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
    >>> conv_kernel_call("cudnn", x, w, None, [1, 1], [0, 0], [1, 1], 1, None, "add", "relu", [])
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
from fxforge.lowering.postop_probes import (  # noqa: F401 - ONEDNN_ACTIVATIONS and the probes, as before
    ONEDNN_ACTIVATIONS,
    SPECIAL_VALUES,
    _channels_last,
    cudnn_relu_keeps_specials,
    mkldnn_available,
    postop_keeps_specials,
)
from fxforge.rewrites import fused_ops

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


def mkldnn_conv_supported(input: Tensor, weight: Tensor, other: Tensor | None, activation: str) -> str | None:
    """Why oneDNN's fused convolution cannot run this call, or None. (An ``other`` of the output's rank may
    broadcast onto it: oneDNN's binary post-op takes ``[1, C, 1, 1]`` and the like.)

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
    return None


def _conv_mkldnn(input, weight, bias, stride, padding, dilation, groups, other, binary, activation, scalars):
    attr, algorithm = ONEDNN_ACTIVATIONS[activation]
    ops = torch.ops.mkldnn
    value = _value(input)
    # After a binary post-op the activation runs in torch: oneDNN's unary after its binary treated NaN unlike
    # eager in blocked (many-channel) kernels that the probe's two channels do not reach.
    residual = binary if other is not None else None
    exact = postop_keeps_specials("conv", activation if other is None else "none", tuple(scalars), residual,
                                  _channels_last(value), value.dtype, weight.dim() - 2)
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
    if exact and activation == "none":
        return ops._convolution_pointwise.binary, (input, other, weight, bias, *conv, binary, None, None, [], None)
    if exact:  # the convolution and its binary post-op in oneDNN, the activation in torch
        return conv_binary_then_activation, (input, other, weight, bias, *conv, binary, activation, list(scalars))
    return conv_add_then_activation, (input, other, weight, bias, *conv, binary, activation, list(scalars))


def _conv_cudnn(input, weight, bias, stride, padding, dilation, groups, other, binary, activation, scalars):
    conv = (list(stride), list(padding), list(dilation), groups)
    if other is None:
        return torch.ops.aten.cudnn_convolution_relu.default, (input, weight, bias, *conv)
    return torch.ops.aten.cudnn_convolution_add_relu.default, (input, weight, other, 1.0, bias, *conv)


def _value(x: Any) -> Any:
    """A tensor, or the (fake) value a graph node stands for."""
    return x.meta.get("val") if isinstance(x, Node) else x


def conv_kernel_call(kernel: str, input: Any, weight: Tensor, bias: Any, stride, padding, dilation, groups: int,
                     other: Any, binary: str, activation: str, scalars) -> tuple[Callable, tuple] | str:
    """``(function, args)`` such that ``function(*args)`` is the op run by ``kernel``, or why it cannot be.

    ``weight`` must be the real weight (oneDNN gets a prepacked copy of it, made once and cached).
    ``input``, ``bias`` and ``other`` may be tensors or graph nodes with fake values; they are passed
    through into ``args`` as given. The runtime's lowering emits this call straight into the graph,
    without the custom op's dispatch; the custom op calls it too, so both run the same kernel.

    Example:
        >>> x, w = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 1, 1)
        >>> conv_kernel_call("cudnn", x, w, None, [1, 1], [0, 0], [1, 1], 1, None, "add", "relu", [])
        'cuDNN fused convolution runs on CUDA (input on cpu)'
        >>> fn, args = conv_kernel_call("composite", x, w, None, [1, 1], [0, 0], [1, 1], 1, None, "add", "relu", [])
        >>> torch.equal(fn(*args), torch.relu(torch.nn.functional.conv2d(x, w)))
        True
    """
    args = (input, weight, bias, stride, padding, dilation, groups, other, binary, activation, scalars)
    if kernel == "mkldnn":
        reason = mkldnn_conv_supported(_value(input), weight, _value(other), activation)
        return reason or _conv_mkldnn(*args)
    if kernel == "cudnn":
        reason = cudnn_conv_supported(_value(input), weight, _value(other), activation)
        full = _conv_output_shape(_value(input), weight, stride, padding, dilation)
        if reason is None and other is not None and (binary != "add" or tuple(_value(other).shape) != full):
            reason = "cuDNN's fused convolution adds a tensor of the output's shape only"
        return reason or _conv_cudnn(*args)
    return fused_ops.conv_pointwise_composite, args


def _conv_output_shape(input: Any, weight: Tensor, stride, padding, dilation) -> tuple:
    """The shape of ``conv(input, weight)`` (sizes as the input gives them: ints, or symbols)."""
    spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1
               for size, k, s, p, d in zip(input.shape[2:], weight.shape[2:], stride, padding, dilation)]
    return (input.shape[0], weight.shape[0], *spatial)


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


def linear_kernel_call(kernel: str, input: Any, weight: Tensor, bias: Any, other: Any, binary: str, activation: str,
                       scalars) -> tuple[Callable, tuple] | str:
    """``(function, args)`` such that ``function(*args)`` is the linear op run by ``kernel``, or why not.

    Arguments as for :func:`conv_kernel_call`. oneDNN adds (or subtracts) ``other`` as its binary post-op where
    it has the output's shape; the activation then runs in torch, in place.

    Example:
        >>> fn, args = linear_kernel_call("composite", torch.ones(1, 2), torch.ones(3, 2), None, None, "add", "relu",
        ...                               [])
        >>> fn(*args).tolist()
        [[2.0, 2.0, 2.0]]
    """
    if kernel == "mkldnn":
        reason = mkldnn_linear_supported(_value(input), weight)
        value, added = _value(input), _value(other)
        if reason is None and added is not None and (tuple(added.shape) != (*value.shape[:-1], weight.shape[0])
                                                     or added.dtype != value.dtype):
            reason = "oneDNN's linear + add takes a tensor of the output's shape and dtype only"
        if reason:
            return reason
        attr, algorithm = ONEDNN_ACTIVATIONS[activation]
        ops = torch.ops.mkldnn
        rows = hint(value.numel()) // hint(value.shape[-1])  # a packing hint: any rows run
        packed = PACKED.get(weight, (*packing_key(weight), "linear", rows),
                            lambda: ops._reorder_linear_weight(weight.detach(), rows))
        if other is not None:
            return linear_binary_then_activation, (input, other, packed, bias, binary, activation, list(scalars))
        if postop_keeps_specials("linear", activation, tuple(scalars), None, False, value.dtype):
            return ops._linear_pointwise.default, (input, packed, bias, attr, list(scalars), algorithm)
        return linear_then_activation, (input, packed, bias, activation, list(scalars))
    if kernel != "composite":
        return f"no {kernel} kernel for linear"
    return fused_ops.linear_pointwise_composite, (input, weight, bias, other, binary, activation, scalars)


def conv_transpose_kernel_call(kernel: str, input: Any, weight: Tensor, bias: Any, stride, padding, output_padding,
                               groups: int, dilation, activation: str, scalars) -> tuple[Callable, tuple] | str:
    """``(function, args)`` such that ``function(*args)`` is the transposed convolution (+ activation) run by
    ``kernel``, or why not (arguments as for :func:`conv_kernel_call`, in ``F.conv_transposeNd``'s order).

    Example:
        >>> x, w = torch.randn(1, 2, 3, 3), torch.randn(2, 2, 2, 2)
        >>> fn, args = conv_transpose_kernel_call("mkldnn", x, w, None, [2, 2], [0, 0], [0, 0], 1, [1, 1], "tanh", [])
        >>> torch.allclose(fn(*args), torch.tanh(torch.nn.functional.conv_transpose2d(x, w, stride=2)), atol=1e-5)
        True
    """
    if kernel == "mkldnn":
        value = _value(input)
        reason = _mkldnn_refusal("transposed convolution", value, weight)
        if reason:
            return reason
        attr, algorithm = ONEDNN_ACTIVATIONS[activation]
        call = (list(padding), list(output_padding), list(stride), list(dilation), groups)
        if postop_keeps_specials("conv_transpose", activation, tuple(scalars), None, False, value.dtype,
                                 weight.dim() - 2):
            return torch.ops.mkldnn._convolution_transpose_pointwise.default, (input, weight, bias, *call, attr,
                                                                               list(scalars), algorithm)
        return conv_transpose_then_activation, (input, weight, bias, *call, activation, list(scalars))
    if kernel != "composite":
        return f"no {kernel} kernel for transposed convolution"
    return fused_ops.conv_transpose_pointwise_composite, (input, weight, bias, stride, padding, output_padding, groups,
                                                          dilation, activation, scalars)


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
                             stride: list, dilation: list, groups: int, binary: str, activation: str,
                             scalars: list) -> Tensor:
    """oneDNN's convolution, then torch adds (or subtracts) ``other`` and applies ``activation`` (where oneDNN's
    binary post-op does not treat special values as eager does).

    Example:
        >>> x, other = torch.ones(1, 1, 1, 2), torch.tensor([[[[float("-inf"), float("nan")]]]])
        >>> conv_add_then_activation(x, other, torch.ones(1, 1, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, "add",
        ...                          "relu", []).tolist()
        [[[[0.0, nan]]]]
    """
    y = torch.ops.mkldnn._convolution_pointwise.default(input, weight, bias, padding, stride, dilation, groups,
                                                         "none", [], None)
    y = y.add_(other) if binary == "add" and y.shape == torch.broadcast_shapes(y.shape, other.shape) \
        else fused_ops.BINARIES[binary](y, other)
    return _activate(y, activation, scalars)


def conv_binary_then_activation(input: Tensor, other: Tensor, weight: Tensor, bias: Tensor | None, padding: list,
                                stride: list, dilation: list, groups: int, binary: str, activation: str,
                                scalars: list) -> Tensor:
    """oneDNN's convolution with its binary post-op (``binary`` of ``other``), then torch's ``activation``.

    Example:
        >>> x, other = torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 1)
        >>> conv_binary_then_activation(x, other, torch.ones(1, 1, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, "sub",
        ...                             "sigmoid", []).tolist()
        [[[[0.5, 0.5]]]]
    """
    y = torch.ops.mkldnn._convolution_pointwise.binary(input, other, weight, bias, padding, stride, dilation, groups,
                                                        binary, None, None, [], None)
    return _activate(y, activation, scalars)


def linear_binary_then_activation(input: Tensor, other: Tensor, weight: Tensor, bias: Tensor | None, binary: str,
                                  activation: str, scalars: list) -> Tensor:
    """oneDNN's linear layer (``weight`` prepacked) with ``other`` added or subtracted as its binary post-op, then
    torch's ``activation``.

    Example:
        >>> w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(1, 1), 1)
        >>> linear_binary_then_activation(torch.ones(1, 1), torch.ones(1, 1), w, None, "sub", "relu", []).tolist()
        [[0.0]]
    """
    y = torch.ops.mkldnn._linear_pointwise.binary(input, other, weight, bias, binary)
    return _activate(y, activation, scalars)


def conv_transpose_then_activation(input: Tensor, weight: Tensor, bias: Tensor | None, padding: list,
                                   output_padding: list, stride: list, dilation: list, groups: int, activation: str,
                                   scalars: list) -> Tensor:
    """oneDNN's transposed convolution alone, then torch's ``activation``.

    Example:
        >>> x = torch.tensor([[[[float("nan"), -1.0]]]])
        >>> conv_transpose_then_activation(x, torch.ones(1, 1, 1, 1), None, [0, 0], [0, 0], [1, 1], [1, 1], 1, "relu",
        ...                                []).tolist()
        [[[[nan, 0.0]]]]
    """
    y = torch.ops.mkldnn._convolution_transpose_pointwise.default(input, weight, bias, padding, output_padding,
                                                                   stride, dilation, groups, "none", [], None)
    return _activate(y, activation, scalars)


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
conv_binary_then_activation.fxforge_op = "fxforge.conv_pointwise"
linear_then_activation.fxforge_op = "fxforge.linear_pointwise"
linear_binary_then_activation.fxforge_op = "fxforge.linear_pointwise"
conv_transpose_then_activation.fxforge_op = "fxforge.conv_transpose_pointwise"


# ---------------------------------------------------------------------------------------------- registration

KERNELS_BY_OP: dict[str, Callable[..., Any]] = {"conv_pointwise": conv_kernel_call, "linear_pointwise": linear_kernel_call,
                                                "conv_transpose_pointwise": conv_transpose_kernel_call}


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
