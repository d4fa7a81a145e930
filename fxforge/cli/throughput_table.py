"""The configurations ``objective="throughput"`` measured, as a ``rich`` table (``fxforge optimize --objective
throughput`` and ``fxforge bench`` print it).

Example:
    >>> from fxforge.core.throughput import Configuration, ThroughputTable
    >>> t = throughput_table(ThroughputTable([Configuration(2, 1, 4, 90.0, 40.0, 45.0, 50.0, 0.9)], 0), "MLP")
    >>> t.row_count, [c.header for c in t.columns][:4]
    (1, ['', 'streams', 'threads', 'batch'])
"""

from __future__ import annotations

from rich.table import Table

from fxforge.core.throughput import ThroughputTable


def throughput_table(table: ThroughputTable, title: str) -> Table:
    """One row per configuration tried, the chosen one marked ``*``; its notes as the caption."""
    view = Table(title=title, title_justify="left", caption="\n".join(table.lines()) or None, caption_justify="left")
    for column in ("", "streams", "threads", "batch", "samples/s", "p50 ms", "p90 ms", "p99 ms", "utilization"):
        view.add_column(column, justify="right" if column else "left")
    for i, row in enumerate(table.rows):
        view.add_row("*" if i == table.chosen else "", str(row.streams), str(row.threads), str(row.batch),
                     f"{row.samples_per_s:.3g}", f"{row.p50_ms:.3g}", f"{row.p90_ms:.3g}", f"{row.p99_ms:.3g}",
                     f"{row.utilization:.0%}")
    return view
