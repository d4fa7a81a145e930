"""``weight_fold``: values a graph computes from the model's weights alone, computed once per change of those
weights (for calls that record no gradients).

Eager code often derives a tensor from parameters on every call, and the fastest models cache it: LeViT gathers
its attention biases from a table by an index buffer and caches them per device in eval mode; BEiT gathers its
relative-position bias from a table, and interpolates it, on every call. A captured graph holds that computation
without any cache. Here each group of nodes computed from parameters, buffers and Python values alone, with at
least one op that computes (not only views of a weight), is folded as a BatchNorm is
(:func:`~fxforge.rewrites.folding.fold_constants`): computed at rewrite time into a buffer, with a recipe the plan
runs again from the live tensors when one of them changes, so the model's weights stay the truth.

The pass runs after ``attention``: a mask the attention rewrite reads as a constant (and guards as one) is read
where the model keeps it, not from a folded copy. Left as they are: groups in graphs whose calls record gradients or run under autocast (a folded value has no
gradient, and no autocast precision), groups that write into a tensor (a weight must not be changed by a fold),
and groups whose values would hold more memory than both their sources and :data:`MAX_BYTES`.

Example:
    >>> from fxforge.rewrites.passes import Pass, PassContext
    >>> class Biased(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.table = torch.nn.Parameter(torch.randn(5, 2))
    ...         self.register_buffer("index", torch.tensor([[0, 1], [3, 4]]))
    ...     def forward(self, x):
    ...         return x + self.table[self.index].sum(-1)
    >>> gm = torch.fx.symbolic_trace(Biased())
    >>> ctx = PassContext("weight_fold", training=False, method="fx")
    >>> fold_weight_subgraphs(gm, ctx); [m.what for m in ctx.matches]
    ['computed from weights alone (4 nodes): once, and again when they change']
    >>> sorted(gm.meta["fxforge_folds"])   # the recipe the plan recomputes from the live table
    ['_fxforge_folded_0']
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from fxforge.core.nodes import attribute_tensor, is_inplace, is_view_op
from fxforge.rewrites.constant_subgraphs import constant_nodes, foldable_reads, groups
from fxforge.rewrites.folding import constant_values, fold_constants
from fxforge.rewrites.passes import Pass, PassContext

MAX_BYTES = 16 << 20  # a folded value larger than its sources is kept only up to this size


def _bytes(values: list) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _computes(node: Node) -> bool:
    """Whether ``node`` computes a value, not a view of its input (indexing by a tensor gathers: it computes)."""
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1]
        return any(isinstance(i, Node) for i in (index if isinstance(index, (tuple, list)) else (index,)))
    return not is_view_op(node)


def fold_weight_subgraphs(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """Fold each group of nodes computed from weights alone (see the module docstring)."""
    if ctx.training or ctx.conditions.gradients or ctx.conditions.autocast:
        return
    constant = constant_nodes(gm, weights=True)
    if not constant:
        return
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for group in groups(constant, order):
        sources = [n for n in group if n.op == "get_attr"]
        computing = [n for n in group if n.op != "get_attr" and _computes(n)]
        if not sources or not computing or any(is_inplace(n, gm) for n in group):
            continue
        outside = foldable_reads(group, gm, order)
        if outside is None:
            continue
        read = list(dict.fromkeys(n for n, _ in outside if n.op != "get_attr"))
        with torch.no_grad():
            values = constant_values(gm, group, lambda t: t)
        if not read or not all(isinstance(values.get(n), torch.Tensor) for n in read):
            continue
        held = _bytes([values[n] for n in read])
        if held > max(MAX_BYTES, _bytes([attribute_tensor(gm, n.target) for n in sources])):
            continue
        ctx.matched(f"computed from weights alone ({len(group)} nodes): once, and again when they change", group)
        fold_constants(gm, list(group))


WEIGHT_FOLD = Pass("weight_fold", fold_weight_subgraphs, "compute once what the graph computes from weights alone "
                   "(a bias gathered from a table), again when a weight changes; inference only")
