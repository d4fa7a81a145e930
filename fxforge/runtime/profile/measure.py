"""Profiling a graph: where it spends its time and memory, node by node.

:func:`profile_graph` (what :func:`fxforge.profile` calls, once it knows which graph to profile) runs a
graph node by node with a ``torch.fx.Interpreter`` and records, for every node
that computes (``call_function``, ``call_method``, ``call_module``):

- ``time_ms``: the median over ``repeat`` runs (after ``warmup`` runs) of the node's own call, with
  ``torch.cuda.synchronize`` before and after it on CUDA, so a node is charged for its kernels only;
- ``flops``: counted by ``torch.utils.flop_counter.FlopCounterMode`` on one run, so the counts are
  torch's own (a linear layer ``2·B·N_in·N_out``, a convolution ``2·B·H'·W'·K²·C_in·C_out``; pointwise
  ops count 0). fxforge's fused ops, and the oneDNN/cuDNN kernels they lower to, count the FLOPs of
  their convolution or linear layer (:data:`~fxforge.core.costs.KERNEL_FLOPS`);
- ``bytes``: the sizes of the node's tensor inputs (a module's parameters included) plus those of its
  outputs; a view (``view``, ``transpose``, ``getitem``...) that returns an alias moves nothing and counts 0;
- ``intensity`` (FLOPs per byte) and ``bound``: ``"compute"`` at or above the ridge point of the machine's
  roofline (:mod:`fxforge.core.costs`, measured by :func:`fxforge.runtime.roofline.measure_machine`), else
  ``"memory"``;
- ``live_bytes``: activation bytes alive after the node, simulated from the shapes
  (:class:`fxforge.core.memory.GraphMemory`), and ``measured_live_bytes``: the same measured during
  the counting run (storages created during the run and still alive: a dispatch-mode tracker on CPU, the
  caching allocator on CUDA);
- ``module`` (the user's module path), ``source`` (the user's ``file:line``) where known.

Timing through an interpreter adds a few microseconds per node to the run, not to the nodes' own
times; ``Profile.graph_ms`` is the graph called directly, for reference.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU())
    >>> p = fxforge.profile(model, (torch.randn(8, 64),), warmup=1, repeat=3)
    >>> p.table[["node", "op", "module", "flops"]].values.tolist()
    [['_0', 'linear', '0', 32768], ['_1', 'relu', '1', 0]]
    >>> set(p.table["bound"]) <= {"compute", "memory"}
    True
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from fxforge.core.costs import intensity
from fxforge.core.memory import tensor_leaves
from fxforge.core.nodes import CALL_OPS, target_name
from fxforge.core.shapes import placeholder_values
from fxforge.core.source import node_source
from fxforge.core.verify import isolated
from fxforge.runtime.memory import device_of
from fxforge.runtime.profile.modules import module_paths
from fxforge.runtime.profile.op_names import op_type
from fxforge.runtime.profile.runner import NodeRunner, simulate_with
from fxforge.runtime.profile.table import COLUMNS, Profile
from fxforge.runtime.roofline import measure_machine


def profile_graph(graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict, *, what: str = "graph",
                  name: str | None = None, model: nn.Module | None = None, warmup: int = 2, repeat: int = 10,
                  device: torch.device | str | None = None) -> Profile:
    """Profile ``graph_module`` on these inputs node by node (what :func:`fxforge.profile` measures).

    Args:
        graph_module: the graph.
        args, kwargs: its inputs.
        what: what the graph is, for the profile's text (``"captured graph"``, ``"lowered graph"``...).
        name: the model's class name (default: the graph's).
        model: the user's model, whose module paths name the nodes' modules where the graph lost them.
        warmup: untimed runs first.
        repeat: timed runs; each node's time is its median.
        device: the device whose roofline judges the nodes (default: the inputs' or parameters' device).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()))
        >>> p = profile_graph(gm, (torch.randn(8, 64),), {}, warmup=0, repeat=1)
        >>> p.table[["node", "op", "flops"]].values.tolist()
        [['_0', 'linear', 32768], ['_1', 'relu', 0]]
    """
    if warmup < 0 or repeat < 1:
        raise ValueError(f"profile needs warmup >= 0 and repeat >= 1 (got {warmup}, {repeat})")
    name = name or type(graph_module).__name__
    values = placeholder_values(graph_module, args, kwargs)
    run_device = device_of(graph_module, values)
    judge = torch.device(device) if device is not None else run_device
    runner = NodeRunner(graph_module, run_device)
    with isolated(graph_module, inputs=(args, kwargs)), torch.no_grad():
        runner.count(values)
        runner.time(values, warmup, repeat)
        graph_ms = _time_graph(graph_module, args, kwargs, run_device, repeat)
    if runner.uncounted:
        warnings.warn(f"fxforge.profile: {len(runner.uncounted)} node(s) could not run under torch's FLOP counter "
                      f"and count 0 FLOPs: {', '.join(runner.uncounted[:5])}", stacklevel=3)
    machine = measure_machine(judge, dtype=_compute_dtype(graph_module, values, judge))
    timeline = simulate_with(graph_module, runner.values)
    live = dict(zip(timeline.nodes, timeline.after))
    modules = module_paths(graph_module, model)
    rows = []
    for node in graph_module.graph.nodes:
        if node.op not in CALL_OPS:
            continue
        times = runner.times.get(node.name) or [0.0]
        flops, nbytes = int(runner.flops.get(node.name, 0)), int(runner.bytes.get(node.name, 0))
        ratio = intensity(flops, nbytes)
        rows.append({
            "node": node.name, "op": op_type(node, graph_module), "target": target_name(node),
            "module": modules.get(node.name, ""), "source": node_source(node) or "",
            "time_ms": float(statistics.median(times)), "flops": flops, "bytes": nbytes,
            "intensity": float(ratio), "bound": machine.bound(ratio),
            "live_bytes": int(live.get(node.name, 0)), "measured_live_bytes": int(runner.measured.get(node.name, 0)),
        })
    import pandas as pd

    table = pd.DataFrame(rows, columns=COLUMNS)
    return Profile(table=table, machine=machine, graph_module=graph_module, timeline=timeline, graph_ms=graph_ms,
                   what=what, name=name, warmup=warmup, repeat=repeat, device=str(run_device))


def _compute_dtype(graph_module: nn.Module, values: list[Any], device: torch.device) -> torch.dtype:
    """The dtype the roofline's peak is measured in: float32, or on CUDA the half-precision dtype most of
    the parameters (else inputs) have (their peak is several times float32's)."""
    if device.type != "cuda":
        return torch.float32
    tensors = [*graph_module.parameters()] or tensor_leaves(values)
    counts: dict[torch.dtype, int] = defaultdict(int)
    for t in tensors:
        if t.is_floating_point():
            counts[t.dtype] += t.numel()
    dtype = max(counts, key=counts.__getitem__) if counts else torch.float32
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def _time_graph(graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict, device: torch.device,
                repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        graph_module(*args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return float(statistics.median(samples))
