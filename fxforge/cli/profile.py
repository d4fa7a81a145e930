"""``fxforge profile``: the per-node time, FLOPs, bytes and bound of a model (``fxforge.profile``); for a model
TorchDynamo cuts into graphs, every graph's nodes (a ``graph`` column) and the breaks between them; for a model
that dynamo cannot run either, eager's time per module (:mod:`fxforge.cli.eager_profile`) and the line why.

Example:
    >>> _cell(0.123456), _cell(123456), _cell(None)
    ('0.123', '1.23e+05', '')
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from fxforge.cli.args import CommandError, check_output
from fxforge.cli.breaks import graphs_line
from fxforge.cli.commands import _console, _model_and_inputs, collected_warnings
from fxforge.cli.eager_profile import module_times
from fxforge.cli.failures import capture_failure
from fxforge.cli.output import Outputs
from fxforge.cli.steps import Steps


def run_profile(args: argparse.Namespace) -> int:
    """``fxforge profile``: the per-node time, FLOPs, bytes and bound of the model (``fxforge.profile``)."""
    import fxforge

    if args.csv:
        check_output(args.csv, (".csv",), "--csv")
    profile = getattr(fxforge, "profile", None)
    if profile is None:
        raise CommandError("fxforge.profile is not available in this installation")
    steps = Steps()
    console = _console()
    notes: list[str] = []
    with Outputs() as outputs, collected_warnings(notes):
        model, inputs, _ = _model_and_inputs(args, steps)
        subject = model
        if args.optimized:
            with steps.step("optimize (capture, rewrite)") as step:
                subject = fxforge.optimize(model, inputs)
                counts = subject.report.counts if subject.report is not None else {}
                step.note(", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "nothing applied")
        with steps.step(f"profile ({args.repeat} runs)") as step:
            try:
                result = profile(subject, inputs, warmup=args.warmup, repeat=args.repeat)
                table = result.table
            except fxforge.CaptureError as error:  # not one graph: eager's time per module instead
                reason = capture_failure(type(model).__name__, error)
                step.note("no graph: eager, timed per module")
                table, total = module_times(model, inputs, warmup=args.warmup, repeat=args.repeat)
                result = None
        if args.csv:
            outputs.write_with(args.csv, lambda path: table.to_csv(path, index=False))
    if result is None:
        console.print(f"note: {reason}; so this is eager's time per module, not per node", markup=False)
        _print_frame(console, table.head(args.top), f"{type(model).__name__} (eager, by module): top "
                                                    f"{min(args.top, len(table))} of {len(table)} rows by time "
                                                    f"(forward {total:.3g} ms, median of {max(1, args.repeat)})")
        if args.csv:
            console.print(f"full table: {args.csv}", markup=False)
        return 0
    shown = table.sort_values("time_ms", ascending=False, kind="stable").head(args.top)
    columns = [c for c in PROFILE_COLUMNS if c in shown.columns]
    parts = getattr(result, "parts", None)  # a GraphsProfile: graphs between breaks
    if parts is not None:
        console.print(graphs_line(type(model).__name__, len(parts), len(result.breaks)) + "; each graph's nodes "
                      "below (column graph)", markup=False, soft_wrap=True)
    across = f" across {len(parts)} graphs" if parts is not None else ""
    _print_frame(console, shown[columns], f"{type(model).__name__}: top {len(shown)} of {len(table)} nodes{across} by "
                                          f"time (total {result.total_ms:.3g} ms)")
    if parts is not None:
        for line in result.graph_lines():
            console.print(line, markup=False, soft_wrap=True)
    if args.by_op:
        _print_frame(console, result.by_op().reset_index(), "by op")
    if args.csv:
        console.print(f"full table: {args.csv}", markup=False)
    return 0


PROFILE_COLUMNS = ("graph", "node", "op", "module", "time_ms", "flops", "bytes", "intensity", "bound", "live_bytes")


def _print_frame(console: Console, frame: Any, title: str) -> None:
    view = Table(title=title, title_justify="left")
    for column in frame.columns:
        numeric = frame[column].dtype.kind in "iuf"
        view.add_column(str(column), justify="right" if numeric else "left", no_wrap=not numeric,
                        overflow="ellipsis", max_width=None if numeric else 40)
    for _, row in frame.iterrows():
        view.add_row(*(_cell(v) for v in row.tolist()))
    console.print(view)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:.3g}"
    return "" if value is None else str(value)
