"""Folding: the parts of a replacement that depend only on parameters, computed once as new constants.

A rule with ``fold=True`` (``conv_bn_fold``) records its replacement into the graph like any other, then
:func:`fold_constants` computes the new nodes whose inputs are all parameters or buffers once, in float64,
rounds the result once to the model's dtype, and registers it as a non-persistent buffer of the
GraphModule (named with :data:`~fxforge.core.verify.CONSTANT_BUFFER_PREFIX`); the model's own parameters
are never modified.

Example:
    >>> g = torch.fx.Graph(); x = g.placeholder("x"); w = g.get_attr("w")
    >>> doubled = g.call_function(torch.mul, (w, 2)); _ = g.output(g.call_function(torch.add, (x, doubled)))
    >>> root = torch.nn.Module(); root.register_buffer("w", torch.ones(2))
    >>> gm = torch.fx.GraphModule(root, g)
    >>> kept = fold_constants(gm, [w, doubled])
    >>> [n.op for n in kept], getattr(gm, kept[0].target).tolist()
    (['get_attr'], [2.0, 2.0])
    >>> recipe = gm.meta["fxforge_folds"][kept[0].target]   # computed again when w changes
    >>> _ = root.w.fill_(5.0); recipe.compute().tolist()
    [10.0, 10.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import attribute_tensor, call_node
from fxforge.core.verify import CONSTANT_BUFFER_PREFIX


@dataclasses.dataclass
class FoldRecipe:
    """How one folded constant is computed from the model's tensors, kept so that it can be computed again
    when they change (see :mod:`fxforge.core.derived`).

    Attributes:
        graph: the computation: ``get_attr`` nodes ``s0``, ``s1``... for the sources, then the ops.
        sources: the tensors the ``get_attr`` nodes read, in order.
        dtype: the folded constant's dtype (the computation runs in float64, then is rounded once to it).
    """

    graph: torch.fx.Graph
    sources: tuple[torch.Tensor, ...]
    dtype: torch.dtype

    def compute(self) -> torch.Tensor:
        """The folded value from the sources as they are now (float64, rounded once to :attr:`dtype`)."""
        values: dict[Node, Any] = {}
        with torch.no_grad():
            for node in self.graph.nodes:
                if node.op == "get_attr":
                    source = self.sources[int(node.target[1:])].detach()
                    values[node] = source.double() if source.is_floating_point() else source
                elif node.op == "output":
                    return values[node.args[0]].to(dtype=self.dtype, copy=True)
                else:
                    values[node] = call_node(node, values.__getitem__)
        raise ValueError("a fold recipe without an output")


def _recipe(gm: torch.fx.GraphModule, node: Node, constant: set[Node], dtype: torch.dtype) -> FoldRecipe:
    """The computation of ``node`` from the parameters and buffers it depends on, as a :class:`FoldRecipe`."""
    needed, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in needed:
            needed.add(current)
            stack.extend(n for n in current.all_input_nodes if n in constant or n.op == "get_attr")
    graph, copies, sources, reads = torch.fx.Graph(), {}, [], {}

    def read(tensor: torch.Tensor) -> Node:  # one get_attr per source tensor
        if id(tensor) not in reads:
            reads[id(tensor)] = graph.get_attr(f"s{len(sources)}")
            sources.append(tensor)
        return reads[id(tensor)]

    earlier = gm.meta.get("fxforge_folds", {})
    for original in sorted(needed):  # nodes sort in graph order, a topological order
        if original.op == "get_attr" and original.target in earlier:
            # A constant an earlier fold made (conv + BatchNorm, then * c): computed again from its own sources, so
            # that this one follows them too.
            copies[original] = _inline(graph, earlier[original.target], read)
        elif original.op == "get_attr":
            copies[original] = read(attribute_tensor(gm, original.target))
        else:
            copies[original] = graph.node_copy(original, copies.__getitem__)
            copies[original].meta = {}  # a recipe needs the op and its arguments, not the fake values
    graph.output(copies[node])
    return FoldRecipe(graph, tuple(sources), dtype)


def _inline(graph: torch.fx.Graph, recipe: FoldRecipe, read: Callable[[torch.Tensor], Node]) -> Node:
    """``recipe``'s computation recorded into ``graph`` (its sources read with ``read``), rounded to its dtype as
    the constant it made was, then taken to float64 as :meth:`FoldRecipe.compute` takes a floating source."""
    values: dict[Node, Node] = {}
    for node in recipe.graph.nodes:
        if node.op == "get_attr":
            values[node] = read(recipe.sources[int(node.target[1:])])
        elif node.op == "output":
            rounded = graph.call_method("to", (values[node.args[0]], recipe.dtype))
            return graph.call_method("double", (rounded,)) if recipe.dtype.is_floating_point else rounded
        else:
            values[node] = graph.node_copy(node, values.__getitem__)
    raise ValueError("a fold recipe without an output")


def fold_constants(gm: torch.fx.GraphModule, new: list[Node]) -> list[Node]:
    """Compute new nodes that depend only on parameters/buffers; register them as tensors on ``gm``.

    Values are computed in float64, and in the model's precision for the dtype of the result (on meta
    tensors that second computation took longer than on real ones). Each folded tensor's :class:`FoldRecipe`
    goes to ``gm.meta["fxforge_folds"]`` under its buffer's name.
    """
    exact = constant_values(gm, new, lambda t: t.double() if t.is_floating_point() else t)
    plain = constant_values(gm, new, lambda t: t)
    recipes = gm.meta.setdefault("fxforge_folds", {})
    kept = []
    for node in new:
        value = plain.get(node)
        if node.op != "get_attr" and isinstance(value, torch.Tensor) and any(u not in plain for u in node.users):
            name = free_name(gm, CONSTANT_BUFFER_PREFIX)
            # One conversion into a new tensor: the folded value never aliases a parameter.
            folded = exact[node].detach().to(dtype=value.dtype, copy=True)
            gm.register_buffer(name, folded, persistent=False)
            recipes[name] = _recipe(gm, node, set(plain), value.dtype)
            with gm.graph.inserting_before(node):
                constant = gm.graph.get_attr(name)
            node.replace_all_uses_with(constant)
            kept.append(constant)
    for node in reversed(new):
        if node in plain and not node.users:
            gm.graph.erase_node(node)
    return [n for n in new if n.graph is gm.graph and n not in plain] + kept


def constant_values(gm: torch.fx.GraphModule, new: list[Node], convert: Callable[[torch.Tensor], Any]
                     ) -> dict[Node, Any]:
    """The values of the nodes among ``new`` computed from parameters and buffers alone, each tensor
    taken through ``convert`` first (to float64, or as it is)."""
    values: dict[Node, Any] = {}
    for node in new:
        if node.op == "get_attr":
            values[node] = convert(attribute_tensor(gm, node.target))
            continue
        inputs = node.all_input_nodes
        if node.op not in ("call_function", "call_method") or not all(n in values or n.op == "get_attr" for n in inputs):
            continue
        for n in inputs:
            if n not in values:
                values[n] = convert(attribute_tensor(gm, n.target))
        with torch.no_grad():
            values[node] = call_node(node, values.__getitem__)
    return values


def free_name(gm: torch.fx.GraphModule, prefix: str) -> str:
    # The search starts where the last one on this module ended (a hint: the loop still checks), so folding
    # n convolutions asks for n names, not n * n / 2.
    hints = gm.__dict__.setdefault("_fxforge_free_names", {})
    i = hints.get(prefix, 0)
    while hasattr(gm, f"{prefix}_{i}"):
        i += 1
    hints[prefix] = i + 1
    return f"{prefix}_{i}"
