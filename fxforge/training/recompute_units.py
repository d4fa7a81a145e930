"""What a training step could recompute: its forward nodes as units, and the forward cut into pieces.

Each forward node (with the ``getitem`` nodes of a multi-output op) is a :class:`Unit` with the bytes of its
outputs and the estimated time to compute it again (:mod:`fxforge.core.costs`). Random ops (dropout)
are never recomputed: on CPU they would draw other numbers. The step's own outputs are alive anyway.
:func:`_pieces` cuts the forward where one value carries everything on; the planner
(:mod:`fxforge.training.checkpointing`) chooses per piece.

Example:
    >>> unit = Unit("relu", ["relu"], nbytes=4096, seconds=1e-7, recomputable=True, needed_by_backward=True)
    >>> _cheap(unit), _pieces([unit])
    (True, [([0], 0)])
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from fxforge.core.costs import Machine, node_seconds
from fxforge.core.memory import tensor_leaves
from fxforge.core.symbolic import hint
from fxforge.training.step_graph import StepGraphs, is_forward, is_random


@dataclasses.dataclass
class Unit:
    """A forward node (with its ``getitem`` nodes): what saving it costs and what recomputing it costs.

    Attributes:
        name: the node's name; ``nodes``: its own and its ``getitem`` nodes' names.
        nbytes: the bytes its outputs allocate (not a parameter's or an input's storage).
        seconds: the estimated time to compute it again.
        recomputable: not random, not impure, not one of the step's outputs.
        needed_by_backward: the backward reads one of its outputs.
        producers: the units it reads (indices).

    Example:
        >>> unit = Unit("mm", ["mm"], nbytes=2**20, seconds=1e-3, recomputable=True, needed_by_backward=True)
        >>> _cheap(unit)  # a millisecond to free a MiB: worth keeping
        False
    """

    name: str
    nodes: list[str]
    nbytes: int
    seconds: float
    recomputable: bool
    needed_by_backward: bool
    producers: list[int] = dataclasses.field(default_factory=list)


def _units(step: StepGraphs, machine: Machine, fused: bool = False) -> list[Unit]:
    joint = step.joint
    primal_keys = set()
    for node in joint.graph.find_nodes(op="placeholder"):
        for leaf in tensor_leaves(node.meta.get("val")):
            primal_keys.add(leaf.untyped_storage()._cdata)
    (out,) = joint.graph.find_nodes(op="output")
    flat_outputs = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    step_outputs = {n for n in flat_outputs[:step.num_fwd_outputs] if isinstance(n, torch.fx.Node)}
    units: list[Unit] = []
    index: dict[torch.fx.Node, int] = {}
    for node in joint.graph.nodes:
        if node.op != "call_function" or not is_forward(node):
            continue
        if node.target is operator.getitem and node.args[0] in index:
            unit = units[index[node.args[0]]]
            unit.nodes.append(node.name)
            index[node] = index[node.args[0]]
            unit.nbytes += _bytes(node, primal_keys)
            unit.needed_by_backward |= any(not is_forward(u) for u in node.users if u.op != "output")
            if node in step_outputs:
                unit.recomputable = False
            continue
        value = node.meta.get("val")
        multi = isinstance(value, (tuple, list))
        tensors = tensor_leaves(value)
        unit = Unit(node.name, [node.name], 0 if multi else _bytes(node, primal_keys),
                    node_seconds(node, machine, fused=fused),
                    bool(tensors) and not is_random(node) and node not in step_outputs
                    and not node.is_impure(impure_random=False),
                    any(not is_forward(u) for u in node.users if u.op != "output"))
        unit.producers = sorted({index[i] for i in node.all_input_nodes if i in index})
        index[node] = len(units)
        units.append(unit)
    return units


def _bytes(node: torch.fx.Node, primal_keys: set[int]) -> int:
    """Bytes of the storages ``node`` allocates: not a parameter's or an input's, not one of its inputs'."""
    total, seen = 0, set()
    for source in node.all_input_nodes:
        for leaf in tensor_leaves(source.meta.get("val")):
            seen.add(leaf.untyped_storage()._cdata)
    for leaf in tensor_leaves(node.meta.get("val")):
        storage = leaf.untyped_storage()
        if storage._cdata in primal_keys or storage._cdata in seen:
            continue
        seen.add(storage._cdata)
        total += hint(storage.nbytes())
    return total


EXPENSIVE_SECONDS_PER_BYTE = 2e-10
"""A unit whose recompute costs more than this per byte it frees (matrix products, convolutions, attention:
about 10x a copy) is kept in a segment's ``"cheap"`` mode; pointwise ops and views are recomputed."""


def _cheap(unit: Unit) -> bool:
    return unit.seconds <= EXPENSIVE_SECONDS_PER_BYTE * max(unit.nbytes, 1) or unit.nbytes == 0


def _pieces(units: list[Unit]) -> list[tuple[list[int], int]]:
    """The forward cut into pieces where one value carries everything on: ``(units, boundary unit)``.

    Views of parameters (a transposed weight) and values used across more than half of the forward (a
    causal mask, rotary tables) are free to cross a cut: they cost nothing, or are global. A position is a
    cut when one other value crosses it; consecutive cuts crossed by the same value are one (the last).
    """
    n = len(units)
    free = [False] * n
    last_use = list(range(n))
    for i, unit in enumerate(units):
        free[i] = unit.nbytes == 0 and all(free[p] for p in unit.producers)
        for p in unit.producers:
            last_use[p] = max(last_use[p], i)
    starts: dict[int, list[int]] = {}
    for i in range(n):
        if not free[i] and last_use[i] > i and last_use[i] - i <= n // 2:
            starts.setdefault(i + 1, []).append(i)
    alive: set[int] = set()
    cuts: list[tuple[int, int]] = []
    for i in range(1, n):
        alive.update(starts.get(i, ()))
        alive = {v for v in alive if last_use[v] >= i}
        if len(alive) == 1:
            value = next(iter(alive))
            if cuts and cuts[-1][1] == value:
                cuts[-1] = (i, value)
            else:
                cuts.append((i, value))
    pieces, previous = [], 0
    for position, boundary in [*cuts, (n, n - 1)]:
        if position > previous:
            pieces.append((list(range(previous, position)), boundary))
            previous = position
    return pieces
