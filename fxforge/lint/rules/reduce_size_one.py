"""``reduce-size-one``: a reduction (sum, mean, max, softmax...) over a dim of size 1: it does nothing (a
softmax over it is all ones), so the dim meant is likely another one.

Example:
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.score = torch.nn.Linear(8, 1)
    ...     def forward(self, x):
    ...         return torch.softmax(self.score(x), dim=-1)
    >>> [f.severity for f in fxforge.lint(Net(), (torch.randn(4, 8),), rules=[RULE])]
    ['error']
"""

from __future__ import annotations

from fxforge.lint.graph import LintGraph
from fxforge.lint.rule import Rule

REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "std", "var", "logsumexp", "argmax", "argmin", "any", "all", "softmax", "log_softmax", "_softmax", "_log_softmax",
              "cumsum", "nansum", "count_nonzero"}
ALWAYS_CONSTANT = {"softmax", "_softmax", "log_softmax", "_log_softmax"}


def _batch_one(graph: LintGraph) -> bool:
    return any(t.dim() > 0 and t.shape[0] == 1 for t in graph.inputs)


def _inputs_have_ones(graph: LintGraph) -> bool:
    """Whether an example input has a dim of size 1 (a sequence of one token): the size-1 dim may be the example's."""
    return any(1 in t.shape for t in graph.inputs)


def check(graph: LintGraph):
    for node in graph.calls(*REDUCTIONS):
        source = graph.tensor_args(node)[:1]
        shape = graph.shape(source[0]) if source else None
        dims = graph.arg(node, 1, "dim")
        if not shape or dims is None or isinstance(dims, bool) or not isinstance(dims, (int, list, tuple)):
            continue
        dims = [dims] if isinstance(dims, int) else list(dims)
        if not all(isinstance(d, int) for d in dims) or not dims:
            continue
        dims = [d % len(shape) for d in dims]
        if any(shape[d] != 1 for d in dims) or all(s == 1 for s in shape):
            continue
        if dims == [0] and _batch_one(graph):
            continue  # the example's batch of one, not the model's dim
        op = graph.op(node).lstrip("_")
        constant = op in ALWAYS_CONSTANT
        example = _inputs_have_ones(graph)
        result = {"softmax": "all ones", "log_softmax": "all zeros"}.get(op, "its input unchanged")
        yield graph.finding(
            node, f"{op} over dim {dims[0] if len(dims) == 1 else dims} of {source[0].name} {list(shape)}, which has "
                  f"size 1: the result is {result}"
                  + (", whatever the input (a one-logit head needs sigmoid, not softmax)" if constant else
                     "; the reduction meant is likely over another dim")
                  + (" (an example input has a dim of size 1, so this may be the example's size, not the "
                     "model's: info)" if example else ""),
            "reduce over the dim that holds the values (dim=0 or the feature dim), or drop the reduction; "
            + ("for one logit use torch.sigmoid" if constant else "squeeze the size-1 dim first if it is a leftover"),
            severity="info" if example else "error" if constant else "", involved=graph.describe(source[0]))


RULE = Rule("reduce-size-one", "warning", check,
            "a reduction or softmax over a dim of size 1: it leaves its input unchanged (softmax: all ones)")
