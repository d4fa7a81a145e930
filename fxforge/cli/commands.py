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
import os
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
from fxforge.targets import TARGETS, Target, by_artifact, lookup

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


def _capture(model: torch.nn.Module, inputs: tuple, steps: Steps) -> Any:
    import fxforge

    with steps.step("capture") as step:
        try:
            captured = fxforge.capture(model, inputs)
        except fxforge.CaptureError as error:
            raise CommandError(str(error)) from error
        step.note(f"{captured.method}, {captured.report.nodes_before} nodes")
    return captured


def _rewrite(captured: Any, rewrites: list[str], steps: Steps, *, verify: bool) -> Any:
    import fxforge

    with steps.step("rewrite (verify, autotune)" if verify else "rewrite") as step:
        new = fxforge.rewrite(captured, rewrites, verify=verify)
        step.note(_counts(new.report))
    return new


def _counts(report: Any) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(report.counts.items())) or "nothing applied"


def _max_error(reference: Any, runner: Any, inputs: tuple) -> float:
    from fxforge.core.verify import compare_outputs

    with torch.no_grad():
        actual = runner(*inputs)
    return compare_outputs(reference, actual).max_abs_err


def _target_of(args: argparse.Namespace) -> Target:
    """The target: as given, else (``auto``, or none) the one that writes the output's suffix, else auto for
    ``optimize`` and native for ``export``."""
    if args.target and args.target != "auto":
        return lookup(args.target)
    output = getattr(args, "output", None)
    if output:
        return by_artifact(os.path.splitext(output)[1])
    return lookup("auto" if args.command == "optimize" else "native")


def check_target(args: argparse.Namespace) -> None:
    """Usage check: the output's suffix is one a target writes, and the target writes it (raises
    ``argparse.ArgumentTypeError``).

    Example:
        >>> check_target(argparse.Namespace(target="native", output="m.onnx"))
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: -o m.onnx: an .onnx file is for --target onnxruntime (native writes .pt2)
    """
    output = getattr(args, "output", None)
    if not output:
        return
    check_output_suffix(output, artifact_suffixes(), "-o")
    if not args.target or args.target == "auto":
        return
    chosen = lookup(args.target)
    suffix = os.path.splitext(output)[1].lower()
    if chosen.contract.artifact is None:
        writers = [f"{t.contract.artifact} (--target {t.name})" for t in TARGETS.values() if t.contract.artifact]
        raise argparse.ArgumentTypeError(f"-o {output}: target {chosen.name} writes no file; drop -o, or write "
                                         + " or ".join(writers))
    if chosen.contract.artifact != suffix:
        raise argparse.ArgumentTypeError(f"-o {output}: a{'n' if suffix[1] in 'aeiou' else ''} {suffix} file is for "
                                         f"--target {by_artifact(suffix).name} ({chosen.name} writes "
                                         f"{chosen.contract.artifact})")


def artifact_suffixes() -> tuple[str, ...]:
    """The suffixes the targets write, in the order of ``TARGETS``.

    Example:
        >>> artifact_suffixes()
        ('.pt2', '.onnx')
    """
    return tuple(t.contract.artifact for t in TARGETS.values() if t.contract.artifact)


def _pipeline(args: argparse.Namespace, rewrites: Any, *, bench: bool) -> int:
    """optimize and export: load, build the target (the API's own entry point), write its file, measure,
    summarize, report."""
    target = _target_of(args)
    output = args.output
    if output:
        check_output(output, artifact_suffixes())
    if args.report:
        check_output(args.report, (".html", ".htm"), "--report")
    steps = Steps()
    console = _console()
    notes: list[str] = []
    with Outputs() as outputs, collected_warnings(notes):
        model, inputs, reference = _model_and_inputs(args, steps)
        runner, description = _built(model, inputs, target, rewrites, args, steps)
        new = target.graph(runner)
        before = new.before or new
        errors = {description: _max_error(reference, runner, inputs)}
        if output:
            with steps.step(f"write {target.contract.artifact}, load back, check") as step:
                written = target.write(runner, output, dynamic_batch=args.dynamic_batch)
                outputs.written(output)
                if os.path.exists(output + ".data"):
                    outputs.written(output + ".data")
                step.note(", ".join(f"{k} max abs error {v:.3g}" for k, v in written.validation.items()))
            errors[f"{output} loaded back"] = max(written.validation.values())
            notes.extend(f"{target.name}: {line}" for line in getattr(written, "translations", []))
        latency = None
        if bench and args.bench_reps > 0:
            with steps.step(f"time eager vs optimized ({args.bench_reps} interleaved reps)") as step:
                latency = compare_latency(model, runner, inputs, reps=args.bench_reps)
                step.note(f"{latency[0]:.3g} ms -> {latency[1]:.3g} ms")
        summary = Summary(
            model=type(model).__name__, inputs=" ".join(format_input(*spec) for spec in args.input),
            report=runner.report, target=description, output=output,
            peak_before=simulated_peak(before.graph_module), peak_after=simulated_peak(new.graph_module),
            latency=latency, reps=args.bench_reps, max_error=max(errors.values()),
            error_of=", ".join(errors), notes=notes)
        if args.report:
            with steps.step("write report") as step:
                drawn = pictures(before.graph_module, new.graph_module, type(model).__name__)
                text = "\n".join(node_lines(new.graph_module, marked_nodes(before.graph_module, new.graph_module)))
                outputs.write_text(args.report, render_html(summary, drawn, graph_text=text))
                step.note(args.report + ("" if drawn else " (no graph pictures: fxforge.core.draw is not available)"))
    summary.notes = notes
    summary.print(console)
    print()
    print(runner.report)
    return 0


def _built(model: Any, inputs: tuple, target: Target, rewrites: Any, args: argparse.Namespace,
           steps: Steps) -> tuple[Any, str]:
    """``fxforge.optimize(model, inputs, target=...)`` as a step: the module and what it runs (``auto:
    <winner>`` for a race). The CLI plans for the given shapes (``dynamic=False``); ``--dynamic-batch`` asks a
    target that takes it for a dynamic batch dim."""
    import fxforge

    options: dict[str, Any] = {"rewrites": rewrites, "verify": not args.no_verify, "dynamic": False}
    if args.dynamic_batch and "dynamic_batch" in target.options:
        options["dynamic_batch"] = True
    raced = getattr(target, "raced", None)
    title = (f"race {', '.join(t.name for t in raced())}; keep the fastest" if raced is not None
             else f"optimize for {target.name}: {target.summary}")
    with steps.step(title) as step:
        try:
            runner = fxforge.optimize(model, inputs, target=target.name, **options)
        except fxforge.CaptureError as error:
            raise CommandError(str(error)) from error
        race = getattr(runner, "race", None)
        if race is not None:
            step.note(f"{race.winner}: {race.why}")
            return runner, f"auto: {race.winner}"
        report = runner.report
        if report is None or report.method == "eager":
            raise CommandError(f"{type(model).__name__} could not be captured: "
                               + "; ".join(getattr(report, "notes", []) or ["no plan"]))
        step.note(f"{report.method} capture, {_counts(report)}")
    return runner, target.name


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
        new = _rewrite(captured, args.rewrites, steps, verify=not args.no_verify)
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
