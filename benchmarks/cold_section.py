"""What the sections that run each model in a cold process share: their options (``--models``, ``--rounds``,
``--reps`` and the markdown options), running the children and publishing the block, building and timing the
contenders of one model, and the latency ratio their blocks print.

Example::

    SECTION = cold_section("fusions", "conv blocks ...", "benchmarks.fusions", MODELS, BLOCK, OUT, markdown)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.cold import rows_in_processes
from benchmarks.section import Section, csv_list


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as a block prints it (``1.25x``), or nothing where either is missing.

    Example:
        >>> ratio(10.0, 8.0), ratio(None, 8.0)
        ('1.25x', '')
    """
    return f"{a / b:.2f}x" if a and b else ""


def cold_section(name: str, description: str, module: str, models: tuple[str, ...], block: str, out: Path,
                 markdown: Callable[[list[dict], str], str]) -> Section:
    """The :class:`Section` that measures each of ``models`` in a new process running ``python -m module MODEL
    ROUNDS REPS`` (its row as JSON, :mod:`benchmarks.cold`), then prints and writes ``markdown(rows, command)``
    as the ``block`` of RESULTS.md and the rows to ``out``."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--models", type=csv_list, default=list(models), help="comma-separated: " + ",".join(models))
        parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
        parser.add_argument("--reps", type=int, default=10, help="calls per contender per round")
        report.add_markdown_options(parser, block)

    def run(args: argparse.Namespace) -> int:
        rows = rows_in_processes(module, args.models, args.rounds, args.reps)
        report.publish(args, block, out, rows, markdown(rows, args.command))
        return 0 if all("error" not in row for row in rows) else 1

    return Section(name, description, add_arguments, run)


def time_contenders(builders: dict[str, Callable[[], Any]], example: tuple, check: tuple,
                    error_of: Callable[[Any], float], rounds: int, reps: int) -> tuple[dict, dict]:
    """Build each contender (a failure is its entry), call it on ``example`` and on ``check`` (its error:
    ``error_of(output on check)``), then time all of them in interleaved rounds on ``example``: ``(callables,
    entries)``, an entry holding ``prepare_s``, ``error`` and ``ms`` (the median), or ``failed``."""
    from benchmarks.rounds import time_interleaved

    fns, entries = {}, {}
    for contender, build in builders.items():
        start = time.perf_counter()
        try:
            fn = build()
            # Its own copies: a contender that writes into its inputs (PT2E's int8 adds a residual into the
            # input it was given) spoils them for itself alone.
            out = fn(*_copies(example))
            if check is not example:
                out = fn(*_copies(check))
            error = error_of(out)
        except Exception as failure:  # noqa: BLE001 - a contender that fails is a row that says so
            entries[contender] = {"failed": f"{type(failure).__name__}: {failure}"[:300]}
            continue
        fns[contender] = fn
        entries[contender] = {"prepare_s": time.perf_counter() - start, "error": error}
    times, failures = time_interleaved(fns, example, warmup=2, rounds=rounds, reps=reps, copies=_copies)
    for contender in fns:
        if contender in failures:
            entries[contender]["failed"] = repr(failures[contender])[:300]
        else:
            entries[contender]["ms"] = statistics.median(t for r in times[contender] for t in r)
    return fns, entries


def _copies(inputs: tuple) -> tuple:
    import torch

    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)


def settled(model: Any, make_inputs: Callable[[], tuple], passes: int = 3) -> Any:
    """``model`` after a few train-mode passes on fresh inputs (BatchNorm statistics as training leaves them),
    in eval mode."""
    import torch

    model.train()
    with torch.no_grad():
        for _ in range(passes):
            model(*make_inputs())
    return model.eval()


def contender_lines(row: dict, label: str, contenders: tuple[str, ...], columns: Callable[[dict], str],
                    width: int) -> list[str]:
    """A block's table lines for one model's row: one per contender, ``| label | contender | columns(entry) |``,
    a failed contender (or model) saying why in its first cell and leaving the other ``width`` cells empty."""
    empty = " |" * width
    if "error" in row:
        return [f"| {row['model']} | failed: {report.md_cell(row['error'])} |{empty}"]
    lines = []
    for contender in contenders:
        entry = row["contenders"].get(contender, {"failed": "not run"})
        if "failed" in entry:
            lines.append(f"| {label} | {contender} | failed: {report.md_cell(entry['failed'])} |{empty[2:]}")
        else:
            lines.append(f"| {label} | {contender} | {columns(entry)} |")
    return lines
