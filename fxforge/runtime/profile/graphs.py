"""Profiling a model TorchDynamo cuts into graphs: each graph between its breaks node by node, in one table.

For a model no whole-graph capture holds (a branch on a tensor's value, ``.item()``, ``print``...),
:func:`fxforge.profile` runs it once through TorchDynamo (``fxforge.capture(model, inputs, method="dynamo")``, the
model's buffers and RNG left as they were), profiles each graph between its breaks with
:func:`~fxforge.runtime.profile.measure.profile_graph` on the inputs it took in that call, and puts their rows
together in one table whose ``graph`` column numbers the graphs in the order the model ran them, from 1 (the
numbers of ``opt.report.graphs``). The Python between the graphs (the branch itself) is in no row. An optimized
module that runs graph by graph (``opt.dynamo``) is profiled the same way, each graph's lowered plan.

Example:
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         h = torch.relu(self.fc(x))
    ...         if h.sum() > 0:
    ...             h = h * 2
    ...         return h - 1
    >>> p = fxforge.profile(Net(), (torch.ones(2, 4),), warmup=0, repeat=1)
    >>> sorted(set(p.table["graph"])), len(p.breaks), list(p.table.columns[:3])
    ([1, 2], 1, ['graph', 'node', 'op'])
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from torch import nn

from fxforge.capture import CaptureError, capture, normalize_inputs
from fxforge.core.breaks import Break, distinct
from fxforge.core.verify import isolated
from fxforge.runtime.interop import sequential_of
from fxforge.runtime.native import OptimizedModule
from fxforge.runtime.profile.measure import profile_graph
from fxforge.runtime.profile.table import Profile


@dataclasses.dataclass(eq=False)
class GraphsProfile(Profile):
    """The profile of a model that runs as graphs between breaks: :class:`Profile`'s table with a ``graph`` column
    first (the graph's number), every graph's rows in the order the model ran them.

    ``graph_module`` is the first graph's, ``timeline`` the one of the graph with the highest simulated peak, and
    ``graph_ms`` the graphs called directly, one run each, summed; :meth:`graph_svg`, :meth:`plot_memory` and
    :meth:`node_colors` take a graph's number (``parts[n - 1]`` is that graph's own profile).

    Attributes:
        parts: each graph's :class:`Profile`, in order.
        breaks: the :class:`~fxforge.core.breaks.Break` s between them.
        calls: how many times each graph ran in one call of the model (a loop runs one several times).
        lines: the user's lines each graph holds (``m.py:3-9``).

    Example:
        >>> p = fxforge.profile(torch.nn.ReLU(), (torch.ones(2),), warmup=0, repeat=1)
        >>> isinstance(p, GraphsProfile)   # one graph: the usual Profile
        False
    """

    parts: list[Profile] = dataclasses.field(default_factory=list)
    breaks: list[Break] = dataclasses.field(default_factory=list)
    calls: list[int] = dataclasses.field(default_factory=list)
    lines: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """What was profiled, the totals, the machine, each graph and break, the slowest op types.

        Example:
            >>> class Branch(torch.nn.Module):
            ...     def forward(self, x):
            ...         return x * 2 if x.sum() > 0 else x - 1
            >>> print(fxforge.profile(Branch(), (torch.ones(2, 4),), warmup=0, repeat=1).summary())
            ... # doctest: +ELLIPSIS
            Branch: captured graphs between breaks, 2 graphs (1 break), 3 nodes, ...
        """
        m = self.machine
        peak = max(range(len(self.parts)), key=lambda i: self.parts[i].timeline.peak_bytes)
        lines = [
            (f"{self.name}: {self.what}, {_count(len(self.parts), 'graph')} ({_count(len(self.breaks), 'break')}), "
             f"{len(self.table)} nodes, {self.total_ms:.3f} ms summed over nodes ({self.graph_ms:.3f} ms the graphs called directly, "
             f"one run each), {self.total_flops / 1e9:.3f} GFLOP, peak {self.timeline.peak_bytes / 2**20:.2f} MiB "
             f"simulated (graph {peak + 1})"),
            (f"machine {m.device}: {m.peak_gflops:.1f} GFLOP/s, {m.bandwidth_gbs:.1f} GB/s, "
             f"ridge {m.ridge:.1f} FLOP/byte"),
        ]
        bounds = self.table["bound"].value_counts().to_dict()
        lines.append(f"compute bound: {bounds.get('compute', 0)} nodes, memory bound: {bounds.get('memory', 0)}")
        lines.extend(f"  {line}" for line in self.graph_lines())
        for op, row in self.by_op().head(5).iterrows():
            lines.append(f"  {op:<28} {int(row['count']):>4}x {row['time_ms']:>9.3f} ms {row['share']:>7.1%}")
        return "\n".join(lines)

    def graph_lines(self) -> list[str]:
        """One line per graph (its user's lines, nodes, time, runs per call), then one per break.

        Example:
            >>> class Branch(torch.nn.Module):
            ...     def forward(self, x):
            ...         return x * 2 if x.sum() > 0 else x - 1
            >>> fxforge.profile(Branch(), (torch.ones(2),), warmup=0, repeat=1).graph_lines()[0]  # doctest: +ELLIPSIS
            'graph 1 (<doctest ...>:3): 2 nodes, ... ms'
        """
        lines = []
        for number, part in enumerate(self.parts, 1):
            runs = self.calls[number - 1] if number <= len(self.calls) else 1
            where = f" ({self.lines[number - 1]})" if number <= len(self.lines) and self.lines[number - 1] else ""
            lines.append(f"graph {number}{where}: {len(part.table)} nodes, {part.total_ms:.3f} ms"
                         + (f", runs {runs} times per call" if runs > 1 else ""))
        return lines + [f"break at {item}" for item in self.breaks]

    def _part(self, graph: int) -> Profile:
        if not 1 <= graph <= len(self.parts):
            raise ValueError(f"graph {graph}: {self.name} ran {len(self.parts)} graphs, numbered from 1")
        return self.parts[graph - 1]

    def graph_svg(self, *, engine: str = "auto", graph: int = 1) -> str:
        """Graph number ``graph`` as SVG, nodes coloured by time (:meth:`Profile.graph_svg`)."""
        return self._part(graph).graph_svg(engine=engine)

    def plot_memory(self, ax: Any = None, measured: bool = True, graph: int | None = None) -> Any:
        """Live bytes through graph number ``graph`` (default: the one with the highest simulated peak)."""
        if graph is None:
            graph = 1 + max(range(len(self.parts)), key=lambda i: self.parts[i].timeline.peak_bytes)
        return self._part(graph).plot_memory(ax=ax, measured=measured)

    def node_colors(self, graph: int = 1) -> dict[str, str]:
        """Graph number ``graph``'s fill colour per node (node names repeat across graphs)."""
        return self._part(graph).node_colors()


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'s' if n != 1 else ''}"


def profile_between_breaks(model: nn.Module, example_inputs: Any, error: CaptureError, **options: Any) -> GraphsProfile:
    """The profile of ``model``'s graphs between its breaks (see the module docstring); ``error`` (why no whole-graph
    capture holds it) is raised where TorchDynamo cannot run it either, or where the model itself raised.

    Args:
        options: ``warmup``, ``repeat``, ``device`` (as :func:`fxforge.profile`).

    Example:
        >>> class Branch(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x * 2 if x.sum() > 0 else x - 1
        >>> error = CaptureError("Branch", {"fx": "a branch"})
        >>> p = profile_between_breaks(Branch(), (torch.ones(2, 4),), error, warmup=0, repeat=1)
        >>> len(p.parts), p.what
        (2, 'captured graphs between breaks')
    """
    args, kwargs = normalize_inputs(example_inputs)
    if "eager" in getattr(error, "reasons", {}):  # the model raised on these inputs: nothing to profile
        raise error
    found = None
    # (dynamo failing too: the whole-graph captures' error says why)
    with contextlib.suppress(Exception), isolated(model, inputs=(args, kwargs)):
        found = capture(model, args, method="dynamo", example_kwargs=kwargs)
    if found is None or not found.graphs:
        raise error
    pieces = [(host, inputs, {}, graph.lines, found.calls.get(graph.index, 1)) for graph, host, inputs in found.graphs]
    # (dynamo names a break it met in code it runs in Python once per process: the error's breaks hold it)
    breaks = distinct([*found.breaks, *getattr(error, "breaks", [])])
    return _combined(model, pieces, breaks, "captured graphs between breaks", **options)


def profile_optimized_graphs(module: OptimizedModule, example_inputs: Any, **options: Any) -> GraphsProfile:
    """The profile of an optimized module that runs graph by graph (``module.dynamo``): each graph's lowered plan on
    the inputs it was prepared with, after preparing ``example_inputs`` (given) or as the latest call ran them.

    Example:
        >>> class Branch(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x * 2 if x.sum() > 0 else x - 1
        >>> opt = fxforge.optimize(Branch(), (torch.ones(2, 4),), method="dynamo")
        >>> p = profile_optimized_graphs(opt, None, warmup=0, repeat=1)
        >>> p.what, len(p.parts)
        ('lowered graphs between breaks', 2)
    """
    runner = module.dynamo
    if example_inputs is not None:
        args, kwargs = normalize_inputs(example_inputs)
        module.prepare(*args, **kwargs)
    ordered = runner.ordered()
    if not ordered:
        raise ValueError("profile: this OptimizedModule has not run yet; pass example_inputs")
    pieces = []
    for graph, part in ordered:
        captured = part.captured
        plan = part.plan_for(*captured.example_args, **captured.example_kwargs)
        if plan is None:
            raise ValueError(f"profile: a graph of {type(module.original).__name__} ({graph.lines}) runs eagerly, so "
                             "there is no plan to profile; profile the model itself")
        pieces.append((sequential_of(plan.executable), captured.example_args, captured.example_kwargs, graph.lines,
                       runner.ran.count(graph.index) or 1))
    return _combined(module.original, pieces, list(runner.breaks), "lowered graphs between breaks", **options)


def _combined(model: nn.Module, pieces: list[tuple], breaks: list[Break], what: str, **options: Any) -> GraphsProfile:
    """One profile of ``pieces`` (``(graph, args, kwargs, lines, runs per call)`` in the order they ran)."""
    import pandas as pd

    name = type(model).__name__
    parts = [profile_graph(graph, args, kwargs, what=f"graph {number} of {len(pieces)}", name=name, model=model,
                           **options)
             for number, (graph, args, kwargs, _, _) in enumerate(pieces, 1)]
    tables = []
    for number, part in enumerate(parts, 1):
        table = part.table.copy()
        table.insert(0, "graph", number)
        tables.append(table)
    peak = max(parts, key=lambda part: part.timeline.peak_bytes)
    first = parts[0]
    return GraphsProfile(table=pd.concat(tables, ignore_index=True), machine=first.machine,
                         graph_module=first.graph_module, timeline=peak.timeline,
                         graph_ms=sum(part.graph_ms for part in parts), what=what, name=name, warmup=first.warmup,
                         repeat=first.repeat, device=first.device, parts=parts, breaks=list(breaks),
                         calls=[runs for *_, runs in pieces], lines=[lines for *_, lines, _ in pieces])
