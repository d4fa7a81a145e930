"""A model with graph breaks, run through TorchDynamo with each graph between its breaks optimized by fxforge.

:class:`DynamoRunner` runs the model's forward under dynamo with fxforge's backend
(:mod:`fxforge.capture.dynamo`). Each graph dynamo hands over becomes a host module holding the model's own
parameters and buffers, and runs as an :class:`~fxforge.runtime.native.OptimizedModule` of its own: the whole
pipeline (capture, verified rewrites, autotuned lowering, or Inductor), its guards (weights, modes, gradients,
autocast), and its plans for new sizes. Dynamo's guards decide which graph runs; the Python between graphs runs
as the model wrote it. A parameter the model swaps for another (not updated in place) gets a new host.

Example:
    >>> from fxforge.lowering.build import plan_builder
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(3, 3)
    ...     def forward(self, x):
    ...         y = torch.relu(self.fc(x))
    ...         if y.sum() > 0:
    ...             y = y * 2
    ...         return y - 1
    >>> net = Net().eval()
    >>> runner = DynamoRunner(net, net.forward, plan_builder)
    >>> with torch.no_grad():
    ...     out = runner((torch.ones(2, 3),), {})
    >>> torch.allclose(out, net(torch.ones(2, 3))), len(runner.report.graphs), len(runner.report.breaks)
    (True, 2, 1)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fxforge.capture.dynamo import CompiledGraph, break_mark, compiled_forward, dynamo_breaks_since, owning
from fxforge.core.breaks import Break, GraphPart, distinct
from fxforge.core.report import Report
from fxforge.core.verify import isolated
from fxforge.runtime.native import OptimizedModule
from fxforge.runtime.plans import PlanBuilder, ShapePolicy


class DynamoRunner:
    """Runs ``forward`` (the model's) under TorchDynamo, each graph through an optimized module of its own.

    Args:
        model: the model (its mode is the one each new graph's host takes).
        forward: what dynamo runs (the model's forward, or a decorated class's original one, bound).
        builder_for: ``host module -> plan builder`` (:func:`fxforge.lowering.build.plan_builder` with the
            target's options).
        policy: how each graph's plans treat sizes.
        why: why the model runs through dynamo (the whole-graph captures' reasons), for the report's notes.
    """

    def __init__(self, model: nn.Module, forward: Callable[..., Any],
                 builder_for: Callable[[nn.Module], PlanBuilder], policy: ShapePolicy | None = None, why: str = ""):
        self.model = model
        self.compiled = compiled_forward(forward)
        self.builder_for = builder_for
        self.policy = policy
        self.why = why
        self.modules: dict[int, tuple[tuple, OptimizedModule]] = {}  # graph index -> (bound tensors, module)
        self.graphs: dict[int, CompiledGraph] = {}
        self.breaks: list[Break] = []
        self.calls: dict[int, int] = {}  # graph index -> runs in the latest measured call
        self.flops: dict[int, int] = {}
        self.flop_share: float | None = None
        self.time_share: float | None = None
        self._measuring: dict | None = None

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        mark = break_mark()
        with owning(self):
            result = self.compiled(*args, **kwargs)
        if break_mark() != mark:
            self.breaks = distinct(self.breaks + dynamo_breaks_since(mark))
        return result

    def run_graph(self, graph: CompiledGraph, args: tuple) -> Any:
        """Run one of dynamo's graphs for this model (the ``owner`` protocol of :mod:`fxforge.capture.dynamo`)."""
        entry = self.modules.get(graph.index)
        if entry is None or any(args[i] is not held for i, held in zip(graph.layout.bound, entry[0])):
            entry = self._adopt(graph, args)
        kept = [args[i] for i in graph.layout.kept]
        measuring = self._measuring
        if measuring is None:
            return entry[1](*kept)
        self.calls[graph.index] = self.calls.get(graph.index, 0) + 1
        start = time.perf_counter()
        result = entry[1](*kept)
        measuring["inside"] += time.perf_counter() - start
        if graph.index not in self.flops:
            with FlopCounterMode(display=False) as counter:
                graph.graph_module(*args)
            self.flops[graph.index] = counter.get_total_flops()
        return result

    def _adopt(self, graph: CompiledGraph, args: tuple) -> tuple[tuple, OptimizedModule]:
        host = graph.host(args, self.model.training)
        module = OptimizedModule(host, self.builder_for(host), self.policy)
        entry = (tuple(args[i] for i in graph.layout.bound), module)
        self.modules[graph.index] = entry
        self.graphs[graph.index] = graph
        if graph.ends is not None:
            self.breaks = distinct([*self.breaks, graph.ends])
        return entry

    def prepare(self, args: tuple, kwargs: dict) -> None:
        """Build every graph's plan for these inputs (one call without gradients; the model's buffers and RNG left
        as they were) and :meth:`measure` the report's shares."""
        with isolated(self.model, inputs=(args, kwargs)), torch.no_grad():
            self(args, kwargs)
        self.measure(args, kwargs)

    def measure(self, args: tuple, kwargs: dict) -> None:
        """Measure on one call (its plans built already) the share of the model's FLOPs (eager's, counted by
        :class:`torch.utils.flop_counter.FlopCounterMode`) and of its time spent inside the optimized graphs, and
        how often each graph runs per call. The model's buffers and RNG are left as they were."""
        with isolated(self.model, inputs=(args, kwargs)), torch.no_grad():
            with FlopCounterMode(display=False) as counter:
                self.model.forward(*args, **kwargs)
            total = counter.get_total_flops()
            self.calls, self._measuring = {}, {"inside": 0.0}
            try:
                start = time.perf_counter()
                self(args, kwargs)
                whole = time.perf_counter() - start
            finally:
                inside, self._measuring = self._measuring["inside"], None
        counted = sum(self.flops.get(index, 0) * runs for index, runs in self.calls.items())
        self.flop_share = min(1.0, counted / total) if total else None
        self.time_share = min(1.0, inside / whole) if whole > 0 else None

    @property
    def report(self) -> Report:
        """One report for every graph: their rewrites together, the breaks, and each graph's part."""
        report = Report(method="dynamo", breaks=list(self.breaks), flop_share=self.flop_share,
                        time_share=self.time_share)
        if self.why:
            report.notes.append(f"captured through TorchDynamo, graph by graph: {self.why}")
        for index in sorted(self.modules):
            part = self.modules[index][1].report
            graph = self.graphs[index]
            if part is None:
                continue
            report.matches.extend(part.matches)
            report.near_misses.extend(part.near_misses)
            report.rolled_back.extend(part.rolled_back)
            report.verified.extend(part.verified)
            report.tuning.extend(part.tuning)
            report.notes.extend(f"graph {len(report.graphs) + 1}: {note}" for note in part.notes)
            report.nodes_before += part.nodes_before
            report.nodes_after += part.nodes_after
            report.graphs.append(GraphPart(len(report.graphs) + 1, graph.lines, part.nodes_before, part.nodes_after,
                                           part.counts, graph.ends, self.calls.get(index, 1),
                                           self.flops.get(index, 0)))
        return report

    @property
    def plans_built(self) -> int:
        """Plans built over every graph."""
        return sum(module.plans_built for _, module in self.modules.values())

    def clear(self) -> None:
        """Forget every graph's plans (new weights loaded)."""
        for _, module in self.modules.values():
            module.cache.clear()
