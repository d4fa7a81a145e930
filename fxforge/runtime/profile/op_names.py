"""What a profile calls each node's op: the name :mod:`fxforge.core.vocabulary` gives it, whatever the call form.

Ops the vocabulary lists are named by it (``nn.ReLU``, ``F.relu``, ``x.relu_()`` and ``aten.relu.default``
are all ``relu``; ``nn.ReLU6`` is ``hardtanh``, the op torch runs for it); fxforge's fused ops and the kernels
they lower to are named by the fused op; any other op by what it calls (an ATen op's name, a method's, a
``torch.nn`` module's class in snake case, another module's class).

Example:
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU6()))
    >>> [op_type(n, gm) for n in gm.graph.nodes if n.op == "call_module"]
    ['linear', 'hardtanh']
"""

from __future__ import annotations

import re

import torch

from fxforge.core.nodes import submodule
from fxforge.core.vocabulary import class_op_name, op_name

# fxforge's fused ops, and the oneDNN/cuDNN kernels the runtime lowers them to, by qualified op name.
FUSED = {"fxforge::conv_pointwise": "fxforge.conv_pointwise", "fxforge::linear_pointwise": "fxforge.linear_pointwise",
         "mkldnn::_convolution_pointwise": "fxforge.conv_pointwise",
         "mkldnn::_linear_pointwise": "fxforge.linear_pointwise",
         "fxforge::conv_transpose_pointwise": "fxforge.conv_transpose_pointwise",
         "mkldnn::_convolution_transpose_pointwise": "fxforge.conv_transpose_pointwise",
         "aten::cudnn_convolution_relu": "fxforge.conv_pointwise",
         "aten::cudnn_convolution_add_relu": "fxforge.conv_pointwise"}


def _snake(name: str) -> str:
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _plain(name: str) -> str:
    """``relu_`` -> ``relu`` (in-place variants grouped with their op); dunders kept."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") and len(name) > 1 else name


def _module_type(module: torch.nn.Module) -> str:
    """A module's op: the vocabulary's for its class (hooks do not change what it computes), else its class
    name (in snake case for ``torch.nn``'s)."""
    cls = type(module)
    name = class_op_name(cls)
    if name is not None:
        return name
    return _snake(cls.__name__) if cls.__module__.startswith("torch.nn") else cls.__name__


def op_type(node: torch.fx.Node, graph_module: torch.nn.Module | None = None) -> str:
    """The kind of op a node runs, the same however the user's code reached it.

    ``nn.Conv2d``, ``F.conv2d`` and ``aten.conv2d`` are all ``"conv2d"``; ``nn.ReLU``, ``F.relu``,
    ``x.relu_()`` and ``aten.relu.default`` are all ``"relu"``; ``+`` is ``"add"`` (the names of
    :data:`fxforge.core.vocabulary.OPS`); fxforge's fused ops (and the oneDNN/cuDNN kernels the runtime lowers
    them to) are ``"fxforge.conv_pointwise"`` and ``"fxforge.linear_pointwise"``; a module that is not from
    ``torch.nn`` is its class name.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1), torch.nn.ReLU()))
        >>> [op_type(n, gm) for n in gm.graph.nodes if n.op == "call_module"]
        ['conv2d', 'relu']
    """
    target = node.target
    if node.op == "call_module":
        module = submodule(node, graph_module) if graph_module is not None else None
        return str(target) if module is None else _module_type(module)
    name = op_name(node)
    if name is not None:
        return name
    if node.op == "call_method":
        return _plain(str(target))
    if isinstance(target, torch._ops.OpOverload):
        qualified = target._schema.name
        if qualified in FUSED:
            return FUSED[qualified]
        return _plain(target._opname) if target.namespace == "aten" else f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return FUSED.get(target._qualified_op_name, str(target))
    fused = getattr(target, "fxforge_op", None)  # a kernel function that runs one of fxforge's fused ops
    return fused or _plain(getattr(target, "__name__", str(target)))
