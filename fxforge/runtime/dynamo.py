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

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fxforge.capture.dynamo import (
    CompiledGraph,
    break_mark,
    compiled_forward,
    dynamo_breaks_since,
    known_breaks,
    owning,
)
from fxforge.capture.model import describe_failure
from fxforge.core.breaks import Break, distinct
from fxforge.core.report import Report
from fxforge.core.verify import RNG_LOCK, isolated
from fxforge.core.vocabulary import has_hooks
from fxforge.runtime.fallbacks import FallbackWarning, caller_stacklevel
from fxforge.runtime.native import OptimizedModule
from fxforge.runtime.plans import PlanBuilder, ShapePolicy


def one_graph_needed(model_name: str, what: str, breaks: list[Break]) -> str:
    """The one line refusing ``what`` (an export) for a model that runs as several graphs, naming each break.

    Example:
        >>> one_graph_needed("Net", "a .pt2 file", [Break("m.py:4", "calls print()", "remove the print")])
        'a .pt2 file holds one graph, and Net runs as graphs between breaks: m.py:4: calls print(); fix: remove the print'
    """
    cuts = "; ".join(map(str, breaks)) if breaks else "dynamo named no break"
    return f"{what} holds one graph, and {model_name} runs as graphs between breaks: {cuts}"


# One call through TorchDynamo at a time, in this process: a guard that failed in several threads at once (a
# BatchNorm eps changed) had them compile together, which TorchDynamo does not support, and one thread ran a
# graph with the old eps (the fuzz suite's threaded calls of a model with a break). Its kernels still use the
# intra-op threads. The lock is isolated()'s (RNG_LOCK): a call here may build a graph's plan, which verifies
# inside isolated(), and an isolated() block may call a model with breaks (optimize's prepare, a check against
# eager): with a lock of its own, two threads taking the two in opposite orders waited for each other forever.
_DYNAMO_CALLS = RNG_LOCK


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
        self.forward = forward
        self.compiled = compiled_forward(forward)
        self.failed = ""  # why dynamo is not used any more (it raised where the model does not)
        self._graph_error: BaseException | None = None  # the latest error raised inside a graph's run
        self.ran: list[int] = []  # the graphs the latest call ran, in order
        self.builder_for = builder_for
        self.policy = policy
        self.why = why
        self.deferred = ""  # why prepare built nothing
        self.modules: dict[int, tuple[tuple, OptimizedModule]] = {}  # graph index -> (bound tensors, module)
        self.graphs: dict[int, CompiledGraph] = {}
        self.breaks: list[Break] = known_breaks(forward)  # (those an instance before this one met)
        self.flops: dict[int, int] = {}
        self.flop_share: float | None = None
        self.time_share: float | None = None
        self._measuring: dict | None = None

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if self.failed:
            return self.forward(*args, **kwargs)
        with _DYNAMO_CALLS:
            return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        mark, skipped = break_mark(), dynamo_config.skip_nnmodule_hook_guards
        self.ran = []
        dynamo_config.skip_nnmodule_hook_guards = False  # a hook added later is the model's: guard on hooks
        try:
            with owning(self):
                result = self.compiled(*args, **kwargs)
        except Exception as error:  # (dynamo's own failures only: an error inside a graph is raised)
            if error is self._graph_error:
                raise
            return self._dynamo_failed(error, args, kwargs)
        finally:
            dynamo_config.skip_nnmodule_hook_guards = skipped
        if break_mark() != mark:
            self.breaks = distinct(self.breaks + known_breaks(self.forward, dynamo_breaks_since(mark)))
        return result

    def _dynamo_failed(self, error: Exception, args: tuple, kwargs: dict) -> Any:
        """A call through dynamo raised: the model's own error where the forward raises too (it is re-raised);
        else dynamo ran the user's code differently from Python (a numpy call it traces, say), and the model runs
        eagerly from now on, after one warning naming dynamo's error."""
        result = self.forward(*args, **kwargs)  # raises the model's own error where the inputs are bad
        self.failed = f"TorchDynamo failed on a call the model serves ({describe_failure(error)})"
        warnings.warn(f"fxforge: running {type(self.model).__name__} eagerly: {self.failed}", FallbackWarning,
                      stacklevel=caller_stacklevel())
        return result

    def run_graph(self, graph: CompiledGraph, args: tuple) -> Any:
        """Run one of dynamo's graphs for this model (the ``owner`` protocol of :mod:`fxforge.capture.dynamo`)."""
        try:
            return self._run_graph(graph, args)
        except Exception as error:  # (fxforge's, or the model's own at these inputs: raised as it is)
            self._graph_error = error
            raise

    def _run_graph(self, graph: CompiledGraph, args: tuple) -> Any:
        self.ran.append(graph.index)
        entry = self.modules.get(graph.index)
        if entry is None or any(args[i] is not held for i, held in zip(graph.layout.bound, entry[0])):
            entry = self._adopt(graph, args)
        kept = tuple(args[i] for i in graph.layout.kept)
        measuring = self._measuring
        if measuring is None:
            return entry[1].cache(kept, {})  # (a host has no hooks: its plan cache, without nn.Module's call)
        start = time.perf_counter()
        result = entry[1].cache(kept, {})
        measuring["inside"] += time.perf_counter() - start
        counting = time.perf_counter()
        with FlopCounterMode(display=False) as counter:  # (at this call's sizes: a loop's graph grows)
            graph.graph_module(*args)
        measuring["counting"] = measuring.get("counting", 0.0) + time.perf_counter() - counting
        measuring["flops"] += counter.get_total_flops()
        self.flops[graph.index] = counter.get_total_flops()
        return result

    def _adopt(self, graph: CompiledGraph, args: tuple) -> tuple[tuple, OptimizedModule]:
        host = graph.host(args, self.model.training)
        # dynamo guards on the grad mode and the inputs' dispatch keys: this graph meets calls in this mode only
        host.fxforge_inference_mode = torch.is_inference_mode_enabled()
        policy = self.policy or ShapePolicy()
        if policy.dynamic is None and policy.dynamic_shapes is None:
            # Dynamo's guards decide the sizes a graph meets: a graph of static sizes meets those only (one plan);
            # one it compiled again with dims symbolic (a new size came) gets one plan serving every size of them.
            policy = (dataclasses.replace(policy, dynamic_shapes=graph.layout.dynamic) if graph.layout.dynamic
                      else dataclasses.replace(policy, dynamic=False))
        module = OptimizedModule(host, self.builder_for(host), policy)
        entry = (tuple(args[i] for i in graph.layout.bound), module)
        self.modules[graph.index] = entry
        self.graphs[graph.index] = graph
        if graph.ends is not None:
            self.breaks = distinct([*self.breaks, graph.ends])
        return entry

    def prepare(self, args: tuple, kwargs: dict) -> None:
        """Build every graph's plan for these inputs (one call without gradients; the model's buffers and RNG left
        as they were) and :meth:`measure` the report's shares. A model with hooks is left for its first call: a
        run here would fire them (and dynamo traces hooks into its graphs, so they cannot be silenced here
        without compiling graphs the user's calls never meet)."""
        if self._hooked():
            self.deferred = "graphs built on the first call, not by optimize: the model has hooks, which a run of fxforge's would fire"
            return
        with isolated(self.model, inputs=(args, kwargs)), torch.no_grad():
            self(args, kwargs)
        self.measure(args, kwargs)

    def _hooked(self) -> bool:
        return any(map(has_hooks, self.model.modules()))

    def measure(self, args: tuple, kwargs: dict) -> None:
        """Measure on one call (its plans built already) the share of the model's FLOPs (eager's, counted by
        :class:`torch.utils.flop_counter.FlopCounterMode`) and of its time spent inside the optimized graphs, and
        how often each graph runs per call. The model's buffers and RNG are left as they were."""
        with isolated(self.model, inputs=(args, kwargs)), torch.no_grad():
            with FlopCounterMode(display=False) as counter:
                self.model.forward(*args, **kwargs)
            total = counter.get_total_flops()
            self._measuring = {"inside": 0.0, "flops": 0}
            try:
                start = time.perf_counter()
                self(args, kwargs)
                whole = time.perf_counter() - start
            finally:
                measured, self._measuring = self._measuring, None
        inside, counted = measured["inside"], measured["flops"]
        whole -= measured.get("counting", 0.0)
        self.flop_share = min(1.0, counted / total) if total else None
        self.time_share = min(1.0, inside / whole) if whole > 0 else None

    @property
    def report(self) -> Report:
        """One report for every graph: their rewrites together, the breaks, and each graph's part."""
        report = Report(method="dynamo", breaks=list(self.breaks), flop_share=self.flop_share,
                        time_share=self.time_share)
        if self.failed:
            report.notes.append(f"runs eagerly: {self.failed}")
        if self.why:
            report.notes.append(f"captured through TorchDynamo, graph by graph: {self.why}")
        if self.deferred:
            report.notes.append(self.deferred)
        for graph, module in self.ordered():
            report.add_graph(module.report, graph.lines, graph.ends, self.ran.count(graph.index) or 1,
                             self.flops.get(graph.index, 0))
        return report

    def ordered(self) -> list[tuple[CompiledGraph, OptimizedModule]]:
        """The graphs of the latest call (else every graph built), in the order they ran, each with its optimized
        module; only those with a report (the report's ``graphs`` number them in this order, from 1)."""
        indices = dict.fromkeys(self.ran or sorted(self.modules))
        return [(self.graphs[i], self.modules[i][1]) for i in indices
                if i in self.modules and self.modules[i][1].report is not None]

    @property
    def plans_built(self) -> int:
        """Plans built over every graph."""
        return sum(module.plans_built for _, module in self.modules.values())

    def clear(self) -> None:
        """Forget every graph's plans (new weights loaded)."""
        for _, module in self.modules.values():
            module.cache.clear()
