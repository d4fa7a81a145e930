"""Graph breaks in plain words: where TorchDynamo cut a model, why, and the usual fix (:class:`Break`).

The explanations are data (:data:`BREAK_RULES`): markers found in dynamo's own reason, the plain reason and the
fix, read top to bottom; the first rule whose marker is in dynamo's text explains the break.

Example:
    >>> print(explain_break("generic_jump TensorVariable()", "/abs/m.py", 7, "if x.sum() > 0:").reason)
    branches on a tensor's value, which one graph cannot hold
"""

from __future__ import annotations

import dataclasses
import os

from fxforge.core.source import format_location

# What to do about a branch on a tensor's value (a graph holds one path).
BRANCH_FIXES = ("compute both sides and pick with torch.where(cond, a, b), or use torch.cond(pred, true_fn, "
                "false_fn, operands), or move the branch out of forward")

# (markers in dynamo's reason, the reason in plain words, the usual fix), first match wins.
BREAK_RULES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("generic_jump", "Data-dependent branching", "data-dependent branching"),
     "branches on a tensor's value, which one graph cannot hold", BRANCH_FIXES),
    (("Tensor.item()", ".item()"),
     "reads a tensor's value into Python (.item())",
     ("keep the value a tensor (a 0-d tensor works in the arithmetic), move the .item() out of forward, or set "
     "torch._dynamo.config.capture_scalar_outputs = True")),
    (("tolist",),
     "turns a tensor into a Python list (.tolist())",
     "compute with tensor ops (masks, sums, torch.where) instead of a Python list"),
    (("`print`",),
     "calls print()",
     "remove the print from forward (print outside the model, or use logging after the call)"),
    (("torch.compiler.disable", "disable()`d", "_dynamo.disable"),
     "calls a function marked torch.compiler.disable, which runs eagerly by request",
     "remove the decorator where the function is traceable; the graphs around it are optimized either way"),
    (("Dynamic shape operator", "dynamic output shape", "data-dependent output", "nonzero"),
     "calls an op whose output size depends on the values (boolean indexing, nonzero, unique)",
     ("keep sizes fixed (torch.where(mask, x, 0) in place of x[mask]), or set "
     "torch._dynamo.config.capture_dynamic_output_shape_ops = True")),
    (("numpy", "ndarray"),
     "hands a tensor's data to numpy",
     "use the torch equivalent of the numpy call (torch.* has most of numpy's functions)"),
    (("builtin operator", "Failed to trace builtin"),
     "calls a Python builtin that dynamo cannot trace",
     "compute it with torch ops, or move it out of forward (or into a helper marked torch.compiler.disable)"),
)
_OTHER_FIX = ("rewrite that line with torch ops, or move it out of forward (or into a helper marked "
              "torch.compiler.disable, so that the graphs around it stay whole)")


@dataclasses.dataclass(frozen=True)
class Break:
    """One place where TorchDynamo cut the model into graphs.

    Attributes:
        line: the user's ``file.py:12`` where the break happened.
        reason: why, in plain words.
        fix: the usual way to remove it.
        code: that line's code.
        detail: dynamo's own first line about it.
        origin: ``file:line`` as the code object names it, whatever the current directory (``line`` is shortened
            to the directory current when the break was seen): what tells two records of one break apart.

    Example:
        >>> print(Break("m.py:7", "calls print()", "remove the print", "print(x)"))
        m.py:7 (print(x)): calls print(); fix: remove the print
    """

    line: str
    reason: str
    fix: str
    code: str = ""
    detail: str = ""
    origin: str = dataclasses.field(default="", compare=False)

    def __str__(self) -> str:
        return f"{self.line}" + (f" ({self.code})" if self.code else "") + f": {self.reason}; fix: {self.fix}"


def explain_break(dynamo_reason: str, filename: str, lineno: int, code: str = "") -> Break:
    """The :class:`Break` for dynamo's reason text at the user's ``filename:lineno``.

    Example:
        >>> b = explain_break("Unsupported Tensor.item() call with capture_scalar_outputs=False", "m.py", 3)
        >>> b.line, b.reason
        ('m.py:3', "reads a tensor's value into Python (.item())")
        >>> explain_break("something new", "m.py", 4).reason
        'dynamo cannot trace it (something new)'
    """
    detail = dynamo_reason.strip().splitlines()[0] if dynamo_reason.strip() else ""
    for markers, reason, fix in BREAK_RULES:
        if any(marker in dynamo_reason for marker in markers):
            break
    else:
        reason, fix = f"dynamo cannot trace it ({detail})", _OTHER_FIX
    return Break(format_location(filename, lineno), reason, fix, (code or "").strip(), detail,
                 origin=f"{os.path.abspath(filename)}:{lineno}")


def distinct(breaks: list[Break]) -> list[Break]:
    """``breaks`` without repeats (a loop breaks at the same line on every iteration; a break seen again after
    the current directory changed, its ``line`` shortened otherwise), in order.

    Example:
        >>> b = Break("m.py:2", "r", "f")
        >>> distinct([b, b, Break("m.py:3", "r", "f")]) == [b, Break("m.py:3", "r", "f")]
        True
        >>> len(distinct([Break("m.py:2", "r", "f", origin="/a/m.py:2"), Break("/a/m.py:2", "r", "f", origin="/a/m.py:2")]))
        1
    """
    seen: dict[tuple[str, str], Break] = {}
    for item in breaks:
        seen.setdefault((item.origin or _same_file(item.line), item.reason), item)
    return list(seen.values())


def _same_file(line: str) -> str:
    """``file:line`` with the file made absolute: one module imported by two paths (``tests/m.py`` and
    ``/repo/tests/m.py``, as two entries of ``sys.path`` give) names one line."""
    file, sep, number = line.rpartition(":")
    return f"{os.path.abspath(file)}:{number}" if sep and file else line


@dataclasses.dataclass
class GraphPart:
    """One graph between breaks, as an optimized module ran it.

    Attributes:
        index: its number, in the order the model ran its graphs.
        lines: the user's lines it holds (``m.py:3-9``).
        nodes_before: call nodes dynamo captured; ``nodes_after``: after the rewrites.
        counts: rewrites applied in it (as :attr:`fxforge.core.report.Report.counts`).
        ends: the break at its end (None: the forward returned).
        calls: times it ran in one call of the model (a loop runs a graph more than once).
        flops: FLOPs of one run of it.

    Example:
        >>> print(GraphPart(1, "m.py:3-5", 8, 6, {"conv_bn_fold": 1}, None, 1, 2000))
        graph 1 (m.py:3-5): 8 -> 6 nodes; conv_bn_fold x1
    """

    index: int
    lines: str
    nodes_before: int
    nodes_after: int
    counts: dict
    ends: Break | None = None
    calls: int = 1
    flops: int = 0

    def __str__(self) -> str:
        applied = ", ".join(f"{k} x{v}" for k, v in sorted(self.counts.items())) or "no rewrite applied"
        runs = f", runs {self.calls} times per call" if self.calls > 1 else ""
        return (f"graph {self.index}" + (f" ({self.lines})" if self.lines else "")
                + f": {self.nodes_before} -> {self.nodes_after} nodes{runs}; {applied}")


def share_line(flop_share: float | None, time_share: float | None) -> str:
    """The report's line on how much of the model ran inside optimized graphs.

    Example:
        >>> share_line(0.987, 0.9)
        "98.7% of the model's FLOPs and 90.0% of its time inside optimized graphs"
        >>> share_line(None, None)
        ''
    """
    parts = []
    if flop_share is not None:
        parts.append(f"{flop_share:.1%} of the model's FLOPs")
    if time_share is not None:
        parts.append(f"{time_share:.1%} of its time")
    return " and ".join(parts) + " inside optimized graphs" if parts else ""
