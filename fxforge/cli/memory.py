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
from fxforge.cli.breaks import breaks_of_error
from fxforge.cli.commands import _console, _model_and_inputs, collected_warnings
from fxforge.cli.failures import capture_failure
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
    """A checkpointing plan (``fxforge.training.plan_checkpointing``) as lines: its summary, then the recomputed
    work by module (``plan.recomputed_by_module()``: the module, how many ops, the user's source line), the
    first ``shown`` modules.

    Example:
        >>> class Plan:
        ...     recomputed = ["tanh", "detach", "tanh_1", "addmm"]
        ...     def recomputed_by_module(self):
        ...         return [("encoder.0", ["net.py:12: x = torch.tanh(x)"], ["tanh"]),
        ...                 ("encoder.1", [], ["tanh_1", "addmm"])]
        ...     def __str__(self):
        ...         return "budget: 60% of the activation peak"
        >>> for line in plan_lines(Plan()):
        ...     print(line)
        budget: 60% of the activation peak
        recomputed, by module (2 modules):
          encoder.0: 1 op (tanh) at net.py:12: x = torch.tanh(x)
          encoder.1: 2 ops (tanh_1, addmm)
    """
    lines = str(plan).splitlines()
    groups = plan.recomputed_by_module() if plan.recomputed else []
    if groups:
        lines.append(f"recomputed, by module ({len(groups)} module{'s' if len(groups) != 1 else ''}):")
        for module, sources, nodes in groups[:shown]:
            ops = ", ".join(nodes[:4]) + (", ..." if len(nodes) > 4 else "")
            where = f" at {sources[0]}" if sources else ""
            more = f" (and {len(sources) - 1} more lines)" if len(sources) > 1 else ""
            count = f"{len(nodes)} op{'s' if len(nodes) != 1 else ''}"
            lines.append(f"  {module or '(the model itself)'}: {count} ({ops}){where}{more}")
        if len(groups) > shown:
            lines.append(f"  ... and {len(groups) - shown} more modules")
    return lines


def _training_memory(model: torch.nn.Module, inputs: tuple, args: argparse.Namespace) -> Any:
    if not any(p.requires_grad for p in model.parameters()):
        raise CommandError(f"{type(model).__name__} has no parameter that requires grad: a training step "
                           "would update nothing")
    try:
        return fxforge.training_memory(model, inputs, optimizer=args.optimizer,
                                       autocast=AUTOCAST.get(args.autocast))
    except fxforge.CaptureError as error:
        raise CommandError(capture_failure(type(model).__name__, error)) from error
    except ValueError as error:
        if "no floating-point tensor" in str(error):
            raise CommandError(f"{type(model).__name__} returns no floating-point tensor to take a loss of "
                               "(the loss is the sum of the floating-point outputs)") from error
        raise


def _plan(model: torch.nn.Module, inputs: tuple, args: argparse.Namespace, tm: Any) -> Any:
    from fxforge.training import plan_checkpointing

    # The model as the prediction captured it: planning does not capture it again.
    return plan_checkpointing(model, inputs, args.budget, optimizer=args.optimizer, loss=None,
                              autocast=AUTOCAST.get(args.autocast), graph_module=tm.step.wrapper.model)


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
    figure and per module, printed before anything else runs; with ``--budget``, the checkpointing plan that
    fits it. Exit 1 where no plan reaches the budget (the least reachable budget said), or where the plan's
    measured step holds more than the budget (unless ``--allow-over``)."""
    from fxforge.cli.args import check_output
    from fxforge.training import BudgetError

    if args.csv:
        check_output(args.csv, (".csv",), "--csv")
    steps = Steps()
    console: Console = _console()
    notes: list[str] = []
    optimizer = optimizer_name(args.optimizer)
    precision = f", autocast {args.autocast}" if args.autocast else ""
    with Outputs() as outputs, collected_warnings(notes):
        model, inputs, _ = _model_and_inputs(args, steps, train=True)
        try:
            with steps.step(f"predict one training step ({optimizer}{precision})") as step:
                tm = _training_memory(model, inputs, args)
                step.note(f"peak {format_bytes(tm.peak_bytes)} in the {tm.peak_phase} at {tm.peak_node}")
        except CommandError as error:
            breaks = breaks_of_error(error)
            if not breaks:
                raise
            return _measured_only(model, inputs, args, breaks, steps, console, outputs, f"{optimizer}{precision}")
        if args.measure:
            with steps.step("measure one real step") as step:
                tm.measure()
                step.note(f"peak {format_bytes(tm.measured.peak_bytes)} ({tm.measured.device})")
        rows = breakdown(tm)
        if args.csv:
            _write_csv(outputs, args.csv, rows)
    # The prediction is shown before any planning, so a plan that fails or takes long loses none of it.
    shapes = " ".join(format_input(*spec) for spec in args.input)
    title = f"{type(model).__name__} ({shapes}): one training step, {optimizer}{precision}, train mode"
    console.print(breakdown_table(rows, title, optimizer))
    console.print(f"peak: {format_bytes(tm.peak_bytes)} in the {tm.peak_phase} at {tm.peak_node}", markup=False)
    depth = args.depth or None
    console.print(module_table(tm.by_module(depth=depth), depth))
    if args.csv:
        console.print(f"table: {args.csv}", markup=False)
    _print_notes(console, notes)
    if args.budget is None:
        return 0
    notes = []
    with collected_warnings(notes):
        try:
            with steps.step(f"plan checkpointing (budget {_budget_text(args.budget)})") as step:
                plan = _plan(model, inputs, args, tm)
                step.note(f"{len(plan.recomputed)} nodes recomputed, predicted overhead {plan.overhead:.1%}")
        except BudgetError as error:
            console.print("[bold]checkpointing plan[/bold]")
            if error.least_budget is not None:
                console.print(f"  least reachable budget: {_budget_text(error.least_budget)} "
                              f"(--budget {_budget_text(args.budget)} cannot be met)", markup=False)
            raise CommandError(" ".join(str(error).split())) from error
    console.print("[bold]checkpointing plan[/bold]")
    for line in plan_lines(plan):
        console.print("  " + line, markup=False, highlight=False, soft_wrap=True)
    _print_notes(console, [n for n in notes if "over its budget" not in n])
    over = plan.over_budget_bytes
    if over is not None and over > 0:
        what = "activation peak" if plan.budget_kind == "fraction" else "step peak"
        share = (f" ({math.ceil(100 * plan.measured_bytes / plan.unconstrained_activation_bytes)}% of the "
                 "unconstrained one)" if plan.budget_kind == "fraction" else "")
        message = (f"the plan's measured {what} is {format_bytes(plan.measured_bytes)}{share}, {format_bytes(over)} "
                   f"over the budget {_budget_text(args.budget)} ({format_bytes(plan.budget_bytes)}), after "
                   "planning again with the excess kept back")
        if not getattr(args, "allow_over", False):
            raise CommandError(message + "; --allow-over accepts it, or give a larger --budget")
        console.print(f"note: {message}; accepted (--allow-over)", markup=False, highlight=False)
    return 0


def _measured_only(model: torch.nn.Module, inputs: tuple | dict, args: argparse.Namespace, breaks: list,
                   steps: Steps, console: Console, outputs: Outputs, step_name: str) -> int:
    """``fxforge memory`` of a model TorchDynamo cuts into graphs: one real step, measured (the prediction, the
    per-module figures and ``--budget``'s plan need one graph of the step: a line says so, naming the breaks; with
    ``--budget`` it is the error, exit 1)."""
    from fxforge.capture import normalize_inputs
    from fxforge.training.measure import measure_step

    name = type(model).__name__
    why = (f"the prediction, the per-module figures and --budget's checkpointing plan need one graph of the training "
           f"step, and {name} runs as graphs between breaks: " + "; ".join(map(str, breaks)))
    call_args, call_kwargs = normalize_inputs(inputs)
    with steps.step("measure one real step (graphs between breaks: nothing to predict from)") as step:
        try:
            measured = measure_step(model, call_args, call_kwargs, optimizer=args.optimizer,
                                    autocast=AUTOCAST.get(args.autocast))
        except ValueError as error:
            if "no floating-point tensor" in str(error):
                raise CommandError(f"{name} returns no floating-point tensor to take a loss of (the loss is the sum "
                                   "of the floating-point outputs)") from error
            raise
        step.note(f"peak {format_bytes(measured.peak_bytes)} ({measured.device})")
    figures = measured_figures(measured)
    shapes = " ".join(format_input(*spec) for spec in args.input)
    table = Table(title=f"{name} ({shapes}): one training step, {step_name}, train mode, measured",
                  title_justify="left")
    for column, justify in (("figure", "left"), ("measured", "right"), ("what it is", "left")):
        table.add_column(column, justify=justify)
    for figure, value in figures.items():
        if figure == _PEAKS[0]:
            table.add_section()
        table.add_row(figure, format_bytes(value), _MEANING.get(figure, ""))
    console.print(table)
    console.print(f"peak: {format_bytes(measured.peak_bytes)}, measured ({measured.device})", markup=False)
    if args.budget is not None:  # (no --csv file: the command failed)
        raise CommandError(f"--budget {_budget_text(args.budget)}: {why}")
    if args.csv:
        import pandas as pd

        frame = pd.DataFrame({"figure": list(figures), "measured_bytes": list(figures.values())})
        outputs.write_with(args.csv, lambda scratch: frame.to_csv(scratch, index=False))
        console.print(f"table: {args.csv}", markup=False)
    console.print(f"note: {why}", markup=False, highlight=False, soft_wrap=True)
    return 0


def measured_figures(measured: Any) -> dict[str, int]:
    """The figures of a measured step (:class:`fxforge.training.measure.StepMeasurement`) under the breakdown's names
    (temporaries are not measured apart).

    Example:
        >>> from fxforge.training.measure import measure_step
        >>> m = measure_step(torch.nn.Linear(8, 8), (torch.randn(2, 8),), {}, optimizer=None)
        >>> measured_figures(m)["gradients"], list(measured_figures(m))[-1]
        (288, 'peak')
    """
    return {"weights": measured.weights_bytes, "buffers": measured.buffers_bytes, "inputs": measured.inputs_bytes,
            "gradients": measured.gradient_bytes, "optimizer_state": measured.optimizer_state_bytes,
            "activations": measured.saved_bytes, "forward_peak": measured.forward_peak_bytes,
            "backward_peak": measured.backward_peak_bytes, "optimizer_peak": measured.optimizer_peak_bytes,
            "peak": measured.peak_bytes}


def add_memory_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``fxforge memory`` that its planning reads beyond the shared ones (``--allow-over``).

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_memory_options(parser)
        >>> parser.parse_args(["--allow-over"]).allow_over
        True
    """
    parser.add_argument("--allow-over", action="store_true",
                        help="exit 0 even when the plan's measured step holds more than --budget (the plan is "
                             "kept as the closest; without it, that exits 1)")


def _print_notes(console: Console, notes: list[str]) -> None:
    for note in notes:
        console.print(f"note: {note}", markup=False, highlight=False)


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
