"""A plan on CUDA replayed as a CUDA graph: one launch per call instead of one per op.

At batch 1 a GPU spends most of a small model's time waiting for the CPU to launch its kernels (an H200 ran
every zoo model in 1-12 ms). :class:`GraphReplay` captures a plan's executable once per input signature into a
``torch.cuda.CUDAGraph`` (after warm-up runs on a side stream, as capture requires) and replays it:

- the call's inputs are copied into the captured static inputs, the graph replayed, and the outputs returned
  as copies (the next replay overwrites the static ones: a caller keeping an output must not see it change);
- the weights are the model's own tensors: a change in place (an optimizer step, ``load_state_dict``) is read
  by the next replay; a weight or buffer assigned anew makes the model's watch build a new plan, and a value the
  plan recomputed into a new tensor (a prepacked weight) makes the replay capture again;
- a call with another signature (shape, strides, dtype, device), or under another grad/inference mode, captures
  again;
- a graph with effects (in-place ops, random numbers, modules in training mode) is not captured (the replay would
  write into the static copies, or draw the same numbers every call): :func:`graph_refusal` says why.

:func:`with_cuda_graph` keeps the replay only where it measures faster than the plan on the call's inputs, and
records the choice in the report (``cuda_graph``). Without a CUDA device none of this runs: the report of a CPU
plan says nothing of it, and the tests exercise the replay logic with a stand-in graph.

Example:
    >>> class Recorded:                       # a stand-in for torch.cuda.CUDAGraph, on CPU: replays write
    ...     def capture(self, fn):            # into the outputs the capture made
    ...         self.fn, self.out = fn, fn(); return self.out
    ...     def replay(self): self.out.copy_(self.fn())
    >>> replay = GraphReplay(lambda x: x * 2, graph_factory=Recorded)
    >>> replay(torch.ones(2)).tolist(), replay(torch.full((2,), 3.0)).tolist(), replay.captures
    ([2.0, 2.0], [6.0, 6.0], 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxforge.core.plan import Plan
from fxforge.core.report import Tuning
from fxforge.core.verify import compare_outputs, isolated
from fxforge.lowering.schedule import effectful_nodes
from fxforge.lowering.timing import time_in_blocks
from fxforge.runtime.interop import run_branches
from fxforge.runtime.interop_choice import stage_builder

RULE = "cuda_graph"
KEEP_BELOW = 0.97  # the replay is kept when its median is below this share of the plan's
WARMUP = 2  # runs on a side stream before capture


class _TorchGraph:
    """``torch.cuda.CUDAGraph`` behind the two calls :class:`GraphReplay` makes."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any]) -> Any:
        with torch.cuda.graph(self.graph):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


def _signature(flat: list[Any]) -> tuple:
    return tuple((tuple(v.shape), v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else ("value", v)
                 for v in flat) + (torch.is_grad_enabled(), torch.is_inference_mode_enabled())


@dataclasses.dataclass(eq=False)
class GraphReplay:
    """``run`` captured as a CUDA graph per input signature and replayed (see the module docstring).

    Attributes:
        run: the plan's executable, ``run(*args, **kwargs)``.
        watched: ``() -> tuple`` of the storages the capture read that a plan may replace (its prepacked
            values' ``data_ptr``): a change captures again.
        graph_factory: ``() -> object`` with ``capture(fn) -> output`` and ``replay()`` (a stand-in on CPU).
        captures: how many captures were made.
    """

    run: Callable[..., Any]
    watched: Callable[[], tuple] = tuple
    graph_factory: Callable[[], Any] = _TorchGraph
    captures: int = 0
    _key: Any = None
    _graph: Any = None
    _static: list = dataclasses.field(default_factory=list)
    _spec: Any = None
    _outputs: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        key = (spec, _signature(flat), self.watched())
        if key != self._key:
            self._capture(flat, spec)
            self._key = key
        for static, value in zip(self._static, flat):
            if isinstance(static, torch.Tensor):
                static.copy_(value)
        self._graph.replay()
        return pytree.tree_map_only(torch.Tensor, torch.clone, self._outputs)

    def _capture(self, flat: list[Any], spec: Any) -> None:
        self._static = [v.clone() if isinstance(v, torch.Tensor) else v for v in flat]
        args, kwargs = pytree.tree_unflatten(self._static, spec)
        cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in flat)
        if cuda:  # warm-up on a side stream: lazy initialisation and autotuning stay out of the graph
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    self.run(*args, **kwargs)
            torch.cuda.current_stream().wait_stream(side)
        graph = self.graph_factory()
        self._outputs = graph.capture(lambda: self.run(*args, **kwargs))
        self._graph = graph
        self.captures += 1


def graph_refusal(executable: torch.nn.Module) -> str | None:
    """Why ``executable`` cannot be replayed as a CUDA graph, or None.

    Example:
        >>> graph_refusal(torch.fx.symbolic_trace(lambda x: x.relu_()))
        'relu_ has effects (in-place, random or a module in training mode): a replay would repeat them on static copies'
        >>> graph_refusal(torch.fx.symbolic_trace(lambda x: x.relu())) is None
        True
    """
    if not isinstance(executable, torch.fx.GraphModule):
        return "the plan is not a graph (a compiled plan manages its own launches)"
    effects = effectful_nodes(executable)
    for node in executable.graph.nodes:
        if node.target is run_branches:
            return ("its independent branches run on side streams (inter-op): not captured together yet "
                    "(no device was lent to check a capture across streams)")
        if node in effects:
            return (f"{node.name} has effects (in-place, random or a module in training mode): a replay would "
                    "repeat them on static copies")
    return None


def _replaceable(plan: Plan) -> Callable[[], tuple]:
    """The storages of the plan's values that a recompute replaces (prepacked weights), read at each call."""
    executable = plan.executable
    names = list(getattr(executable, "meta", {}).get("fxforge_packs", {}))

    def pointers() -> tuple:
        return tuple(getattr(executable, name).data_ptr() for name in names if hasattr(executable, name))

    return pointers


def with_cuda_graph(plan: Plan, args: tuple, kwargs: dict, *, graph_factory: Callable[[], Any] = _TorchGraph,
                    always: bool = False) -> Plan:
    """``plan`` replayed as a CUDA graph where its inputs are on CUDA, its sizes static, its graph free of
    effects, and the replay measures faster on these inputs (``always``: without timing); else ``plan``. The
    report's ``cuda_graph`` entry says which and why.

    Example:
        >>> from fxforge.lowering.build import build_plan
        >>> plan = build_plan(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {})
        >>> with_cuda_graph(plan, (torch.ones(1, 2),), {}) is plan   # CPU inputs: nothing to replay
        True
    """
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if graph_factory is _TorchGraph and not (tensors and all(t.is_cuda for t in tensors)):
        return plan
    report = plan.report
    refusal = graph_refusal(plan.executable) or ("the plan serves many sizes (symbolic shapes): one capture per size "
                                                 "is not kept" if plan.shapes is not None else None)
    if refusal is not None:
        report.tuning.append(Tuning(RULE, "graph", "launches", note=refusal, kind="schedule"))
        return plan
    replay = GraphReplay(plan.executable, _replaceable(plan), graph_factory)
    with isolated(plan.executable, inputs=(args, kwargs)), torch.no_grad():
        comparison = compare_outputs(plan.executable(*args, **kwargs), replay(*args, **kwargs))
        if not comparison.ok:
            report.tuning.append(Tuning(RULE, "graph", "launches", note=f"the replay differs ({comparison.reason})",
                                        kind="schedule"))
            return plan
        timings = {} if always else time_in_blocks({"launches": lambda: plan.executable(*args, **kwargs),
                                                    "graph": lambda: replay(*args, **kwargs)}, budget_s=0.5)
    faster = always or timings["graph"] < KEEP_BELOW * timings["launches"]
    report.tuning.append(Tuning(RULE, "graph", "graph" if faster else "launches", timings,
                                note="replayed as one CUDA graph per input signature" if faster else
                                "the replay was not faster", kind="schedule"))
    return dataclasses.replace(plan, executable=replay) if faster else plan


def cuda_graph_builder(build: Any, *, always: bool = False) -> Any:
    """A plan builder whose plans for calls on CUDA that record no gradients and run without autocast go through
    :func:`with_cuda_graph` (``always``: kept without timing).

    Example:
        >>> from fxforge.core.plan import CallConditions
        >>> from fxforge.lowering.build import plan_builder
        >>> cuda_graph_builder(plan_builder(torch.nn.ReLU()))((torch.ones(2),), {}, CallConditions()).report.method
        'fx'
    """
    return stage_builder(build, with_cuda_graph, always=always)
