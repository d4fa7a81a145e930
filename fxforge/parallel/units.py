"""The model as a chain of units between the places a pipeline may be split, with what each unit costs.

A pipeline stage of ``torch.distributed.pipelining`` begins where a submodule is called
(``split_spec={"transformer.h.6": SplitPoint.BEGINNING}``). So the candidates are the submodules called
once whose operations run as one unbroken stretch of the forward: cutting before one of them cuts the
forward in two. The stretches between consecutive candidates are the **units**; a stage is a run of
consecutive units.

Everything is read from the training step's own graphs (:func:`fxforge.training.step_graph.trace_step`
on fake tensors, one microbatch, no real compute):

- each unit's forward and backward time: the roofline estimate of its nodes
  (:func:`fxforge.core.costs.node_seconds`); a backward node belongs to the unit of the forward
  operation it differentiates (the autograd sequence number both carry);
- the bytes it saves for its backward (per microbatch);
- the parameters and buffers each unit uses (a parameter used by several stages is replicated to each);
- every value used outside the unit that makes it, with its size and whether a gradient flows back.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> units = stage_units(model, (torch.randn(4, 8),))
    >>> units.names                     # the first unit begins the model; a stage may begin at 1 or 2
    ['', '1', '2']
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Any

import numpy as np
import torch

from fxforge.capture.model import normalize_inputs
from fxforge.core.costs import Machine, node_flops, node_seconds
from fxforge.core.memory import tensor_leaves, value_bytes
from fxforge.core.nodes import is_view_op
from fxforge.runtime.roofline import measure_machine
from fxforge.training.eager_graph import eager_like_graph
from fxforge.training.step_graph import clean_module_path, default_loss, module_of, trace_step


@dataclasses.dataclass(frozen=True)
class Item:
    """A tensor some units use: a parameter, a buffer, or a value made by one unit and used by others.

    Attributes:
        name: the parameter's or buffer's name, or the graph node's.
        nbytes: its size (per microbatch, for values).
        unit: the unit that makes it (0 for the model's inputs; -1 for parameters and buffers).
        uses: the units that use it, ascending.
        grad: a gradient flows back for it (a trainable parameter, or a float value downstream of one).
    """

    name: str
    nbytes: int
    unit: int
    uses: tuple[int, ...]
    grad: bool


@dataclasses.dataclass
class StageUnits:
    """The forward cut at every candidate split point, with each unit's costs (see the module docstring).

    Attributes:
        names: per unit, the submodule it begins with (the ``split_spec`` key of a stage starting there;
            ``""`` for the first unit, which begins the model).
        forward_seconds, backward_seconds: per unit, per microbatch (roofline estimates).
        flops: per unit, forward FLOPs per microbatch.
        saved_bytes: per unit, what its forward keeps for its backward, per microbatch.
        parameters: the parameters (``grad`` when trainable); buffers: the buffers.
        values: the values crossing unit boundaries (model inputs count as made before unit 0).
        microbatch: the example inputs of one microbatch (``(args, kwargs)``), as ``pipeline`` wants them.
        machine: what the estimates assume.
    """

    names: list[str]
    forward_seconds: np.ndarray
    backward_seconds: np.ndarray
    flops: np.ndarray
    saved_bytes: np.ndarray
    parameters: list[Item]
    buffers: list[Item]
    values: list[Item]
    microbatch: tuple[tuple[Any, ...], dict[str, Any]]
    machine: Machine

    def __len__(self) -> int:
        return len(self.names)

    @property
    def seconds(self) -> np.ndarray:
        """Forward + backward time per unit."""
        return self.forward_seconds + self.backward_seconds


def module_stack(node: torch.fx.Node) -> list[str]:
    """The submodules running while ``node`` ran, outermost first (the root left out): those the trace
    saw being called, or (without that record) the prefixes of the innermost one."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if stack:
        return [p for p in (clean_module_path(path) for path, _ in stack.values()) if p]
    parts = module_of(node).split(".") if module_of(node) else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def split_candidates(stacks: list[list[str]]) -> dict[int, str]:
    """Where a stage may begin: position in the forward -> the outermost submodule whose operations start
    there and run unbroken (every operation between its first and last is its own; a module called twice
    with other work between is no candidate).

    Example:
        >>> split_candidates([["a", "a.x"], ["a", "a.y"], ["b"], ["a", "a.x"]])   # a runs twice
        {1: 'a.y', 2: 'b'}
    """
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    for i, stack in enumerate(stacks):
        for module in stack:
            first.setdefault(module, i)
            last[module] = i
            count[module] = count.get(module, 0) + 1
    starts: dict[int, str] = {}
    for module in sorted(first, key=lambda m: (first[m], m.count("."))):
        if first[module] == 0 or first[module] in starts:
            continue
        if count[module] == last[module] - first[module] + 1:  # contiguous: no foreign op inside
            starts[first[module]] = module
    return starts


def microbatches_of(args: tuple[Any, ...], kwargs: dict[str, Any], count: int) -> list[tuple[tuple, dict]]:
    """The batch sliced along dim 0 into ``count`` microbatches, as the schedules slice it.

    Example:
        >>> [a[0].shape[0] for a, _ in microbatches_of((torch.ones(6, 2),), {}, 3)]
        [2, 2, 2]
    """
    def piece(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.tensor_split(count)[i]
        return value

    return [(tuple(piece(a, i) for a in args), {k: piece(v, i) for k, v in kwargs.items()}) for i in range(count)]


def _microbatch(args: tuple[Any, ...], kwargs: dict[str, Any], microbatches: int):
    """The first of ``microbatches`` equal slices of every tensor input along dim 0 (copies: the slices are
    pickled to the workers, and a view would carry the whole batch)."""
    if microbatches == 1:
        return args, kwargs
    sizes = {t.shape[0] for t in tensor_leaves((args, kwargs)) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"cannot split the inputs into {microbatches} microbatches: their first dimensions "
                         f"differ ({sorted(sizes)}); pipelining slices every input tensor along dim 0")
    (batch,) = sizes
    if batch % microbatches:
        raise ValueError(f"the batch of {batch} does not split into {microbatches} equal microbatches")
    first_args, first_kwargs = microbatches_of(args, kwargs, microbatches)[0]
    return torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                                        (first_args, first_kwargs))


def _base(node: torch.fx.Node) -> torch.fx.Node:
    while is_view_op(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


COSTS = ("roofline", "measured")
"""Where a node's time comes from: the roofline estimate (FLOPs and bytes on the measured machine;
deterministic), or the node itself timed running the step's graphs on real data (one microbatch)."""


class _TimedInterpreter(torch.fx.Interpreter):
    """Runs a graph on real tensors and keeps each call's wall time (the least over the runs)."""

    def __init__(self, module: torch.fx.GraphModule, seconds: dict[torch.fx.Node, float]):
        super().__init__(module)
        self.seconds = seconds

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op != "call_function":
            return super().run_node(node)
        start = time.perf_counter()
        result = super().run_node(node)
        took = time.perf_counter() - start
        self.seconds[node] = min(took, self.seconds.get(node, took))
        return result


def measured_node_seconds(step: Any, flat_inputs: tuple[Any, ...], repeats: int = 3) -> dict[torch.fx.Node, float]:
    """Each forward and backward node's time, run on the model's real parameters and ``flat_inputs`` (the
    least of ``repeats`` runs: the first one pays for kernels' set-up). The model is not changed: the
    graphs are functional (batch-norm statistics come out as values)."""
    params = [p.detach() for _, p in step.wrapper.named_parameters(remove_duplicate=False)]
    buffers = [b.detach().clone() for _, b in step.wrapper.named_buffers(remove_duplicate=False)]
    forward_inputs = [*params, *buffers, *(t for t in flat_inputs if isinstance(t, torch.Tensor))]
    placeholders = list(step.forward.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(forward_inputs):
        raise ValueError(f"the forward graph takes {len(placeholders)} inputs, not {len(forward_inputs)}")
    seconds: dict[torch.fx.Node, float] = {}
    with torch.no_grad(), torch.random.fork_rng():
        for _ in range(repeats):
            outputs = _TimedInterpreter(step.forward, seconds).run(*forward_inputs)
            saved = list(outputs[step.num_fwd_outputs:])
            tangents = [torch.ones(n.meta["val"].shape, dtype=n.meta["val"].dtype)
                        for n in step.backward.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
            _TimedInterpreter(step.backward, seconds).run(*saved, *tangents)
    return seconds


def stage_units(model: torch.nn.Module, example_inputs: Any, *, microbatches: int = 1,
                machine: Machine | None = None, loss: Any = default_loss, costs: str = "roofline") -> StageUnits:
    """Trace one microbatch of ``model``'s training step and cut it into units (module docstring).

    Args:
        model: the model, as it will be pipelined.
        example_inputs: the whole batch (a tuple of positional inputs, a tensor, or a dict of keywords).
        microbatches: the batch is sliced into this many along dim 0; costs are per slice.
        machine: the device the stages run on (default: this machine's CPU, measured once).
        loss: outputs -> the scalar the backward starts from (only its cost depends on it).
        costs: ``"roofline"`` (default) or ``"measured"`` (:data:`COSTS`): the latter runs the step's graphs
            three times on one microbatch with this process's threads.
    """
    if costs not in COSTS:
        raise ValueError(f"costs {costs!r}: one of {', '.join(COSTS)}")
    args, kwargs = normalize_inputs(example_inputs)
    mb_args, mb_kwargs = _microbatch(args, kwargs, microbatches)
    machine = machine or measure_machine("cpu")
    if args and kwargs:
        raise ValueError("give the example inputs as a tuple of positional inputs or a dict of keywords, not both")
    graph_module = eager_like_graph(model, mb_kwargs or mb_args)
    # The captured graph takes the keywords as its placeholders: pass them positionally, so each traced
    # op keeps its node's module (the Interpreter runs the graph).
    names = [n.target for n in graph_module.graph.find_nodes(op="placeholder")]
    flat = tuple(mb_kwargs[name] for name in names) if mb_kwargs else mb_args
    step = trace_step(graph_module, flat, {}, loss=loss)
    timed = measured_node_seconds(step, flat) if costs == "measured" else None

    def seconds_of(node: torch.fx.Node) -> float:
        return timed.get(node, 0.0) if timed is not None else node_seconds(node, machine)

    forward = [n for n in step.forward.graph.nodes if n.op == "call_function"]
    starts = split_candidates([module_stack(n) for n in forward])
    positions = [0, *sorted(starts)]
    names = ["", *(starts[p] for p in positions[1:])]
    unit_of: dict[torch.fx.Node, int] = {n: bisect.bisect_right(positions, i) - 1 for i, n in enumerate(forward)}
    count = len(positions)

    fwd_s = np.zeros(count)
    bwd_s = np.zeros(count)
    flops = np.zeros(count)
    by_seq: dict[int, int] = {}
    by_path: dict[str, int] = {}
    for node in forward:
        unit = unit_of[node]
        fwd_s[unit] += seconds_of(node)
        flops[unit] += node_flops(node)
        if (seq := node.meta.get("seq_nr")) is not None:
            by_seq.setdefault(seq, unit)
        by_path.setdefault(module_of(node), unit)
    backward_unit: dict[torch.fx.Node, int] = {}
    for node in step.backward.graph.nodes:
        if node.op != "call_function":
            continue
        inputs = [backward_unit[i] for i in node.all_input_nodes if i in backward_unit]
        if node.target is torch.ops.aten.add.Tensor and not module_of(node) and len(inputs) == 2:
            # Autograd adding up the gradients of a tensor several units use (a tied weight, the blocks
            # of a split layer): the earlier unit's stage adds them when both are its own.
            unit = min(inputs)
        else:
            unit = by_seq.get(node.meta.get("seq_nr"), by_path.get(module_of(node), count - 1))
        backward_unit[node] = unit
        bwd_s[unit] += seconds_of(node)

    placeholders = [n for n in step.forward.graph.nodes if n.op == "placeholder"]
    n_params, n_buffers = len(step.parameter_names), len(step.buffer_names)
    state = set(placeholders[:n_params + n_buffers])

    def uses(node: torch.fx.Node) -> tuple[int, ...]:
        return tuple(sorted({unit_of[u] for u in node.users if u in unit_of}))

    parameters = [Item(name, value_bytes(node.meta.get("val")), -1, uses(node), trainable)
                  for name, node, trainable in zip(step.parameter_names, placeholders, step.trainable)]
    buffers = [Item(name, value_bytes(node.meta.get("val")), -1, uses(node), False)
               for name, node in zip(step.buffer_names, placeholders[n_params:])]

    grad: dict[torch.fx.Node, bool] = {}
    for node, trainable in zip(placeholders, step.trainable):
        grad[node] = trainable
    values = []
    for node in step.forward.graph.nodes:
        if node.op == "output" or node in state:
            continue
        floating = any(t.is_floating_point() for t in tensor_leaves(node.meta.get("val")))
        grad[node] = floating and any(grad.get(i, False) for i in node.all_input_nodes)
        made = unit_of.get(node, 0)  # the model's inputs enter with the first stage
        used = uses(node)
        if isinstance(node.meta.get("val"), (tuple, list)) or not used or used == (made,):
            continue  # a multi-output op's tensors are its getitem nodes
        values.append(Item(node.name, value_bytes(node.meta.get("val")), made, used, grad[node]))

    saved = np.zeros(count)
    seen: set[torch.fx.Node] = set()
    for node in step.saved_nodes():
        base = _base(node)
        if base in seen or base in state or base.op == "placeholder":
            continue
        seen.add(base)
        saved[unit_of.get(base, 0)] += value_bytes(base.meta.get("val"))
    return StageUnits(names, fwd_s, bwd_s, flops, saved, parameters, buffers, values, (mb_args, mb_kwargs),
                      machine)
