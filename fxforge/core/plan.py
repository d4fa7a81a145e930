"""``Plan``: a captured, rewritten graph together with what runs it, the value lowering hands the runtime.

Example:
    >>> import torch, fxforge
    >>> from fxforge.lowering.lower import make_plan
    >>> plan = make_plan(fxforge.capture(torch.nn.ReLU(), (torch.ones(2),)))
    >>> plan.executable(-torch.ones(2)).tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from fxforge.core.captured import Captured
from fxforge.core.derived import DerivedValues
from fxforge.core.symbolic import ShapeGuard


@dataclasses.dataclass(frozen=True)
class CallConditions:
    """What about a call, besides its inputs and the modules' modes, decides which plan serves it.

    Attributes:
        gradients: the call records gradients (grad mode on, and a parameter or an input requires them):
            its plan keeps every op eager has, so every parameter gets eager's gradient (no folding, no
            fused kernels; double backward works).
        autocast: ``(device type, dtype)`` of each autocast region the call runs in: its plan has only ops
            autocast knows, and is verified under the same autocast.
        guards_as_ops: the graph is for a target whose translation chooses the kernels (an ONNX export for
            ONNX Runtime): guards a rewrite adds only because torch's kernel differs from eager (the attention
            rewrite's NaN query rows) are written as one op each (``torch.ops.fxforge.nan_rows``), which that
            translation drops where its kernel gives eager's value itself. Same values; for inference graphs
            (the ops have no autograd formula).

    Example:
        >>> CallConditions.now()
        CallConditions(gradients=False, autocast=(), guards_as_ops=False)
        >>> with torch.autocast("cpu", torch.bfloat16):
        ...     CallConditions.now().autocast
        (('cpu', torch.bfloat16),)
    """

    gradients: bool = False
    autocast: tuple = ()
    guards_as_ops: bool = False

    # The words a rewrite's refusal ends with when it refused only because the calls record gradients (the
    # optimized module says once that such calls run without those rewrites).
    FOR_GRADIENTS = "the calls this graph serves record gradients"

    @classmethod
    def now(cls, gradients: bool = False) -> CallConditions:
        """The conditions of a call made here (``gradients`` as the caller found them)."""
        if not any(map(torch.is_autocast_enabled, AUTOCAST_DEVICES)):  # most calls: one of two constants
            return _WITH_GRADIENTS if gradients else _PLAIN
        return cls(gradients, tuple((device, torch.get_autocast_dtype(device)) for device in AUTOCAST_DEVICES
                                    if torch.is_autocast_enabled(device)))

    def autocast_context(self) -> contextlib.ExitStack:
        """A context that enters the call's autocast regions (nothing when there are none).

        Example:
            >>> with CallConditions(autocast=(("cpu", torch.bfloat16),)).autocast_context():
            ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
            torch.bfloat16
        """
        stack = contextlib.ExitStack()
        for device, dtype in self.autocast:
            stack.enter_context(torch.autocast(device, dtype))
        return stack


# The devices whose autocast state a call can be under.
AUTOCAST_DEVICES = ("cpu", "cuda")
_PLAIN, _WITH_GRADIENTS = CallConditions(), CallConditions(gradients=True)


@dataclasses.dataclass
class Plan:
    """What fxforge runs for one input signature.

    Attributes:
        captured: the rewritten graph (with its report and example inputs). Its fused ops are custom ops
            with autograd: it runs when a call records gradients.
        executable: the lowered graph (fused ops as direct calls of their chosen kernels, weights
            prepacked): it runs when no gradient is recorded.
        derived: the values computed from the model's tensors (folded and prepacked weights), recomputed
            when those change (:class:`~fxforge.core.derived.DerivedValues`).
        shapes: for a graph with symbolic sizes, the calls it serves (a
            :class:`~fxforge.core.symbolic.ShapeGuard`); None: the example's input signature only.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> from fxforge.core.report import Report
        >>> cap = Captured(gm, "fx", [], (torch.ones(1),), {}, torch.nn.ReLU(), False, Report(method="fx"))
        >>> Plan(cap, gm).report.method
        'fx'
    """

    captured: Captured
    executable: torch.nn.Module
    derived: DerivedValues = dataclasses.field(default_factory=lambda: DerivedValues([]))
    shapes: ShapeGuard | None = None

    @property
    def report(self):
        """The rewritten graph's report."""
        return self.captured.report
