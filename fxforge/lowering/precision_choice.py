"""Which layers of a rewritten graph run in reduced precision: as many as keep the outputs within the tolerance,
found by each layer's sensitivity, as the pass-by-pass rollback finds a pass that changed results.

The float32 graph's outputs on the calibration inputs are the reference. First every reducible layer
(:func:`~fxforge.lowering.precision.reducible`) is reduced at once; if the outputs keep the tolerance, that is the
choice. Otherwise each layer is reduced alone and its agreement measured (its *sensitivity*); layers are then
taken from the least sensitive up, the largest such set that keeps the tolerance found by bisection, and the rest
stay in float32 with the reason. The trials run the graph through an interpreter that casts around the chosen
layers, so the graph itself is not copied or changed: :func:`~fxforge.lowering.precision.reduce_layers` applies
the choice afterwards.

Example:
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    >>> gm = torch.fx.symbolic_trace(model)
    >>> choice = choose_layers(gm, [(torch.randn(8, 16),)], torch.bfloat16, Tolerance(relative_error=0.05))
    >>> choice.reduced, choice.refusal
    (['_0', '_2'], None)
    >>> tight = choose_layers(gm, [(torch.randn(8, 16),)], torch.bfloat16, Tolerance(relative_error=1e-6))
    >>> tight.reduced, tight.refusal.split(": ")[0]
    ([], 'no layer keeps the tolerance in bfloat16 (the least sensitive alone')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.fx import Node

from fxforge.core.accuracy import Agreement, Tolerance, agreement
from fxforge.core.nodes import copy_graph_module
from fxforge.core.report import Tuning
from fxforge.core.source import node_source
from fxforge.lowering.precision import reduce_layers, reducible


@dataclasses.dataclass
class LayerPrecision:
    """One reducible layer: its node, the user's line, the dtype it runs in, and its agreement reduced alone
    (measured only where the layers could not all be reduced together)."""

    name: str
    source: str | None
    dtype: str
    alone: Agreement | None = None
    reason: str = ""

    def tuning(self, speed: str = "") -> Tuning:
        """The report's line for this layer: its precision, why, its agreement reduced alone and ``speed``.

        Example:
            >>> LayerPrecision("fc", "m.py:3", "int8").tuning().subject
            'fc (m.py:3)'
        """
        where = f" ({self.source})" if self.source else ""
        measured = f"reduced alone: {self.alone.describe()}" if self.alone is not None else ""
        note = "; ".join(x for x in (self.reason, measured, speed) if x)
        return Tuning("precision", f"{self.name}{where}", self.dtype, note=note, kind="accuracy")


@dataclasses.dataclass
class PrecisionChoice:
    """The layers to reduce (node names), every reducible layer's precision, and the outputs' agreement with
    float32 with the chosen layers reduced; ``refusal``: why no layer is (None where some are)."""

    reduced: list[str]
    layers: list[LayerPrecision]
    agreement: Agreement
    refusal: str | None = None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                           else t, value)


class _CastAround(torch.fx.Interpreter):
    """Runs the graph with the named layers computing in ``dtype`` (inputs cast in, results cast back)."""

    def __init__(self, gm: torch.fx.GraphModule, layers: set[str], dtype: torch.dtype):
        super().__init__(gm)
        self.layers, self.dtype = layers, dtype

    def run_node(self, n: Node) -> Any:
        if n.name not in self.layers:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args, kwargs = _cast(args, self.dtype), _cast(kwargs, self.dtype)
        if n.op == "call_module":
            result = _module_in(self.module.get_submodule(str(n.target)), args[0], self.dtype)
        else:
            result = getattr(self, n.op)(n.target, args, kwargs)
        return pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == self.dtype else t,
                               result)


def _module_in(module: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    weight = module.weight.to(dtype)
    bias = module.bias.to(dtype) if module.bias is not None else None
    if isinstance(module, nn.Linear):
        return F.linear(x, weight, bias)
    return module._conv_forward(x, weight, bias)


def _run(gm: torch.fx.GraphModule, inputs: Sequence[tuple], layers: set[str], dtype: torch.dtype) -> list:
    with torch.no_grad():
        return [_CastAround(gm, layers, dtype).run(*args) for args in inputs]


def _key(found: Agreement) -> float:
    return math.inf if math.isnan(found.relative_error) else found.relative_error


class FloatReduction:
    """Layers cast to a reduced floating-point ``dtype`` (the trials cast around them in an interpreter).

    Example:
        >>> FloatReduction(torch.bfloat16).kind
        'bfloat16'
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.kind = dtype, str(dtype).removeprefix("torch.")

    def layers(self, gm: torch.fx.GraphModule) -> list[Node]:
        """The layers that can be reduced."""
        return reducible(gm)

    def run(self, gm: torch.fx.GraphModule, inputs: Sequence[tuple], names: set[str]) -> list:
        """``gm``'s outputs on ``inputs`` with the named layers reduced."""
        return _run(gm, inputs, names, self.dtype)

    def apply(self, gm: torch.fx.GraphModule, names: set[str]) -> torch.fx.GraphModule:
        """A copy of ``gm`` (sharing the model's tensors) with the named layers reduced."""
        reduced = copy_graph_module(gm)
        reduce_layers(reduced, [n for n in reduced.graph.nodes if n.name in names], self.dtype)
        return reduced


def choose_layers(gm: torch.fx.GraphModule, inputs: Sequence[tuple], reduction: Any,
                  tolerance: Tolerance) -> PrecisionChoice:
    """The layers of ``gm`` to run reduced so that its outputs on ``inputs`` (calls, each a tuple of arguments)
    keep ``tolerance`` against float32 (see the module docstring). ``reduction``: a reduced floating-point dtype,
    or an object with ``kind``, ``layers(gm)`` and ``run(gm, inputs, names)`` as :class:`FloatReduction` has
    (int8: :class:`~fxforge.lowering.int8.Int8Reduction`); its ``apply(gm, names)`` makes the chosen graph."""
    if isinstance(reduction, torch.dtype):
        reduction = FloatReduction(reduction)
    names = [n.name for n in reduction.layers(gm)]
    nodes = {n.name: n for n in gm.graph.nodes}
    with torch.no_grad():
        reference = [gm(*args) for args in inputs]
    kind = reduction.kind
    every = agreement(reference, reduction.run(gm, inputs, set(names)), tolerance.metric)
    if names and tolerance.refusal(every) is None:
        return PrecisionChoice(names, [LayerPrecision(n, node_source(nodes[n]), kind) for n in names], every)
    alone = {n: agreement(reference, reduction.run(gm, inputs, {n}), tolerance.metric) for n in names}
    order = sorted(names, key=lambda n: _key(alone[n]))
    # The largest prefix of ``order`` that keeps the tolerance; the whole of it broke it above, so it is not run again.
    low, high, found = 0, len(order) - 2, {}
    while low <= high:
        middle = (low + high) // 2
        trial = agreement(reference, reduction.run(gm, inputs, set(order[:middle + 1])), tolerance.metric)
        if tolerance.refusal(trial) is None:
            found[middle + 1] = trial
            low = middle + 1
        else:
            high = middle - 1
    count = max(found, default=0)
    chosen = set(order[:count])
    layers = []
    for n in names:
        if n in chosen:
            layers.append(LayerPrecision(n, node_source(nodes[n]), kind, alone[n]))
        else:
            why = tolerance.refusal(alone[n]) or f"with the {count} less sensitive layers reduced, the outputs break it"
            layers.append(LayerPrecision(n, node_source(nodes[n]), "float32", alone[n], f"kept in float32: {why}"))
    reduced = [n for n in names if n in chosen]
    if not reduced:
        refusal = (f"no layer keeps the tolerance in {kind} (the least sensitive alone: "
                   f"{tolerance.refusal(alone[order[0]])})" if names
                   else "no matrix product or convolution computes in float32")
        return PrecisionChoice([], layers, Agreement(0.0, 1.0, None), refusal)
    return PrecisionChoice(reduced, layers, found[count])
