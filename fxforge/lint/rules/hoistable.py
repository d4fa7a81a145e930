"""``hoistable-constant``: work that does not depend on the inputs (nor on trainable parameters) recomputed every
call: a mask, a table of frequencies, a float64 conversion of a buffer, built in forward from constants. Compute it
once in ``__init__`` (``register_buffer``) or cache it.

Reported where the constant work meets the inputs, with the bytes it makes: from ``MIN_BYTES`` as info, from
``LARGE_BYTES`` as a warning.

Example:
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         mask = torch.triu(torch.ones(512, 512), diagonal=1).bool()
    ...         return x.masked_fill(mask, 0.0)
    >>> [(f.rule, f.severity) for f in fxforge.lint(Net(), (torch.randn(2, 512, 512),), rules=[RULE])]
    [('hoistable-constant', 'warning')]
"""

from __future__ import annotations

import torch

from fxforge.lint.graph import LintGraph, format_bytes
from fxforge.lint.rule import Rule

LARGE_BYTES = 256 << 10
MIN_BYTES = 1024
"""Constant work that makes less than this is not reported (an arange of positions costs less than its call)."""
# Ops that make no new values: reading them is free, so a chain of only these is nothing to hoist.
FREE = {"view", "reshape", "unsqueeze", "squeeze", "expand", "permute", "transpose", "t", "getitem", "slice",
        "select", "detach", "alias", "_assert_tensor_metadata", "lift_fresh_copy", "to", "contiguous", "flatten",
        "expand_as", "view_as", "size", "sym_size", "_unsafe_view", "lift_fresh", "dropout", "type_as",
        "numel", "dim"}


def trainable(graph: LintGraph) -> set[torch.fx.Node]:
    """Nodes that read a trainable parameter (their values change with training: recomputing them is right)."""
    names = {name for name, p in graph.model.named_parameters() if p.requires_grad}
    found: set[torch.fx.Node] = set()
    for node in graph.nodes():
        reads = node.op == "get_attr" and str(node.target) in names
        if node.op == "call_module":
            reads = any(p.requires_grad for p in graph.owner(node).get_submodule(str(node.target)).parameters())
        if reads or any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def check(graph: LintGraph):
    varying = graph.depends_on_inputs() | trainable(graph)
    constant = [n for n in graph.calls() if n not in varying and graph.value(n) is not None]
    constant_set = set(constant)
    for node in constant:
        if not any(u in varying or u.op == "output" for u in node.users):
            continue  # not where the constant work ends
        work, stack, seen = [], [node], set()
        while stack:
            current = stack.pop()
            if current in seen or current not in constant_set:
                continue
            seen.add(current)
            if graph.op(current) not in FREE:
                work.append(current)
            stack.extend(current.all_input_nodes)
        if not work:
            continue
        made = sum(graph.nbytes(n) for n in work)
        if made < MIN_BYTES:
            continue
        ops = sorted({graph.op(n) for n in work})
        yield graph.finding(
            node, f"{len(work)} op{'s' * (len(work) != 1)} ({', '.join(ops[:5])}{', ...' if len(ops) > 5 else ''}) "
                  f"{'computes' if len(work) == 1 else 'compute'} {node.name} {graph.describe(node)} from constants only, again every call "
                  f"({format_bytes(made)} made per call)",
            "compute it once: in __init__ with self.register_buffer(name, value, persistent=False), or cache it per "
            "size (functools.lru_cache on a function of the shape)",
            severity="warning" if made >= LARGE_BYTES else "", involved=graph.describe(node), bytes=made)


RULE = Rule("hoistable-constant", "info", check,
            "work that depends on neither the inputs nor trainable parameters, recomputed every call "
            "(warning from 256 KiB made per call)")
