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

from fxforge.core.breaks import share_line
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


# A ratio is not shown where the median-based and the fastest-call-based ratios differ by more than this factor:
# eager and the optimized module were then timed in different conditions (one of them disturbed).
IMPLAUSIBLE = 2.0


@dataclasses.dataclass
class Latency:
    """Eager's and the optimized module's median milliseconds per call, and whether the ratio is a result.

    Attributes:
        eager_ms, optimized_ms: medians; fastest: the fastest call of each (None where not kept).
        how: how they were measured (``"median of 10, interleaved"``, ``"the race's interleaved rounds"``).
        busy: why the timing is not a result after a re-timing (the machine was busy; samples varied), or "".
        retimed: the first timing was disturbed and this is the second.

    Example:
        >>> Latency(2.0, 1.0, how="median of 5, interleaved").text()
        'eager 2 ms -> 1 ms (2.00x faster; median of 5, interleaved)'
        >>> Latency(2.0, 1.0, how="median of 5", busy="load 3.10 per core").text()
        'eager ~2 ms -> ~1 ms (~2x faster; machine busy: load 3.10 per core; not a result)'
        >>> print(Latency(300.0, 0.2, fastest=(2.0, 0.2), how="median of 5").text())
        eager 300 ms, optimized 0.2 ms (no ratio: timed in different conditions: 1.5e+03x by medians, 10x by the fastest calls (2 ms -> 0.2 ms))
    """

    eager_ms: float
    optimized_ms: float
    fastest: tuple[float, float] | None = None
    how: str = ""
    busy: str = ""
    retimed: bool = False

    @property
    def ratio(self) -> float:
        """Eager's median over the optimized module's (above 1: faster)."""
        return self.eager_ms / self.optimized_ms if self.optimized_ms > 0 else float("inf")

    def implausible(self) -> str:
        """Why the two medians were taken in different conditions (their ratio is not the fastest calls'), or ""."""
        if self.fastest is None or min(self.fastest) <= 0 or self.optimized_ms <= 0:
            return ""
        by_fastest = self.fastest[0] / self.fastest[1]
        if max(self.ratio / by_fastest, by_fastest / self.ratio) <= IMPLAUSIBLE:
            return ""
        return (f"timed in different conditions: {self.ratio:.3g}x by medians, {by_fastest:.3g}x by the fastest "
                f"calls ({self.fastest[0]:.3g} ms -> {self.fastest[1]:.3g} ms)")

    def text(self) -> str:
        """One line for the summary: the medians, and the ratio unless it is not a result."""
        odd = self.implausible()
        busy = f"; machine busy: {self.busy}" if self.busy else ""
        if odd:
            return f"eager {self.eager_ms:.3g} ms, optimized {self.optimized_ms:.3g} ms (no ratio: {odd}{busy})"
        ratio = self.ratio
        word = "faster" if ratio >= 1 else "slower"
        shown = ratio if ratio >= 1 else 1 / ratio
        if self.busy:
            return (f"eager ~{self.eager_ms:.3g} ms -> ~{self.optimized_ms:.3g} ms (~{shown:.2g}x {word}{busy}; "
                    "not a result)")
        again = "; timed twice, the first was disturbed" if self.retimed else ""
        return f"eager {self.eager_ms:.3g} ms -> {self.optimized_ms:.3g} ms ({shown:.2f}x {word}; {self.how}{again})"


def _interleaved(functions: tuple[Callable[..., Any], ...], args: tuple | dict, reps: int,
                 warmup: int) -> dict[int, list[float]]:
    times: dict[int, list[float]] = {0: [], 1: []}
    call = (lambda fn: fn(**args)) if isinstance(args, dict) else (lambda fn: fn(*args))
    with torch.no_grad():
        for _ in range(warmup):
            for fn in functions:
                call(fn)
        for rep in range(max(1, reps)):
            order = (0, 1) if rep % 2 == 0 else (1, 0)
            for index in order:
                start = time.perf_counter()
                call(functions[index])
                times[index].append((time.perf_counter() - start) * 1e3)
    return times


def _disturbance(times: dict[int, list[float]], load: float) -> str:
    """Why a timing is not a result: the machine's load, a side whose samples varied; "" when steady."""
    from fxforge.core.disk_cache import BUSY_LOAD
    from fxforge.runtime.race import NOISY_FLOOR_MS, NOISY_SPREAD, statistics_spread

    parts = [f"load {load:.2f} per core"] if load > BUSY_LOAD else []
    for index, name in ((0, "eager"), (1, "optimized")):
        values = times[index]
        spread = statistics_spread(values)
        if spread > NOISY_SPREAD and statistics.median(values) - min(values) > NOISY_FLOOR_MS:
            parts.append(f"{name}'s calls varied {spread:.2f}x")
    return ", ".join(parts)


def measure_latency(eager: Callable[..., Any], optimized: Callable[..., Any], args: tuple | dict, *,
                    reps: int = 10, warmup: int = 2) -> Latency:
    """:func:`compare_latency` with its honesty: a timing taken while the machine was busy, or whose calls
    varied, is taken again with three times the repetitions; still disturbed, it is marked ``busy``.
    ``args`` is a tuple of positional inputs or a dict of keyword inputs.

    Example:
        >>> latency = measure_latency(torch.relu, torch.relu, (torch.ones(4),), reps=3, warmup=1)
        >>> latency.eager_ms > 0 and latency.optimized_ms > 0 and latency.fastest is not None
        True
    """
    from fxforge.core.disk_cache import machine_load

    times = _interleaved((eager, optimized), args, reps, warmup)
    busy = _disturbance(times, machine_load())
    retimed = bool(busy)
    if busy:
        times = _interleaved((eager, optimized), args, 3 * max(1, reps), 1)
        busy = _disturbance(times, machine_load())
    n = len(times[0])
    return Latency(statistics.median(times[0]), statistics.median(times[1]), (min(times[0]), min(times[1])),
                   how=f"median of {n}, interleaved", busy=busy, retimed=retimed)


def race_latency(race: Any) -> Latency | None:
    """The summary's latency from ``target="auto"``'s race (the same numbers as its table), or None where the
    winner was not timed.

    Example:
        >>> from fxforge.core.report import Contender, Race
        >>> race_latency(Race("native", "x", [Contender("native", 1.0)], eager_ms=2.0)).text()
        "eager 2 ms -> 1 ms (2.00x faster; the race's interleaved rounds)"
    """
    timed = [c for c in race.contenders if c.target != "eager" and c.latency_ms and not c.refused]
    winner = next((c for c in timed if c.target == race.winner), None)
    how = "the race's interleaved rounds"
    if winner is None and race.winner == "eager" and timed:  # auto kept eager: against the fastest target
        winner = min(timed, key=lambda c: c.latency_ms)
        how += f"; optimized = {winner.target}, the fastest target, which auto did not keep"
    if winner is None or not race.eager_ms:
        return None
    return Latency(race.eager_ms, winner.latency_ms, how=how, busy=getattr(race, "busy", ""),
                   retimed=any(n.startswith("timed again") for n in race.notes))


def compare_latency(eager: Callable[..., Any], optimized: Callable[..., Any], args: tuple, *, reps: int = 10,
                    warmup: int = 2) -> tuple[float, float]:
    """Median milliseconds per call of ``eager`` and ``optimized`` on ``args``, measured in the same run
    with interleaved repetitions (the order alternates each repetition), under ``torch.no_grad()``
    (:func:`measure_latency` also says whether they are a result).

    Example:
        >>> e, o = compare_latency(torch.relu, torch.relu, (torch.ones(4),), reps=3, warmup=1)
        >>> e > 0 and o > 0
        True
    """
    times = _interleaved((eager, optimized), args, reps, warmup)
    return statistics.median(times[0]), statistics.median(times[1])


def graphs_row(report: Report) -> str:
    """The summary's row for a model run as graphs between breaks: how many, and the share of its work inside them.

    Example:
        >>> graphs_row(Report(method="dynamo", graphs=[1, 2], breaks=[1], flop_share=0.9, time_share=0.5))
        "2 graphs between 1 break (TorchDynamo); 90.0% of the model's FLOPs and 50.0% of its time inside optimized graphs"
    """
    graphs, breaks = len(report.graphs), len(report.breaks)
    shares = share_line(report.flop_share, report.time_share)
    return (f"{graphs} graph{'s' if graphs != 1 else ''} between {breaks} break{'s' if breaks != 1 else ''} "
            "(TorchDynamo)" + (f"; {shares}" if shares else ""))


@dataclasses.dataclass
class Summary:
    """Everything the final table shows.

    Attributes:
        model: the model's name; inputs: the input specs as given (``2x3x32x32``).
        report: the rewrite report (applied, refused, rolled back).
        target: ``"native"`` or ``"onnxruntime"`` (None: nothing run but the rewritten graph).
        output: the file written, or None.
        peak_before, peak_after: simulated peak activation bytes of the captured and rewritten graphs.
        latency: a :class:`Latency` (or ``(eager ms, optimized ms)`` medians), or None when not measured;
            reps: repetitions (for a pair).
        nodes: ``(before, after)`` nodes that compute, counted in the graphs the report draws (default: the
            report's counts).
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
    latency: Latency | tuple[float, float] | None = None
    reps: int = 0
    nodes: tuple[int, int] | None = None
    max_error: float | None = None
    error_of: str = "the rewritten graph"
    notes: list[str] = dataclasses.field(default_factory=list)

    def busy(self) -> str:
        """Why the timings shown are not results (the machine was busy, calls varied, or a ratio was taken in
        different conditions), or "".

        Example:
            >>> Summary("Net", "2x8", Report(method="fx"), latency=Latency(2.0, 1.0, busy="load 3 per core")).busy()
            'eager vs optimized: load 3 per core'
        """
        reasons = []
        if isinstance(self.latency, Latency) and (self.latency.busy or self.latency.implausible()):
            reasons.append(f"eager vs optimized: {self.latency.busy or self.latency.implausible()}")
        race_busy = getattr(self.report.race, "busy", "") if self.report.race is not None else ""
        if race_busy and not (isinstance(self.latency, Latency) and self.latency.how.startswith("the race")):
            reasons.append(f"the target race: {race_busy}")
        return "; ".join(reasons)

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
                ("nodes", "{} -> {}".format(*(self.nodes or (self.report.nodes_before, self.report.nodes_after))))]
        if self.report.method == "dynamo":  # graphs between breaks
            rows.insert(2, ("graphs", graphs_row(self.report)))
        if self.peak_before is not None or self.peak_after is not None:
            change = ""
            if self.peak_before and self.peak_after is not None:
                change = f" ({(self.peak_after - self.peak_before) / self.peak_before:+.0%})"
            rows.append(("peak memory (simulated)",
                         f"{format_bytes(self.peak_before)} -> {format_bytes(self.peak_after)}{change}"))
        if self.latency is not None:
            latency = self.latency if isinstance(self.latency, Latency) else Latency(
                *self.latency, how=f"median of {self.reps}, interleaved")
            rows.append(("latency", latency.text()))
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
