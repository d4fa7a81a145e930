"""``float64-drift``: float64 entering a float32 graph: a float64 constant or buffer (``torch.tensor`` of a
numpy array, ``torch.from_numpy``, ``dtype=torch.float64``) meets float32 tensors, and every op after it runs in
float64, twice the bytes and far slower on GPUs.

Example:
    >>> import numpy as np
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("scale", torch.from_numpy(np.linspace(0.5, 1.5, 8)))
    ...     def forward(self, x):
    ...         return x * self.scale
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(4, 8),), rules=[RULE])]
    ['float64-drift']
"""

from __future__ import annotations

import torch

from fxforge.lint.graph import LintGraph, format_bytes
from fxforge.lint.rule import Rule
from fxforge.lint.rules.upcast import CASTS


def check(graph: LintGraph):
    if any(t.dtype == torch.float64 for t in graph.inputs):
        return  # a float64 model by its inputs
    for node in graph.calls():
        value = graph.value(node)
        if value is None or value.dtype != torch.float64:
            continue
        if graph.op(node) in CASTS:
            continue  # asked for float64 by name: large-upcast's
        args = graph.tensor_args(node)
        lower = [a for a in args if graph.value(a).dtype in (torch.float32, torch.float16, torch.bfloat16)]
        if not lower:
            continue  # float64 from float64: reported where it entered
        doubles = [a for a in args if graph.value(a).dtype == torch.float64]
        origin = ", ".join(f"{a.name} {graph.describe(a)}" for a in doubles) or "a float64 dtype argument"
        yield graph.finding(
            node, f"{graph.op(node)} mixes float32 {lower[0].name} with float64 ({origin}): the result and every "
                  f"op after it run in float64 ({format_bytes(graph.nbytes(node))} here, twice the float32 bytes; "
                  "float64 is 2-64x slower on GPUs), and the outputs come back float64",
            "make the constant float32 where it is made: torch.tensor(x, dtype=torch.float32), "
            "torch.from_numpy(a).float(), or register the buffer as .float()",
            involved=f"{graph.describe(lower[0])} with {origin} -> {graph.describe(node)}", bytes=graph.nbytes(node))


RULE = Rule("float64-drift", "warning", check,
            "float64 (a numpy or Python constant, torch.tensor's default of a float64 array) entering a float32 graph")
