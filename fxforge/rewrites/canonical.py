"""Canonical ops: a graph node read as the op it calls, with its arguments bound by name.

Every call form of an op is bound to the op's signature, defaults filled in; the op names, their forms and
their signatures are the vocabulary's (:mod:`fxforge.core.vocabulary`: ``OPS``, ``SIGNATURES``,
``FIXED_ARGUMENTS``). ``nn.ReLU()``, ``F.relu``, ``torch.relu``, ``x.relu()``, ``relu_``, ``inplace=True`` and
``aten.relu_`` are all ``relu``; ``+``, ``torch.add``, ``x.add_`` and ``aten.add.Tensor`` are all ``add``;
``nn.ReLU6`` and ``F.relu6`` are ``hardtanh`` from 0 to 6; ``nn.Conv2d``, ``F.conv2d``, ``aten.conv2d`` and
``aten.convolution`` are all ``conv2d`` (strides, paddings and dilations as tuples). The pattern engine
(:mod:`fxforge.rewrites.pattern`) compares graphs in these terms.

Example:
    >>> gm = torch.fx.symbolic_trace(lambda x, y: torch.add(y, x).relu_())
    >>> [canonicalize(n, gm).name for n in gm.graph.nodes if n.op.startswith("call")]
    ['add', 'relu']
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from fxforge.core.nodes import CALL_OPS, attribute_tensor, is_inplace, submodule
from fxforge.core.vocabulary import FIXED_ARGUMENTS, REQUIRED, SIGNATURES, module_op_name, op_name

F = nn.functional
aten = torch.ops.aten
# Multi-output batch norms of decomposed export graphs, seen through ``getitem(node, 0)``.
_BN_TUPLES = {getattr(aten, n) for n in ("_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
                                         "native_batch_norm") if hasattr(aten, n)}
_DUNDER = {"__add__": "add", "__iadd__": "add_", "__sub__": "sub", "__isub__": "sub_", "__mul__": "mul",
           "__imul__": "mul_", "__truediv__": "div", "__itruediv__": "div_", "__matmul__": "matmul",
           "__pow__": "pow", "__ipow__": "pow_"}
_IGNORED_ARGS = {"inplace", "cudnn_enabled", "output_padding"}
_PARAMETERS = ("weight", "bias", "running_mean", "running_var")


@dataclasses.dataclass(frozen=True)
class ParamRef:
    """A parameter or buffer of a called module (``conv.weight``), which the graph has no node for."""

    target: str


@dataclasses.dataclass
class Op:
    """One graph node seen as a canonical op.

    Attributes:
        name: the canonical op (``"relu"``, ``"conv2d"``...), or the call target for ops outside the table.
        args: canonical argument name -> ``Node``, :class:`ParamRef` or constant, defaults filled in.
        node: the node whose value the op is.
        covered: other nodes the op consists of (a multi-output batch norm behind ``getitem``).
        inplace: the op writes its result into ``args["input"]``.
        effect: a side effect the op has besides its result, if any.
    """

    name: Any
    args: dict[str, Any]
    node: Node
    covered: tuple[Node, ...] = ()
    inplace: bool = False
    effect: str | None = None


@functools.cache
def _python_signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _bind_schema(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> dict | None:
    positional = [a for a in schema.arguments if not a.kwarg_only]
    names = {a.name for a in schema.arguments}
    if len(args) > len(positional) or any(k not in names for k in kwargs):
        return None
    bound = {a.name: v for a, v in zip(positional, args)}
    bound.update(kwargs)
    if any(a.name not in bound and not a.has_default_value() for a in schema.arguments):
        return None
    return bound


def _bind_aten(name: str, args: tuple, kwargs: dict) -> dict | None:
    packet = getattr(aten, name, None)
    for overload in packet.overloads() if packet is not None else []:
        bound = _bind_schema(getattr(packet, overload)._schema, args, kwargs)
        if bound is not None:
            return bound
    return None


def _bind_call(node: Node) -> dict | None:
    """The node's arguments by name, using the signature of what it calls."""
    target, args, kwargs = node.target, tuple(node.args), dict(node.kwargs)
    if node.op == "call_method":
        return _bind_aten(_DUNDER.get(target, target), args, kwargs)
    if isinstance(target, torch._ops.OpOverload):
        return _bind_schema(target._schema, args, kwargs)
    if target in (operator.add, operator.iadd, operator.sub, operator.isub, operator.mul, operator.imul,
                  operator.truediv, operator.itruediv, operator.matmul, operator.gt):
        return {"input": args[0], "other": args[1]} if len(args) == 2 and not kwargs else None
    if target in (operator.pow, operator.ipow):
        return {"input": args[0], "exponent": args[1]} if len(args) == 2 and not kwargs else None
    signature = _python_signature(target)
    if signature is not None:
        try:
            return dict(signature.bind(*args, **kwargs).arguments)
        except TypeError:
            return None
    return _bind_aten(getattr(target, "__name__", ""), args, kwargs)


def bound_tensor(gm: torch.fx.GraphModule, value: Any) -> torch.Tensor | None:
    """The real tensor behind a ParamRef or get_attr node, else the node's FakeTensor, else None.

    Example:
        >>> bound_tensor(torch.nn.Linear(2, 3), ParamRef("weight")).shape
        torch.Size([3, 2])
    """
    target = value.target if isinstance(value, ParamRef) else None
    if isinstance(value, Node):
        if value.op == "get_attr":
            target = value.target
        else:
            val = value.meta.get("val")
            return val if isinstance(val, torch.Tensor) else None
    return None if target is None else attribute_tensor(gm, target)


def _normalize_conv(gm: torch.fx.GraphModule, args: dict, n: int) -> dict | None:
    """Conv strides/paddings/dilations as n-tuples; ``padding="same"/"valid"`` as numbers where exact."""
    def tup(v):
        if isinstance(v, Node):  # a pattern argument: it binds the whole tuple
            return v
        return tuple(v) * (n if len(v) == 1 else 1) if isinstance(v, (list, tuple)) else (v,) * n
    args["stride"], args["dilation"] = tup(args["stride"]), tup(args["dilation"])
    if "output_padding" in args:
        args["output_padding"] = tup(args["output_padding"])
    padding = args["padding"]
    if padding == "valid":
        padding = 0
    elif padding == "same":
        weight = bound_tensor(gm, args["weight"])
        total = None if weight is None else [d * (k - 1) for d, k in zip(args["dilation"], weight.shape[2:])]
        if total is not None and all(t % 2 == 0 for t in total) and all(s == 1 for s in args["stride"]):
            padding = [t // 2 for t in total]
    args["padding"] = padding if isinstance(padding, str) else tup(padding)
    return args


def _bind_module(node: Node, module: nn.Module, name: str) -> dict | None:
    if node.kwargs or len(node.args) != 1:
        return None
    bound: dict[str, Any] = {"input": node.args[0]}
    for arg, _ in SIGNATURES[name][1:]:
        if arg in _PARAMETERS:
            bound[arg] = ParamRef(f"{node.target}.{arg}") if getattr(module, arg, None) is not None else None
        elif hasattr(module, arg) and arg != "training":
            bound[arg] = getattr(module, arg)
    if name.startswith("conv") and module.padding_mode != "zeros":
        return None
    if name == "batch_norm":
        bound["training"] = module.training or module.running_mean is None
        bound["momentum"] = 0.0 if module.momentum is None else module.momentum
    return bound


def _canonical(node: Node, gm: torch.fx.GraphModule) -> str | None:
    """The canonical op ``node`` calls, among those the engine binds (:data:`SIGNATURES`)."""
    name = op_name(node, gm)
    return name if name in SIGNATURES else None


def _lookup(node: Node, gm: torch.fx.GraphModule) -> tuple[Any, dict | None, tuple[Node, ...]]:
    """(canonical name, arguments by name, covered nodes) for a node, or (None, None, ()) if unknown."""
    if node.op == "call_module":
        module = submodule(node, gm)
        name = module_op_name(module)
        name = name if name in SIGNATURES else None
        return (name, _bind_module(node, module, name), ()) if name else (None, None, ())
    if node.op == "call_method":
        name = _canonical(node, gm)
        return name, _bind_call(node) if name else None, ()
    if node.op != "call_function":
        return None, None, ()
    target = node.target
    if target is operator.getitem and node.args[1] == 0 and isinstance(node.args[0], Node):
        source = node.args[0]
        if source.op == "call_function" and getattr(source.target, "overloadpacket", None) in _BN_TUPLES:
            bound = _bind_schema(source.target._schema, tuple(source.args), dict(source.kwargs))
            siblings = tuple(u for u in source.users if u is not node and u.target is operator.getitem and not u.users)
            if bound is not None:
                bound.setdefault("training", False)
            return "batch_norm", bound, (source, *siblings)
    packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    if packet is aten.convolution:
        bound = _bind_call(node)
        if bound and bound.get("transposed"):  # the transposed convolution, its arguments in its own order
            bound = {k: v for k, v in bound.items() if k != "transposed"}
            return f"conv_transpose{len(bound['stride'])}d", bound, ()
        return (f"conv{len(bound['stride'])}d" if bound else None), bound, ()
    name = _canonical(node, gm)
    bound = _bind_call(node) if name else None
    if bound is not None and packet in FIXED_ARGUMENTS:
        bound.update(FIXED_ARGUMENTS[packet])
    return name, bound, ()


def canonicalize(node: Node, gm: torch.fx.GraphModule) -> Op | None:
    """``node`` as a canonical :class:`Op`; calls outside the table keep their own target and arguments.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(inplace=True)))
        >>> op = canonicalize([n for n in gm.graph.nodes if n.op == "call_module"][0], gm)
        >>> op.name, op.inplace
        ('relu', True)
    """
    if node.op not in CALL_OPS:
        return None
    name, bound, covered = _lookup(node, gm)
    if name is None:
        args = {str(i): a for i, a in enumerate(node.args)} | dict(node.kwargs)
        named = op_name(node, gm) if node.op != "call_module" else None
        # an op the vocabulary names but the engine does not bind: its forms meet under that name, with their
        # arguments as given (``x.reshape_as(y)`` and ``aten.reshape_as(x, y)``; ``reshape(x, shape)`` then
        # differs in its arguments)
        key = ("op", named) if named else ("method", node.target) if node.op != "call_function" else node.target
        return Op(key, args, node, inplace=bool(named) and is_inplace(node, gm))
    if bound is None:
        return None
    bound = {("input" if k == "self" else "other" if k == "mat2" else k): v for k, v in bound.items()}
    inplace = bool(bound.get("inplace")) or is_inplace(node, gm)
    if bound.pop("transposed", False):
        return None
    args = {}
    for arg, default in SIGNATURES[name]:
        if arg not in bound and default is REQUIRED:
            return None
        args[arg] = bound.pop(arg, default)
    if any(k not in _IGNORED_ARGS for k in bound):
        return None  # an argument the canonical op does not have (out=, dtype=...)
    if name.startswith("conv"):
        args = _normalize_conv(gm, args, int(name[-2]))
    effect = None
    if name == "batch_norm" and args["training"] and args["running_mean"] is not None:
        effect = "updates BatchNorm running statistics (training mode)"
    return Op(name, args, node, covered, inplace, effect)


def same_value(a: Any, b: Any) -> bool:
    """Whether two bound values are the same: the same node, equal constants, or sequences of those (a
    constant equals a sequence that repeats it: ``stride=1`` is ``(1, 1)``).

    Example:
        >>> same_value(1, (1, 1)), same_value([1, 2], (1, 2)), same_value(1, 2)
        (True, True, False)
    """
    if isinstance(a, (Node, ParamRef)) or isinstance(b, (Node, ParamRef)):
        return a is b if isinstance(a, Node) or isinstance(b, Node) else a == b
    seq_a, seq_b = isinstance(a, (list, tuple)), isinstance(b, (list, tuple))
    if seq_a and seq_b:
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if seq_a != seq_b:
        return all(same_value(x, b if seq_a else a) for x in (a if seq_a else b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values do not match
        return False
