"""Reading single nodes: what a node calls, softmaxes, casts, and users the replacement may drop.

Which call forms count is the vocabulary's (:mod:`fxforge.core.vocabulary`): :func:`read_softmax` and
:func:`read_cast` ask :func:`~fxforge.core.vocabulary.calls`, and dropout is read by
:func:`~fxforge.core.vocabulary.read_dropout`.

Example:
    >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(2, 3)
    >>> s = g.call_function(torch.softmax, (x, -1)); s.meta["val"] = torch.ones(2, 3)
    >>> read_softmax(s, None).dim, describe(s, None)
    (1, 'softmax')
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import nn
from torch.fx import Node

from fxforge.core.nodes import fake_value, submodule, target_name
from fxforge.core.vocabulary import CASTS, argument, calls
from fxforge.rewrites.canonical import canonicalize
from fxforge.rewrites.cleanup import proven_assertion

F = nn.functional
aten = torch.ops.aten


def describe(node: Node, gm: torch.fx.GraphModule) -> str:
    """What a node calls, named the same in traced and exported graphs: ``tanh`` for ``torch.tanh``,
    ``x.tanh()`` and ``aten.tanh.default``; ``mul`` for ``*``; a module's class name (``Tanh``).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> [describe(g.call_function(f, (x,)), None) for f in (torch.tanh, aten.tanh.default, operator.mul)]
        ['tanh', 'tanh', 'mul']
    """
    if node.op == "call_module":
        module = submodule(node, gm)
        return type(module).__name__ if module is not None else str(node.target)
    op = canonicalize(node, gm) if node.op.startswith("call") and gm is not None else None
    if op is not None and isinstance(op.name, str):
        return op.name
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._opname
    if node.target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[node.target]
    return target_name(node)


_OPERATOR_NAMES = {operator.mul: "mul", operator.add: "add", operator.sub: "sub", operator.truediv: "div",
                   operator.matmul: "matmul", operator.getitem: "getitem", operator.neg: "neg"}


@dataclasses.dataclass(frozen=True)
class Softmax:
    """A softmax node: its input and the dim it normalises (non-negative).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> Softmax(g.call_method("softmax", (x, -1)), x, 1).input is x
        True
    """

    node: Node
    input: Node
    dim: int


# Softmax functions by the name of their input (the vocabulary says which calls are softmax; ``dim`` is
# the second argument in every form).
_SOFTMAX_INPUTS = {F.softmax: "input", torch.softmax: "input", torch.special.softmax: "input",
                   aten.softmax.int: "self", aten._softmax.default: "self"}


def read_softmax(node: Node, gm: torch.fx.GraphModule) -> Softmax | None:
    """``node`` as a :class:`Softmax`, or None when it is no softmax (or has no shape metadata).

    ``dim=None`` is resolved as torch does (dim 0 for 0-, 1- and 3-d inputs, else 1). A module counts only
    if it is an ``nn.Softmax`` itself, not a subclass.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(2, 3)
        >>> s = g.call_method("softmax", (x, -1)); s.meta["val"] = torch.ones(2, 3)
        >>> read_softmax(s, None).dim
        1
    """
    if not calls(node, "softmax", gm=gm):
        return None
    if node.op == "call_module":
        module = submodule(node, gm)
        if type(module) is not nn.Softmax or len(node.args) != 1 or node.kwargs:
            return None
        source, dim = node.args[0], module.dim
    elif node.op == "call_method":
        source, dim = argument(node, 0, "self"), argument(node, 1, "dim")
    elif node.target in _SOFTMAX_INPUTS:
        source, dim = argument(node, 0, _SOFTMAX_INPUTS[node.target]), argument(node, 1, "dim")
    else:
        return None
    value = fake_value(source)
    if value is None or not isinstance(dim, (int, type(None))) or fake_value(node) is None:
        return None
    if dim is None:
        dim = 0 if value.ndim in (0, 1, 3) else 1
    return Softmax(node, source, dim % max(value.ndim, 1))


def read_cast(node: Node) -> Node | None:
    """The input of a floating-point cast or copy that keeps shape and device, else None.

    The casts are the vocabulary's :data:`~fxforge.core.vocabulary.CASTS` (``to``, ``float``, ``type_as``,
    ``contiguous``, ``clone``...).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(2, dtype=torch.half)
        >>> y = g.call_method("float", (x,)); y.meta["val"] = torch.ones(2)
        >>> read_cast(y) is x
        True
    """
    if not calls(node, *CASTS) or not node.args or not isinstance(node.args[0], Node):
        return None
    before, after = fake_value(node.args[0]), fake_value(node)
    if before is None or after is None or not after.is_floating_point():
        return None
    if before.shape != after.shape or before.device != after.device:
        return None
    return node.args[0]


def ignorable(user: Node, gm: torch.fx.GraphModule) -> bool:
    """A user that may be dropped with the value it uses: export's dtype/device assertions that the shape
    metadata proves (graphs are specialised to their input signature).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> ignorable(g.call_function(torch.relu, (x,)), None)
        False
    """
    return (user.target is aten._assert_tensor_metadata.default
            and isinstance(proven_assertion(user, gm, None), Node))
