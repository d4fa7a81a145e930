"""``dead-code``: computation whose result nothing uses: a floating-point value computed in forward and dropped (a leftover of
an edit, a loss term never added). It still runs every call (eagerly), and it usually means a bug: the value
was meant to be used.

Example:
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         aux = x.exp().sum()
    ...         return x.relu()
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(4, 8),), rules=[RULE])]
    ['dead-code']
"""

from __future__ import annotations

from fxforge.core.nodes import is_effectful
from fxforge.lint.graph import LintGraph
from fxforge.lint.rule import Rule

# Nodes without users that are no computation of the user's (export's checks, shape reads).
QUIET = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "_assert_async", "size",
         "sym_size", "sym_numel", "dim", "_set_grad_enabled", "dropout", "getitem", "detach", "alias"}


def check(graph: LintGraph):
    dead = set()
    for node in reversed(graph.calls()):
        users = set(node.users)
        if users and not users <= dead:
            continue
        value = graph.value(node)
        if graph.op(node) in QUIET or value is None or is_effectful(node, graph.owner(node)):
            continue
        dead.add(node)
    reported = set()
    for node in graph.calls():
        if node not in dead or any(u in dead for u in node.users) or not graph.value(node).is_floating_point():
            continue  # report the last dead node of each chain, where it is a real value (not index arithmetic)
        chain, stack = [], [node]
        while stack:
            current = stack.pop()
            if current in dead and current not in chain:
                chain.append(current)
                stack.extend(current.all_input_nodes)
        where = graph.source(node)
        if where in reported:
            continue
        reported.add(where)
        yield graph.finding(
            node, f"{node.name} {graph.describe(node)} is computed ({len(chain)} op{'s' * (len(chain) != 1)}) and "
                  "never used: wasted work every call, or a value (a loss term, a residual) meant to be used",
            "use it (return it, add it where it was meant to go) or delete the line", involved=graph.describe(node),
            bytes=sum(graph.nbytes(n) for n in chain))


RULE = Rule("dead-code", "warning", check, "a value computed in forward that nothing uses")
