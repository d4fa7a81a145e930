"""The graph before and after the rewrites, with the rewritten nodes marked (for ``show`` and ``--report``).

A node is *marked* when it is in the rewritten graph but not in the captured one (by name), or when it
calls one of fxforge's fused ops or ``scaled_dot_product_attention``. Pictures are drawn by
:func:`fxforge.core.draw.graph_svg`.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(), nn.ReLU()).eval()
    >>> cap = fxforge.capture(model, (torch.ones(1, 4),))
    >>> new = fxforge.rewrite(cap, ["cleanup"])
    >>> len(cap.graph_module.graph.nodes), len(new.graph_module.graph.nodes)
    (5, 4)
    >>> marked_nodes(cap.graph_module, new.graph_module)   # a removal makes no new node
    []
"""

from __future__ import annotations

import torch

from fxforge.core.nodes import CALL_OPS, count_calls

_SDPA = {torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


def is_fused(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls a fxforge fused op or scaled-dot-product attention.

    Example:
        >>> g = torch.fx.symbolic_trace(torch.nn.ReLU()).graph
        >>> [is_fused(n) for n in g.nodes]
        [False, False, False]
    """
    if node.op != "call_function":
        return False
    if node.target in _SDPA:
        return True
    name = getattr(node.target, "name", None)
    return isinstance(node.target, torch._ops.OpOverload) and callable(name) and name().startswith("fxforge::")


def marked_nodes(before: torch.fx.GraphModule, after: torch.fx.GraphModule) -> list[str]:
    """Names of the nodes of ``after`` the rewrites made: new names, fused ops, attention (parameters such
    as folded weights are not marked; the ops using them are).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> marked_nodes(gm, gm)
        []
    """
    names = {n.name for n in before.graph.nodes}
    return [n.name for n in after.graph.nodes
            if n.op in CALL_OPS and (n.name not in names or is_fused(n))]


def _target(node: torch.fx.Node) -> str:
    if node.op in ("call_module", "get_attr", "call_method"):
        return str(node.target)
    if node.op == "call_function":
        name = getattr(node.target, "name", None)
        if isinstance(node.target, torch._ops.OpOverload) and callable(name):
            return name()
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def _shape(node: torch.fx.Node) -> str:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return "x".join(str(d) for d in value.shape) + f" {str(value.dtype).removeprefix('torch.')}"
    return ""


def node_lines(graph_module: torch.fx.GraphModule, marked: list[str] | set[str] = ()) -> list[str]:
    """One line per node: ``name  op target  shape``, with ``*`` after marked nodes' names.

    Example:
        >>> gm = fxforge.capture(torch.nn.ReLU(), (torch.ones(2),)).graph_module
        >>> node_lines(gm, {"relu"})[1]
        'relu *  call_function relu  2 float32'
    """
    marked = set(marked)
    lines = []
    for node in graph_module.graph.nodes:
        star = " *" if node.name in marked else ""
        lines.append(f"{node.name}{star}  {node.op} {_target(node)}  {_shape(node)}".rstrip())
    return lines


def draw_available() -> bool:
    """Whether :mod:`fxforge.core.draw` (graph pictures) is installed in this checkout.

    Example:
        >>> isinstance(draw_available(), bool)
        True
    """
    try:
        from fxforge.core.draw import graph_svg  # noqa: F401
    except ImportError:
        return False
    return True


def pictures(before: torch.fx.GraphModule, after: torch.fx.GraphModule | None,
             title: str = "") -> dict[str, str]:
    """SVG pictures of the captured graph and (if given) the rewritten one with its new nodes marked,
    keyed by caption; empty when :mod:`fxforge.core.draw` is not available."""
    if not draw_available():
        return {}
    from fxforge.core.draw import graph_svg

    result = {}
    label = f"{title}: " if title else ""
    result["captured"] = graph_svg(before, title=f"{label}captured ({node_count(before)})")
    if after is not None:
        marked = marked_nodes(before, after)
        result["rewritten"] = graph_svg(after, marked=marked, title=f"{label}rewritten ({node_count(after)}, "
                                                                   f"{len(marked)} marked)")
    return result


def node_count(graph_module: torch.fx.GraphModule) -> str:
    """The count the summary shows (nodes that compute), and what else the picture draws.

    Example:
        >>> node_count(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))
        '1 nodes that compute; 5 drawn with inputs, weights and outputs'
    """
    return (f"{count_calls(graph_module.graph)} nodes that compute; {len(graph_module.graph.nodes)} drawn with "
            "inputs, weights and outputs")
