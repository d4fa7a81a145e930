"""``scaled_dot_product_attention`` calls given the inputs eager would give them.

A traced model that already calls SDPA (transformers' ``sdpa`` attention) can reach it with larger inputs
than it does in eager: under tracing, transformers builds the causal mask as a tensor (eager passes
``is_causal=True`` and no mask) and repeats K and V per head for grouped-query attention (eager passes
``enable_gqa=True``). Both cost memory (an S x S mask, and K and V n times over, each saved for the
backward in training) and time. :func:`simplify_sdpa_calls` gives each call what eager gives it:

- a mask that :mod:`~fxforge.rewrites.attention.index_masks` proves True at every position for every size
  (``q_idx >= 0``) is dropped;
- a mask it proves causal (key index <= query index, for every size: SDPA's ``is_causal``, whose triangle is
  aligned top-left as the formula's) becomes ``is_causal=True``; a causal row is never empty, so no row
  differs;
- K and V both repeated n times per head (``repeat_interleave``, or ``[:, :, None].expand().reshape()``)
  are passed un-repeated with ``enable_gqa=True``, where this torch's SDPA takes it.

The results are the same numbers (the masked scores become exact zeros either way), in training too.

Example:
    >>> class Causal(torch.nn.Module):
    ...     def forward(self, q, k, v):
    ...         i = torch.arange(q.size(-2))
    ...         keep = i[None, :] <= i[:, None]
    ...         return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    >>> from fxforge.core.shapes import annotate
    >>> gm = torch.fx.symbolic_trace(Causal())
    >>> _ = annotate(gm, (torch.randn(1, 2, 8, 4),) * 3, {})
    >>> simplify_sdpa_calls(gm)
    ['scaled_dot_product_attention: causal mask -> is_causal=True']
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fxforge.core.nodes import fake_value
from fxforge.core.vocabulary import SDPA_PARAMETERS, SDPA_TARGETS, sdpa_arguments
from fxforge.rewrites.attention.checks import SDPA_HAS_GQA
from fxforge.rewrites.attention.index_masks import Additive, Keep, holds_everywhere, is_causal, read_mask
from fxforge.rewrites.attention.operands import repeated_heads


def _mask_change(mask: Node, query: Node, key: Node) -> str | None:
    """``"drop"``, ``"causal"`` or None for an SDPA mask."""
    value = fake_value(mask)
    read = read_mask(mask)
    if value is None or read is None:
        return None
    if isinstance(read, Keep) and value.dtype != torch.bool:
        return None  # a float tensor of 0/1 read as a condition would be added, not applied
    keep = read.keep if isinstance(read, Additive) else read
    if holds_everywhere(keep):
        return "drop"
    if is_causal(keep):
        return "causal"
    return None


def simplify_sdpa_calls(gm: torch.fx.GraphModule) -> list[str]:
    """Give each SDPA call of ``gm`` the smaller inputs of the module docstring; returns what changed.

    Nodes left without users are erased; the graph is linted and recompiled when anything changed.
    """
    changes: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        args = sdpa_arguments(node)
        if args.get("enable_gqa"):
            continue
        done: list[str] = []
        mask = args.get("attn_mask")
        if isinstance(mask, Node) and not args.get("is_causal"):
            change = _mask_change(mask, args["query"], args["key"])
            if change == "drop":
                args["attn_mask"] = None
                done.append("mask true everywhere dropped")
            elif change == "causal":
                args["attn_mask"], args["is_causal"] = None, True
                done.append("causal mask -> is_causal=True")
        if SDPA_HAS_GQA:
            k, v = repeated_heads(args["key"]), repeated_heads(args["value"])
            if k is not None and v is not None and k[1] == v[1]:
                args["key"], args["value"], args["enable_gqa"] = k[0], v[0], True
                done.append(f"K and V un-repeated, enable_gqa=True ({k[1]} query heads per kv head)")
        if not done:
            continue
        node.args = tuple(args.pop(name) for name in SDPA_PARAMETERS[:3])
        node.kwargs = {name: value for name, value in args.items() if value is not None or name == "attn_mask"}
        changes.append(f"{node.name}: {', '.join(done)}")
    if changes:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return changes
