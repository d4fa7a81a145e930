"""Whether a plan runs its independent branches at the same time: measured on the call's own inputs.

:func:`with_inter_op` finds the plan's regions (:func:`~fxforge.lowering.schedule.independent_branches`), times
every node once at the caller's thread count to price each branch, groups each region's branches onto the
threads (the costliest first: the critical path on the caller's thread), and keeps a region only where its
second group has work enough to pay for a thread's hand-off. The graph with those regions concurrent
(:func:`~fxforge.runtime.interop.concurrent_module`) must give the plan's outputs, and is kept only where it
measures faster than the plan as it was, timed in blocks (a thread pool's switch paid once per block, as a
caller running one of them pays it), so it is never slower than sequential on the shapes it was timed on.

The report gets one :class:`~fxforge.core.report.Tuning` entry, ``inter_op``: the two timings, the choice,
and the schedule (each region's fork and the groups of branches with their cost), or why none was tried.

Example:
    >>> from fxforge.lowering.build import build_plan
    >>> class Heads(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.cat([x.sin(), x.cos()], 1)
    >>> plan = build_plan(Heads(), (torch.ones(1, 4),), {})
    >>> kept = with_inter_op(plan, (torch.ones(1, 4),), {})
    >>> kept is plan, plan.report.tuning[-1].rule  # tiny branches: not worth a thread
    (True, 'inter_op')
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import statistics
from typing import Any

import torch

from fxforge.core.disk_cache import BUSY_LOAD, machine_key, machine_load
from fxforge.core.plan import Plan
from fxforge.core.report import Tuning
from fxforge.core.shapes import placeholder_values
from fxforge.core.verify import compare_outputs, isolated
from fxforge.lowering.lower import derived_values
from fxforge.lowering.schedule import Region, effectful_nodes, grouped, independent_branches, schedule
from fxforge.lowering.timing import DECISIVE, NOTE, autotune_cache, time_in_blocks
from fxforge.runtime.interop import concurrent_module
from fxforge.runtime.memory import device_of
from fxforge.runtime.profile.runner import NodeRunner

# A region whose second costliest group of branches takes less than this (ms, timed node by node) is left
# sequential: handing work to another thread and waiting for it costs tens of microseconds.
MIN_OVERLAP_MS = 0.05
# The concurrent graph is kept when its median is below this share of the sequential one's (on a busy
# machine, the second).
KEEP_BELOW, KEEP_BELOW_BUSY = 0.97, 0.85
# Seconds spent timing the two graphs against each other, about.
BUDGET_S = 0.6
RULE = "inter_op"


def _node_ms(graph_module: torch.fx.GraphModule, values: list[Any], device: torch.device) -> dict[str, float]:
    runner = NodeRunner(graph_module, device)
    runner.time(values, warmup=1, repeat=3)
    return {name: statistics.median(times) for name, times in runner.times.items()}


def _describe(region: Region, groups: list[list[int]], costs: list[float]) -> str:
    parts = []
    for members in groups:
        names = "+".join(region.branches[i][0].name for i in members)
        parts.append(f"{names} {sum(costs[i] for i in members):.2f} ms")
    return f"after {region.label}: " + " | ".join(parts)


def plan_regions(regions: list[Region], node_ms: dict[str, float], workers: int, *,
                 min_overlap_ms: float = MIN_OVERLAP_MS) -> tuple[list, list, list[str]]:
    """The regions worth running concurrently on ``workers`` threads (or streams), with their groups and the
    schedule's lines: ``(regions, groups, lines)``; a region whose second group is under
    :data:`MIN_OVERLAP_MS` is left out, its line saying so.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x.sin() + x.cos())
        >>> regions = independent_branches(gm)
        >>> kept, groups, lines = plan_regions(regions, {"sin": 1.0, "cos": 0.8}, 2)
        >>> groups, lines
        ([[[0], [1]]], ['after x: sin 1.00 ms | cos 0.80 ms'])
        >>> plan_regions(regions, {"sin": 1.0, "cos": 0.01}, 2)[2]
        ['after x: sin 1.00 ms | cos 0.01 ms (second group under 0.05 ms: sequential)']
    """
    kept, groups, lines = [], [], []
    for region in regions:
        costs = [sum(node_ms.get(n.name, 0.0) for n in branch) for branch in region.branches]
        members = grouped(costs, workers)
        line = _describe(region, members, costs)
        loads = [sum(costs[i] for i in m) for m in members]
        if len(members) < 2 or loads[1] < min_overlap_ms:
            lines.append(f"{line} (second group under {min_overlap_ms} ms: sequential)")
            continue
        kept.append(region)
        groups.append(members)
        lines.append(line)
    return kept, groups, lines


def with_inter_op(plan: Plan, args: tuple, kwargs: dict, *, always: bool = False) -> Plan:
    """``plan`` with its independent branches run at the same time where that measures faster on these inputs,
    else ``plan`` itself; either way the report's ``inter_op`` entry says what was found, measured and kept.

    A clear choice measured on a quiet machine is remembered in the autotune cache (per graph, input shapes,
    threads and machine) and read back the next time instead of timed. On a busy machine the concurrent
    graph must be :data:`KEEP_BELOW_BUSY` of the sequential one's time to be kept (other work holds the cores
    the branches need), and nothing is remembered.

    ``always``: every region concurrent, however small its branches, without timing (its outputs still checked
    against the plan's): for tests, and for callers who measured it themselves.

    Example:
        >>> from fxforge.lowering.build import build_plan
        >>> plan = build_plan(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {})
        >>> with_inter_op(plan, (torch.ones(1, 2),), {}) is plan   # a chain: nothing to run concurrently
        True
    """
    executable = plan.executable
    if not isinstance(executable, torch.fx.GraphModule):
        return plan
    regions = independent_branches(executable)
    if not regions:
        return plan
    report = plan.report
    values = placeholder_values(executable, args, kwargs)
    device = device_of(executable, values)
    workers = torch.get_num_threads() if device.type == "cpu" else max(len(r.branches) for r in regions)
    if always:
        workers = max(workers, 2)  # (a caller with one thread runs the groups in turn)
    if workers < 2:
        report.tuning.append(Tuning(RULE, "graph", "sequential", note=(
            f"{len(regions)} region(s) of independent branches; one intra-op thread: nothing to share"), kind="schedule"))
        return plan
    cache = None if always else autotune_cache()
    key = _cache_key(executable, values, workers, device)
    stored = cache.get(key) if cache is not None else None
    # (the runs below leave the model's buffers and the inputs as they were: BatchNorm in training mode, in-place ops)
    with isolated(executable, inputs=(args, kwargs)), torch.no_grad():
        if stored is not None:
            chosen = {r.label: r for r in regions}
            kept = [chosen[name] for name in stored["groups"] if name in chosen]
            groups, lines = list(stored["groups"].values()), stored["lines"]
        else:
            node_ms = {} if always else _node_ms(executable, values, device)
            kept, groups, lines = plan_regions(regions, node_ms, workers,
                                               min_overlap_ms=-1.0 if always else MIN_OVERLAP_MS)
        if not kept:
            report.tuning.append(Tuning(RULE, "graph", "sequential", note="; ".join(lines), kind="schedule"))
            return plan
        kept, groups, dropped = orderable(executable, kept, groups)
        lines += dropped
        if not kept:
            report.tuning.append(Tuning(RULE, "graph", "sequential", note="; ".join(lines), kind="schedule"))
            return plan
        concurrent = concurrent_module(executable, kept, groups)
        comparison = compare_outputs(executable(*args, **kwargs), concurrent(*args, **kwargs))
        if not comparison.ok:
            report.tuning.append(Tuning(RULE, "graph", "sequential", note=(
                f"the concurrent graph differs from the plan ({comparison.reason}): not used; " + "; ".join(lines)),
                kind="schedule"))
            return plan
        if stored is not None or always:
            timings = stored["timings"] if stored is not None else {}
        else:
            timings = time_in_blocks({"sequential": lambda: executable(*args, **kwargs),
                                      "concurrent": lambda: concurrent(*args, **kwargs)}, budget_s=BUDGET_S)
    load = machine_load()
    busy = load > BUSY_LOAD and stored is None and not always
    faster = always or timings["concurrent"] < (KEEP_BELOW_BUSY if busy else KEEP_BELOW) * timings["sequential"]
    how = f"{len(kept)} region(s) on {workers} {'threads' if device.type == 'cpu' else 'streams'}"
    if always:
        how = "inter_op='always', not timed; " + how
    elif stored is not None:
        how += f" ({NOTE})"
    elif busy:
        how += f" (machine busy, load {load:.2f} per core: kept only {1 / KEEP_BELOW_BUSY:.2f}x faster; not remembered)"
    elif cache is not None and abs(timings["sequential"] / timings["concurrent"] - 1) > DECISIVE:
        cache.put(key, {"groups": {r.label: g for r, g in zip(kept, groups)}, "lines": lines,
                        "timings": timings, "load": round(load, 2)})
    report.tuning.append(Tuning(RULE, "graph", "concurrent" if faster else "sequential", timings,
                                note=f"{how}: " + "; ".join(lines), kind="schedule"))
    if not faster:
        return plan
    return dataclasses.replace(plan, executable=concurrent,
                               derived=derived_values(plan.captured.graph_module, concurrent))


def orderable(executable: torch.fx.GraphModule, regions: list[Region], groups: list) -> tuple[list, list, list[str]]:
    """The regions (and their groups) that one order of the graph runs together, the last ones left out until it
    does, each left out with a line saying so (:func:`~fxforge.lowering.schedule.independent_branches` only
    proposes such sets; this holds the promise where the graph changed under it).

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x.sin() + x.cos())
        >>> orderable(gm, independent_branches(gm), [[[0], [1]]])[2]
        []
    """
    barred = effectful_nodes(executable)
    regions, groups, dropped = list(regions), list(groups), []
    while regions and schedule(regions, executable.graph, barred) is None:
        left = regions.pop()
        groups.pop()
        dropped.append(f"after {left.label}: left sequential (no order of the graph runs it with the other regions)")
    return regions, groups, dropped


def _cache_key(executable: torch.fx.GraphModule, values: list[Any], workers: int, device: torch.device) -> str:
    inputs = [(tuple(t.shape), t.stride(), str(t.dtype)) for t in values if isinstance(t, torch.Tensor)]
    digest = hashlib.sha256(f"{executable.code}\n{inputs}\n{workers}".encode()).hexdigest()
    return f"{machine_key(device)} | inter_op {digest}"


def inter_op_builder(build: Any, *, always: bool = False) -> Any:
    """A plan builder (``(args, kwargs, conditions, dynamic=None) -> Plan``) whose plans for calls that record
    no gradients and run without autocast go through :func:`with_inter_op` (plans that keep eager's ops for
    gradients or autocast are left as they are); ``always``: see :func:`with_inter_op`.

    Example:
        >>> from fxforge.core.plan import CallConditions
        >>> from fxforge.lowering.build import plan_builder
        >>> build = inter_op_builder(plan_builder(torch.nn.ReLU()))
        >>> build((torch.ones(2),), {}, CallConditions()).report.method
        'fx'
    """
    return stage_builder(build, with_inter_op, always=always)


def stage_builder(build: Any, stage: Any, *, always: bool = False) -> Any:
    """``build`` followed by ``stage(plan, args, kwargs, always=always)`` for plans of calls that record no
    gradients and run without autocast (a picklable partial: an optimized module's copies keep their builder).

    Example:
        >>> from fxforge.lowering.build import plan_builder
        >>> stage_builder(plan_builder(torch.nn.ReLU()), lambda plan, *a, always: plan)((torch.ones(1),), {}).report.method
        'fx'
    """
    return functools.partial(_built_then, build, stage, always)


def _built_then(build: Any, stage: Any, always: bool, args: tuple, kwargs: dict, conditions: Any = None,
                dynamic: Any = None) -> Plan:
    plan = build(args, kwargs, conditions, *(() if dynamic is None else (dynamic,)))
    if conditions is not None and (conditions.gradients or conditions.autocast):
        return plan
    return stage(plan, args, kwargs, always=always)
