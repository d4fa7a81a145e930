"""Which int8-able layers are faster in int8 at the size they run: each layer's int8 kernel timed against its
float32 one on the input it met on the example call.

Int8 pays where the product is large enough for VNNI's rate to outweigh what int8 adds around it (quantizing the
input per token, converting the int32 sums back); a small layer (a 256-wide projection of 128 tokens) can be
slower in int8. Each layer's input is recorded on the example call; layers of the same kind, weight shape,
settings and input shape are timed once (a transformer's layers repeat), int8 (:func:`~fxforge.lowering.int8_ops.
linear_int8`, :func:`~fxforge.lowering.int8_ops.conv_int8`) against ``F.linear``/``F.conv2d`` in interleaved
calls; a linear layer's int8 kernels (inputs quantized per token, per tensor by FBGEMM's dynamic kernel, or
static in their calibrated range by oneDNN's) are all timed and the fastest kept. A layer is offered to int8 only where its int8 kernel is faster; the others
stay in float32 with the timings (:class:`~fxforge.lowering.int8.Int8Reduction` reads these).

Example:
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1024)).eval()
    >>> gm = torch.fx.symbolic_trace(model)
    >>> speeds = layer_speeds(gm, (torch.randn(4, 8),), ["_0", "_2"], {})
    >>> sorted(speeds), all(s.int8_ms > 0 and s.float32_ms > 0 for s in speeds.values())
    (['_0', '_2'], True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from fxforge.lowering.int8_ops import (
    conv_int8,
    dynamic_kernel_exists,
    input_qparams,
    linear_int8,
    linear_int8_static,
    linear_int8_tensor,
    weight_int8,
    weight_scale,
)
from fxforge.lowering.timing import DECISIVE, time_interleaved

BUDGET_S = 0.05  # timing one layer shape, every kernel
# The int8 kernels of a linear layer (:mod:`fxforge.lowering.int8_ops`): inputs quantized per token
# (``torch._int_mm``), per tensor at call time (FBGEMM's dynamic kernel) or static (a calibrated range, oneDNN's
# int8 product); a convolution has one (static).
PER_TOKEN, PER_TENSOR, STATIC = "per token", "per tensor", "static"


@dataclasses.dataclass(frozen=True)
class LayerSpeed:
    """One layer's median milliseconds a call in int8 (its faster int8 kernel, ``kernel``) and in float32, on
    the example's input."""

    int8_ms: float
    float32_ms: float
    kernel: str = PER_TOKEN

    @property
    def faster(self) -> bool:
        """Int8 is faster by more than timing noise (:data:`~fxforge.lowering.timing.DECISIVE`)."""
        return self.int8_ms < self.float32_ms * (1 - DECISIVE)

    def describe(self) -> str:
        """One line.

        Example:
            >>> LayerSpeed(0.05, 0.1, PER_TENSOR).describe()
            'int8 (per tensor) 0.05 ms against float32 0.1 ms'
        """
        return f"int8 ({self.kernel}) {self.int8_ms:.3g} ms against float32 {self.float32_ms:.3g} ms"


class _Inputs(torch.fx.Interpreter):
    """Runs the graph and keeps each named layer's input and float32 weight and bias."""

    def __init__(self, gm: torch.fx.GraphModule, layers: dict[str, Any]):
        super().__init__(gm)
        self.layers, self.seen = layers, {}

    def run_node(self, n: Node) -> Any:
        parts = self.layers.get(n.name)
        if parts is not None:
            if n.op == "call_module":
                module = self.module.get_submodule(str(n.target))
                weight, bias = module.weight, module.bias
            else:
                weight = self.env[parts.weight]
                bias = self.env[parts.bias] if isinstance(parts.bias, Node) else parts.bias
            self.seen[n.name] = (self.env[parts.input], weight, bias)
        return super().run_node(n)


def _calls(conv: tuple | None, x: torch.Tensor, weight: torch.Tensor, bias: Any,
           input_range: tuple[float, float] | None) -> dict[str, Any]:
    weight = weight.detach()
    wq, ws = weight_int8(weight), weight_scale(weight)
    if conv is None:
        calls = {PER_TOKEN: lambda: linear_int8(x, wq, ws, bias), "float32": lambda: F.linear(x, weight, bias)}
        if x.device.type == "cpu" and dynamic_kernel_exists():
            calls[PER_TENSOR] = lambda: linear_int8_tensor(x, wq, ws, bias)
        if x.device.type == "cpu" and input_range is not None:
            scale, zero = input_qparams(*input_range)
            calls[STATIC] = lambda: linear_int8_static(x, wq, ws, bias, scale, zero)
        return calls
    scale, zero = input_qparams(*input_range)
    return {STATIC: lambda: conv_int8(x, wq, ws, bias, *conv, scale, zero, "none"),
            "float32": lambda: F.conv2d(x, weight, bias, *conv)}


def layer_speeds(gm: torch.fx.GraphModule, example: tuple, names: Sequence[str],
                 ranges: dict[str, tuple[float, float]]) -> dict[str, LayerSpeed]:
    """Each named int8-able layer's :class:`LayerSpeed` on the input it meets on ``example`` (a convolution
    quantizes with its range in ``ranges``; one without stays out, as does a layer the call does not reach)."""
    from fxforge.lowering.int8 import _conv_settings, _parts

    wanted = set(names)
    nodes = {n.name: n for n in gm.graph.nodes if n.name in wanted}
    layers = {name: parts for name, node in nodes.items() if (parts := _parts(node, gm)) is not None}
    recorder = _Inputs(gm, layers)
    with torch.no_grad():
        recorder.run(*example)
        speeds: dict[tuple, LayerSpeed] = {}
        found = {}
        for name, (x, weight, bias) in recorder.seen.items():
            conv = _conv_settings(gm, nodes[name])
            if conv is not None and name not in ranges:
                continue
            settings = tuple(tuple(v) if isinstance(v, list) else v for v in conv) if conv else None
            key = (settings, tuple(x.shape), tuple(weight.shape), bias is not None, ranges.get(name),
                   x.is_contiguous(memory_format=torch.channels_last) if x.dim() == 4 else False)
            if key not in speeds:
                timings = time_interleaved(_calls(conv, x, weight, bias, ranges.get(name)),
                                           BUDGET_S, decisive=DECISIVE)
                kernel = min((k for k in timings if k != "float32"), key=timings.__getitem__)
                speeds[key] = LayerSpeed(timings[kernel], timings["float32"], kernel)
            found[name] = speeds[key]
    return found
