"""What the other operand of an elementwise op is, as folding sees it: a number, a tensor computed from
parameters and constants alone, a tensor built from shapes alone that holds one value, or a run-time value.

``binary_fold`` folds ``conv(x) * c`` into the convolution's weights only when ``c`` is the same on every call:
:func:`read_operand` follows ``c``'s computation back through pure ops (no random numbers, nothing in place) to
the parameters, buffers and constants it reads, or to the run-time values whose shape alone it reads
(``torch.ones(y.size())``, ``torch.full_like(y, 2.0)``), and computes it as it is now.

Example:
    >>> class Scale(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gamma = torch.nn.Parameter(torch.ones(3))
    ...     def forward(self, x):
    ...         return x * self.gamma[:, None]
    >>> gm = torch.fx.symbolic_trace(Scale()); mul = list(gm.graph.nodes)[-2]
    >>> operand = read_operand(mul.args[1], gm); operand.kind, operand.value.shape, len(operand.nodes)
    ('tensor', torch.Size([3, 1]), 2)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import attribute_tensor, call_node, is_inplace
from fxforge.core.symbolic import size_expr
from fxforge.core.vocabulary import CASTS, COPIES, RESHAPES, calls, op_name, reads_metadata

aten = torch.ops.aten
# What an operand may be computed with: pure, deterministic ops (no random numbers, nothing written in place).
_PURE_OPS = frozenset({"add", "sub", "mul", "div", "neg", "pow", "rsub", *CASTS, *COPIES, *RESHAPES, "transpose",
                       "permute", "t", "squeeze", "getitem", "slice", "select", "narrow", "ones", "zeros", "new_like"})
_PURE_FUNCTIONS = frozenset({torch.full, torch.tensor, torch.scalar_tensor, torch.exp, torch.sqrt, torch.rsqrt,
                             torch.reciprocal, torch.abs, aten.full, aten.scalar_tensor, aten.exp, aten.sqrt,
                             aten.rsqrt, aten.reciprocal, aten.abs})
_PURE_METHODS = frozenset({"exp", "sqrt", "rsqrt", "reciprocal", "abs"})
# Constructors whose values do not depend on their size arguments; ``full``'s depend on its fill value only (the
# argument at this position).
_FILL_FREE = ("ones", "zeros")
_FULL = {torch.full: 1, aten.full.default: 1, torch.full_like: 1, aten.full_like.default: 1, "new_full": 2,
         aten.new_full.default: 2}


def is_pure(node: Node, gm: torch.fx.GraphModule) -> bool:
    """Whether an operand may be computed with ``node``: a pure, deterministic op (no random numbers, nothing
    written in place), or a read of a shape.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: (x.size(), x.unsqueeze(0), torch.rand_like(x), x.add_(1)))
        >>> [is_pure(n, gm) for n in gm.graph.nodes if n.op.startswith("call")]
        [True, True, False, False]
    """
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target is aten.detach_.default:  # exported graphs' lifted constants: lift_fresh_copy, then detach_
        return True
    if is_inplace(node, gm):
        return False
    if reads_metadata(node) or op_name(node, gm) in _PURE_OPS:
        return True
    if node.op == "call_method":
        return node.target in _PURE_METHODS
    return node.target in _PURE_FUNCTIONS or getattr(node.target, "overloadpacket", None) in _PURE_FUNCTIONS


def _shape_source(node: Node, gm: torch.fx.GraphModule) -> Node | None:
    """The input whose shape, dtype and device alone ``node`` reads (``y.size()``, ``full_like(y, 2.0)``)."""
    if not (reads_metadata(node) or calls(node, "new_like", gm=gm)):
        return None
    source = node.args[0] if node.args else node.kwargs.get("input")
    return source if isinstance(source, Node) else None


@dataclasses.dataclass
class Operand:
    """A binary op's other operand, as folding sees it.

    Attributes:
        kind: ``"number"`` (a Python int or float), ``"tensor"`` (a parameter, buffer or tensor constant, or a value
            computed from those alone), ``"uniform"`` (built from shapes alone, one value everywhere), ``"runtime"``
            (computed at run time), or ``"other"``.
        value: the number, or the tensor's value now (``"tensor"``, ``"uniform"``).
        nodes: the nodes computing it (``"tensor"``, ``"uniform"``).
        shapes: the nodes outside whose shapes it reads (``"uniform"``).
        blame: (``"runtime"``) the first node found in its computation that is no constant.
        dynamic: (``"runtime"``) it depends on a size of ``blame`` that changes from call to call.

    Example:
        >>> read_operand(2.0, torch.nn.Module()).kind
        'number'
    """

    kind: str
    value: Any = None
    nodes: frozenset[Node] = frozenset()
    shapes: frozenset[Node] = frozenset()
    blame: Node | None = None
    dynamic: bool = False

    def uses_elsewhere(self, source: Node, user: Node) -> list[Node]:
        """The nodes other than ``user`` that use the part of the operand's computation that reads ``source``'s
        shape (that part is ``user``'s alone when this is empty; reads of other shapes may be shared).

        Example:
            >>> g = torch.fx.Graph(); y = g.placeholder("y"); size = g.call_method("size", (y,))
            >>> ones = g.call_function(torch.ones, (size,)); add = g.call_function(torch.add, (y, ones))
            >>> Operand("uniform", 1.0, frozenset({size, ones}), frozenset({y})).uses_elsewhere(y, add)
            []
        """
        reading: set[Node] = set()
        for node in sorted(self.nodes):
            if source in node.all_input_nodes or any(n in reading for n in node.all_input_nodes):
                reading.add(node)
        return [u for n in sorted(reading) for u in n.users if u not in self.nodes and u is not user]


def read_operand(value: Any, gm: torch.fx.GraphModule) -> Operand:
    """What ``value``, a binary op's operand, is (see :class:`Operand`); tensors are computed as they are now.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda y: y + torch.ones(y.size()))
        >>> add = [n for n in gm.graph.nodes if n.name == "add"][0]
        >>> add.args[0].meta["val"] = torch.empty(2, 3)   # (capture puts shapes on every node)
        >>> operand = read_operand(add.args[1], gm); operand.kind, operand.value.shape
        ('uniform', torch.Size([2, 3]))
    """
    if isinstance(value, (int, float)):
        return Operand("number", value)
    if not isinstance(value, Node):
        return Operand("other", value)
    nodes, shapes, reads_values, stack = set(), set(), False, [value]
    while stack:
        node = stack.pop()
        if node.op == "get_attr":
            if attribute_tensor(gm, node.target) is None:
                return Operand("other", node)
            nodes.add(node)
            reads_values = True
            continue
        if node in nodes:
            continue
        if not is_pure(node, gm):
            return Operand("runtime", blame=node)
        nodes.add(node)
        inputs, source = list(node.all_input_nodes), _shape_source(node, gm)
        if source is not None:
            inputs.remove(source)
            (nodes if source.op == "get_attr" else shapes).add(source)
        stack.extend(inputs)
    if reads_values and shapes:  # parameters shaped by a run-time value: no copy of it can be folded
        return Operand("runtime", blame=min(shapes))
    computed = _evaluate(value, nodes, shapes, gm)
    if reads_values:
        return Operand("tensor", computed, frozenset(nodes)) if isinstance(computed, torch.Tensor) else \
            Operand("other", computed)
    dynamic = _dynamic_value(value, nodes, gm)
    if dynamic is not None:
        return Operand("runtime", blame=dynamic, dynamic=True)
    if isinstance(computed, torch.Tensor) and computed.numel() and bool((computed == computed.reshape(-1)[0]).all()):
        return Operand("uniform", computed, frozenset(nodes), frozenset(shapes))
    if isinstance(computed, (int, float)) and not isinstance(computed, bool):
        return Operand("uniform", computed, frozenset(nodes), frozenset(shapes))
    return Operand("runtime", blame=min(shapes) if shapes else value)


def _hint(size: Any) -> int:
    expr = size_expr(size)
    return expr if isinstance(expr, int) else int(size.node.hint)


def _evaluate(root: Node, nodes: set[Node], shapes: set[Node], gm: torch.fx.GraphModule) -> Any:
    """``root``'s value from the tensors it reads now, the run-time values whose shapes it reads stood in for by
    zeros of their (example) shape; None if it cannot be computed."""
    values: dict[Node, Any] = {}
    try:
        for node in shapes:
            val = node.meta.get("val")
            values[node] = torch.zeros([_hint(s) for s in val.shape], dtype=val.dtype)
        with torch.no_grad():
            for node in sorted(nodes):
                values[node] = attribute_tensor(gm, node.target) if node.op == "get_attr" else \
                    call_node(node, values.__getitem__)
    except Exception:  # noqa: BLE001 - a value this cannot compute is one it does not fold
        return None
    return values[root]


def _dynamic_value(root: Node, nodes: set[Node], gm: torch.fx.GraphModule) -> Node | None:
    """A node whose dynamic size ``root``'s value (not only its shape) depends on, or None: a fill value or a
    factor read from a size that changes from call to call."""
    def depends(node: Any) -> Node | None:
        if not isinstance(node, Node) or node not in nodes or node.op == "get_attr":
            return None
        if reads_metadata(node):
            source = _shape_source(node, gm)
            val = source.meta.get("val") if source is not None else None
            static = isinstance(val, torch.Tensor) and all(isinstance(size_expr(s), int) for s in val.shape)
            return None if static else source
        if op_name(node, gm) in _FILL_FREE:  # ones, zeros and their _like and new_ forms
            return None
        if node.target in _FULL:
            index = _FULL[node.target]
            return depends(node.args[index] if len(node.args) > index else node.kwargs.get("fill_value"))
        return next((d for d in map(depends, node.all_input_nodes) if d is not None), None)
    return depends(root)


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (fake) tensors have the same shape, symbolic sizes compared as expressions (no guard added).

    Example:
        >>> same_shape(torch.ones(2, 3), torch.zeros(2, 3)), same_shape(torch.ones(2, 3), torch.ones(3, 2))
        (True, False)
    """
    return a.dim() == b.dim() and all(size_expr(p) == size_expr(q) for p, q in zip(a.shape, b.shape))
