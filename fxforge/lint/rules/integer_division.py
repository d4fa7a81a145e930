"""``integer-division``: an integer tensor divided with rounding (``//``, ``div(..., rounding_mode=...)``) whose
result is then used as a real number: the fraction was dropped before the float math (a mean of counts,
a ratio of lengths).

Example:
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x, mask):
    ...         count = mask.sum(1) // mask.shape[1]
    ...         return x * count[:, None]
    >>> inputs = (torch.randn(4, 8), torch.ones(4, 8, dtype=torch.int64))
    >>> [f.rule for f in fxforge.lint(Net(), inputs, rules=[RULE])]
    ['integer-division']
"""

from __future__ import annotations

from fxforge.lint.graph import LintGraph
from fxforge.lint.rule import Rule

DIVISIONS = {"floor_divide", "div", "div_", "floordiv"}
# Ops through which an integer value still flows as an integer (and the floats it meets later count).
PASSING = {"unsqueeze", "view", "reshape", "getitem", "expand", "squeeze", "clone", "contiguous", "select", "slice"}


def _rounds(graph: LintGraph, node) -> bool:
    if graph.op(node) in ("floor_divide", "floordiv"):
        return True
    return graph.arg(node, 2, "rounding_mode") in ("floor", "trunc")


def _meets_float(graph: LintGraph, node, depth: int = 4) -> object:
    """The first user (through views) that uses the integer result as a real number."""
    frontier = [node]
    for _ in range(depth):
        following = []
        for current in frontier:
            for user in current.users:
                value = graph.value(user)
                if value is None:
                    continue
                if value.dtype.is_floating_point:
                    return user
                if graph.op(user) in PASSING:
                    following.append(user)
        frontier = following
    return None


def check(graph: LintGraph):
    for node in graph.calls(*DIVISIONS):
        operands = graph.tensor_args(node)
        if not operands or not all(not graph.value(a).dtype.is_floating_point for a in operands):
            continue
        if not _rounds(graph, node):
            continue
        user = _meets_float(graph, node)
        if user is None:
            continue
        yield graph.finding(
            node, f"integer division rounds {operands[0].name} {graph.describe(operands[0])} before the result is "
                  f"used as a real number ({graph.op(user)} with a float): the fraction is lost (7 // 2 == 3)",
            "divide as floats: a.float() / b (or torch.div(a, b) without rounding_mode), and round afterwards if "
            "an integer is meant", involved=graph.describe(node))


RULE = Rule("integer-division", "warning", check,
            "integer tensors divided with rounding (//) whose result is used as a real number: the fraction is lost")
