"""Linear layers and 2d convolutions of a rewritten graph in int8 (:mod:`fxforge.lowering.int8_ops`).

A layer is int8-able when its weight is a tensor of the model (a parameter, buffer or folded constant), it
computes in float32, and (convolutions) its padding is numeric. :func:`int8_layers` lists them;
:func:`~fxforge.lowering.int8_ranges.observe_inputs` records each convolution's input range on calibration calls
(the observers of static quantization); :func:`quantize_layers` replaces the chosen layers by the int8 ops,
their int8 weights and scales folded from the live float weights (so a changed weight is quantized again), and
a fused op's residual and activation applied to the float32 result.

Example:
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
    ...                             torch.nn.Linear(8 * 6 * 6, 4)).eval()
    >>> gm = torch.fx.symbolic_trace(model)
    >>> [n.name for n in int8_layers(gm)]
    ['_0', '_3']
    >>> from fxforge.lowering.int8_ranges import observe_inputs
    >>> x = torch.randn(2, 3, 6, 6)
    >>> ranges = observe_inputs(gm, [(x,)], ["_0"])
    >>> quantize_layers(gm, int8_layers(gm), ranges)
    >>> sorted({str(n.target) for n in gm.graph.nodes if "int8" in str(n.target)})
    ['fxforge.int8_conv.default', 'fxforge.int8_linear.default']
    >>> bool((gm(x) - model(x)).abs().max() < 0.05 * model(x).abs().max())
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from fxforge.core.nodes import copy_graph_module
from fxforge.lowering.int8_ops import DIRECT, input_qparams, weight_int8, weight_scale
from fxforge.lowering.precision import _float32, _module_call_as_function
from fxforge.rewrites import fused_ops
from fxforge.rewrites.folding import fold_constants

aten = torch.ops.aten
_LINEARS = (F.linear, torch._C._nn.linear, aten.linear.default)
_CONVS = (F.conv2d, torch.conv2d, aten.conv2d.default)
_FUSED_LINEAR = "fxforge.linear_pointwise"
_FUSED_CONV = "fxforge.conv_pointwise"


@dataclasses.dataclass
class _Layer:
    """One int8-able layer's parts: input, weight and bias nodes, the convolution's settings (None: a linear
    layer), and what a fused op does after it (residual ``other`` with ``binary``, then ``activation``)."""

    input: Node
    weight: Node
    bias: Any
    conv: tuple | None = None
    other: Any = None
    binary: str = "add"
    activation: str = "none"
    scalars: Sequence[float] = ()


def _pair(value: Any) -> list[int]:
    return [value, value] if isinstance(value, int) else list(value)


def _argument(node: Node, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _parts(node: Node, gm: torch.fx.GraphModule) -> _Layer | None:
    """The layer ``node`` is, or None where it is not one int8 runs."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.padding_mode == "zeros"
                                             and not isinstance(module.padding, str)):
            return _Layer(node.args[0], node, None)  # (turned into its functional call when quantized)
        return None
    if node.op != "call_function":
        return None
    target, args = node.target, node.args
    if target in _LINEARS + _CONVS and not isinstance(_argument(node, 0, "input", None), Node):
        return None  # (an input passed in a way this does not read: the layer stays as it is)
    if target in _LINEARS:
        return _Layer(_argument(node, 0, "input", None), _argument(node, 1, "weight", None),
                      _argument(node, 2, "bias", None))
    if target in _CONVS:
        padding = _argument(node, 4, "padding", 0)
        if isinstance(padding, str):
            return None
        conv = (_pair(_argument(node, 3, "stride", 1)), _pair(padding), _pair(_argument(node, 5, "dilation", 1)),
                _argument(node, 6, "groups", 1))
        return _Layer(_argument(node, 0, "input", None), _argument(node, 1, "weight", None),
                      _argument(node, 2, "bias", None), conv)
    if str(target).startswith(_FUSED_LINEAR):
        x, w, b, other, binary, activation, scalars = args[:7]
        return _Layer(x, w, b, None, other, binary, activation, scalars)
    if str(target).startswith(_FUSED_CONV) and len(args[3]) == 2:
        x, w, b, stride, padding, dilation, groups, other, binary, activation, scalars = args[:11]
        return _Layer(x, w, b, (list(stride), list(padding), list(dilation), groups), other, binary, activation,
                      scalars)
    return None


def _constant(node: Any) -> bool:
    return isinstance(node, Node) and node.op in ("get_attr", "call_module")


def int8_layers(gm: torch.fx.GraphModule) -> list[Node]:
    """The nodes of ``gm`` that int8 can run (see the module docstring), in graph order.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Conv1d(1, 1, 1)))
        >>> [n.name for n in int8_layers(gm)]
        ['_0']
    """
    found = []
    for node in gm.graph.nodes:
        parts = _parts(node, gm)
        if parts is not None and _constant(parts.weight) and (parts.bias is None or _constant(parts.bias)) \
                and _float32(node) and _float32(parts.input):
            found.append(node)
    return found


def _after(y: torch.Tensor, other: torch.Tensor | None, binary: str, activation: str,
           scalars: Sequence[float]) -> torch.Tensor:
    """A fused op's residual and activation, applied to the int8 layer's float32 result ``y`` (a fresh tensor
    of the graph's own, so changed in place where the shapes allow)."""
    if other is not None:
        if torch.broadcast_shapes(y.shape, other.shape) == y.shape and other.dtype == y.dtype:
            y = y.add_(other) if binary == "add" else y.sub_(other)
        else:
            y = fused_ops.BINARIES[binary](y, other)
    if activation == "relu":
        return y.relu_()
    return fused_ops.ACTIVATIONS[activation](y, scalars)


def quantize_layers(gm: torch.fx.GraphModule, layers: Sequence[Node], ranges: dict[str, tuple[float, float]],
                    kernels: dict[str, str] | None = None) -> None:
    """Replace each of ``layers`` (from :func:`int8_layers`) by its int8 op; a convolution's input is quantized
    with the scale of its range in ``ranges`` (by node name; a convolution without one stays as it is), a linear
    layer's by its kernel in ``kernels`` (``"per token"``, the default; ``"per tensor"``; ``"static"``, in its
    range). ``gm`` is changed in place and recompiled."""
    kernels = kernels or {}
    for node in layers:
        name = node.name
        parts = _parts(node, gm)
        if parts is None or (parts.conv is not None or _is_conv_module(gm, node)) and name not in ranges:
            continue
        if node.op == "call_module":
            node = _module_call_as_function(gm, node)
            parts = _parts(node, gm)
        graph = gm.graph
        with graph.inserting_before(node):
            quantized = graph.call_function(weight_int8, (parts.weight,))
            scale = graph.call_function(weight_scale, (parts.weight,))
            activation = parts.activation
            kernel = kernels.get(name, "per token")
            if parts.conv is None and kernel == "static" and name in ranges:
                call = graph.call_function(torch.ops.fxforge.int8_linear_static.default,
                                           (parts.input, quantized, scale, parts.bias, *input_qparams(*ranges[name])))
            elif parts.conv is None:
                op = torch.ops.fxforge.int8_linear_tensor if kernel == "per tensor" else torch.ops.fxforge.int8_linear
                call = graph.call_function(op.default, (parts.input, quantized, scale, parts.bias))
            else:
                fused_relu = activation == "relu" and parts.other is None
                activation = "none" if fused_relu else activation
                call = graph.call_function(torch.ops.fxforge.int8_conv.default,
                                           (parts.input, quantized, scale, parts.bias, *parts.conv,
                                            *input_qparams(*ranges[name]), "relu" if fused_relu else "none"))
            result = call
            if parts.other is not None or activation != "none":
                result = graph.call_function(_after, (call, parts.other, parts.binary, activation,
                                                      list(parts.scalars)))
                result.meta.update(node.meta)
        call.meta.update(node.meta)
        node.replace_all_uses_with(result)
        weight = parts.weight
        graph.erase_node(node)
        fold_constants(gm, [weight, quantized, scale])  # (the int8 weight and scales follow the live weight)
    gm.graph.lint()
    gm.recompile()


def _is_conv(gm: torch.fx.GraphModule, node: Node) -> bool:
    return _conv_settings(gm, node) is not None


def _conv_settings(gm: torch.fx.GraphModule, node: Node) -> tuple | None:
    """A convolution layer's (stride, padding, dilation, groups); None for a linear layer."""
    if _is_conv_module(gm, node):
        module = gm.get_submodule(str(node.target))
        return (list(module.stride), list(module.padding), list(module.dilation), module.groups)
    return _parts(node, gm).conv if node.op == "call_function" else None


def _is_conv_module(gm: torch.fx.GraphModule, node: Node) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.Conv2d)


def direct_calls(gm: torch.fx.GraphModule) -> None:
    """Call the int8 ops' plain functions in ``gm`` (in place): a graph that runs skips the custom-op dispatch
    (tens of microseconds a call); a graph to export keeps the ops."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in DIRECT:
            node.target = DIRECT[node.target]
    gm.recompile()


def quantized_copy(gm: torch.fx.GraphModule, names: set[str], ranges: dict[str, tuple[float, float]],
                   kernels: dict[str, str] | None = None) -> torch.fx.GraphModule:
    """A new GraphModule of ``gm``'s graph (sharing the model's tensors) with the named layers in int8, calling
    the ops' plain functions (:func:`direct_calls`).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8)))
        >>> copy = quantized_copy(gm, {"_0"}, {})
        >>> [n.target.__name__ for n in copy.graph.nodes if n.op == "call_function"], len(list(gm.graph.nodes))
        (['linear_int8'], 3)
    """
    quantized = copy_graph_module(gm)
    quantize_layers(quantized, [n for n in quantized.graph.nodes if n.name in names], ranges, kernels)
    direct_calls(quantized)
    return quantized


class Int8Reduction:
    """The int8 trials of :func:`~fxforge.lowering.precision_choice.choose_layers`: each runs a quantized copy
    of the graph (:func:`quantized_copy`), the convolutions' inputs in the ``ranges`` observed on calibration
    calls. ``convolutions=False`` (a graph run on a GPU, where no int8 convolution kernel is at hand) offers the
    linear layers alone; ``speeds`` leaves out the layers not faster in int8 at their size and picks each linear
    layer's kernel (per token, per tensor or static).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8)))
        >>> reduction = Int8Reduction({})
        >>> reduction.kind, [n.name for n in reduction.layers(gm)]
        ('int8', ['_0'])
    """

    kind = "int8"

    def __init__(self, ranges: dict[str, tuple[float, float]], convolutions: bool = True,
                 speeds: dict[str, Any] | None = None):
        self.ranges, self.convolutions, self.speeds = ranges, convolutions, speeds or {}

    def layers(self, gm: torch.fx.GraphModule) -> list[Node]:
        """The layers int8 can run, less those ``speeds`` (by node name, from
        :func:`~fxforge.lowering.int8_speed.layer_speeds`) found not faster in int8."""
        return [n for n in int8_layers(gm) if (self.convolutions or not _is_conv(gm, n))
                and (n.name not in self.speeds or self.speeds[n.name].faster)]

    def apply(self, gm: torch.fx.GraphModule, names: set[str]) -> torch.fx.GraphModule:
        """A copy of ``gm`` with the named layers in int8 (:func:`quantized_copy`)."""
        return quantized_copy(gm, names, self.ranges, {name: speed.kernel for name, speed in self.speeds.items()})

    def run(self, gm: torch.fx.GraphModule, inputs: Sequence[tuple], names: set[str]) -> list:
        """``gm``'s outputs on ``inputs`` with the named layers in int8."""
        quantized = self.apply(gm, names)
        with torch.no_grad():
            return [quantized(*args) for args in inputs]
