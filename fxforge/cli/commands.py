"""The commands: ``optimize``, ``export``, ``profile``, ``show``, ``rewrites``.

Each takes the parsed arguments and returns the exit code; a failure is raised (as
:class:`~fxforge.cli.args.CommandError`, :class:`fxforge.ExportError`...) and turned into one line by
:func:`fxforge.cli.main`. Files are written whole or not at all (:class:`~fxforge.cli.output.Outputs`).

Example:
    >>> import argparse
    >>> run_rewrites(argparse.Namespace())  # doctest: +ELLIPSIS
    cleanup  ...
    0
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from fxforge.cli.args import (
    CommandError,
    check_eager,
    check_output,
    check_output_suffix,
    example_inputs,
    format_input,
    load_model,
    load_weights,
)
from fxforge.cli.graphs import draw_available, marked_nodes, node_lines, pictures
from fxforge.cli.html import render_html
from fxforge.cli.output import Outputs
from fxforge.cli.steps import Steps
from fxforge.cli.summary import Summary, compare_latency, simulated_peak

MODEL_SUFFIXES = (".onnx", ".pt2")
_MAX_WARNINGS = 5  # distinct warnings listed in the summary's notes


def _console() -> Console:
    """stdout; wide enough that tables do not wrap in a log file."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=140)
    return console


@contextlib.contextmanager
def collected_warnings(notes: list[str]) -> Iterator[None]:
    """Python warnings raised in the block become notes (each distinct first line once), not stderr noise.

    Example:
        >>> notes = []
        >>> with collected_warnings(notes):
        ...     warnings.warn("careful")
        >>> notes
        ['warning: careful']
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    seen: list[str] = []
    for item in caught:
        if issubclass(item.category, DeprecationWarning):
            continue
        text = str(item.message).strip().splitlines()[0][:300] if str(item.message).strip() else ""
        if text and text not in seen:
            seen.append(text)
    notes.extend(f"warning: {text}" for text in seen[:_MAX_WARNINGS])
    if len(seen) > _MAX_WARNINGS:
        notes.append(f"warning: ... and {len(seen) - _MAX_WARNINGS} more (--debug shows them all)")


# ---------------------------------------------------------------------------------------------- shared steps

def _model_and_inputs(args: argparse.Namespace, steps: Steps, *,
                      train: bool = False) -> tuple[torch.nn.Module, tuple, Any]:
    """Load the model (and weights), put it in eval mode (train mode with ``train``), make the example
    inputs, run the model once on them."""
    with steps.step("load model") as step:
        model = load_model(args.model, args.model_args)
        if getattr(args, "weights", None):
            load_weights(model, args.weights)
        model.train(train)
        inputs = example_inputs(args.input)
        reference = check_eager(model, inputs, args.input)
        parameters = sum(p.numel() for p in model.parameters())
        step.note(f"{type(model).__name__}, {parameters:,} parameters" + (", train mode" if train else ""))
    return model, inputs, reference


def _capture(model: torch.nn.Module, inputs: tuple, steps: Steps, *, dynamic_batch: bool = False) -> Any:
    import fxforge
    from fxforge.planner import dynamic_capture

    with steps.step("capture") as step:
        try:
            captured = fxforge.capture(model, inputs)
        except fxforge.CaptureError as error:
            raise CommandError(str(error)) from error
        if dynamic_batch and captured.method == "export":
            captured = dynamic_capture(model, inputs, {}, reference=captured.example_outputs)
        step.note(f"{captured.method}, {captured.report.nodes_before} nodes")
    return captured


def _rewrite(captured: Any, rewrites: list[str], steps: Steps, *, verify: bool, for_onnx: bool) -> Any:
    from fxforge.lowering.autotune import MEASURE_ALL
    from fxforge.planner import rewrite

    with steps.step("rewrite (verify, autotune)" if verify else "rewrite") as step:
        # ONNX Runtime runs its own kernels: PyTorch's are not timed for an ONNX file (as export_onnx does).
        new = rewrite(captured, rewrites, verify=verify, tuning=None if for_onnx else MEASURE_ALL)
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(new.report.counts.items())) or "nothing applied"
        step.note(counts)
    return new


def _max_error(reference: Any, runner: Any, inputs: tuple) -> float:
    from fxforge.core.verify import compare_outputs

    with torch.no_grad():
        actual = runner(*inputs)
    return compare_outputs(reference, actual).max_abs_err


def _target_of(args: argparse.Namespace) -> str:
    """The target: as given, else (``auto``, or none) the one the output's suffix names (``.onnx``:
    onnxruntime, ``.pt2``: native), else auto for ``optimize`` and native for ``export``."""
    if args.target and args.target != "auto":
        return args.target
    output = getattr(args, "output", None)
    if output:
        return "onnxruntime" if output.lower().endswith(".onnx") else "native"
    return "auto" if args.command == "optimize" else "native"


def check_target(args: argparse.Namespace) -> None:
    """Usage check: the output's suffix fits the target (raises ``argparse.ArgumentTypeError``).

    Example:
        >>> check_target(argparse.Namespace(target="native", output="m.onnx"))
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: -o m.onnx: an .onnx file is for --target onnxruntime (native writes .pt2)
    """
    output = getattr(args, "output", None)
    if output:
        check_output_suffix(output, MODEL_SUFFIXES, "-o")
        if args.target == "native" and output.lower().endswith(".onnx"):
            raise argparse.ArgumentTypeError(f"-o {output}: an .onnx file is for --target onnxruntime (native writes .pt2)")
        if args.target == "onnxruntime" and output.lower().endswith(".pt2"):
            raise argparse.ArgumentTypeError(f"-o {output}: a .pt2 file is for --target native (onnxruntime writes .onnx)")
        if args.target == "inductor":
            raise argparse.ArgumentTypeError(f"-o {output}: Inductor's compiled code is not written to a file; "
                                             "drop -o, or write .pt2 (--target native) or .onnx (--target onnxruntime)")


def _pipeline(args: argparse.Namespace, rewrites: list[str], *, bench: bool) -> int:
    """optimize and export: load, capture, rewrite, write (.pt2 / .onnx), measure, summarize, report."""
    from fxforge.lowering.lower import make_plan

    target = _target_of(args)
    output = args.output
    if output:
        check_output(output, MODEL_SUFFIXES)
    if args.report:
        check_output(args.report, (".html", ".htm"), "--report")
    steps = Steps()
    console = _console()
    notes: list[str] = []
    scratch = None
    with Outputs() as outputs, collected_warnings(notes):
        model, inputs, reference = _model_and_inputs(args, steps)
        captured = _capture(model, inputs, steps, dynamic_batch=args.dynamic_batch)
        new = _rewrite(captured, rewrites, steps, verify=not args.no_verify, for_onnx=target == "onnxruntime")
        errors = {}
        try:
            if target == "onnxruntime":
                from fxforge.exporters.onnx import write_checked
                from fxforge.planner import write_exportable  # (lazily, as every heavy stage here)

                path = output
                if not path:
                    scratch = tempfile.mkdtemp(prefix="fxforge-cli-")
                    path = os.path.join(scratch, "model.onnx")
                with steps.step("export ONNX, check, validate in ONNX Runtime") as step:
                    write = functools.partial(write_checked, path=path, dynamic_batch=args.dynamic_batch)
                    result, runner = write_exportable(write, new, captured, rewrites, not args.no_verify)
                    new = result.captured or new  # a rewrite that broke the export was left out of it
                    notes.extend([result.left_out] if result.left_out else [])
                    if output:
                        outputs.written(output)
                        if os.path.exists(output + ".data"):
                            outputs.written(output + ".data")
                    step.note(", ".join(f"{k} max abs error {v:.3g}" for k, v in result.validation.items()))
                notes.extend(f"onnx: {line}" for line in result.translations)
                errors["ONNX Runtime"] = _max_error(reference, runner, inputs)
            elif target in ("auto", "inductor"):
                runner, description = _raced_or_compiled(model, inputs, target, rewrites, not args.no_verify, steps)
                target = description
                if getattr(runner, "race", None) is not None:
                    new.report.race = runner.race
                errors[description] = _max_error(reference, runner, inputs)
            else:
                runner = make_plan(new).executable
                errors["optimized graph"] = _max_error(reference, runner, inputs)
                if output:
                    from fxforge.exporters.pt2 import save_native

                    with steps.step("export .pt2 (torch.export), load back, check") as step:
                        saved = save_native(new, output, dynamic_batch=args.dynamic_batch)
                        outputs.written(output)
                        ops = ", ".join(f"{op} x{n}" for op, n in saved.ops.items()) or "no fused ops"
                        step.note(ops)
                    errors[".pt2 loaded back"] = saved.validation["example inputs"]
            latency = None
            if bench and args.bench_reps > 0:
                with steps.step(f"time eager vs optimized ({args.bench_reps} interleaved reps)") as step:
                    latency = compare_latency(model, runner, inputs, reps=args.bench_reps)
                    step.note(f"{latency[0]:.3g} ms -> {latency[1]:.3g} ms")
            summary = Summary(
                model=type(model).__name__, inputs=" ".join(format_input(*spec) for spec in args.input),
                report=new.report, target=target, output=output,
                peak_before=simulated_peak(captured.graph_module), peak_after=simulated_peak(new.graph_module),
                latency=latency, reps=args.bench_reps, max_error=max(errors.values()),
                error_of=", ".join(errors), notes=notes)
            if args.report:
                with steps.step("write report") as step:
                    drawn = pictures(captured.graph_module, new.graph_module, type(model).__name__)
                    text = "\n".join(node_lines(new.graph_module, marked_nodes(captured.graph_module, new.graph_module)))
                    outputs.write_text(args.report, render_html(summary, drawn, graph_text=text))
                    step.note(args.report + ("" if drawn else " (no graph pictures: fxforge.core.draw is not available)"))
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
    summary.notes = notes
    summary.print(console)
    print()
    print(new.report)
    return 0


def _raced_or_compiled(model: Any, inputs: tuple, target: str, rewrites: Any, verify: bool,
                       steps: Steps) -> tuple[Any, str]:
    """``--target auto``: the targets raced (the winner and ``auto: <winner>``); ``--target inductor``: the
    rewritten graph compiled by torch.compile."""
    from fxforge.planner import AUTO_TARGETS, optimized

    title = f"race {', '.join(AUTO_TARGETS)}; keep the fastest" if target == "auto" else "compile with torch.compile"
    with steps.step(title) as step:
        runner = optimized(model, inputs, target=target, rewrites=rewrites, verify=verify)
        race = getattr(runner, "race", None)
        if race is None:
            return runner, target
        step.note(f"{race.winner}: {race.why}")
        return runner, f"auto: {race.winner}"


def run_optimize(args: argparse.Namespace) -> int:
    """``fxforge optimize``: capture, rewrite, write ``.pt2`` / ``.onnx``, time, summarize."""
    return _pipeline(args, args.rewrites, bench=not args.no_bench)


def run_export(args: argparse.Namespace) -> int:
    """``fxforge export``: capture and write ``.onnx`` (or ``.pt2``) without rewrites."""
    return _pipeline(args, [], bench=args.bench)


# ---------------------------------------------------------------------------------------------- show

def run_show(args: argparse.Namespace) -> int:
    """``fxforge show``: the captured and rewritten graphs, rewritten nodes marked; text, SVG or HTML."""
    output = args.output
    if output:
        check_output(output, (".svg", ".html", ".htm"))
        if output.lower().endswith(".svg") and not draw_available():
            raise CommandError("drawing an SVG needs fxforge.core.draw, which this installation does not have; "
                               "use -o graph.html or no -o for a text listing")
    steps = Steps()
    console = _console()
    notes: list[str] = []
    with Outputs() as outputs, collected_warnings(notes):
        model, inputs, _ = _model_and_inputs(args, steps)
        captured = _capture(model, inputs, steps)
        new = _rewrite(captured, args.rewrites, steps, verify=not args.no_verify, for_onnx=False)
        marked = marked_nodes(captured.graph_module, new.graph_module)
        name = type(model).__name__
        if output and output.lower().endswith(".svg"):
            from fxforge.core.draw import graph_svg

            with steps.step("draw"):
                svg = graph_svg(new.graph_module, marked=marked,
                                title=f"{name}: rewritten ({len(new.graph_module.graph.nodes)} nodes, {len(marked)} marked)")
                outputs.write_text(output, svg)
        elif output:
            with steps.step("draw"):
                drawn = pictures(captured.graph_module, new.graph_module, name)
                summary = Summary(name, " ".join(format_input(*spec) for spec in args.input), new.report,
                                  peak_before=simulated_peak(captured.graph_module),
                                  peak_after=simulated_peak(new.graph_module), notes=notes)
                outputs.write_text(output, render_html(summary, drawn, graph_text="\n".join(
                    node_lines(new.graph_module, marked))))
    if output:
        console.print(f"wrote {output} ({len(marked)} rewritten nodes marked)", markup=False)
        return 0
    for title, gm, marks in (("captured", captured.graph_module, ()), ("rewritten (* = made by a rewrite)",
                                                                       new.graph_module, marked)):
        console.print(f"[bold]{title}[/bold]: {len(gm.graph.nodes)} nodes")
        for line in node_lines(gm, marks):
            console.print("  " + line, markup=False)
    return 0


# ---------------------------------------------------------------------------------------------- profile

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
        with steps.step(f"profile ({args.repeat} runs)"):
            result = profile(subject, inputs, warmup=args.warmup, repeat=args.repeat)
        table = result.table
        if args.csv:
            outputs.write_with(args.csv, lambda path: table.to_csv(path, index=False))
    shown = table.sort_values("time_ms", ascending=False, kind="stable").head(args.top)
    columns = [c for c in PROFILE_COLUMNS if c in shown.columns]
    _print_frame(console, shown[columns], f"{type(model).__name__}: top {len(shown)} of {len(table)} nodes by time "
                                          f"(total {result.total_ms:.3g} ms)")
    if args.by_op:
        _print_frame(console, result.by_op().reset_index(), "by op")
    if args.csv:
        console.print(f"full table: {args.csv}", markup=False)
    return 0


PROFILE_COLUMNS = ("node", "op", "module", "time_ms", "flops", "bytes", "intensity", "bound", "live_bytes")


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


# ---------------------------------------------------------------------------------------------- rewrites

def run_rewrites(args: argparse.Namespace) -> int:
    """``fxforge rewrites``: the built-in rewrites, one line each, ``(default)`` for those run by default."""
    from fxforge.rewrites.registry import BUILTIN, DEFAULT

    width = max(len(n) for n in BUILTIN)
    for name, rewrite_pass in BUILTIN.items():
        default = " (default)" if name in DEFAULT else ""
        print(f"{name:<{width}}  {rewrite_pass.description}{default}")
    return 0
