"""``large-upcast``: a large tensor converted to a wider float dtype (float16 -> float32, float32 -> float64):
a new tensor of twice the bytes, every call.

Example:
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.double().sum()
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(512, 1024),), rules=[RULE])]
    ['large-upcast']
"""

from __future__ import annotations

import torch

from fxforge.lint.graph import LintGraph, format_bytes
from fxforge.lint.rule import Rule

CASTS = {"to", "_to_copy", "float", "double", "type", "type_as", "_autocast_to_full_precision"}
LARGE_BYTES = 1 << 20
"""An upcast result from this size is reported (smaller ones cost less than the call that makes them)."""


def check(graph: LintGraph):
    for node in graph.calls(*CASTS):
        source = graph.tensor_args(node)[:1]
        before, after = (graph.value(source[0]) if source else None), graph.value(node)
        if before is None or after is None or not before.dtype.is_floating_point:
            continue
        if not after.dtype.is_floating_point or after.element_size() <= before.element_size():
            continue
        size = graph.nbytes(node)
        if size < LARGE_BYTES:
            continue
        to64 = after.dtype == torch.float64
        yield graph.finding(
            node, f"upcast of {source[0].name} from {str(before.dtype).removeprefix('torch.')} to "
                  f"{str(after.dtype).removeprefix('torch.')} makes a {format_bytes(size)} copy every call "
                  f"({after.element_size() // before.element_size()}x the bytes)"
                  + ("; float64 runs far slower on GPUs" if to64 else ""),
            "upcast only what needs the precision (the reduction's result: x.sum(dtype=torch.float32)), or keep "
            "the tensor in its dtype", severity="warning" if to64 else "",
            involved=f"{graph.describe(source[0])} -> {graph.describe(node)}", bytes=size)


RULE = Rule("large-upcast", "info", check,
            "a large tensor converted to a wider float dtype: a copy of twice the bytes every call (float64: warning)")
