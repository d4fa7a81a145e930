"""``fxforge lint``: the silent tensor bugs a model's graph shows (:func:`fxforge.lint`), for a terminal or CI.

::

    fxforge lint MODEL --input SHAPE[:DTYPE] ... [--rules a,b] [--mode eval|train] [--method auto|export]
                 [--csv findings.csv]

Prints each finding (its line, what and why, the fix), worst first. Exit 0 when no finding is an error (warnings
and info are printed), 1 when one is (or lint failed: one line saying why), 2 for a usage error.

Example:
    >>> parse_rules("host-sync, dead-code")
    ['host-sync', 'dead-code']
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.text import Text

from fxforge.cli.args import check_output, format_input
from fxforge.cli.commands import _console, _model_and_inputs, collected_warnings
from fxforge.cli.output import Outputs
from fxforge.cli.steps import Steps

_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


def parse_rules(text: str) -> list[str]:
    """``--rules a,b``: registered rule names.

    Raises:
        argparse.ArgumentTypeError: a name that is not a registered rule (a usage error).

    Example:
        >>> parse_rules("nope")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: unknown lint rule 'nope'; see fxforge lint --help for the rules
    """
    from fxforge.lint import RULES

    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in RULES:
            raise argparse.ArgumentTypeError(f"unknown lint rule {name!r}; see fxforge lint --help for the rules")
    return names


def add_lint_command(commands: Any, model_arguments: Any) -> argparse.ArgumentParser:
    """Add ``fxforge lint`` to the subcommands; returns its parser."""
    from fxforge.lint import RULES

    rules = ", ".join(f"{r.name} ({r.severity})" for r in RULES.values())
    lint = commands.add_parser(
        "lint", help="silent tensor bugs the graph shows: broadcasts, dtype drift, copies, host syncs, mode hazards",
        description="Capture the model in eval mode and run the lint rules over its graph (fxforge.lint): each "
                    "finding with the user's source line, the shapes and bytes involved, why, and the fix. Exit 1 "
                    "when a finding is at error level. '# fxforge: ignore[rule]' on a source line silences it. "
                    f"Rules: {rules}.")
    model_arguments(lint)
    lint.add_argument("--rules", type=parse_rules, default=None, metavar="A,B",
                      help="run only these rules (default: all)")
    lint.add_argument("--mode", choices=("eval", "train"), default="eval",
                      help="the mode the model is captured in (default eval; train: as it trains, where "
                           "inplace-on-saved applies and a functional dropout drops as it should)")
    lint.add_argument("--method", choices=("auto", "export"), default="auto",
                      help="the graph read: auto (fxforge's capture where it shows all of forward, else export, "
                           "a symbolic trace or TorchDynamo's graphs) or export (torch.export's ATen graph first)")
    lint.add_argument("--csv", metavar="TABLE.csv", help="save the findings as a table")
    lint.set_defaults(run=run_lint, parser=lint)
    return lint


def run_lint(args: argparse.Namespace) -> int:
    """``fxforge lint``: print the findings; 1 when one is an error."""
    import fxforge

    if args.csv:
        check_output(args.csv, (".csv",), "--csv")
    steps = Steps()
    console = _console()
    notes: list[str] = []
    with Outputs() as outputs, collected_warnings(notes):
        model, inputs, _ = _model_and_inputs(args, steps)
        with steps.step("lint") as step:
            findings = fxforge.lint(model, inputs, rules=args.rules, mode=args.mode, method=args.method)
            step.note(findings.summary())
        if args.csv:
            outputs.write_with(args.csv, lambda path: findings.table.to_csv(path, index=False))
    shapes = " ".join(format_input(*spec) for spec in args.input)
    mode = "" if args.mode == "eval" else ", train mode"
    console.print(f"{type(model).__name__} ({shapes}{mode}): {findings.summary()}", markup=False, highlight=False)
    for finding in findings:
        console.print(Text.assemble(f"{finding.where}: ", (finding.severity, _STYLE[finding.severity]),
                                    f" [{finding.rule}] {finding.message}"), soft_wrap=True, highlight=False)
        if finding.code:
            console.print(f"    {finding.code}", markup=False, highlight=False, soft_wrap=True)
        if finding.involved:
            console.print(f"    involved: {finding.involved}", markup=False, highlight=False, soft_wrap=True)
        console.print(f"    fix: {finding.fix}", markup=False, highlight=False, soft_wrap=True)
    for note in findings.notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if args.csv:
        console.print(f"table: {args.csv}", markup=False)
    return 1 if findings.has_errors else 0
