"""Memory layouts a graph can run in: channels-last converts once at the graph's entry and exit.

Example:
    >>> from fxforge.core.shapes import annotate
    >>> gm = torch.fx.symbolic_trace(torch.nn.Conv2d(3, 3, 1))
    >>> _ = annotate(gm, (torch.randn(1, 3, 4, 4),), {})
    >>> to_channels_last(gm)
    2
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import mutated_aliases

aten = torch.ops.aten


def to_channels_last(gm: torch.fx.GraphModule) -> int:
    """Convert 4-d/5-d floating graph inputs to channels-last at entry, and such outputs back at exit.

    An input the graph changes in place keeps its layout: the change must land in the caller's tensor.

    Returns the number of conversions inserted (0: nothing to convert).

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(torch.nn.Conv2d(3, 3, 1))
        >>> _ = annotate(gm, (torch.randn(1, 3, 4, 4),), {})
        >>> to_channels_last(gm)
        2
    """
    graph, count = gm.graph, 0
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(val, torch.Tensor) or val.dim() not in formats:
            continue
        if not val.is_floating_point() or not node.users or mutated_aliases(node, gm):
            continue  # an input the graph changes in place is changed where the caller holds it, not in a copy
        with graph.inserting_after(node):
            converted = graph.call_function(aten.contiguous.default, (node,), {"memory_format": formats[val.dim()]})
        node.replace_all_uses_with(converted, delete_user_cb=lambda user, new=converted: user is not new)
        count += 1
    output = next(n for n in graph.nodes if n.op == "output")

    def back(value: Any) -> Any:
        nonlocal count
        val = value.meta.get("val") if isinstance(value, Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() not in formats or not val.is_contiguous():
            return value
        with graph.inserting_before(output):
            count += 1
            return graph.call_function(aten.contiguous.default, (value,))

    output.args = torch.fx.node.map_arg(output.args, back)
    return count
