"""Running a plan's independent branches at the same time (inter-operator parallelism).

:func:`concurrent_module` turns a lowered graph and the regions :mod:`fxforge.lowering.schedule` found into a
graph where each region is one call of a :class:`BranchRunner`. The runner holds one small graph per group
of branches and runs them at the same time:

- on CPU, each group on its own thread, with its share of the caller's intra-op threads (``torch.set_num_threads``
  acts on the calling thread only), the costliest group on the caller's thread; the caller's grad and
  inference mode hold in every thread; when the caller has fewer threads than groups (a throughput stream
  given one core), the groups run one after another on the caller's thread;
- on CUDA, each group after the first on a side stream of its own, ordered with the caller's stream by
  ``wait_stream`` both ways (no thread: launches are asynchronous).

Weights and folded or prepacked values are read by the outer graph (``get_attr``) and handed to the branch
graphs as inputs, so that a value the plan recomputes is the one every branch reads.

Example:
    >>> from fxforge.lowering.schedule import independent_branches
    >>> gm = torch.fx.symbolic_trace(lambda x: torch.cat([x.sin().exp(), x.cos().neg()]))
    >>> both = concurrent_module(gm, independent_branches(gm), [[[0], [1]]])
    >>> x = torch.randn(4)
    >>> torch.equal(both(x), gm(x)), sum(n.target is run_branches for n in both.graph.nodes)
    (True, 1)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import operator
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node
from torch.utils import _pytree as pytree

from fxforge.core.target_cache import device_of
from fxforge.lowering.schedule import Region, effectful_nodes, external_inputs, external_outputs, schedule
from fxforge.runtime.streams import cores

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that run branches besides the caller's (one fewer than the cores; made on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(max(1, cores() - 1), thread_name_prefix="fxforge-branch")
        return _POOL


def shares(threads: int, groups: int) -> list[int]:
    """Intra-op threads per group: ``threads`` split as evenly as it goes, the first group getting the rest.

    Example:
        >>> shares(4, 2), shares(5, 2), shares(2, 3)
        ([2, 2], [3, 2], [1, 1, 1])
    """
    base = max(1, threads // groups)
    return [max(1, threads - base * (groups - 1))] + [base] * (groups - 1)


def _run_group(graph: torch.nn.Module, args: tuple, threads: int, grad: bool, inference: bool) -> tuple:
    torch.set_num_threads(threads)
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return graph(*args)


@dataclasses.dataclass(eq=False)
class BranchRunner:
    """Runs groups of branches at the same time; ``runner(inputs)`` -> every group's outputs, in group order.

    Attributes:
        groups: one graph per group, ``graph(*its inputs) -> tuple of its outputs``; the first the costliest.
        takes: for each group, the positions in ``inputs`` of what it reads.
        names: for each group, the names of the branches' first nodes (for the report).

    Example:
        >>> double = torch.fx.symbolic_trace(lambda a: (a * 2,)); negate = torch.fx.symbolic_trace(lambda a: (-a,))
        >>> runner = BranchRunner([double, negate], [[0], [0]], [["mul"], ["neg"]])
        >>> [t.tolist() for t in runner((torch.ones(2),))]
        [[2.0, 2.0], [-1.0, -1.0]]
    """

    groups: list[torch.nn.Module]
    takes: list[list[int]]
    names: list[list[str]]
    _streams: dict = dataclasses.field(default_factory=dict, repr=False)

    def __call__(self, inputs: Sequence[Any]) -> tuple:
        per_group = [tuple(inputs[i] for i in take) for take in self.takes]
        device = device_of(tuple(inputs), {})
        if device.type == "cuda":
            results = self._on_streams(per_group, device)
        else:
            results = self._on_threads(per_group)
        return tuple(value for result in results for value in result)

    def _on_threads(self, per_group: list[tuple]) -> list[tuple]:
        threads = torch.get_num_threads()
        if threads < len(self.groups):
            return [group(*args) for group, args in zip(self.groups, per_group)]
        share = shares(threads, len(self.groups))
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        pool = _pool()
        futures = [pool.submit(_run_group, group, args, n, grad, inference)
                   for group, args, n in zip(self.groups[1:], per_group[1:], share[1:])]
        try:
            torch.set_num_threads(share[0])
            first = self.groups[0](*per_group[0])
        finally:
            torch.set_num_threads(threads)
            concurrent.futures.wait(futures)  # no branch may outlive the call, whatever happened here
        return [first, *(future.result() for future in futures)]

    def _on_streams(self, per_group: list[tuple], device: torch.device) -> list[tuple]:
        current = torch.cuda.current_stream(device)
        streams = self._streams.setdefault(device, [torch.cuda.Stream(device) for _ in self.groups[1:]])
        results = []
        for index, (group, args) in enumerate(zip(self.groups, per_group)):
            if index == 0:
                results.append(group(*args))
                continue
            stream = streams[index - 1]
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                result = group(*args)
            for tensor in _tensors((args, result)):  # freed by either stream: the allocator must know both used it
                tensor.record_stream(stream)
                tensor.record_stream(current)
            results.append(result)
        for stream in streams:
            current.wait_stream(stream)
        return results


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.device.type == "cuda"]


def run_branches(runner: BranchRunner, *inputs: Any) -> tuple:
    """What a region's node in the graph calls: ``runner(inputs)``.

    Example:
        >>> run_branches(BranchRunner([torch.fx.symbolic_trace(lambda a: (a + 1,))], [[0]], [["add"]]), torch.zeros(1))
        (tensor([1.]),)
    """
    return runner(inputs)


def _fetch(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def group_module(graph_module: torch.fx.GraphModule, nodes: Sequence[Node]) -> tuple[torch.fx.GraphModule, list[Node], list[Node]]:
    """A graph of ``nodes`` alone (in graph order): ``(graph, what it reads, what it returns)``; what it reads
    from outside (weights included) comes in as inputs, and what is read outside it goes out as a tuple.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x.sin().cos() + x)
        >>> sin, cos = [n for n in gm.graph.nodes if n.op == "call_method"]
        >>> part, reads, returns = group_module(gm, [sin, cos])
        >>> [n.name for n in reads], [n.name for n in returns], part(torch.zeros(1))
        (['x'], ['cos'], (tensor([1.]),))
    """
    reads, returns = external_inputs(nodes), external_outputs(nodes)
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for node in reads:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in returns))
    modules = {n.target: graph_module.get_submodule(n.target) for n in nodes if n.op == "call_module"}
    return torch.fx.GraphModule(modules, graph, "Branches"), reads, returns


def concurrent_module(graph_module: torch.fx.GraphModule, regions: Sequence[Region],
                      groups: Sequence[Sequence[Sequence[int]]]) -> torch.fx.GraphModule:
    """A copy of ``graph_module`` whose regions each run as one :func:`run_branches` call, the branches of
    ``regions[i]`` grouped as ``groups[i]`` says (lists of branch indices, the costliest group first).

    The copy holds the same weights, submodules and ``meta`` (its prepacked values are its own attributes:
    a plan recomputing them replaces them there). Raises ValueError when no order serves the regions.

    Example:
        >>> from fxforge.lowering.schedule import independent_branches
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        >>> concurrent_module(gm, independent_branches(gm), []).graph is not gm.graph
        True
    """
    steps = schedule(list(regions), graph_module.graph, effectful_nodes(graph_module))
    if steps is None:
        raise ValueError("no order of the graph runs these regions' branches together")
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    attributes: dict[str, Any] = {}
    for step in steps:
        if isinstance(step, Node):
            env[step] = graph.node_copy(step, env.__getitem__)
            if step.op in ("get_attr", "call_module"):
                attributes[step.target] = _fetch(graph_module, step.target)
            continue
        region, index = step
        runner, reads, returns = _runner(graph_module, region, groups[index])
        name = f"_fxforge_branches_{index}"
        attributes[name] = runner
        call = graph.call_function(run_branches, (graph.get_attr(name), *(env[n] for n in reads)))
        for position, node in enumerate(returns):
            env[node] = graph.call_function(operator.getitem, (call, position))
            env[node].meta = dict(node.meta)
    graph.set_codegen(graph_module.graph._codegen)  # (export's pytree in and out specs)
    module = torch.fx.GraphModule(attributes, graph, type(graph_module).__name__)
    module.meta = {k: dict(v) if isinstance(v, dict) else v for k, v in getattr(graph_module, "meta", {}).items()}
    module.meta["fxforge_sequential"] = graph_module  # (what a node-by-node profile measures)
    return module


def sequential_of(executable: Any) -> Any:
    """The graph a concurrent plan was made from (its nodes one after another), else ``executable`` itself: what
    a node-by-node profile measures, as a ``run_branches`` node would hide the nodes it runs.

    Example:
        >>> from fxforge.lowering.schedule import independent_branches
        >>> gm = torch.fx.symbolic_trace(lambda x: x.sin() + x.cos())
        >>> sequential_of(concurrent_module(gm, independent_branches(gm), [[[0], [1]]])) is gm, sequential_of(gm) is gm
        (True, True)
    """
    return getattr(executable, "meta", {}).get("fxforge_sequential", executable)


def _runner(graph_module: torch.fx.GraphModule, region: Region,
            groups: Sequence[Sequence[int]]) -> tuple[BranchRunner, list[Node], list[Node]]:
    position = {node: i for i, node in enumerate(graph_module.graph.nodes)}
    parts, takes, names, reads, returns = [], [], [], {}, []
    for members in groups:
        nodes = sorted((n for i in members for n in region.branches[i]), key=position.__getitem__)
        part, part_reads, part_returns = group_module(graph_module, nodes)
        parts.append(part)
        takes.append([reads.setdefault(n, len(reads)) for n in part_reads])
        names.append([region.branches[i][0].name for i in members])
        returns.extend(part_returns)
    return BranchRunner(parts, takes, names), list(reads), returns
