"""Constants: what depends only on shapes, Python constants and buffers, computed at rewrite time.

A graph is specialised to its input signature, so its sizes are constants, and so is every value computed
from them and from buffers the graph does not change: a causal mask built from ``q.size(-2)``, a scale
``q.size(-1) ** -0.5``. :class:`Constants` computes such values (once per pass) so that the masks can be
proven causal or all-kept, and fills and scales read as numbers.

Example:
    >>> from fxforge.core.shapes import annotate
    >>> gm = torch.fx.symbolic_trace(lambda q: q * q.size(-1) ** -0.5)
    >>> _ = annotate(gm, (torch.ones(2, 4),), {})
    >>> scale = list(gm.graph.nodes)[2]
    >>> Constants(gm).number(scale)
    0.5
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import Node

from fxforge.core.nodes import (
    alias_users,
    attribute_tensor,
    call_node,
    fake_value,
    is_effectful,
    is_inplace,
    mutated_aliases,
)
from fxforge.core.vocabulary import METADATA_FUNCTIONS, calls, reads_metadata

_NOT_CONSTANT = object()
_DTYPE_INFO = (torch.finfo, torch.iinfo)
_PLAIN = (int, float, bool, str, torch.dtype, torch.device, torch.Size, type(None))


def _is_shape_expression(node: Node, seen: dict[Node, bool] | None = None) -> bool:
    """Whether ``node`` computes a Python value from shapes, dtypes and devices only (``q.size(-1) ** -0.5``)
    rather than from tensor data (``x.sum().item()``, whose recorded value held for the example only).
    ``torch.finfo(x.dtype)`` and ``torch.iinfo`` of such a dtype, and their attributes (``.min``), count too.

    Attributes and methods count as the vocabulary's :func:`~fxforge.core.vocabulary.reads_metadata` says;
    ATen's metadata functions (``sym_size``), ``operator`` and ``math`` functions count only when no input
    is a tensor and every input is itself a shape expression."""
    seen = {} if seen is None else seen
    if node in seen:
        return seen[node]
    seen[node] = False
    source = node.args[0] if node.op == "call_function" and node.target is getattr and node.args else None
    if isinstance(source, Node) and source.op == "call_function" and source.target in _DTYPE_INFO:
        result = _is_shape_expression(source, seen)  # torch.finfo(scores.dtype).min
    elif node.op == "call_function" and node.target in _DTYPE_INFO:
        result = all(_is_shape_expression(n, seen) for n in node.all_input_nodes)
    elif node.op == "call_function" and (node.target in METADATA_FUNCTIONS
                                       or getattr(node.target, "__module__", None) in ("_operator", "math")):
        result = all(not isinstance(fake_value(n), torch.Tensor) and _is_shape_expression(n, seen)
                     for n in node.all_input_nodes)
    else:
        result = reads_metadata(node)
    seen[node] = result
    return result


def _changed_by_a_statement(node: Node, gm: torch.fx.GraphModule) -> bool:
    """Whether ``node``'s value, or a view of it, is changed in place by a node whose result is unused (a
    statement such as ``mask[1, :, 3:] = -100`` in the user's code): its value as computed from its inputs is
    not the one its users read."""
    return any(is_inplace(user, gm) and user.args[:1] == (alias,) and not user.users
               for alias, user in alias_users(node))


def _reads_metadata_only(node: Node) -> bool:
    """A constructor that reads only the shape, dtype and device of its first argument (``x.new_ones``)."""
    return calls(node, "new_like") and bool(node.args) and isinstance(node.args[0], Node)


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


class Constants:
    """Values of nodes computed from shapes, Python constants and buffers only; computed once per pass.

    A graph is specialised to its input signature, so sizes are constants, and so are ``x.new_ones(...)``
    and ``torch.zeros_like(x)`` even of a graph input; parameters (which training changes), graph inputs,
    module calls and random ops are not.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x + torch.ones(2).cumsum(0))  # the sum becomes a constant
        >>> x, constant, add = list(gm.graph.nodes)[:3]
        >>> c = Constants(gm); c.value(constant).tolist(), c.is_constant(add)
        ([1.0, 2.0], False)
    """

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.cache: dict[Node, Any] = {}
        # id -> each buffer (or tensor attribute) whose values were read: a graph built on them holds while they
        # keep them (see :func:`fxforge.core.derived.read_as_constants`)
        self.read: dict[int, torch.Tensor] = {}

    def is_constant(self, node: Any) -> bool:
        """Whether :meth:`value` can compute ``node``."""
        return self.value(node) is not _NOT_CONSTANT

    def value(self, node: Any) -> Any:
        """The value of ``node``, or ``_NOT_CONSTANT``; anything that is no node is its own value."""
        if not isinstance(node, Node):
            return node
        if node not in self.cache:
            order = self._ancestors(node)
            if order is None:
                self.cache[node] = _NOT_CONSTANT
            else:
                for n in order:
                    self.cache[n] = self._compute(n)
        return self.cache[node]

    def number(self, value: Any) -> float | None:
        """A Python number, or the number a constant node or one-element constant tensor holds, else None."""
        value = self.value(value)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return None

    def _leaf(self, node: Node) -> Any:
        """A value for nodes that end the search, ``_NOT_CONSTANT``, or None (search on)."""
        val = node.meta.get("val")
        if node.op in ("placeholder", "output", "call_module"):
            return _NOT_CONSTANT
        if val is not None and not isinstance(val, torch.Tensor) and _plain(val):
            # a size, dtype or device, read from the shape metadata; other Python values came from data
            return val if _is_shape_expression(node) else _NOT_CONSTANT
        if node.op == "get_attr":
            tensor = attribute_tensor(self.gm, node.target)
            if tensor is None or isinstance(tensor, nn.Parameter) or mutated_aliases(node, self.gm):
                return _NOT_CONSTANT  # parameters change in training, mutated buffers as the graph runs
            self.read[id(tensor)] = tensor
            return tensor
        if is_effectful(node, self.gm) and not is_inplace(node, self.gm):
            return _NOT_CONSTANT  # random numbers
        if isinstance(val, torch.Tensor) and _changed_by_a_statement(node, self.gm):
            return _NOT_CONSTANT  # mask[1, :, 3:] = -100 changes it after it is made: not this value
        return None

    def _ancestors(self, node: Node) -> list[Node] | None:
        order, stack, seen = [], [node], {node}
        while stack:
            current = stack.pop()
            if self.cache.get(current, None) is _NOT_CONSTANT or self._leaf(current) is _NOT_CONSTANT:
                return None
            order.append(current)
            if current in self.cache or self._leaf(current) is not None:
                continue
            parents = current.all_input_nodes
            if _reads_metadata_only(current):
                parents = [p for p in parents if p is not current.args[0]]
            for parent in parents:
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        position = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return sorted((n for n in order if n not in self.cache), key=position.__getitem__)

    def _compute(self, node: Node) -> Any:
        leaf = self._leaf(node)
        if leaf is not None:
            return leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf
        stand_in = {}
        if _reads_metadata_only(node):  # any tensor of that shape, dtype and device gives the same result
            like = fake_value(node.args[0])
            if like is None or not all(isinstance(size, int) for size in like.shape):
                return _NOT_CONSTANT  # a symbolic size: the value differs from call to call
            stand_in[node.args[0]] = torch.zeros(like.shape, dtype=like.dtype, device=like.device)

        def value_of(n: Node) -> Any:
            return stand_in[n] if n in stand_in else self.cache.get(n, _NOT_CONSTANT)

        if any(value_of(n) is _NOT_CONSTANT for n in node.all_input_nodes):
            return _NOT_CONSTANT
        try:
            with torch.no_grad():
                return call_node(node, value_of)
        except Exception:  # noqa: BLE001 - a value that cannot be computed here is not a constant
            return _NOT_CONSTANT
