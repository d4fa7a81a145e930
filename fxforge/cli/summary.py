"""The final summary of ``fxforge optimize`` / ``export``: what changed, and what it bought, measured.

Rows: rewrites applied, refused (near misses and rolled-back passes, with reasons), nodes before/after,
simulated peak activation memory before/after (:func:`fxforge.core.memory.simulate_peak`), latency of
eager and optimized measured in the same run (interleaved repetitions, medians), and the largest
difference from eager of what was produced.

Example:
    >>> from fxforge.core.report import Report
    >>> s = Summary(model="Net", inputs="2x8", report=Report(method="fx", nodes_before=5, nodes_after=4))
    >>> dict(s.rows())["nodes"]
    '5 -> 4'
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from fxforge.core.report import Report


def format_bytes(n: int | None) -> str:
    """Bytes as ``12.0 KiB`` / ``3.4 MiB``.

    Example:
        >>> format_bytes(12288), format_bytes(5 * 2**20)
        ('12.0 KiB', '5.0 MiB')
    """
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def simulated_peak(graph_module: torch.fx.GraphModule) -> int | None:
    """The simulated peak of live activations of a graph, in bytes (None where it cannot be simulated).

    Example:
        >>> gm = fxforge.capture(torch.nn.Linear(4, 8), (torch.ones(2, 4),)).graph_module
        >>> simulated_peak(gm)
        64
    """
    from fxforge.core.memory import simulate_peak

    try:
        return simulate_peak(graph_module).peak_bytes
    except Exception:  # noqa: BLE001 - a graph without shape metadata: no figure rather than a failure
        return None


def compare_latency(eager: Callable[..., Any], optimized: Callable[..., Any], args: tuple, *, reps: int = 10,
                    warmup: int = 2) -> tuple[float, float]:
    """Median milliseconds per call of ``eager`` and ``optimized`` on ``args``, measured in the same run
    with interleaved repetitions (the order alternates each repetition), under ``torch.no_grad()``.

    Example:
        >>> e, o = compare_latency(torch.relu, torch.relu, (torch.ones(4),), reps=3, warmup=1)
        >>> e > 0 and o > 0
        True
    """
    times: dict[int, list[float]] = {0: [], 1: []}
    functions = (eager, optimized)
    with torch.no_grad():
        for _ in range(warmup):
            for fn in functions:
                fn(*args)
        for rep in range(max(1, reps)):
            order = (0, 1) if rep % 2 == 0 else (1, 0)
            for index in order:
                start = time.perf_counter()
                functions[index](*args)
                times[index].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


@dataclasses.dataclass
class Summary:
    """Everything the final table shows.

    Attributes:
        model: the model's name; inputs: the input specs as given (``2x3x32x32``).
        report: the rewrite report (applied, refused, rolled back).
        target: ``"native"`` or ``"onnxruntime"`` (None: nothing run but the rewritten graph).
        output: the file written, or None.
        peak_before, peak_after: simulated peak activation bytes of the captured and rewritten graphs.
        latency: ``(eager ms, optimized ms)`` medians, or None when not measured; reps: repetitions.
        max_error: largest absolute difference from eager of ``error_of`` on the example inputs.
        notes: anything else to say (warnings seen on the way, the export's checks).

    Example:
        >>> s = Summary("Net", "2x8", Report(method="fx"), latency=(2.0, 1.0), reps=5)
        >>> dict(s.rows())["latency"]
        'eager 2 ms -> 1 ms (2.00x faster; median of 5, interleaved)'
    """

    model: str
    inputs: str
    report: Report
    target: str | None = None
    output: str | None = None
    peak_before: int | None = None
    peak_after: int | None = None
    latency: tuple[float, float] | None = None
    reps: int = 0
    max_error: float | None = None
    error_of: str = "the rewritten graph"
    notes: list[str] = dataclasses.field(default_factory=list)

    def refused(self) -> list[tuple[str, str, str]]:
        """``(rule, where, reason)`` for every near miss and rolled-back pass."""
        rows = [(r.rule, f"{r.matches} matches", f"rolled back: {r.error}") for r in self.report.rolled_back]
        rows += [(n.rule, n.node + (f" ({n.source})" if n.source else ""), n.reason) for n in self.report.near_misses]
        return rows

    def rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` pairs, in display order."""
        counts = self.report.counts
        applied = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"
        refused = self.refused()
        if self.report.method == "eager":  # not captured: nothing was rewritten
            return [("model", f"{self.model} ({self.inputs}), not captured"),
                    *([("target", self.target)] if self.target else [])]
        rows = [("model", f"{self.model} ({self.inputs}), captured with {self.report.method or '?'}"),
                *([("target", self.target)] if self.target else []),
                ("rewrites applied", applied),
                ("refused", f"{len(refused)} (below)" if refused else "none"),
                ("nodes", f"{self.report.nodes_before} -> {self.report.nodes_after}")]
        if self.peak_before is not None or self.peak_after is not None:
            change = ""
            if self.peak_before and self.peak_after is not None:
                change = f" ({(self.peak_after - self.peak_before) / self.peak_before:+.0%})"
            rows.append(("peak memory (simulated)",
                         f"{format_bytes(self.peak_before)} -> {format_bytes(self.peak_after)}{change}"))
        if self.latency is not None:
            eager, optimized = self.latency
            ratio = eager / optimized if optimized > 0 else float("inf")
            word = "faster" if ratio >= 1 else "slower"
            shown = ratio if ratio >= 1 else 1 / ratio
            timing = f"eager {eager:.3g} ms -> {optimized:.3g} ms ({shown:.2f}x {word}; median of {self.reps}, interleaved)"
            rows.append(("latency", timing))
        if self.max_error is not None:
            rows.append(("max abs error vs eager", f"{self.max_error:.3g} ({self.error_of})"))
        if self.output:
            rows.append(("output", self.output))
        return rows

    def print(self, console: Console | None = None) -> None:
        """Print the summary table (and the refusals, and notes) with rich."""
        console = console or Console()
        table = Table(title="fxforge summary", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for label, value in self.rows():
            table.add_row(label, value)
        console.print(table)
        refused = self.refused()
        if refused:
            table = Table(title="refused", title_justify="left")
            for column in ("rewrite", "where", "reason"):
                table.add_column(column)
            for row in refused:
                table.add_row(*row)
            console.print(table)
        for note in self.notes:
            console.print(f"note: {note}", markup=False, highlight=False)
