"""Plots of a :class:`~fxforge.runtime.profile.table.Profile` with matplotlib (imported only when a plot is made).

Each function takes the profile and an optional matplotlib ``Axes`` to draw into (default: a new figure
from ``pyplot``, so Jupyter shows it) and returns the Axes.

- :func:`plot_top`: the slowest nodes as horizontal bars, coloured by their roofline verdict;
- :func:`plot_roofline`: the machine's roofline (bandwidth slope, then the compute peak) with each node at
  its arithmetic intensity and achieved GFLOP/s; nodes with no counted FLOPs (pointwise ops, copies) sit on
  the plot's floor at the left edge, counted in the legend;
- :func:`plot_memory`: live activation bytes after each node, simulated, and measured where measured.

Example:
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(4, 8),), warmup=0, repeat=1)
    >>> plot_top(p).get_xlabel()
    'time (ms, median)'
"""

from __future__ import annotations

from typing import Any

_COLORS = {"compute": "#d62728", "memory": "#1f77b4"}


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - exercised only without matplotlib
        raise ImportError("fxforge's profile plots need matplotlib: pip install matplotlib") from error
    return plt


def _axes(ax: Any, size: tuple[float, float]) -> Any:
    if ax is not None:
        return ax
    _, ax = _pyplot().subplots(figsize=size)
    return ax


def plot_top(profile: Any, n: int = 15, ax: Any = None) -> Any:
    """The ``n`` slowest nodes as horizontal bars (slowest on top), red when compute bound, blue when memory
    bound, labelled ``node (op)``.

    Example:
        >>> p = fxforge.profile(torch.nn.ReLU(), (torch.randn(4),), warmup=0, repeat=1)
        >>> [t.get_text() for t in plot_top(p).get_yticklabels()]
        ['relu (relu)']
    """
    _pyplot()
    top = profile.table.sort_values("time_ms", ascending=False, kind="stable").head(n).iloc[::-1]
    ax = _axes(ax, (7, max(2.0, 0.3 * len(top) + 1)))
    labels = [f"{row.node} ({row.op})" for row in top.itertuples()]
    ax.barh(range(len(top)), top["time_ms"], color=[_COLORS.get(b, "#7f7f7f") for b in top["bound"]])
    ax.set_yticks(range(len(top)), labels)
    ax.set_xlabel("time (ms, median)")
    ax.set_title(f"{profile.name}: slowest nodes ({profile.total_ms:.3f} ms in all)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=f"{b} bound") for b, c in _COLORS.items()], loc="lower right",
              fontsize="small")
    return ax


def plot_roofline(profile: Any, ax: Any = None) -> Any:
    """The roofline of ``profile.machine`` on log-log axes, with one point per node: x its FLOPs per byte,
    y the GFLOP/s it achieved; marker area by its share of the time. Nodes without counted FLOPs sit at the
    bottom-left corner.

    Example:
        >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(4, 8),), warmup=0, repeat=1)
        >>> plot_roofline(p).get_xscale()
        'log'
    """
    import numpy as np

    _pyplot()
    table, machine = profile.table, profile.machine
    ax = _axes(ax, (7, 5))
    seconds = table["time_ms"].to_numpy(dtype=float) / 1e3
    flops = table["flops"].to_numpy(dtype=float)
    intensity = table["intensity"].to_numpy(dtype=float)
    achieved = np.where(seconds > 0, flops / np.maximum(seconds, 1e-12) / 1e9, 0.0)
    counted = (flops > 0) & np.isfinite(intensity) & (intensity > 0)
    ridge = machine.ridge
    lo_x = min([ridge / 100, *intensity[counted]]) / 2 if counted.any() else ridge / 100
    hi_x = max([ridge * 100, *intensity[counted]]) * 2 if counted.any() else ridge * 100
    lo_y = min([machine.peak_gflops / 1e4, *achieved[counted & (achieved > 0)]]) / 2
    hi_y = machine.peak_gflops * 3
    xs = np.geomspace(lo_x, hi_x, 200)
    ax.plot(xs, np.minimum(machine.peak_gflops, machine.bandwidth_gbs * xs), color="black", linewidth=1.5,
            label=f"roof: {machine.peak_gflops:.0f} GFLOP/s, {machine.bandwidth_gbs:.0f} GB/s")
    ax.axvline(ridge, color="grey", linestyle=":", linewidth=1, label=f"ridge {ridge:.1f} FLOP/byte")
    total = max(float(table["time_ms"].sum()), 1e-12)
    sizes = 20 + 400 * table["time_ms"].to_numpy(dtype=float) / total
    colors = [_COLORS.get(b, "#7f7f7f") for b in table["bound"]]
    x = np.where(counted, intensity, lo_x)
    y = np.where(counted & (achieved > 0), achieved, lo_y)
    if counted.any():
        ax.scatter(x[counted], y[counted], s=sizes[counted], c=[c for c, k in zip(colors, counted) if k],
                   alpha=0.7, edgecolors="black", linewidths=0.5, label=f"{int(counted.sum())} nodes with FLOPs")
    if (~counted).any():
        ax.scatter(x[~counted], y[~counted], s=sizes[~counted], facecolors="none", edgecolors="#7f7f7f",
                   label=f"{int((~counted).sum())} nodes without FLOPs (at the floor)")
    order = np.argsort(-table["time_ms"].to_numpy(dtype=float))[:5]
    for i in order:
        if counted[i]:
            ax.annotate(table["node"].iloc[i], (x[i], y[i]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo_x, hi_x)
    ax.set_ylim(lo_y / 1.5, hi_y)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"{profile.name}: roofline on {machine.device}")
    ax.legend(fontsize="small", loc="lower right")
    return ax


def plot_memory(profile: Any, ax: Any = None, measured: bool = True) -> Any:
    """Live activation MiB after each node in run order: simulated (a step line), measured when
    ``measured`` and the profile has a measurement; the simulated peak is marked.

    Example:
        >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(4, 8),), warmup=0, repeat=1)
        >>> [line.get_label() for line in plot_memory(p).get_lines()][:2]
        ['simulated', 'measured']
    """
    _pyplot()
    table = profile.table
    ax = _axes(ax, (8, 3.5))
    steps = range(len(table))
    mib = 2.0**20
    ax.step(steps, table["live_bytes"] / mib, where="post", color="#1f77b4", label="simulated")
    if measured and "measured_live_bytes" in table and (table["measured_live_bytes"] > 0).any():
        ax.step(steps, table["measured_live_bytes"] / mib, where="post", color="#ff7f0e", linestyle="--",
                label="measured")
    timeline = profile.timeline
    peak = timeline.peak_node
    if peak is not None and peak in set(table["node"]):
        at = int(table.index[table["node"] == peak][0])
        ax.annotate(f"peak {timeline.peak_bytes / mib:.2f} MiB at {peak}", (at, timeline.peak_bytes / mib),
                    fontsize=8, xytext=(5, -12), textcoords="offset points")
        ax.plot([at], [timeline.peak_bytes / mib], marker="v", color="#d62728", linestyle="none", label="peak (during)")
    if len(table) <= 40:
        ax.set_xticks(list(steps), list(table["node"]), rotation=90, fontsize=7)
    ax.set_xlabel("node (run order)")
    ax.set_ylabel("live activations (MiB)")
    ax.set_title(f"{profile.name}: memory after each node")
    ax.legend(fontsize="small")
    return ax
