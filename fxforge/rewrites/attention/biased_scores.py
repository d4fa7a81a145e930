"""Scores computed with their bias in one call, ``baddbmm(bias, q, k^T, beta=b, alpha=a)``, split into the product,
its scale and an additive mask, so that the attention pass reads ALiBi as SDPA's float mask.

BLOOM adds its ALiBi bias (one slope per head times the key position) inside the scores product:
``alibi.baddbmm(q, k^T, beta=1.0, alpha=1 / sqrt(d))``, which is ``bmm(q, k^T) * alpha + beta * alibi``. Written
so, the scores product, the scale and the mask are the steps the pass already reads
(:mod:`~fxforge.rewrites.attention.steps`), and the replacement is
``scaled_dot_product_attention(q, k, v, attn_mask=alibi (+ the causal mask), scale=alpha)``.

Only a ``baddbmm`` whose result reaches a softmax through views, casts, scales and masks is split (a plain
``baddbmm`` elsewhere stays one call); a split the attention pass then refuses is verified like any rewrite.

Example:
    >>> from fxforge.core.shapes import annotate
    >>> def scores(bias, q, k, v):
    ...     return torch.softmax(torch.baddbmm(bias, q, k.transpose(1, 2), alpha=0.5), -1) @ v
    >>> gm = torch.fx.symbolic_trace(scores)
    >>> _ = annotate(gm, (torch.randn(2, 4, 4), *[torch.randn(2, 4, 8)] * 3), {})
    >>> [n.name for n in split_biased_scores(gm)]
    ['bmm', 'mul', 'add']
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fxforge.core.shapes import propagate_meta
from fxforge.core.vocabulary import argument, calls

_BADDBMM = (torch.baddbmm, torch.ops.aten.baddbmm.default, torch.ops.aten.baddbmm)
_ON_THE_WAY = ("view", "reshape", "to", "add", "sub", "mul", "div", "masked_fill", "where", "contiguous", "clone")


def _reaches_softmax(node: Node, gm: torch.fx.GraphModule, hops: int = 4) -> bool:
    """Whether ``node``'s value reaches a softmax through at most ``hops`` views, casts, scales and masks."""
    frontier = [node]
    for _ in range(hops):
        users = [u for n in frontier for u in n.users]
        if any(calls(u, "softmax", gm=gm) for u in users):
            return True
        frontier = [u for u in users if calls(u, *_ON_THE_WAY, gm=gm)]
    return False


def _is_baddbmm(node: Node) -> bool:
    return (node.op == "call_function" and node.target in _BADDBMM) or (node.op == "call_method"
                                                                         and node.target == "baddbmm")


def split_biased_scores(gm: torch.fx.GraphModule) -> list[Node]:
    """Split each ``baddbmm`` that makes attention scores into ``bmm(q, k) * alpha + beta * bias``; returns the new
    nodes (with their shape metadata)."""
    new: list[Node] = []
    for node in list(gm.graph.nodes):
        if not _is_baddbmm(node) or not _reaches_softmax(node, gm):
            continue
        bias, q, k = node.args[0], argument(node, 1, "batch1"), argument(node, 2, "batch2")
        beta, alpha = argument(node, 3, "beta", 1), argument(node, 4, "alpha", 1)
        if not all(isinstance(v, Node) for v in (bias, q, k)) or not all(isinstance(v, (int, float))
                                                                         for v in (beta, alpha)):
            continue
        graph, aten = gm.graph, isinstance(node.target, torch._ops.OpOverload)  # (exported graphs stay ATen)
        bmm, mul, add = ((torch.ops.aten.bmm.default, torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor) if aten
                         else (torch.bmm, torch.mul, torch.add))
        with graph.inserting_before(node):
            made = [graph.call_function(bmm, (q, k))]
            if alpha != 1:
                made.append(graph.call_function(mul, (made[-1], alpha)))
            scaled, term = made[-1], bias
            if beta != 1:
                term = graph.call_function(mul, (bias, beta))
                made.append(term)
            total = graph.call_function(add, (scaled, term))
            made.append(total)
        for made_node in made:
            made_node.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        propagate_meta(gm, made)
        new.extend(made)
    return new
