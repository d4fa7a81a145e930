"""One device's memory under a mesh: its share of the weights, gradients and optimizer state, and the
activations of its slice of the batch, from the one-process training-memory model
(:func:`fxforge.training.training_memory`).

- **Weights**: a tensor-parallel layer keeps ``1/tp`` of its matrix (``torch.chunk``'s split: the first
  ranks hold the larger part when it does not divide), replicated ones stay whole; ``fully_shard`` then
  keeps ``ceil(dim0 / fsdp)`` rows of each. Gradients follow the weights; the optimizer's state is
  :func:`fxforge.training.optimizer_memory.optimizer_memory` of the local shards.
- **Activations**: the one-process step at the slice of the batch a replica sees (``batch / (dp x fsdp)``),
  with the part tensor parallelism splits (:func:`fxforge.parallel.step_costs.split_forward_nodes`)
  divided by ``tp``.
- the batch itself is not counted (a run measures above it).
- **Gathered**: under ``fully_shard`` a block's whole parameters exist while it runs, with the buffers
  of the all-gathers around it: :data:`FSDP_BLOCKS_HELD` times the largest block; and the root's
  parameters (what no block holds: embeddings, the head) stay whole from its forward to the end of the
  backward, where its whole gradients wait for the last reduce-scatter (those of the parameters
  registered after the blocks, the head's, are there at the backward's peak; the embedding's come last).

Example:
    >>> local_shape((8, 6), 1, 4)
    (8, 2)
    >>> local_shape((10, 6), 0, 4), local_shape((6,), None, 4)
    ((3, 6), (6,))
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from fxforge.parallel.step_costs import split_forward_nodes

FSDP_BLOCKS_HELD = 3
"""Whole blocks' worth of bytes FSDP2 holds at its peak: while a block's parameters are all-gathered, the
all-gather's output and the unsharded parameters it is copied out to exist together, and the previous
block's all-gather output is kept until this one is issued (FSDP2 holds it so the CPU cannot run ahead of
the collective); in backward the same with the next block prefetched."""


def local_shape(shape: tuple[int, ...], dim: int | None, parts: int) -> tuple[int, ...]:
    """The largest shard of ``shape`` split in ``parts`` along ``dim`` (``torch.chunk``: ceil division)."""
    if dim is None or parts == 1:
        return tuple(shape)
    out = list(shape)
    out[dim] = math.ceil(shape[dim] / parts)
    return tuple(out)


def fsdp_shape(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """FSDP2's shard of ``shape`` over ``parts``: ``ceil(dim0 / parts)`` rows (the padding is allocated)."""
    if parts == 1 or not shape:
        return tuple(shape)
    return (math.ceil(shape[0] / parts), *shape[1:])


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """A device's predicted peak and its parts, bytes.

    Example:
        >>> m = DeviceMemory(100, 0, 100, 200, 50, 0, 0, 450, "backward")
        >>> m.peak, m.parts()["activations"]
        (450, 50)
    """

    weights: int
    buffers: int
    gradients: int
    optimizer_state: int
    activations: int
    gathered: int
    inputs: int
    peak: int
    peak_phase: str

    def parts(self) -> dict[str, int]:
        return {"weights": self.weights, "buffers": self.buffers, "gradients": self.gradients,
                "optimizer_state": self.optimizer_state, "activations": self.activations,
                "gathered": self.gathered, "inputs": self.inputs, "peak": self.peak}


def local_parameters(model: torch.nn.Module, shard_dims: dict[str, int | None], tp: int, fsdp: int
                     ) -> list[tuple[str, tuple[int, ...], torch.dtype, bool]]:
    """Each distinct parameter's local shape on one device: ``(name, shape, dtype, requires_grad)``."""
    out, seen = [], set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        shape = local_shape(tuple(p.shape), shard_dims.get(name) if tp > 1 else None, tp)
        out.append((name, fsdp_shape(shape, fsdp), p.dtype, p.requires_grad))
    return out


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def saved_share(training: Any, styles: dict[str, str]) -> float:
    """The share of the step's saved activations tensor parallelism splits: the saved values whose result the
    split reaches (:func:`~fxforge.parallel.step_costs.split_forward_nodes`), by bytes."""
    if not styles:
        return 0.0
    saved = training.step.saved_nodes()
    _, split = split_forward_nodes(training.step.forward.graph, styles)
    nbytes = {node: node.meta["val"].numel() * node.meta["val"].element_size() for node in saved}
    total = sum(nbytes.values())
    return sum(b for node, b in nbytes.items() if node in split) / total if total else 0.0


def device_memory(training: Any, model: torch.nn.Module, mesh: dict[str, int], styles: dict[str, str],
                  shard_dims: dict[str, int | None], optimizer: Any, blocks: list[str],
                  measured: dict[str, int] | None = None) -> DeviceMemory:
    """One device's predicted memory under ``mesh``.

    Args:
        training: :func:`~fxforge.training.training_memory` of the model on one replica's slice of the batch.
        model: the model (its parameters' shapes and dtypes).
        mesh: ``{"dp", "fsdp", "tp", "pp"}`` sizes (``pp`` is planned by :func:`fxforge.partition`).
        styles: the tensor-parallel styles by module (empty without tensor parallelism).
        shard_dims: the dimension each parameter is split on by tensor parallelism (None: replicated).
        optimizer: what :func:`~fxforge.training.optimizer_memory.optimizer_memory` takes.
        blocks: the modules ``fully_shard`` wraps before the root.
        measured: a tensor-parallel or fully sharded rank's forward, backward and optimizer-step peaks above
            the start of its step, measured as built (:func:`~fxforge.parallel.rank_steps.built_peaks`; the
            optimizer's where there is one; FSDP2's gathered parameters are in them); None: the one-process
            step's, with the share of its saved values the split reaches divided by the degree, and the
            gathered blocks added.
    """
    from fxforge.training.optimizer_memory import optimizer_memory

    tp, fsdp = mesh.get("tp", 1), mesh.get("fsdp", 1)
    local = local_parameters(model, shard_dims, tp, fsdp)
    weights = sum(_nbytes(s, d) for _, s, d, _ in local)
    gradients = sum(_nbytes(s, d) for _, s, d, g in local if g)
    state = optimizer_memory(optimizer, [torch.empty(s, dtype=d, device="meta", requires_grad=g)
                                         for _, s, d, g in local]).state_bytes if optimizer is not None else 0
    share = saved_share(training, styles) if tp > 1 else 0.0
    scale = (1 - share) + share / tp
    persistent = training.persistent_bytes
    fwd = (training.forward_peak_bytes - persistent) * scale
    bwd = (training.backward_peak_bytes - persistent - training.gradients_bytes) * scale + gradients
    activations = int(training.activations_bytes * scale)
    if measured is not None:
        fwd, bwd, activations = measured["forward"], measured["backward"], measured["forward"]
    opt = gradients + training.optimizer.step_peak_bytes * (weights / max(training.weights_bytes, 1))
    if measured is not None and "optimizer" in measured:
        opt = measured["optimizer"]
    gathered = 0
    if fsdp > 1:
        unsharded = {name: 0 for name in blocks}
        root = root_grads = 0
        after_blocks = False
        for name, shape, dtype, grad in local_parameters(model, shard_dims, tp, 1):
            owner = next((b for b in blocks if name.startswith(b + ".")), None)
            if owner is not None:
                unsharded[owner] += _nbytes(shape, dtype)
                after_blocks = True
            else:
                root += _nbytes(shape, dtype)
                # a root parameter registered after the blocks (the head) is used after them: its gradient
                # comes first in the backward and is there at the peak; the embedding's comes last
                root_grads += _nbytes(shape, dtype) if grad and after_blocks else 0
        block = max(unsharded.values(), default=0)
        gathered = FSDP_BLOCKS_HELD * block + root
        # The root's parameters stay gathered from its forward to the end of the backward (FSDP2 does not
        # reshard the root after forward), and its whole gradients wait there for the last reduce-scatter.
        if measured is None:
            fwd += gathered
            bwd += gathered + root_grads
    phases = {"forward": fwd, "backward": bwd, "optimizer": opt}
    phase = max(phases, key=phases.get)
    base = weights + training.buffers_bytes + state  # the batch itself is left out (as the run measures)
    return DeviceMemory(weights, training.buffers_bytes, gradients, state, activations, gathered,
                        training.inputs_bytes, int(base + phases[phase]), phase)


def shard_dims(model: torch.nn.Module, styles: dict[str, str]) -> dict[str, int | None]:
    """The dimension tensor parallelism splits each parameter on (None: replicated), by parameter name.

    ``nn.Linear`` stores ``[out, in]``: column-split (and a vocabulary head) on 0, its bias too; row-split
    on 1, its bias replicated. ``nn.Embedding`` over the vocabulary on 0. GPT-2's ``Conv1D`` stores
    ``[in, out]``: the other way round.

    Example:
        >>> shard_dims(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)), {"0": "colwise", "1": "rowwise"})
        {'0.weight': 0, '0.bias': 0, '1.weight': 1, '1.bias': None}
    """
    dims: dict[str, int | None] = {}
    for module_name, module in model.named_modules():
        style = styles.get(module_name)
        transposed = type(module).__name__ == "Conv1D"
        for param_name, _ in module.named_parameters(recurse=False):
            key = f"{module_name}.{param_name}" if module_name else param_name
            dim = None
            if style in ("colwise", "vocab") and not isinstance(module, torch.nn.Embedding):
                dim = (1 if param_name == "weight" else 0) if transposed else 0
            elif style == "vocab":
                dim = 0
            elif style == "rowwise" and param_name == "weight":
                dim = 0 if transposed else 1
            dims.setdefault(key, dim)
    return dims


def local_model(model: torch.nn.Module, dims: dict[str, int | None], tp: int) -> torch.nn.Module:
    """A copy of ``model`` on the meta device whose parameters have one tensor-parallel rank's shapes
    (tied parameters stay tied): what fully sharded or replicated data parallelism then acts on."""
    copied = copy.deepcopy(model)
    made: dict[int, torch.nn.Parameter] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for original, module in zip(model.modules(), copied.modules(), strict=True):
        for key, p in original._parameters.items():
            if p is None:
                continue
            if id(p) not in made:
                shape = local_shape(tuple(p.shape), dims.get(names[id(p)]), tp)
                made[id(p)] = torch.nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"),
                                                 requires_grad=p.requires_grad)
            module._parameters[key] = made[id(p)]
    return copied
