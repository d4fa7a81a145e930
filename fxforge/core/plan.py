"""``Plan``: a captured, rewritten graph together with what runs it, the value lowering hands the runtime.

Example:
    >>> import torch, fxforge
    >>> from fxforge.lowering.lower import make_plan
    >>> plan = make_plan(fxforge.capture(torch.nn.ReLU(), (torch.ones(2),)))
    >>> plan.executable(-torch.ones(2)).tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

import dataclasses

import torch

from fxforge.core.captured import Captured


@dataclasses.dataclass
class Plan:
    """What fxforge runs for one input signature.

    Attributes:
        captured: the rewritten graph (with its report and example inputs). Its fused ops are custom ops
            with autograd: it runs when a call records gradients.
        executable: the lowered graph (fused ops as direct calls of their chosen kernels, weights
            prepacked): it runs when no gradient is recorded.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> from fxforge.core.report import Report
        >>> cap = Captured(gm, "fx", [], (torch.ones(1),), {}, torch.nn.ReLU(), False, Report(method="fx"))
        >>> Plan(cap, gm).report.method
        'fx'
    """

    captured: Captured
    executable: torch.nn.Module

    @property
    def report(self):
        """The rewritten graph's report."""
        return self.captured.report
