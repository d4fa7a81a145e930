"""The commands: ``optimize``, ``export``, ``show``, ``rewrites`` (``profile``: :mod:`fxforge.cli.profile`).

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
import dataclasses
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from rich.console import Console

from fxforge.cli.args import (
    CommandError,
    call_factory,
    call_model,
    check_eager,
    check_output,
    check_output_suffix,
    format_input,
    load_callable,
    load_model,
    load_weights,
)
from fxforge.cli.breaks import (
    breaks_of_error,
    file_refused,
    graph_by_graph,
    graphs_summary,
    show_graphs,
    target_refused,
)
from fxforge.cli.dynamic import DIMS_STAGES, dynamic_options
from fxforge.cli.failures import capture_failure
from fxforge.cli.graphs import draw_available, marked_nodes, node_lines, pictures
from fxforge.cli.html import render_html
from fxforge.cli.inputs import build_inputs, described, factory_inputs, reshaped, signature_of
from fxforge.cli.output import Outputs
from fxforge.cli.steps import Steps
from fxforge.cli.summary import Summary, measure_latency, race_latency, simulated_peak
from fxforge.cli.throughput_table import throughput_table
from fxforge.core.nodes import count_calls
from fxforge.core.source import first_line
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
                      train: bool = False) -> tuple[torch.nn.Module, tuple | dict, Any]:
    """Load the model (and weights), put it in eval mode (train mode with ``train``), make the example
    inputs (a tuple, or a dict of keyword inputs), run the model once on them. ``args.input`` becomes the
    specs of the inputs made (a factory's included), which the summaries show."""
    with steps.step("load model") as step:
        model = load_model(args.model, args.model_args)
        if getattr(args, "weights", None):
            load_weights(model, args.weights)
        model.train(train)
        inputs = model_inputs(model, args.input or [], getattr(args, "inputs", None))
        if getattr(args, "inputs", None):  # the factory's inputs, as reshaped
            args.input = described(inputs, signature_of(model))
        reference = check_eager(model, inputs, args.input)
        parameters = sum(p.numel() for p in model.parameters())
        step.note(f"{type(model).__name__}, {parameters:,} parameters" + (", train mode" if train else ""))
    return model, inputs, reference


def model_inputs(model: torch.nn.Module, specs: list, factory: str | None) -> tuple | dict:
    """The example inputs: from ``--input`` specs, or from the ``--inputs`` factory reshaped by them."""
    signature = signature_of(model)
    if factory is None:
        return build_inputs(specs, signature, model_name=type(model).__name__)
    make, name = load_callable(factory, "--inputs")
    inputs = factory_inputs(call_factory(make, name), factory, signature)
    return reshaped(inputs, specs, signature, factory)


def _capture(model: torch.nn.Module, inputs: tuple, steps: Steps) -> Any:
    import fxforge

    with steps.step("capture") as step:
        try:
            captured = fxforge.capture(model, inputs)
        except fxforge.CaptureError as error:
            raise CommandError(capture_failure(type(model).__name__, error)) from error
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


def _max_error(reference: Any, runner: Any, inputs: tuple | dict) -> float:
    from fxforge.core.verify import compare_outputs

    with torch.no_grad():
        actual = call_model(runner, inputs)
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
        runner, description = _built(model, inputs, target, rewrites, args, steps, notes)
        split = graph_by_graph(runner)
        if split is not None:  # graphs between breaks: no file, the graphs' summary
            if output:
                raise CommandError(file_refused(type(model).__name__, output, split.report.breaks))
            summary = graphs_summary(model, runner, split, description, inputs, reference, args, notes, outputs,
                                     steps, bench=bench)
        else:
            summary = _whole_graph(model, inputs, reference, runner, description, target, args, steps, notes,
                                   outputs, console, bench=bench)
            if summary is None:  # it runs eagerly, and said so
                return 0
    summary.notes = notes
    summary.print(console)
    table = getattr(summary.report, "throughput", None)
    if table is not None:
        console.print(throughput_table(table, f"objective=throughput: {table.best.label} chosen"))
    print()
    print(summary.report)
    return 0


def _whole_graph(model: Any, inputs: tuple | dict, reference: Any, runner: Any, description: str, target: Target,
                 args: argparse.Namespace, steps: Steps, notes: list[str], outputs: Outputs, console: Console, *,
                 bench: bool) -> Summary | None:
    """The rest of ``_pipeline`` for a model built as one graph: write the file, time, summarize (None where the
    model runs eagerly: that is printed, with why)."""
    output = args.output
    if description == "eager":
        _eager_fallback(model, runner, args, console, "; ".join(runner.report.notes) or "no plan", outputs)
        return None
    new = target.graph(runner)
    if new is None:  # auto chose eager, and no target was built
        race = runner.race
        why = "; ".join([race.why, *(f"{c.target}: {c.refused}" for c in race.contenders if c.refused)])
        if output:
            raise CommandError(f"nothing to write: {capture_failure(type(model).__name__, why)}")
        _eager_fallback(model, runner, args, console, why, outputs)
        return None
    before = new.before or new
    errors = {description: _max_error(reference, runner, inputs)}
    if output:
        with steps.step(f"write {target.contract.artifact}, load back, check") as step:
            written = _write(target, runner, output, args.dynamic, inputs, notes)
            outputs.written(output)
            if os.path.exists(output + ".data"):
                outputs.written(output + ".data")
            step.note(", ".join(f"{k} max abs error {v:.3g}" for k, v in written.validation.items()))
        errors[f"{output} loaded back"] = max(written.validation.values())
        notes.extend(f"{target.name}: {line}" for line in getattr(written, "translations", []))
    latency = race_latency(runner.race) if getattr(runner, "race", None) is not None else None
    if latency is None and bench and args.bench_reps > 0:
        with steps.step(f"time eager vs optimized ({args.bench_reps} interleaved reps)") as step:
            latency = measure_latency(model, runner, inputs, reps=args.bench_reps)
            step.note(latency.text())
    summary = Summary(
        model=type(model).__name__, inputs=" ".join(format_input(*spec) for spec in args.input),
        report=runner.report, target=description, output=output,
        peak_before=simulated_peak(before.graph_module), peak_after=simulated_peak(new.graph_module),
        latency=latency, reps=args.bench_reps, max_error=max(errors.values()),
        error_of=", ".join(errors), notes=notes,
        nodes=(count_calls(before.graph_module.graph), count_calls(new.graph_module.graph)))
    if args.report:
        with steps.step("write report") as step:
            drawn = pictures(before.graph_module, new.graph_module, type(model).__name__)
            text = "\n".join(node_lines(new.graph_module, marked_nodes(before.graph_module, new.graph_module)))
            outputs.write_text(args.report, render_html(summary, drawn, graph_text=text))
            step.note(args.report + ("" if drawn else " (no graph pictures: fxforge.core.draw is not available)"))
    return summary


def _built(model: Any, inputs: tuple | dict, target: Target, rewrites: Any, args: argparse.Namespace,
           steps: Steps, notes: list[str]) -> tuple[Any, str]:
    """``fxforge.optimize(model, inputs, target=...)`` as a step: the module and what it runs (``auto:
    <winner>`` for a race). The CLI plans for the given shapes (``dynamic=False``), and exports an ``.onnx``
    with the dims ``--dynamic`` asks for; where the default (``auto``) dims cannot stay dynamic in this model,
    the file is static and a note says why."""
    import fxforge

    options: dict[str, Any] = {"rewrites": rewrites, "verify": not args.no_verify, "dynamic": False}
    if getattr(args, "precision", "float32") != "float32":
        options.update(precision=args.precision, tolerance=args.tolerance)
    if getattr(args, "objective", "latency") == "throughput":
        options["objective"] = "throughput"
    if args.output and target.contract.artifact == ".onnx":
        options.update(dynamic_options(args.dynamic, ".onnx", inputs))
    raced = getattr(target, "raced", None)
    title = (f"race {', '.join(t.name for t in raced())}; keep the fastest" if raced is not None
             else f"optimize for {target.name}: {target.summary}")
    with steps.step(title) as step:
        try:
            runner = fxforge.optimize(model, inputs, target=target.name, **options)
        except fxforge.ExportError as error:
            if args.dynamic != "auto" or not options["dynamic"] or error.stage not in DIMS_STAGES:
                raise
            notes.append(f"the file is static: its batch and length could not stay dynamic ({first_line(error)}); "
                         "--dynamic none asks for a static file, --dynamic 0 for the batch alone")
            runner = fxforge.optimize(model, inputs, target=target.name, **{**options, "dynamic": False})
        except fxforge.CaptureError as error:
            name = type(model).__name__
            if error.breaks and args.output:  # a file holds one graph
                raise CommandError(file_refused(name, args.output, error.breaks)) from error
            if error.breaks:  # graphs between breaks, which this target does not run
                raise CommandError(target_refused(name, target.name, error.breaks)) from error
            raise CommandError(capture_failure(name, error)) from error
        race = getattr(runner, "race", None)
        if race is not None:
            busy = getattr(race, "busy", "")
            step.note(f"{race.winner}: {race.why}" + (f" (machine busy: {busy}; not a result)" if busy else ""))
            return runner, f"auto: {race.winner}"
        report = runner.report
        if report is None or report.method == "eager":
            reason = capture_failure(type(model).__name__, "; ".join(getattr(report, "notes", []) or ["no plan"]))
            if args.output:
                raise CommandError(reason)
            step.note(f"runs eagerly: {reason}")
            return runner, "eager"
        step.note(f"{report.method} capture, {_counts(report)}")
    return runner, target.name


def _eager_fallback(model: Any, runner: Any, args: argparse.Namespace, console: Console, why: str,
                    outputs: Outputs) -> int:
    """``optimize`` without ``-o`` of a model that cannot be one graph: what the optimized module does (runs
    the model eagerly), why, and where (also in ``--report``); exit 0 (the module works, as eager)."""
    from fxforge.core.report import Report

    reason = capture_failure(type(model).__name__, why)
    report = runner.report if getattr(runner, "report", None) is not None else Report(method="eager")
    report = report if report.method == "eager" else dataclasses.replace(report, method="eager")
    summary = Summary(model=type(model).__name__, inputs=" ".join(format_input(*spec) for spec in args.input),
                      report=report, target="eager (fxforge.optimize returns a module that runs the model "
                                                   "as it is, with a FallbackWarning)",
                      notes=[reason, "nothing was rewritten or timed: the optimized module is the model itself"])
    if args.report:
        outputs.write_text(args.report, render_html(summary, {}))
    summary.print(console)
    return 0


def _write(target: Target, runner: Any, output: str, dynamic: str | tuple, inputs: tuple | dict,
           notes: list[str]) -> Any:
    """``target.write``; a ``.pt2`` with the batch dynamic (``--dynamic`` auto or batch), static with a note
    where the default cannot keep it dynamic in this model."""
    import fxforge

    dynamic_batch = dynamic_options(dynamic, target.contract.artifact, inputs).get("dynamic_batch", False)
    try:
        return target.write(runner, output, dynamic_batch=dynamic_batch)
    except fxforge.ExportError as error:
        if dynamic != "auto" or not dynamic_batch or error.stage not in DIMS_STAGES:
            raise
        notes.append(f"the file is static: its batch could not stay dynamic ({first_line(error)}); --dynamic none "
                     "asks for a static file")
        return target.write(runner, output, dynamic_batch=False)


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
        try:
            captured = _capture(model, inputs, steps)
        except CommandError as error:
            breaks = breaks_of_error(error)
            if not breaks:
                raise
            return show_graphs(model, inputs, args, steps, console, outputs, breaks)  # every graph between them
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


# ---------------------------------------------------------------------------------------------- rewrites

def run_rewrites(args: argparse.Namespace) -> int:
    """``fxforge rewrites``: the built-in rewrites, one line each, ``(default)`` for those run by default."""
    from fxforge.rewrites.registry import BUILTIN, DEFAULT

    width = max(len(n) for n in BUILTIN)
    for name, rewrite_pass in BUILTIN.items():
        default = " (default)" if name in DEFAULT else ""
        print(f"{name:<{width}}  {rewrite_pass.description}{default}")
    return 0
