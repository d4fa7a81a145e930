"""What ``objective="throughput"`` measured: one row per serving configuration tried, the one chosen marked.

A serving configuration is ``streams`` worker threads, each running ``threads`` intra-op threads, each call
taking ``batch`` requests concatenated along dim 0. The runtime (:mod:`fxforge.runtime.throughput`) measures
every configuration on a stream of independent requests and keeps the highest samples/s; this is the table
the report shows (text, HTML, and a pandas ``DataFrame``).

Example:
    >>> table = ThroughputTable([Configuration(1, 2, 1, 100.0, 10.0, 11.0, 12.0, 0.9),
    ...                          Configuration(2, 1, 1, 150.0, 13.0, 14.0, 15.0, 0.95)], chosen=1)
    >>> table.best.streams, list(table.frame()["chosen"])
    (2, [False, True])
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any

COLUMNS = ("streams", "threads", "batch", "samples_per_s", "p50_ms", "p90_ms", "p99_ms", "utilization", "chosen")


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One serving configuration and what it measured.

    Attributes:
        streams: worker threads serving requests at once.
        threads: intra-op threads of each stream (``torch.set_num_threads`` inside it).
        batch: requests concatenated into one call (1: no batching).
        samples_per_s: requests served per second (the median of the rounds).
        p50_ms, p90_ms, p99_ms: percentiles of a request's latency (the call that served it), milliseconds.
        utilization: process CPU time / (wall time x cores used), 0..1 (spinning OpenMP threads count as used).

    Example:
        >>> Configuration(2, 1, 4, 300.0, 20.0, 22.0, 25.0, 0.97).label
        '2 x 1 threads, batch 4'
    """

    streams: int
    threads: int
    batch: int
    samples_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    utilization: float

    @property
    def label(self) -> str:
        """``"2 x 1 threads, batch 4"``."""
        return f"{self.streams} x {self.threads} threads, batch {self.batch}"


@dataclasses.dataclass
class ThroughputTable:
    """Every configuration tried (``rows``), the index of the chosen one, why batching was or was not allowed,
    and notes (the machine busy, the search cut short by its budget).

    Attributes:
        rows: the configurations, in the order tried.
        chosen: index into ``rows`` of the one served.
        batching: ``""`` where batching was proven on the example, else why it is refused.
        notes: more lines for the report.

    Example:
        >>> t = ThroughputTable([Configuration(1, 2, 1, 100.0, 10.0, 11.0, 12.0, 0.9)], 0, batching="mixes samples")
        >>> print(t)  # doctest: +NORMALIZE_WHITESPACE
        throughput: 1 x 2 threads, batch 1 chosen: 100 samples/s (1.00x the latency configuration)
          streams threads batch samples/s p50 ms p90 ms p99 ms util
        * 1 2 1 100 10 11 12 0.90
          batching refused: mixes samples
    """

    rows: list[Configuration]
    chosen: int
    batching: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def best(self) -> Configuration:
        """The chosen configuration."""
        return self.rows[self.chosen]

    @property
    def latency_row(self) -> Configuration | None:
        """The latency configuration (one stream, every core, batch 1), where it was tried."""
        candidates = [r for r in self.rows if r.streams == 1 and r.batch == 1]
        return max(candidates, key=lambda r: r.threads) if candidates else None

    @property
    def speedup(self) -> float | None:
        """Samples/s of the chosen configuration over the latency configuration's.

        Example:
            >>> ThroughputTable([Configuration(1, 2, 1, 100.0, 1, 1, 1, 1), Configuration(2, 1, 1, 130.0, 1, 1, 1, 1)],
            ...                 1).speedup
            1.3
        """
        base = self.latency_row
        return None if base is None or base.samples_per_s <= 0 else self.best.samples_per_s / base.samples_per_s

    def frame(self) -> Any:
        """The table as a pandas ``DataFrame`` (columns :data:`COLUMNS`).

        Example:
            >>> ThroughputTable([Configuration(1, 1, 1, 5.0, 1, 1, 1, 1)], 0).frame().columns[-1]
            'chosen'
        """
        import pandas as pd

        return pd.DataFrame([{**dataclasses.asdict(r), "chosen": i == self.chosen} for i, r in enumerate(self.rows)],
                            columns=list(COLUMNS))

    def lines(self) -> list[str]:
        """The notes of the table: batching's refusal, then the others.

        Example:
            >>> ThroughputTable([], 0, batching="mixes samples", notes=["busy"]).lines()
            ['batching refused: mixes samples', 'busy']
        """
        return ([f"batching refused: {self.batching}"] if self.batching else []) + list(self.notes)

    def __str__(self) -> str:
        gain = f" ({self.speedup:.2f}x the latency configuration)" if self.speedup is not None else ""
        out = [f"throughput: {self.best.label} chosen: {self.best.samples_per_s:.3g} samples/s{gain}",
               "  streams threads batch samples/s p50 ms p90 ms p99 ms util"]
        for i, r in enumerate(self.rows):
            mark = "*" if i == self.chosen else " "
            out.append(f"{mark} {r.streams} {r.threads} {r.batch} {r.samples_per_s:.3g} {r.p50_ms:.3g} "
                       f"{r.p90_ms:.3g} {r.p99_ms:.3g} {r.utilization:.2f}")
        out.extend(f"  {line}" for line in self.lines())
        return "\n".join(out)

    def html(self) -> str:
        """The table for :meth:`fxforge.core.report.Report._repr_html_`.

        Example:
            >>> ThroughputTable([Configuration(2, 1, 1, 5.0, 1, 1, 1, 1)], 0).html()[:40]
            '<h4>Throughput: 2 x 1 threads, batch 1 c'
        """
        head = "".join(f"<th>{c}</th>" for c in ("", "streams", "threads", "batch", "samples/s", "p50 ms", "p90 ms",
                                                  "p99 ms", "utilization"))
        body = "".join(
            f"<tr><td>{'&#10003;' if i == self.chosen else ''}</td><td>{r.streams}</td><td>{r.threads}</td>"
            f"<td>{r.batch}</td><td>{r.samples_per_s:.3g}</td><td>{r.p50_ms:.3g}</td><td>{r.p90_ms:.3g}</td>"
            f"<td>{r.p99_ms:.3g}</td><td>{r.utilization:.2f}</td></tr>" for i, r in enumerate(self.rows))
        notes = "".join(f"<li>{html.escape(line)}</li>" for line in self.lines())
        return (f"<h4>Throughput: {html.escape(self.best.label)} chosen</h4><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>" + (f"<ul>{notes}</ul>" if notes else ""))
