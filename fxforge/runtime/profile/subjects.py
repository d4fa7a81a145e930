"""What :func:`fxforge.profile` measures: a model's captured graph, a ``Captured``, or the graph an
``OptimizedModule`` really runs.

Example:
    >>> p = profile(torch.nn.ReLU(), (torch.randn(4),), warmup=0, repeat=1)
    >>> p.table["op"].tolist()
    ['relu']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxforge.capture import CaptureError, capture, normalize_inputs
from fxforge.core.captured import Captured
from fxforge.runtime.interop import sequential_of
from fxforge.runtime.native import OptimizedModule
from fxforge.runtime.profile.graphs import profile_between_breaks, profile_optimized_graphs
from fxforge.runtime.profile.measure import profile_graph
from fxforge.runtime.profile.table import Profile


def profile(model_or_captured: Any, example_inputs: Any = None, *, warmup: int = 2, repeat: int = 10,
            device: torch.device | str | None = None) -> Profile:
    """Profile a model's graph node by node: time, FLOPs, bytes, roofline verdict, memory.

    What is profiled:

    - an ``nn.Module``: captured with :func:`fxforge.capture` (no rewrites), its graph;
    - a :class:`~fxforge.Captured` (from ``fxforge.capture`` or ``fxforge.rewrite``): its graph as it is
      (fused ops are custom-op calls choosing their kernel at each call);
    - an :class:`~fxforge.OptimizedModule`: the graph it runs for these inputs when no gradient is
      recorded: its plan's lowered graph (:func:`fxforge.lowering.lower.lower`), whose fused ops are direct
      calls of their oneDNN/cuDNN kernels on prepacked weights (their ``op`` is still
      ``fxforge.conv_pointwise``; ``target`` names the kernel). (With gradients on, it runs the rewritten
      graph instead: profile ``opt.captured`` for that.)

    A model no whole graph holds (a branch on a tensor's value, ``.item()``...) is profiled graph by graph
    between the breaks TorchDynamo cuts it at (an optimized module running it graph by graph: each graph's
    lowered plan): a :class:`~fxforge.runtime.profile.graphs.GraphsProfile`, whose table's ``graph`` column
    numbers the graphs (:mod:`fxforge.runtime.profile.graphs`).

    Nodes run under ``torch.no_grad()``; the graph's buffers (BatchNorm statistics in training mode) and the
    RNG are restored afterwards. See :mod:`fxforge.runtime.profile` for every column.

    Args:
        model_or_captured: what to profile (above).
        example_inputs: a tuple of inputs, one tensor, or a dict of keyword inputs; for a ``Captured`` or an
            ``OptimizedModule`` that has run, the inputs it was captured with by default.
        warmup: untimed runs first.
        repeat: timed runs; each node's time is its median.
        device: the device whose roofline judges the nodes (default: the inputs' or parameters' device).
            Inputs and the model are not moved.

    Returns:
        A :class:`~fxforge.runtime.profile.Profile`.

    Example:
        >>> conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        >>> p = profile(conv, (torch.randn(2, 3, 16, 16),), warmup=1, repeat=2)
        >>> int(p.table["flops"][0]) == 2 * 2 * 8 * 8 * 3 * 3 * 3 * 8
        True
    """
    if warmup < 0 or repeat < 1:
        raise ValueError(f"profile needs warmup >= 0 and repeat >= 1 (got {warmup}, {repeat})")
    options = {"warmup": warmup, "repeat": repeat, "device": device}
    if isinstance(model_or_captured, OptimizedModule) and model_or_captured.dynamo is not None:
        return profile_optimized_graphs(model_or_captured, example_inputs, **options)
    try:
        graph_module, args, kwargs, what, model = _profiled(model_or_captured, example_inputs)
    except CaptureError as error:  # not one graph: each graph between the model's breaks
        return profile_between_breaks(model_or_captured, example_inputs, error, **options)
    name = type(model if model is not None else graph_module).__name__
    return profile_graph(graph_module, args, kwargs, what=what, name=name, model=model, **options)


def _profiled(subject: Any, example_inputs: Any) -> tuple[torch.fx.GraphModule, tuple, dict, str, nn.Module | None]:
    """``(graph, args, kwargs, what it is, the user's model)`` that :func:`profile` measures."""
    args, kwargs = normalize_inputs(example_inputs)
    if isinstance(subject, OptimizedModule):
        if example_inputs is None:
            if subject.captured is None:
                raise ValueError("profile: this OptimizedModule has not run yet; pass example_inputs")
            args, kwargs = subject.captured.example_args, subject.captured.example_kwargs
        plan = subject.plan_for(*args, **kwargs)
        if plan is None:
            raise ValueError(f"profile: {type(subject.original).__name__} runs eagerly for these inputs (fxforge "
                             "could not capture it), so there is no graph to profile")
        return sequential_of(plan.executable), args, kwargs, "lowered graph", subject.original
    if isinstance(subject, Captured):
        if example_inputs is None:
            args, kwargs = subject.example_args, subject.example_kwargs
        rewritten = any(getattr(subject.report, "counts", {}).values())
        return subject.graph_module, args, kwargs, "rewritten graph" if rewritten else "captured graph", subject.module
    if isinstance(subject, torch.fx.GraphModule) and example_inputs is not None:
        return subject, args, kwargs, "graph", None
    if isinstance(subject, nn.Module):
        if example_inputs is None:
            raise ValueError("profile: example_inputs are needed to capture a model")
        cap = capture(subject, example_inputs)
        return cap.graph_module, cap.example_args, cap.example_kwargs, "captured graph", subject
    raise TypeError("profile takes an nn.Module, a fxforge.Captured or an OptimizedModule, "
                    f"got {type(subject).__name__}")
