"""A derived tensor-parallel plan built with ``parallelize_module`` (DTensor), and its collectives predicted.

:func:`module_plan` turns a :class:`~fxforge.parallel.tp_derive.TensorParallelPlan` into the dictionary
``parallelize_module`` takes: ``ColwiseParallel`` / ``RowwiseParallel`` for the split linear layers (and, for
GPT-2's transposed ``Conv1D``, the same styles with the weight's dimensions swapped), ``RowwiseParallel`` over
the vocabulary for embeddings and ``ColwiseParallel`` with a replicated output for the LM head,
``PrepareModuleInput`` where several layers read one input, and under sequence parallelism
``SequenceParallel`` for norms and dropouts, rows reduced-scattered over the sequence, and inputs gathered
back before the column-parallel layers (torchtitan's layouts). :func:`apply_tp` edits the attributes the
plan names, builds the plan and keeps tied weights tied.

:func:`predicted_tp_collectives` lists every collective of one forward and backward, with its exact bytes,
from the plan and the sizes of the values in the traced graph.

Under sequence parallelism the norms' replicated parameters get partial gradients (each rank's sum over its
positions), which DTensor leaves partial: an optimizer would then step each replica with its own part.
:func:`apply_tp` sums them as soon as they are accumulated (one all-reduce each, in the backward, predicted).

Example:
    >>> from fxforge.parallel.tp_derive import derive_tp_plan
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> plan = derive_tp_plan(model, (torch.randn(4, 8),), degree=2)
    >>> {name: type(style).__name__ for name, style in module_plan(plan).items()}
    {'0': 'ColwiseParallel', '2': 'RowwiseParallel'}
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fxforge.parallel.collectives import Collective
from fxforge.parallel.tp_derive import TensorParallelPlan
from fxforge.parallel.tp_trace import TracedForward, trace_forward

SEQUENCE = Shard(1)


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: dict[str, list], src_data_rank: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, placements[name], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class TransposedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a linear layer stored transposed (transformers' ``Conv1D``: weight
    ``[in, out]``): the weight is split along dimension 1, the bias along 0."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            _distribute(mod, mesh, {"weight": [Shard(1)], "bias": [Shard(0)]}, self.src_data_rank)

        return distribute_module(module, device_mesh, partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class TransposedRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a linear layer stored transposed: the weight is split along dimension 0, the
    bias replicated."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            _distribute(mod, mesh, {"weight": [Shard(0)], "bias": [Replicate()]}, self.src_data_rank)

        return distribute_module(module, device_mesh, partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Styles(ParallelStyle):
    """Several styles applied to one module in turn (a norm that is sequence-parallel and hands a full
    sequence on; a module whose input is gathered and whose output is split)."""

    def __init__(self, *styles: ParallelStyle):
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return f"Styles({', '.join(map(repr, self.styles))})"


def _prepare(slot: int | str, positional: int, layout, desired=None) -> PrepareModuleInput:
    """``PrepareModuleInput`` making the input in ``slot`` (of ``layout``) a DTensor of layout ``desired``
    (replicated by default)."""
    desired = desired or Replicate()
    if isinstance(slot, str):
        return PrepareModuleInput(input_kwarg_layouts={slot: layout}, desired_input_kwarg_layouts={slot: desired})
    layouts = tuple(layout if i == slot else None for i in range(positional))
    wanted = tuple(desired if i == slot else None for i in range(positional))
    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=wanted)


def _add(plan: dict[str, ParallelStyle], name: str, style: ParallelStyle) -> None:
    plan[name] = Styles(plan[name], style) if name in plan else style


def module_plan(plan: TensorParallelPlan) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of a derived plan (module docstring).

    Example:
        >>> from fxforge.parallel.tp_derive import TensorParallelPlan
        >>> plan = TensorParallelPlan({"up": "colwise", "down": "rowwise"}, {}, 2, kinds={"up": "linear", "down": "linear"})
        >>> module_plan(plan)["down"]
        RowwiseParallel(input_layouts=(Shard(dim=-1),), output_layouts=(Replicate(),), use_local_output=True)
    """
    sp = plan.sequence_parallel
    stream = SEQUENCE if sp else Replicate()
    result: dict[str, ParallelStyle] = {}
    for name, style in plan.styles.items():
        kind = plan.kinds.get(name, "linear")
        own_input = SEQUENCE if name in plan.seq_inputs else Replicate()
        if style == "colwise":
            if kind == "embedding":
                result[name] = ColwiseParallel()
            else:
                cls = TransposedColwiseParallel if kind == "transposed_linear" else ColwiseParallel
                result[name] = cls(input_layouts=own_input)
        elif style == "rowwise":
            cls = TransposedRowwiseParallel if kind == "transposed_linear" else RowwiseParallel
            result[name] = cls(output_layouts=stream, use_local_output=not sp)
        elif style == "vocab" and kind == "embedding":
            split = name in plan.split_outputs
            result[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=SEQUENCE if split else Replicate(),
                                           use_local_output=not split)
        elif style == "vocab":
            result[name] = ColwiseParallel(input_layouts=own_input, output_layouts=Replicate())
        elif style == "sequence":
            result[name] = SequenceParallel()
            if name in plan.exits:
                result[name] = Styles(SequenceParallel(), PrepareModuleOutput(
                    output_layouts=SEQUENCE, desired_output_layouts=Replicate(), use_local_output=True))
    for name, (slot, positional) in plan.gathers.items():
        # One replicated DTensor for all the layers that read it: its gradient summed once, not once each.
        _add(result, name, _prepare(slot, positional, SEQUENCE if name in plan.seq_inputs else Replicate()))
    for name in plan.gather_outputs:
        layout = SEQUENCE if name in plan.seq_inputs else Replicate()
        _add(result, name, PrepareModuleOutput(output_layouts=layout, desired_output_layouts=Replicate(),
                                               use_local_output=False))
    for name, (slot, positional) in plan.entry_inputs.items():
        _add(result, name, _prepare(slot, positional, Replicate(), SEQUENCE))
    for name in plan.entries:
        _add(result, name, PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=SEQUENCE,
                                               use_local_output=False))
    return result


def apply_tp(model: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh) -> nn.Module:
    """Build ``plan`` on ``model`` in place over the 1-D ``mesh``, and return it.

    The attributes in ``plan.edits`` are divided (each only if it still holds the value the plan saw), the
    styles of :func:`module_plan` applied with ``parallelize_module``, and parameters that were one tensor
    before are made one again (``parallelize_module`` replaces each module's parameters by its own).
    """
    if mesh.size() != plan.degree:
        raise ValueError(f"the plan is for {plan.degree} ranks, the mesh has {mesh.size()}")
    for module_name, attrs in plan.edits.items():
        module = model.get_submodule(module_name)
        for attr, (old, new) in attrs.items():
            if getattr(module, attr) == old:
                setattr(module, attr, new)
    parallelize_module(model, mesh, module_plan(plan))
    for name in plan.of_style("sequence"):
        # A replicated parameter used on sequence pieces gets a partial gradient on each rank (its sum over
        # the rank's positions). An optimizer would step each replica with its own part (DTensor leaves the
        # gradient partial): summed here, as soon as it is accumulated.
        for param in model.get_submodule(name).parameters(recurse=False):
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(_sum_partial_gradient)
    for group in plan.tied:
        owners = [name.rpartition(".") for name in group]
        sharded = [model.get_submodule(m)._parameters[p] for m, _, p in owners]
        keep = next((p for p, (m, _, _) in zip(sharded, owners) if plan.styles.get(m) not in (None, "replicate")),
                    sharded[0])
        for module_name, _, param in owners:
            model.get_submodule(module_name).register_parameter(param, keep)
    return model


def _sum_partial_gradient(param: nn.Parameter) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=[Replicate()] * len(grad.placements))


def tp_mesh(degree: int, device_type: str = "cpu") -> DeviceMesh:
    """A 1-D mesh over ranks ``0..degree-1`` of the default process group, named ``tp``."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (degree,), mesh_dim_names=("tp",))



def _nbytes(node: torch.fx.Node | None) -> int:
    value = node.meta.get("val") if node is not None else None
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def tp_collectives(traced: TracedForward, plan: TensorParallelPlan) -> list[Collective]:
    """:func:`predicted_tp_collectives` on a graph already traced (forward in order, then backward)."""
    sp, degree = plan.sequence_parallel, plan.degree
    forward: list[tuple[int, Collective]] = []
    backward: list[tuple[int, Collective]] = []
    order = {node: i for i, node in enumerate(traced.graph.nodes)}

    def add(kind: str, node: torch.fx.Node | None, phase: str, where: str) -> None:
        if node is None or (phase == "backward" and not traced.requires_grad(node)):
            return
        (forward if phase == "forward" else backward).append(
            (order[node], Collective(kind, _nbytes(node), degree, "tp", phase, where)))

    def gather_input(node: torch.fx.Node | None, where: str) -> None:
        # Replicated input of column-parallel layers: gathered over the sequence (all-gather, its gradient
        # reduce-scattered) when it comes from the stream, else only its gradient summed (all-reduce).
        if where in plan.seq_inputs:
            add("all_gather", node, "forward", where)
            add("reduce_scatter", node, "backward", where)
        else:
            add("all_reduce", node, "backward", where)

    for name, style in plan.styles.items():
        kind = plan.kinds.get(name, "linear")
        for call in traced.calls_of(name):
            inp, out = call.inputs.get(0), call.outputs.get(0)
            own = name not in plan.gathered
            if style == "rowwise" or (style == "vocab" and kind == "embedding" and name in plan.split_outputs):
                if sp:
                    add("reduce_scatter", out, "forward", name)
                    add("all_gather", out, "backward", name)
                else:
                    add("all_reduce", out, "forward", name)
            elif style == "vocab" and kind == "embedding":
                add("all_reduce", out, "forward", name)
            elif style == "vocab":
                gather_input(inp, name)
                add("all_gather", out, "forward", name)
            elif style == "colwise" and kind != "embedding" and own:
                gather_input(inp, name)
            if name in plan.exits:
                add("all_gather", out, "forward", name)
    for name, (slot, _) in plan.gathers.items():
        for call in traced.calls_of(name):
            gather_input(call.inputs.get(slot), name)
    for name in plan.gather_outputs:
        for call in traced.calls_of(name):
            gather_input(call.outputs.get(0), name)
    for name in plan.entries:  # cut over the sequence: free; the gradient is gathered back
        for call in traced.calls_of(name):
            add("all_gather", call.outputs.get(0), "backward", name)
    for name in plan.of_style("sequence"):  # their replicated parameters' partial gradients, summed
        for call in traced.calls_of(name)[-1:]:
            for node, param in traced.parameters.items():
                if param.rpartition(".")[0] == name and traced.step.trainable[list(traced.parameters).index(node)]:
                    backward.append((order[call.inputs.get(0, node)], Collective(
                        "all_reduce", _nbytes(node), degree, "tp", "backward", param)))
    for name, (slot, _) in plan.entry_inputs.items():
        for call in traced.calls_of(name):
            add("all_gather", call.inputs.get(slot), "backward", name)
    return ([c for _, c in sorted(forward, key=lambda item: item[0])]
            + [c for _, c in sorted(backward, key=lambda item: -item[0])])


def predicted_tp_collectives(model: nn.Module, example_inputs: Any, plan: TensorParallelPlan) -> list[Collective]:
    """Every tensor-parallel collective of one forward and backward of ``model`` built with ``plan``, with
    the bytes of the full tensor each moves (the :class:`~fxforge.parallel.collectives.Collective` record),
    read from the sizes of the values in the model's graph for ``example_inputs``:

    - a row-parallel layer sums its output: all-reduce (sequence parallel: reduce-scatter, and its
      gradient all-gathered in the backward); an embedding split over the vocabulary too;
    - a column-parallel layer's replicated input gets its gradient summed in the backward: all-reduce, once
      per ``PrepareModuleInput`` that several layers share (sequence parallel: the input is all-gathered and
      its gradient reduce-scattered);
    - the LM head split over the vocabulary all-gathers its logits.

    - under sequence parallelism, where the stream is cut (free; its gradient all-gathered), gathered back
      (all-gather), and the norms' parameters' gradients (all-reduce).

    Gradients are only summed for values a gradient reaches (an input that needs none costs nothing).
    ``model`` is the model before :func:`apply_tp` (it is traced on fake tensors, in its own dtype).

    Example:
        >>> from fxforge.parallel.tp_derive import derive_tp_plan
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        >>> x = torch.randn(4, 8)
        >>> [(c.kind, c.nbytes, c.phase) for c in predicted_tp_collectives(model, (x,), derive_tp_plan(model, (x,), 2))]
        [('all_reduce', 128, 'forward')]
    """
    return tp_collectives(trace_forward(model, example_inputs), plan)
