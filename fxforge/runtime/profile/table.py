"""``Profile``: a graph's time, FLOPs, bytes and memory, node by node, and the ways to read it.

Example:
    >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(2, 8),), warmup=0, repeat=1)
    >>> list(p.by_op().index), p.total_flops
    (['linear'], 256)
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any

import torch

from fxforge.core.costs import Machine
from fxforge.core.memory import MemoryTimeline

COLUMNS = ["node", "op", "target", "module", "source", "time_ms", "flops", "bytes", "intensity", "bound",
           "live_bytes", "measured_live_bytes"]


@dataclasses.dataclass(eq=False)
class Profile:
    """A graph's time, FLOPs, bytes and memory, node by node (see :func:`fxforge.profile`).

    Attributes:
        table: a pandas DataFrame, one row per computing node in run order: ``node``, ``op``, ``target``,
            ``module``, ``source``, ``time_ms``, ``flops``, ``bytes``, ``intensity``, ``bound``,
            ``live_bytes`` (simulated, after the node) and ``measured_live_bytes``.
        machine: the device's measured :class:`~fxforge.core.costs.Machine` (peak, bandwidth, ridge).
        graph_module: the graph profiled.
        timeline: the simulated :class:`~fxforge.core.memory.MemoryTimeline` (every node, inputs included).
        graph_ms: the median time of the whole graph called directly (no interpreter).
        what: what was profiled (``"captured graph"``, ``"rewritten graph"``, ``"lowered graph ..."``).
        name: the model's class name.
        warmup, repeat: the runs behind the timings.

    Example:
        >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(2, 8),), warmup=0, repeat=1)
        >>> p.by_op().index.tolist(), round(float(p.by_op()["share"].sum()), 6)
        (['linear'], 1.0)
    """

    table: Any
    machine: Machine
    graph_module: torch.fx.GraphModule
    timeline: MemoryTimeline
    graph_ms: float
    what: str
    name: str
    warmup: int
    repeat: int
    device: str = "cpu"

    @property
    def total_ms(self) -> float:
        """The sum of the nodes' median times, in ms."""
        return float(self.table["time_ms"].sum())

    @property
    def total_flops(self) -> int:
        """The sum of the nodes' FLOPs."""
        return int(self.table["flops"].sum())

    def _group(self, column: str) -> Any:
        import pandas as pd

        table = self.table
        grouped = table.groupby(column, sort=False).agg(
            count=("node", "size"), time_ms=("time_ms", "sum"), flops=("flops", "sum"), bytes=("bytes", "sum"))
        total = float(table["time_ms"].sum())
        grouped["share"] = grouped["time_ms"] / total if total > 0 else 0.0
        grouped = grouped.sort_values("time_ms", ascending=False, kind="stable")
        grouped.index = pd.Index(grouped.index, name=column)
        return grouped

    def by_op(self) -> Any:
        """Time, FLOPs and bytes per op type: a DataFrame indexed by ``op`` with ``count``, ``time_ms``,
        ``flops``, ``bytes`` and ``share`` (of the total time), slowest first.

        Example:
            >>> p = fxforge.profile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
            ...                     (torch.ones(1, 4),), warmup=0, repeat=1)
            >>> sorted(p.by_op().index), int(p.by_op()["count"].sum())
            (['linear', 'relu'], 2)
        """
        return self._group("op")

    def by_module(self, depth: int | None = None) -> Any:
        """The same per module path; with ``depth``, paths cut to their first ``depth`` parts (``layers.0``).

        Example:
            >>> p = fxforge.profile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
            ...                     (torch.ones(1, 4),), warmup=0, repeat=1)
            >>> sorted(p.by_module().index)
            ['0', '1']
        """
        if depth is None:
            return self._group("module")
        cut = self.table.copy()
        cut["module"] = cut["module"].map(lambda m: ".".join(str(m).split(".")[:depth]) if m else m)
        return dataclasses.replace(self, table=cut)._group("module")

    def compare(self, other: Profile) -> Any:
        """Time per op type here (before) and in ``other`` (after): where an optimization won or lost time.

        Returns:
            A DataFrame indexed by op type, with ``count_before``, ``count_after``, ``time_ms_before``,
            ``time_ms_after`` and ``delta_ms`` (after − before), largest times first, and a last row
            ``"total"``. Ops that disappeared have ``count_after == 0``, new ones ``count_before == 0``.
            ``.attrs`` holds ``total_ms_before``, ``total_ms_after``, ``speedup`` (before / after) and
            ``summary`` (one sentence).

        Example:
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
            >>> a = fxforge.profile(model, (torch.ones(1, 4),), warmup=0, repeat=1)
            >>> c = a.compare(a)
            >>> c.index[-1], float(c.loc["total", "delta_ms"]), c.attrs["speedup"]
            ('total', 0.0, 1.0)
        """
        import pandas as pd

        before, after = self.by_op(), other.by_op()
        table = pd.DataFrame({
            "count_before": before["count"], "count_after": after["count"],
            "time_ms_before": before["time_ms"], "time_ms_after": after["time_ms"],
        })
        table = table.fillna(0)
        table[["count_before", "count_after"]] = table[["count_before", "count_after"]].astype(int)
        table["delta_ms"] = table["time_ms_after"] - table["time_ms_before"]
        order = table[["time_ms_before", "time_ms_after"]].max(axis=1).sort_values(ascending=False, kind="stable")
        table = table.loc[order.index]
        total_before, total_after = self.total_ms, other.total_ms
        total = pd.DataFrame({"count_before": [int(table["count_before"].sum())],
                              "count_after": [int(table["count_after"].sum())],
                              "time_ms_before": [total_before], "time_ms_after": [total_after],
                              "delta_ms": [total_after - total_before]}, index=["total"])
        table = pd.concat([table, total])
        table.index.name = "op"
        speedup = total_before / total_after if total_after > 0 else float("inf")
        table.attrs.update({
            "total_ms_before": total_before, "total_ms_after": total_after, "speedup": speedup,
            "summary": (f"{self.name} ({self.what}) {total_before:.3f} ms -> {other.name} ({other.what}) "
                        f"{total_after:.3f} ms: {speedup:.2f}x"),
        })
        return table

    # -------------------------------------------------------------------------------------------- plots

    def plot_top(self, n: int = 15, ax: Any = None) -> Any:
        """Horizontal bars of the ``n`` slowest nodes (matplotlib Axes); see :mod:`fxforge.runtime.profile.plots`."""
        from fxforge.runtime.profile import plots

        return plots.plot_top(self, n=n, ax=ax)

    def plot_roofline(self, ax: Any = None) -> Any:
        """The machine's roofline with one point per node, log-log (matplotlib Axes)."""
        from fxforge.runtime.profile import plots

        return plots.plot_roofline(self, ax=ax)

    def plot_memory(self, ax: Any = None, measured: bool = True) -> Any:
        """Simulated live bytes after each node, and the measured ones when ``measured`` (matplotlib Axes)."""
        from fxforge.runtime.profile import plots

        return plots.plot_memory(self, ax=ax, measured=measured)

    def node_colors(self) -> dict[str, str]:
        """A fill colour per profiled node, pale yellow (fast) to dark red (the slowest node).

        Example:
            >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(2, 8),), warmup=0, repeat=1)
            >>> p.node_colors()
            {'linear': '#b10026'}
        """
        times = dict(zip(self.table["node"], self.table["time_ms"]))
        slowest = max(times.values(), default=0.0)
        return {name: time_color(t / slowest if slowest > 0 else 0.0) for name, t in times.items()}

    def graph_svg(self, *, engine: str = "auto") -> str:
        """The graph as SVG with nodes coloured by time and labelled with their op and time.

        Example:
            >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(2, 8),), warmup=0, repeat=1)
            >>> p.graph_svg(engine="builtin").startswith("<svg")
            True
        """
        from fxforge.core.draw import graph_svg

        labels = {row.node: f"{row.node}\n{row.op}\n{row.time_ms:.3f} ms" for row in self.table.itertuples()}
        title = f"{self.name}: {self.what}, {self.total_ms:.3f} ms on {self.device}"
        return graph_svg(self.graph_module, node_colors=self.node_colors(), node_labels=labels, title=title,
                         engine=engine)

    # -------------------------------------------------------------------------------------------- text

    def summary(self) -> str:
        """A few lines: what was profiled, the totals, the machine, the slowest op types.

        Example:
            >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(2, 8),), warmup=0, repeat=1)
            >>> p.summary().splitlines()[0].startswith("Linear: captured graph, 1 nodes")
            True
        """
        m = self.machine
        lines = [
            (f"{self.name}: {self.what}, {len(self.table)} nodes, {self.total_ms:.3f} ms summed over nodes "
             f"({self.graph_ms:.3f} ms called directly), {self.total_flops / 1e9:.3f} GFLOP, "
             f"peak {self.timeline.peak_bytes / 2**20:.2f} MiB simulated"),
            (f"machine {m.device}: {m.peak_gflops:.1f} GFLOP/s, {m.bandwidth_gbs:.1f} GB/s, "
             f"ridge {m.ridge:.1f} FLOP/byte"),
        ]
        bounds = self.table["bound"].value_counts().to_dict()
        lines.append(f"compute bound: {bounds.get('compute', 0)} nodes, memory bound: {bounds.get('memory', 0)}")
        for op, row in self.by_op().head(5).iterrows():
            lines.append(f"  {op:<28} {int(row['count']):>4}x {row['time_ms']:>9.3f} ms {row['share']:>7.1%}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<Profile {self.name}: {len(self.table)} nodes, {self.total_ms:.3f} ms on {self.device}>"

    def _repr_html_(self) -> str:
        """A compact summary for Jupyter: the totals, the machine, the slowest op types and nodes."""
        first, machine, bounds, *_ = self.summary().splitlines()
        top_ops = self.by_op().head(8).copy()
        top_ops["share"] = (top_ops["share"] * 100).round(1).astype(str) + " %"
        columns = ["node", "op", "module", "time_ms", "flops", "bytes", "intensity", "bound"]
        top_nodes = self.table.sort_values("time_ms", ascending=False).head(8)[columns]
        return (f"<div><b>{html.escape(first)}</b><br>{html.escape(machine)}<br>{html.escape(bounds)}"
                f"<p>By op type</p>{top_ops.to_html(float_format=lambda v: f'{v:.4g}')}"
                f"<p>Slowest nodes</p>{top_nodes.to_html(index=False, float_format=lambda v: f'{v:.4g}')}</div>")


_COLOR_STOPS = [(1.0, 1.0, 0.8), (0.996, 0.851, 0.463), (0.992, 0.553, 0.235), (0.890, 0.102, 0.110),
                (0.694, 0.0, 0.149)]


def time_color(fraction: float) -> str:
    """A colour from pale yellow (0) through orange to dark red (1), as ``#rrggbb``.

    Example:
        >>> time_color(0.0), time_color(1.0)
        ('#ffffcc', '#b10026')
    """
    f = min(1.0, max(0.0, float(fraction))) * (len(_COLOR_STOPS) - 1)
    i = min(int(f), len(_COLOR_STOPS) - 2)
    t = f - i
    a, b = _COLOR_STOPS[i], _COLOR_STOPS[i + 1]
    return "#" + "".join(f"{round(255 * (x + (y - x) * t)):02x}" for x, y in zip(a, b))
