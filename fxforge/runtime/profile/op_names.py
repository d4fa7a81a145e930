"""What a profile calls each node's op: one name per op type, whatever the call form.

Example:
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> [op_type(n, gm) for n in gm.graph.nodes if n.op == "call_module"]
    ['linear', 'relu']
"""

from __future__ import annotations

import operator
import re

import torch

from fxforge.core.nodes import submodule

aten = torch.ops.aten


_OPERATORS = {operator.add: "add", operator.iadd: "add", operator.sub: "sub", operator.isub: "sub",
              operator.mul: "mul", operator.imul: "mul", operator.truediv: "div", operator.itruediv: "div",
              operator.floordiv: "floor_divide", operator.matmul: "matmul", operator.imatmul: "matmul",
              operator.neg: "neg", operator.pow: "pow", operator.getitem: "getitem", operator.mod: "remainder"}
_FUSED = {"fxforge::conv_pointwise": "fxforge.conv_pointwise", "fxforge::linear_pointwise": "fxforge.linear_pointwise",
          "mkldnn::_convolution_pointwise": "fxforge.conv_pointwise",
          "mkldnn::_linear_pointwise": "fxforge.linear_pointwise",
          "aten::cudnn_convolution_relu": "fxforge.conv_pointwise",
          "aten::cudnn_convolution_add_relu": "fxforge.conv_pointwise"}
_MODULES = {"BatchNorm1d": "batch_norm", "BatchNorm2d": "batch_norm", "BatchNorm3d": "batch_norm",
            "ReLU": "relu", "ReLU6": "relu6", "GELU": "gelu", "SiLU": "silu", "PReLU": "prelu", "ELU": "elu",
            "SELU": "selu", "CELU": "celu", "GLU": "glu", "LeakyReLU": "leaky_relu", "MultiheadAttention":
            "multi_head_attention"}


def _snake(name: str) -> str:
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _plain(name: str) -> str:
    """``relu_`` -> ``relu`` (in-place variants grouped with their op); dunders kept."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") and len(name) > 1 else name


def op_type(node: torch.fx.Node, graph_module: torch.nn.Module | None = None) -> str:
    """The kind of op a node runs, the same however the user's code reached it.

    ``nn.Conv2d``, ``F.conv2d`` and ``torch.conv2d`` are all ``"conv2d"``; ``nn.ReLU``, ``F.relu``,
    ``x.relu_()`` and ``aten.relu.default`` are all ``"relu"``; ``+`` is ``"add"``; fxforge's fused ops (and
    the oneDNN/cuDNN kernels the runtime lowers them to) are ``"fxforge.conv_pointwise"`` and
    ``"fxforge.linear_pointwise"``; a module that is not from ``torch.nn`` is its class name.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1), torch.nn.ReLU()))
        >>> [op_type(n, gm) for n in gm.graph.nodes if n.op == "call_module"]
        ['conv2d', 'relu']
    """
    target = node.target
    if node.op == "call_module":
        module = submodule(node, graph_module) if graph_module is not None else None
        if module is None:
            return str(target)
        cls = type(module)
        if not cls.__module__.startswith("torch.nn"):
            return cls.__name__
        return _MODULES.get(cls.__name__) or _snake(cls.__name__)
    if node.op == "call_method":
        return _plain(str(target))
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
        if name in _FUSED:
            return _FUSED[name]
        if target.namespace == "aten":
            return _plain(target._opname)
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _FUSED.get(target._qualified_op_name, str(target))
    if target in _OPERATORS:
        return _OPERATORS[target]
    fused = getattr(target, "fxforge_op", None)  # a kernel function that runs one of fxforge's fused ops
    return fused or _plain(getattr(target, "__name__", str(target)))
