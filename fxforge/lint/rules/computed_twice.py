"""``computed-twice``: the same computation on the same values done twice in one forward (a module called
twice on the same input, a normalization repeated): the second is wasted work every call.

Reported once per repeated chain, where it ends, with the line that computed it first.

Example:
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.enc = torch.nn.Linear(64, 64)
    ...     def forward(self, x):
    ...         a = self.enc(x).relu()
    ...         b = self.enc(x).relu()
    ...         return a + b
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(8, 64),), rules=[RULE])]
    ['computed-twice']
"""

from __future__ import annotations

import torch

from fxforge.core.nodes import is_effectful, is_random
from fxforge.lint.graph import LintGraph
from fxforge.lint.rule import Rule
from fxforge.lint.rules.hoistable import FREE

MIN_BYTES = 1024
"""Repeated work that makes less than this is not reported (index arithmetic, masks of a few bytes)."""


def check(graph: LintGraph):
    varying = graph.depends_on_inputs()
    original: dict[torch.fx.Node, torch.fx.Node] = {}  # repeat -> the first computation of it
    seen: dict[str, torch.fx.Node] = {}
    for node in graph.calls():
        if is_effectful(node, graph.owner(node)) or is_random(node) or graph.value(node) is None:
            continue
        args = torch.fx.map_arg((node.args, node.kwargs), lambda n: original.get(n, n))
        key = f"{id(node.graph)}|{node.op}|{node.target}|{args}"  # names are per graph (graphs between breaks)
        if key in seen:
            original[node] = seen[key]
        else:
            seen[key] = node
    for node, first in original.items():
        if any(u in original for u in node.users):
            continue  # not the end of the repeated chain
        chain, stack = set(), [node]
        while stack:
            current = stack.pop()
            if current in original and current not in chain:
                chain.add(current)
                stack.extend(current.all_input_nodes)
        work = [n for n in chain if graph.op(n) not in FREE]
        if not work or node not in varying or sum(graph.nbytes(n) for n in work) < MIN_BYTES:
            continue  # nothing but views, constants (hoistable-constant's), or a few bytes
        file, line, _ = graph.source(first)
        yield graph.finding(
            node, f"{node.name} {graph.describe(node)} repeats {first.name}, computed from the same values "
                  f"({len(work)} op{'s' * (len(work) != 1)}) at {file}:{line}: the second computation is wasted "
                  "every call",
            "compute it once and reuse the result (a = self.enc(x); use a twice)", involved=graph.describe(node),
            bytes=sum(graph.nbytes(n) for n in work))


RULE = Rule("computed-twice", "warning", check, "the same computation on the same values done twice in one forward")
