"""``lint``: capture a model in eval mode, run the rules over its graph, drop what ``# fxforge: ignore[rule]``
silences.

Example:
    >>> findings = lint(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.ones(2, 4),))
    >>> len(findings.above("info"))
    0
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch

from fxforge.capture import CaptureError, capture
from fxforge.capture.model import breaks_of, describe_failure, normalize_inputs
from fxforge.core.shapes import annotate
from fxforge.lint.finding import Finding, Findings, rank
from fxforge.lint.graph import LintGraph, source_line
from fxforge.lint.rule import Rule, resolve_rules

IGNORE = re.compile(r"#\s*fxforge:\s*ignore(?:\[(?P<rules>[^\]]*)\])?")
"""``# fxforge: ignore`` (every rule) or ``# fxforge: ignore[rule-a, rule-b]`` on the finding's source line."""


def lint(model: torch.nn.Module, example_inputs: Any = None, *, example_kwargs: dict | None = None,
         rules: Iterable[Rule | str] | None = None, mode: str = "eval", method: str = "auto") -> Findings:
    """The silent tensor bugs and costs a model's graph shows: broadcasts that grow a tensor, dtype drift, copies
    the layout forces, work redone every call, unused parameters, host syncs, mode hazards (see
    :mod:`fxforge.lint.rules`).

    The model is captured once on the example inputs, in eval mode (``mode="train"``: as it is in training; the
    modes are put back after): :func:`fxforge.capture`'s own graph where it shows all of forward, else torch.export's
    (a symbolic trace where export fails). Each rule reads the graph's nodes, their shapes and dtypes, and the
    user's source line each came from. A model no single graph can hold is linted
    graph by graph between the places TorchDynamo breaks it (each break a host sync: a branch on a tensor's value,
    ``.item()``), with a note.

    Args:
        model: the ``nn.Module``.
        example_inputs: a tuple of positional inputs, one tensor, or a dict of keyword inputs.
        example_kwargs: keyword inputs in addition to positional ``example_inputs``.
        rules: rule names and :class:`~fxforge.lint.rule.Rule` objects to run; default every registered rule
            (the built-in ones and those :func:`~fxforge.lint.rule.register` added).
        mode: ``"eval"`` (default) or ``"train"``: the mode the model is captured in.
        method: ``"auto"`` (default: :func:`fxforge.capture`'s own graph where it shows all of forward, a symbolic
            trace on small models, far cheaper than export) or ``"export"`` (torch.export's ATen graph first).

    Returns:
        :class:`~fxforge.lint.finding.Findings`, worst first; ``.table`` is a DataFrame.

    Raises:
        CaptureError: neither export, a trace nor TorchDynamo could read the model.

    Example:
        >>> class Head(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(8, 1)
        ...     def forward(self, x, target):
        ...         return ((self.fc(x) - target) ** 2).mean()
        >>> findings = fxforge.lint(Head(), (torch.randn(4, 8), torch.randn(4)))
        >>> findings[0].rule, findings[0].severity, findings.has_errors
        ('broadcast-blowup', 'error', True)
    """
    if mode not in ("eval", "train"):
        raise ValueError(f"mode must be 'eval' or 'train', not {mode!r}")
    if method not in ("auto", "export"):
        raise ValueError(f"method must be 'auto' or 'export', not {method!r}")
    chosen = resolve_rules(rules)
    notes: list[str] = []
    found: list[Finding] = []
    ignored = 0
    with _mode(model, mode == "train"):  # captured in this mode, and the rules read graph.model.training
        args, kwargs = normalize_inputs(example_inputs)
        graph = _graph(model, args, {**kwargs, **(example_kwargs or {})}, notes, method)
        if graph.graph_module is None and not graph.graphs:
            skipped = [r.name for r in chosen if r.needs_graph]
            if skipped:
                notes.append(f"no graph, so only the breaks were linted (not run: {', '.join(skipped)})")
            chosen = [r for r in chosen if not r.needs_graph]
        for rule in chosen:
            for finding in merged(rule.run(graph)):
                if silenced(finding):
                    ignored += 1
                    continue
                found.append(finding)
    if ignored:
        notes.append(f"{ignored} finding{'s' * (ignored != 1)} silenced by # fxforge: ignore")
    return Findings(found, notes, type(model).__name__, graph.method)


def merged(findings: list[Finding]) -> list[Finding]:
    """One finding per rule and source line: a line that runs several times in the graph (a layer of a loop, each
    block of a stack) is reported once, the worst of its findings, with how many times and the bytes of all.

    Example:
        >>> f = Finding("layout-copy", "info", "m.py", 3, "x", "copies 2 KiB", "fix", bytes=2048)
        >>> [(g.message, g.bytes) for g in merged([f, f])]
        [('copies 2 KiB (x2: the line runs 2 times)', 4096)]
    """
    groups: dict[tuple, list[Finding]] = {}
    for finding in findings:
        key = (finding.rule, finding.file, finding.line) if finding.file else (finding.rule, id(finding))
        groups.setdefault(key, []).append(finding)
    result = []
    for group in groups.values():
        first = min(group, key=lambda f: rank(f.severity))
        if len(group) > 1:
            sizes = [f.bytes for f in group if f.bytes is not None]
            first = dataclasses.replace(first, message=f"{first.message} (x{len(group)}: the line runs {len(group)} times)",
                                        bytes=sum(sizes) if sizes else None)
        result.append(first)
    return result


def silenced(finding: Finding) -> bool:
    """Whether the finding's source line carries ``# fxforge: ignore`` for its rule (or for every rule).

    Example:
        >>> silenced(Finding("dead-code", "warning", "", 0, "", "m", "f"))
        False
    """
    match = IGNORE.search(source_line(finding.file, finding.line))
    if match is None:
        return False
    names = match["rules"]
    return names is None or finding.rule in {n.strip() for n in names.split(",")}


class _mode:
    """The model's modules in one mode for the block, each put back after."""

    def __init__(self, model: torch.nn.Module, training: bool):
        self.model, self.training = model, training

    def __enter__(self) -> None:
        self.modes = {m: m.training for m in self.model.modules()}
        self.model.train(self.training)

    def __exit__(self, *exc: object) -> None:
        for module, training in self.modes.items():
            module.training = training


def faithful(graph_module: torch.fx.GraphModule) -> bool:
    """Whether a symbolic trace shows everything forward computes: no tensor it made while tracing from constants
    alone (``torch.ones(512, 512)``, ``torch.from_numpy(table)``: kept as a constant, the work that made it and
    its line gone from the graph), so the rules read it as they read an export.

    Example:
        >>> class Masked(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x.masked_fill(torch.ones(2, 2).bool(), 0.0)
        >>> faithful(torch.fx.symbolic_trace(Masked())), faithful(torch.fx.symbolic_trace(torch.nn.ReLU()))
        (False, True)
    """
    return not any(node.op == "get_attr" and str(node.target).startswith("_tensor_constant")
                   for node in graph_module.graph.nodes)


def _with_opaque(captured: Any, model: torch.nn.Module, args: tuple, kwargs: dict, notes: list[str]) -> LintGraph:
    """The lint view of a capture; where a trace kept submodules opaque, with where TorchDynamo breaks them (their
    branches on tensor values are host syncs) and a note that their insides are not linted."""
    breaks = []
    if captured.opaque:
        breaks = breaks_of(model, args, kwargs)
        notes.append("not linted inside " + ", ".join(map(str, captured.opaque)))
    return LintGraph.of(captured, model, breaks)


def _graph(model: torch.nn.Module, args: tuple, kwargs: dict, notes: list[str], method: str = "auto") -> LintGraph:
    """The lint view of the model: fxforge's capture where it shows all of forward (a symbolic trace that hides
    nothing, or export), else export's graph, else a symbolic trace's (with its breaks where it kept submodules
    opaque), else TorchDynamo's graphs and the breaks between them."""
    reasons: dict[str, CaptureError] = {}
    if method == "auto":
        try:  # fxforge's own choice, its shapes recorded in the checking run: on small models far cheaper than export
            captured = capture(model, args, example_kwargs=kwargs)
        except CaptureError as error:
            reasons["export"] = error  # auto tried export too
        else:
            if captured.method == "export" or (not captured.opaque and faithful(captured.graph_module)):
                return LintGraph.of(captured, model)
            if captured.opaque:  # auto tried export and it failed: the trace with its opaque leaves is what there is
                notes.append("captured by symbolic trace (" + "; ".join(captured.report.notes) + ")")
                return _with_opaque(captured, model, args, kwargs, notes)
    for kind in ("export", "fx"):
        if kind in reasons:
            continue
        try:
            captured = capture(model, args, method=kind, example_kwargs=kwargs, check=False)
        except CaptureError as error:
            reasons[kind] = error
            continue
        except Exception as error:  # unchecked: a trace's shape propagation is the first to run the model
            why = {m: e.message_without_breaks for m, e in reasons.items()}
            raise CaptureError(type(model).__name__, {**why, kind: describe_failure(error)}, breaks=[]) from error
        if kind != "export":
            notes.append(f"captured by symbolic trace (torch.export failed: {reasons['export'].message_without_breaks})")
        return _with_opaque(captured, model, args, kwargs, notes)
    error = reasons["fx"]
    try:
        cut = capture(model, args, method="dynamo", example_kwargs=kwargs)
    except Exception:  # noqa: BLE001 - dynamo fails too: the capture's own error says why
        raise error from None
    if not cut.graphs and not cut.breaks:
        raise error
    graphs = []
    for _, host, host_inputs in cut.graphs:
        try:
            annotate(host, tuple(host_inputs), {})
        except Exception:  # noqa: BLE001 - a graph whose shapes cannot be propagated is left out, with a note
            notes.append(f"a graph between breaks left out: its shapes could not be propagated ({len(host.graph.nodes)} "
                         "nodes)")
            continue
        graphs.append(host)
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    where = (f"between TorchDynamo's {len(cut.breaks)} break{'s' * (len(cut.breaks) != 1)}" if cut.breaks else
             "as TorchDynamo traced it (numpy as torch)")
    notes.append(f"export and a trace cannot hold {type(model).__name__}: linted as {len(graphs)} graph"
                 f"{'s' * (len(graphs) != 1)} {where} ({error.message_without_breaks})")
    return LintGraph(None, model, "dynamo", tuple(tensors), list(cut.breaks), graphs=graphs)
