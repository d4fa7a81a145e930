"""``fxforge memory``: the memory of one training step, predicted from its graphs before it runs (and
measured with ``--measure``), and with ``--budget`` the activation checkpointing plan that fits it.

::

    fxforge memory MODEL --input SHAPE[:DTYPE] ... [--optimizer adamw|adam|sgd|rmsprop|adagrad|none]
                   [--autocast bf16|fp16] [--measure] [--budget 60%|2GiB] [--depth N] [--csv table.csv]

The step is ``loss(model(*inputs)).backward(); optimizer.step()`` with the model in train mode and the
sum of its floating-point outputs as the loss (:func:`fxforge.training_memory`): weights + gradients +
optimizer state + activations saved for the backward, and each phase's peak.

Example:
    >>> tm = fxforge.training_memory(torch.nn.Linear(8, 8), (torch.randn(2, 8),), optimizer="sgd")
    >>> [(row.figure, format_bytes(row.predicted)) for row in breakdown(tm)][:5]
    [('weights', '288 B'), ('buffers', '0 B'), ('inputs', '64 B'), ('gradients', '288 B'), ('optimizer_state', '288 B')]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import fxforge
from fxforge.cli.args import CommandError, format_input
from fxforge.cli.commands import _console, _model_and_inputs, collected_warnings
from fxforge.cli.output import Outputs
from fxforge.cli.steps import Steps
from fxforge.cli.summary import format_bytes

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``--autocast`` names -> the dtype the forward runs in under ``torch.autocast``."""

_MEANING = {
    "weights": "the parameters",
    "buffers": "batch-norm statistics and other buffers",
    "inputs": "the example batch",
    "gradients": "one per trainable parameter",
    "optimizer_state": "kept by the optimizer between steps",
    "activations": "saved by the forward for the backward: grow with batch and sequence",
    "temporaries": "working values alive at the peak that are not saved ones",
    "forward_peak": "most alive at once in the forward (everything above counted)",
    "backward_peak": "most alive at once in the backward",
    "optimizer_peak": "most alive at once in optimizer.step()",
    "peak": "the step's peak",
}
_PEAKS = ("forward_peak", "backward_peak", "optimizer_peak", "peak")

@dataclasses.dataclass(frozen=True)
class Row:
    """One figure of the breakdown, in bytes: predicted, and measured with the error once measured.

    Example:
        >>> Row("weights", 288, 288, 0.0).figure
        'weights'
    """

    figure: str
    predicted: int
    measured: int | None = None
    error_percent: float | None = None


def breakdown(tm: Any) -> list[Row]:
    """The rows of ``tm`` (a :class:`fxforge.TrainingMemory`): every figure, measured beside predicted once
    ``tm.measure()`` has run (the error as ``tm.table`` gives it).

    Example:
        >>> tm = fxforge.training_memory(torch.nn.Linear(8, 8), (torch.randn(2, 8),), optimizer=None).measure()
        >>> breakdown(tm)[3]
        Row(figure='gradients', predicted=288, measured=288, error_percent=0.0)
    """
    errors = tm.table["error_%"] if tm.measured is not None else None
    measured_figures = tm.measured_figures()
    rows = []
    for figure, predicted in tm.figures().items():
        measured = measured_figures.get(figure)
        error = errors.get(figure) if errors is not None and measured is not None else None
        known = error is not None and not math.isnan(error)
        rows.append(Row(figure, int(predicted), measured, float(error) if known else None))
    return rows


def breakdown_table(rows: list[Row], title: str, optimizer: str = "the optimizer") -> Table:
    """The breakdown as a ``rich`` table: the parts first, then the phases' peaks."""
    measured = any(row.measured is not None for row in rows)
    predicted = {row.figure: row.predicted for row in rows}
    meaning = dict(_MEANING)
    if optimizer == "no optimizer":
        meaning["optimizer_state"] = "none: no optimizer"
    elif predicted.get("weights"):
        ratio = predicted.get("optimizer_state", 0) / predicted["weights"]
        meaning["optimizer_state"] = f"kept by {optimizer} between steps: {ratio:.2g}x the weights"
    table = Table(title=title, title_justify="left")
    table.add_column("figure")
    table.add_column("predicted", justify="right")
    if measured:
        table.add_column("measured", justify="right")
        table.add_column("error", justify="right")
    table.add_column("what it is")
    for row in rows:
        if row.figure == _PEAKS[0]:
            table.add_section()
        cells = [row.figure, format_bytes(row.predicted)]
        if measured:
            cells += [format_bytes(row.measured) if row.measured is not None else "-",
                      _percent(row.error_percent)]
        table.add_row(*cells, meaning.get(row.figure, ""))
    return table


def module_table(frame: Any, depth: int | None, top: int = 15) -> Table:
    """``tm.by_module(depth)`` (MiB per module) as a ``rich`` table of sizes, the ``top`` largest rows."""
    title = f"by module (depth {depth})" if depth is not None else "by module (innermost)"
    if len(frame) > top:
        title += f": the {top} largest of {len(frame)}"
    table = Table(title=title, title_justify="left")
    table.add_column("module")
    columns = list(frame.columns)
    for column in columns:
        table.add_column(column.removesuffix("_MiB").replace("_", " "), justify="right")
    for name, values in frame.head(top).iterrows():
        table.add_row(str(name), *(format_bytes(round(float(values[c]) * 2**20)) for c in columns))
    return table


def plan_lines(plan: Any, shown: int = 12) -> list[str]:
    """A checkpointing plan (``fxforge.training.plan_checkpointing``) as lines: its summary, then the names of
    the recomputed nodes (the first ``shown``).

    Example:
        >>> class Plan:
        ...     recomputed = ["tanh", "tanh_1", "tanh_2"]
        ...     def __str__(self):
        ...         return "budget: 60% of the activation peak"
        >>> plan_lines(Plan(), shown=2)
        ['budget: 60% of the activation peak', 'recomputed nodes: tanh, tanh_1, ... and 1 more']
    """
    names = list(plan.recomputed)
    lines = str(plan).splitlines()
    if names:
        more = f", ... and {len(names) - shown} more" if len(names) > shown else ""
        lines.append(f"recomputed nodes: {', '.join(names[:shown])}{more}")
    return lines


def _training_memory(model: torch.nn.Module, inputs: tuple, args: argparse.Namespace) -> Any:
    if not any(p.requires_grad for p in model.parameters()):
        raise CommandError(f"{type(model).__name__} has no parameter that requires grad: a training step "
                           "would update nothing")
    try:
        return fxforge.training_memory(model, inputs, optimizer=args.optimizer,
                                       autocast=AUTOCAST.get(args.autocast))
    except fxforge.CaptureError as error:
        raise CommandError(str(error)) from error
    except ValueError as error:
        if "no floating-point tensor" in str(error):
            raise CommandError(f"{type(model).__name__} returns no floating-point tensor to take a loss of "
                               "(the loss is the sum of the floating-point outputs)") from error
        raise


def _plan(model: torch.nn.Module, inputs: tuple, args: argparse.Namespace) -> Any:
    from fxforge.training import plan_checkpointing

    try:
        return plan_checkpointing(model, inputs, args.budget, optimizer=args.optimizer, loss=None,
                                  autocast=AUTOCAST.get(args.autocast))
    except ValueError as error:  # the budget cannot be met (a malformed one is a usage error, caught before)
        raise CommandError(" ".join(str(error).split())) from error


def _write_csv(outputs: Outputs, path: str, rows: list[Row]) -> None:
    import pandas as pd

    frame = pd.DataFrame([dataclasses.asdict(row) for row in rows]).rename(
        columns={"predicted": "predicted_bytes", "measured": "measured_bytes", "error_percent": "error_%"})
    if frame["measured_bytes"].isna().all():
        frame = frame.drop(columns=["measured_bytes", "error_%"])
    else:
        frame["measured_bytes"] = frame["measured_bytes"].astype("Int64")
    outputs.write_with(path, lambda scratch: frame.to_csv(scratch, index=False))


def run_memory(args: argparse.Namespace) -> int:
    """``fxforge memory``: the predicted (``--measure``: and measured) memory of one training step, per
    figure and per module; with ``--budget``, the checkpointing plan that fits it."""
    from fxforge.cli.args import check_output

    if args.csv:
        check_output(args.csv, (".csv",), "--csv")
    steps = Steps()
    console: Console = _console()
    notes: list[str] = []
    optimizer = optimizer_name(args.optimizer)
    precision = f", autocast {args.autocast}" if args.autocast else ""
    with Outputs() as outputs, collected_warnings(notes):
        model, inputs, _ = _model_and_inputs(args, steps, train=True)
        with steps.step(f"predict one training step ({optimizer}{precision})") as step:
            tm = _training_memory(model, inputs, args)
            step.note(f"peak {format_bytes(tm.peak_bytes)} in the {tm.peak_phase} at {tm.peak_node}")
        if args.measure:
            with steps.step("measure one real step") as step:
                tm.measure()
                step.note(f"peak {format_bytes(tm.measured.peak_bytes)} ({tm.measured.device})")
        plan = None
        if args.budget is not None:
            with steps.step(f"plan checkpointing (budget {_budget_text(args.budget)})") as step:
                plan = _plan(model, inputs, args)
                step.note(f"{len(plan.recomputed)} nodes recomputed, predicted overhead {plan.overhead:.1%}")
        rows = breakdown(tm)
        if args.csv:
            _write_csv(outputs, args.csv, rows)
    shapes = " ".join(format_input(*spec) for spec in args.input)
    title = f"{type(model).__name__} ({shapes}): one training step, {optimizer}{precision}, train mode"
    console.print(breakdown_table(rows, title, optimizer))
    console.print(f"peak: {format_bytes(tm.peak_bytes)} in the {tm.peak_phase} at {tm.peak_node}", markup=False)
    depth = args.depth or None
    console.print(module_table(tm.by_module(depth=depth), depth))
    if plan is not None:
        console.print("[bold]checkpointing plan[/bold]")
        for line in plan_lines(plan):
            console.print("  " + line, markup=False, highlight=False, soft_wrap=True)
    for note in notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    if args.csv:
        console.print(f"table: {args.csv}", markup=False)
    return 0


def _percent(value: float | None) -> str:
    if value is None:
        return "-"
    return "0.0%" if abs(value) < 0.05 else f"{value:+.1f}%"


def optimizer_name(name: str) -> str:
    """How the summary names ``--optimizer NAME``.

    Example:
        >>> optimizer_name("adamw"), optimizer_name("sgd"), optimizer_name("none")
        ('AdamW', 'SGD (momentum 0.9)', 'no optimizer')
    """
    from fxforge.training.optimizer_memory import OPTIMIZERS

    optimizer = OPTIMIZERS.get(name)
    if optimizer is None:
        return "no optimizer" if name == "none" else name
    return optimizer.__name__ + (" (momentum 0.9)" if optimizer is torch.optim.SGD else "")


def _budget_text(budget: int | str) -> str:
    return budget if isinstance(budget, str) else format_bytes(budget)
