"""``low-precision-reduction``: a sum, mean, softmax or norm computed and returned in float16 or bfloat16 over
many elements: the accumulation loses digits (float16 overflows past 65504; bfloat16 keeps 3 significant
digits), so large sums and softmax denominators come out wrong.

Example:
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.half().sum(dim=-1)
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(2, 4096),), rules=[RULE])]
    ['low-precision-reduction']
"""

from __future__ import annotations

import math

import torch

from fxforge.lint.graph import LintGraph
from fxforge.lint.rule import Rule

REDUCTIONS = {"sum", "mean", "softmax", "log_softmax", "_softmax", "_log_softmax", "cumsum", "var", "std", "norm",
              "linalg_vector_norm", "logsumexp", "prod", "var_mean", "std_mean"}
LOW = (torch.float16, torch.bfloat16)
MIN_REDUCED = 256
"""Elements reduced into one value from which the rounding matters (fewer: within a few ulps)."""


def check(graph: LintGraph):
    for node in graph.calls(*REDUCTIONS):
        source = graph.tensor_args(node)[:1]
        value, out = (graph.value(source[0]) if source else None), graph.value(node)
        if value is None or out is None or value.dtype not in LOW or out.dtype not in LOW:
            continue
        reduced = max(1, value.numel()) // max(1, out.numel())
        if graph.op(node).lstrip("_") in ("softmax", "log_softmax", "cumsum"):
            dim = graph.arg(node, 1, "dim")
            reduced = value.shape[dim] if isinstance(dim, int) and value.dim() else reduced
        if reduced < MIN_REDUCED:
            continue
        name = str(value.dtype).removeprefix("torch.")
        yield graph.finding(
            node, f"{graph.op(node).lstrip('_')} accumulates {reduced:,} {name} values into each result in {name}: "
                  f"{'float16 overflows past 65504 and ' if value.dtype == torch.float16 else ''}"
                  f"the low-precision accumulation loses digits ({math.log2(reduced):.0f} bits of the sum's range)",
            "accumulate in float32: x.sum(dtype=torch.float32), torch.softmax(x, dim, dtype=torch.float32), or "
            "x.float() before the reduction (autocast does this for softmax and sums)",
            involved=f"{graph.describe(source[0])} -> {graph.describe(node)}")


RULE = Rule("low-precision-reduction", "warning", check,
            "a sum, mean, softmax or norm over many values accumulated and returned in float16 or bfloat16")
