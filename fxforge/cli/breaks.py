"""The command line on a model TorchDynamo cuts into graphs (a branch on a tensor's value, ``.item()``, ``print``).

Graph by graph: ``optimize`` without ``-o`` (each graph optimized, as ``fxforge.optimize`` runs it, with the report's
graphs, breaks and shares), ``show`` (every graph before and after the rewrites, and the breaks between them),
``profile`` (every graph's nodes, :mod:`fxforge.runtime.profile.graphs`) and ``memory`` (one real step, measured).
One whole graph: a ``-o`` file and ``export`` (a ``.pt2`` or ``.onnx`` holds one graph), ``memory``'s prediction and
``--budget`` (one graph of the training step) and ``partition``'s stages; each refuses in one line naming every
break and its fix (:data:`WHOLE_GRAPH`).

Example:
    >>> from fxforge.core.breaks import Break
    >>> print(file_refused("Net", "net.pt2", [Break("m.py:4", "calls print()", "remove the print")]))
    -o net.pt2: a .pt2 file holds one graph, and Net runs as graphs between breaks: m.py:4: calls print(); fix: remove the print; fxforge optimize without -o runs it graph by graph
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

import torch
from rich.console import Console

import fxforge
from fxforge.capture import CaptureError
from fxforge.cli.args import call_model, format_input
from fxforge.cli.graphs import marked_nodes, node_lines, pictures
from fxforge.cli.html import render_html
from fxforge.cli.output import Outputs
from fxforge.cli.steps import Steps
from fxforge.cli.summary import Summary, measure_latency, race_latency
from fxforge.core.breaks import Break, distinct
from fxforge.core.nodes import count_calls
from fxforge.core.report import Report
from fxforge.core.verify import compare_outputs, isolated
from fxforge.runtime.dynamo import one_graph_needed
from fxforge.runtime.native import OptimizedModule
from fxforge.targets.auto import EagerModule

WHOLE_GRAPH = ("A model TorchDynamo breaks into graphs (a branch on a tensor's value, .item(), print) works graph by "
               "graph in optimize without -o, show, profile and memory; -o files, export, memory --budget and "
               "partition's stages need one whole graph, and refuse such a model in one line naming each break and "
               "its fix.")
"""The sentence ``fxforge --help`` (and the README) says about models with graph breaks."""


def breaks_of_error(error: BaseException | None) -> list[Break]:
    """The breaks named by a :class:`fxforge.CaptureError` in ``error``'s chain of causes ([] where none is).

    Example:
        >>> breaks_of_error(ValueError("no"))
        []
        >>> cut = Break("m.py:4", "calls print()", "remove the print")
        >>> try:
        ...     try:
        ...         raise CaptureError("Net", {"fx": "print"}, [cut])
        ...     except CaptureError as inner:
        ...         raise RuntimeError("partition failed") from inner
        ... except RuntimeError as outer:
        ...     breaks_of_error(outer) == [cut]
        True
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, CaptureError) and error.breaks:
            return list(error.breaks)
        error = error.__cause__ or error.__context__
    return []


def graph_by_graph(built: Any) -> OptimizedModule | None:
    """The optimized module that runs the model graph by graph through TorchDynamo: ``built`` itself, or where
    ``target="auto"`` kept eager, the fastest target's module; None for a model that runs as one graph (or eagerly).

    Example:
        >>> graph_by_graph(fxforge.optimize(torch.nn.Linear(2, 2), (torch.ones(1, 2),))) is None
        True
    """
    if isinstance(built, EagerModule):
        built = built.built_fastest()
    return built if isinstance(built, OptimizedModule) and built.dynamo is not None else None


def file_refused(model_name: str, output: str, breaks: list[Break]) -> str:
    """The one line refusing ``-o output`` for a model that runs as graphs between ``breaks``."""
    suffix = os.path.splitext(output)[1].lower() or "file"
    article = "an" if suffix[1:2] in tuple("aeiou") else "a"
    return (f"-o {output}: " + one_graph_needed(model_name, f"{article} {suffix} file", breaks)
            + "; fxforge optimize without -o runs it graph by graph")


def target_refused(model_name: str, target: str, breaks: list[Break]) -> str:
    """The one line refusing ``--target`` for a model with breaks where that target runs one graph only.

    Example:
        >>> target_refused("Net", "onnxruntime", [Break("m.py:4", "calls print()", "remove the print")])
        ... # doctest: +ELLIPSIS
        '--target onnxruntime: an onnxruntime session holds one graph, and Net runs ...; --target native ...'
    """
    return (f"--target {target}: " + one_graph_needed(model_name, f"an {target} session", breaks)
            + "; --target native (or inductor, or auto) runs it graph by graph")


def graphs_of(model: torch.nn.Module, inputs: tuple | dict, known: list[Break] = ()) -> Any:
    """``fxforge.capture(model, inputs, method="dynamo")``, the model's buffers and RNG left as they were, with the
    ``known`` breaks added to its own (dynamo names a break it met in code it runs in Python, a break inside a loop,
    once per process: the capture error that found it first holds it)."""
    with isolated(model, inputs=inputs):
        found = fxforge.capture(model, inputs, method="dynamo")
    found.breaks = distinct([*found.breaks, *known])
    return found


def _plural(n: int, thing: str) -> str:
    return f"{n} {thing}{'s' if n != 1 else ''}"


def graphs_line(model_name: str, graphs: int, breaks: int) -> str:
    """What runs where, in one line.

    Example:
        >>> graphs_line("Net", 2, 1)
        'Net runs as 2 graphs between 1 break (TorchDynamo); the Python between them runs as the model wrote it'
    """
    return (f"{model_name} runs as {_plural(graphs, 'graph')} between {_plural(breaks, 'break')} (TorchDynamo); the "
            "Python between them runs as the model wrote it")


def graph_listing(found: Any) -> list[str]:
    """One line per graph of a dynamo capture (its lines, nodes, runs per call), each break where it falls."""
    lines: list[str] = []
    placed: set[tuple[str, str]] = set()
    total = len(found.graphs)
    for number, (graph, host, _) in enumerate(found.graphs, 1):
        runs = found.calls.get(graph.index, 1)
        lines.append(f"graph {number} of {total}" + (f" ({graph.lines})" if graph.lines else "")
                     + f": {count_calls(host.graph)} nodes" + (f", runs {runs} times per call" if runs > 1 else ""))
        if graph.ends is not None:
            lines.append(f"break at {graph.ends}")
            placed.add((graph.ends.line, graph.ends.reason))
    lines.extend(f"break at {item}" for item in found.breaks if (item.line, item.reason) not in placed)
    return lines


def print_graphs(console: Console, model: torch.nn.Module, inputs: tuple | dict, known: list[Break] = ()) -> None:
    """Print the model's graphs between its breaks (:func:`graph_listing`); nothing where TorchDynamo fails on it."""
    try:
        found = graphs_of(model, inputs, known)
    except Exception:  # noqa: BLE001 - the refusal that follows names the breaks either way
        return
    console.print(graphs_line(type(model).__name__, len(found.graphs), len(found.breaks)), markup=False,
                  soft_wrap=True)
    for line in graph_listing(found):
        console.print("  " + line, markup=False, highlight=False, soft_wrap=True)


def stages_refused(model_name: str, breaks: list[Break]) -> str:
    """The one line refusing pipeline stages for a model that runs as graphs between ``breaks``.

    Example:
        >>> stages_refused("Net", [Break("m.py:4", "calls print()", "remove the print")])  # doctest: +ELLIPSIS
        'pipeline stages need one graph (torch.distributed.pipelining splits ...), and Net runs as graphs between ...'
    """
    return ("pipeline stages need one graph (torch.distributed.pipelining splits the one graph torch.export captures "
            "of the model, and fxforge balances the stages on its traced training step), and "
            + one_graph_needed(model_name, "", breaks).split(", and ", 1)[1])


# ---------------------------------------------------------------------------------------------- optimize

def graphs_summary(model: torch.nn.Module, built: Any, split: OptimizedModule, description: str,
                   inputs: tuple | dict, reference: Any, args: argparse.Namespace, notes: list[str], outputs: Outputs,
                   steps: Steps, *, bench: bool) -> Summary:
    """``optimize`` without ``-o`` of a model that runs graph by graph: its summary (the report's graphs, breaks and
    shares; the max error and the latency of the graph-by-graph module against eager), and ``--report``."""
    name = type(model).__name__
    report = built.report if getattr(built.report, "method", "") == "dynamo" else split.report
    target = description
    if built is not split:
        fastest = getattr(built, "fastest_target", "") or "the fastest target"
        target += f" (no target beat eager; the graphs below are {fastest}'s, which auto did not keep)"
    with torch.no_grad():
        error = compare_outputs(reference, call_model(split, inputs)).max_abs_err
    race = report.race
    latency = race_latency(race) if race is not None else None
    if latency is None and bench and args.bench_reps > 0:
        with steps.step(f"time eager vs optimized ({args.bench_reps} interleaved reps)") as step:
            latency = measure_latency(model, split, inputs, reps=args.bench_reps)
            step.note(latency.text())
    notes.append("a .pt2 or .onnx file (-o) holds one graph: remove the breaks below to write one")
    summary = Summary(model=name, inputs=" ".join(format_input(*spec) for spec in args.input), report=report,
                      target=target, latency=latency, reps=args.bench_reps, max_error=error,
                      error_of="the graphs between breaks, with the Python between them", notes=notes,
                      nodes=(report.nodes_before, report.nodes_after))
    if args.report:
        with steps.step("write report") as step:
            pairs = [(module.captured.before or module.captured, module.captured)
                     for _, module in split.dynamo.ordered()]
            drawn = graph_pictures(pairs, name)
            text = "\n".join(_listing_text(pairs))
            outputs.write_text(args.report, render_html(summary, drawn, graph_text=text))
            step.note(args.report)
    return summary


def graph_pictures(pairs: list[tuple[Any, Any]], name: str) -> dict[str, str]:
    """Pictures of each graph before and after its rewrites (``pairs`` of Captured), captioned ``graph N: ...``."""
    drawn: dict[str, str] = {}
    for number, (before, after) in enumerate(pairs, 1):
        for caption, svg in pictures(before.graph_module, after.graph_module, f"{name} graph {number}").items():
            drawn[f"graph {number}: {caption}"] = svg
    return drawn


def _listing_text(pairs: list[tuple[Any, Any]]) -> list[str]:
    lines = []
    for number, (before, after) in enumerate(pairs, 1):
        lines.append(f"graph {number}:")
        lines.extend("  " + line for line in node_lines(after.graph_module,
                                                        marked_nodes(before.graph_module, after.graph_module)))
    return lines


# ---------------------------------------------------------------------------------------------- show

def rewritten_graphs(found: Any, rewrites: Any, *, verify: bool) -> list[tuple[Any, Any]]:
    """``(captured, rewritten)`` of each graph of a dynamo capture, in order (the rewrites verified on the inputs
    the graph took)."""
    pairs = []
    for _, host, host_inputs in found.graphs:
        captured = fxforge.capture(host, host_inputs)
        pairs.append((captured, fxforge.rewrite(captured, rewrites, verify=verify)))
    return pairs


def merged_report(found: Any, pairs: list[tuple[Any, Any]]) -> Report:
    """One report for every graph of ``show``: their rewrites together, the breaks, each graph's part."""
    report = Report(method="dynamo", breaks=list(found.breaks))
    for (graph, _, _), (_, new) in zip(found.graphs, pairs):
        report.add_graph(new.report, graph.lines, graph.ends, found.calls.get(graph.index, 1))
    return report


def show_graphs(model: torch.nn.Module, inputs: tuple | dict, args: argparse.Namespace, steps: Steps,
                console: Console, outputs: Outputs, known: list[Break] = ()) -> int:
    """``fxforge show`` of a model with breaks (``known``: those the capture error named): every graph before and
    after the rewrites, and each break where it falls (text, ``-o graph.html``, or ``-o graph.svg``: the rewritten
    graphs one under another)."""
    name = type(model).__name__
    with steps.step("capture through TorchDynamo, graph by graph") as step:
        found = graphs_of(model, inputs, known)
        step.note(f"{_plural(len(found.graphs), 'graph')}, {_plural(len(found.breaks), 'break')}")
    with steps.step("rewrite each graph (verify, autotune)" if not args.no_verify else "rewrite each graph") as step:
        pairs = rewritten_graphs(found, args.rewrites, verify=not args.no_verify)
        report = merged_report(found, pairs)
        step.note(", ".join(f"{k} x{v}" for k, v in sorted(report.counts.items())) or "nothing applied")
    headline = graphs_line(name, len(found.graphs), len(found.breaks))
    output = args.output
    if output and output.lower().endswith(".svg"):
        from fxforge.core.draw import graph_svg

        with steps.step("draw"):
            svgs = [graph_svg(new.graph_module, marked=marked_nodes(cap.graph_module, new.graph_module),
                              title=f"{name} graph {number}: rewritten") for number, (cap, new) in enumerate(pairs, 1)]
            outputs.write_text(output, stacked_svg(svgs, _between(found)))
    elif output:
        with steps.step("draw"):
            summary = Summary(name, " ".join(format_input(*spec) for spec in args.input), report, notes=[headline])
            outputs.write_text(output, render_html(summary, graph_pictures(pairs, name),
                                                   graph_text="\n".join(_listing_text(pairs))))
    if output:
        marked = sum(len(marked_nodes(cap.graph_module, new.graph_module)) for cap, new in pairs)
        console.print(f"wrote {output} ({_plural(len(pairs), 'graph')}, {marked} rewritten nodes marked)", markup=False)
        return 0
    console.print(headline, markup=False, soft_wrap=True)
    between = _between(found)
    for number, (cap, new) in enumerate(pairs, 1):
        graph = found.graphs[number - 1][0]
        console.print(f"[bold]graph {number} of {len(pairs)}[/bold]" + (f" ({graph.lines})" if graph.lines else ""))
        for title, gm, marks in (("captured", cap.graph_module, ()), ("rewritten (* = made by a rewrite)",
                                                                      new.graph_module,
                                                                      marked_nodes(cap.graph_module, new.graph_module))):
            console.print(f"  {title}: {len(gm.graph.nodes)} nodes", markup=False)
            for line in node_lines(gm, marks):
                console.print("    " + line, markup=False)
        for item in between[number - 1]:
            console.print(f"[bold]break[/bold] at {_escape(str(item))}", soft_wrap=True)
    for item in between[len(pairs)]:
        console.print(f"[bold]break[/bold] (in code dynamo ran in Python) at {_escape(str(item))}", soft_wrap=True)
    return 0


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _between(found: Any) -> list[list[Break]]:
    """The breaks after each graph (a graph's own end), then those dynamo met elsewhere (last list)."""
    after: list[list[Break]] = [[graph.ends] if graph.ends is not None else [] for graph, _, _ in found.graphs]
    placed = {(b.line, b.reason) for items in after for b in items}
    after.append([b for b in found.breaks if (b.line, b.reason) not in placed])
    return after


def stacked_svg(svgs: list[str], between: list[list[Break]]) -> str:
    """One SVG holding ``svgs`` one under another, each break's line written under the graph it ends.

    Example:
        >>> page = stacked_svg(['<svg xmlns="http://www.w3.org/2000/svg" width="20" height="10"></svg>'] * 2,
        ...                    [[Break("m.py:4", "calls print()", "remove the print")], [], []])
        >>> page.count("<svg"), "m.py:4" in page
        (3, True)
    """
    import html

    parts, y, width = [], 0, 0
    for number, svg in enumerate(svgs):
        w, h = (_size(svg, "width"), _size(svg, "height"))
        inner = re.sub(r"^<svg\b", f'<svg x="0" y="{y}"', svg.strip(), count=1)
        parts.append(inner)
        y, width = y + h, max(width, w)
        for item in between[number] + (between[-1] if number == len(svgs) - 1 else []):
            y += 18
            parts.append(f'<text x="8" y="{y}" style="font-family:monospace;font-size:12px;fill:#b00">'
                         f"break at {html.escape(str(item))}</text>")
            width = max(width, 8 + 7 * len(str(item)))
        y += 12
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" viewBox="0 0 {width} {y}">\n'
            + "\n".join(parts) + "\n</svg>")


def _size(svg: str, attribute: str) -> int:
    found = re.search(rf'^<svg\b[^>]*\b{attribute}="([\d.]+)', svg.strip())
    return int(float(found.group(1))) if found else 0

