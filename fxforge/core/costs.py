"""The cost model: a node's FLOPs, the bytes it moves, and its roofline time on a :class:`Machine`.

One model that the profiler (``intensity`` and ``bound`` per node), checkpointing (what recomputing a node
costs) and the pipeline planner (each stage's forward and backward time) all read:

- FLOPs: ``torch.utils.flop_counter``'s formulas (matrix products, convolutions, attention), plus
  :data:`KERNEL_FLOPS` for the kernels it has none for (fxforge's fused ops, the oneDNN/cuDNN kernels they
  lower to, CPU's fused attention), so a rewritten graph keeps the FLOPs of the graph it came from;
- bytes: the sizes of a node's tensor inputs and outputs;
- seconds: ``max(flops / peak, bytes / bandwidth) + launch``, the roofline of a machine whose peak FLOP
  rate and bandwidth were measured (:func:`fxforge.runtime.roofline.measure_machine` measures them). Views
  and ``getitem`` cost nothing (they copy no data). The estimate ranks choices; benchmarks measure.

A node whose arithmetic intensity (FLOPs per byte) is above the machine's *ridge point* ``peak /
bandwidth`` can at best run at the peak: it is compute bound; below it, memory bound.

Example:
    >>> g = torch.fx.Graph(); a = g.placeholder("a"); a.meta["val"] = torch.ones(64, 64)
    >>> mm = g.call_function(torch.ops.aten.mm.default, (a, a)); mm.meta["val"] = torch.ones(64, 64)
    >>> node_flops(mm), node_bytes(mm)
    (524288, 32768)
    >>> m = Machine("cpu", 100.0, 10.0, "")
    >>> round(node_seconds(mm, m) * 1e6, 2), m.bound(intensity(node_flops(mm), node_bytes(mm)))   # 5.24 us + launch
    (8.24, 'compute')
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import conv_flop_count, flop_registry, sdpa_flop_count, shape_wrapper

from fxforge.core.memory import value_bytes
from fxforge.core.nodes import is_view_op
from fxforge.core.symbolic import hint

LAUNCH_SECONDS = {"cpu": 3e-6, "cuda": 8e-6}
"""A fixed cost per op on top of the roofline time (dispatch and kernel launch)."""


@dataclasses.dataclass(frozen=True)
class Machine:
    """What a device can do at best, measured (:func:`fxforge.runtime.roofline.measure_machine`).

    Attributes:
        device: ``"cpu"``, ``"cuda:0"``...
        peak_gflops: the best measured rate of a large float32 matrix product, in GFLOP/s.
        bandwidth_gbs: the best measured rate of a large copy (bytes read + written), in GB/s (1e9 bytes).
        measured_at: when (ISO 8601, UTC).
        dtype: the dtype the peak was measured in.

    Example:
        >>> m = Machine("cpu", peak_gflops=100.0, bandwidth_gbs=20.0, measured_at="2026-01-01T00:00:00+00:00")
        >>> m.ridge, m.bound(2.0), m.bound(50.0)
        (5.0, 'memory', 'compute')
    """

    device: str
    peak_gflops: float
    bandwidth_gbs: float
    measured_at: str
    dtype: str = "float32"

    @property
    def ridge(self) -> float:
        """The ridge point in FLOP/byte: intensities above it are compute bound."""
        return self.peak_gflops / self.bandwidth_gbs if self.bandwidth_gbs > 0 else float("inf")

    def bound(self, intensity: float) -> str:
        """``"compute"`` when ``intensity`` (FLOP/byte) reaches the ridge point, else ``"memory"``.

        Example:
            >>> Machine("cpu", 50.0, 10.0, "").bound(5.0)
            'compute'
        """
        return "compute" if intensity >= self.ridge else "memory"

    def attainable_gflops(self, intensity: float) -> float:
        """The roof at ``intensity``: ``min(peak, bandwidth * intensity)`` in GFLOP/s.

        Example:
            >>> Machine("cpu", 50.0, 10.0, "").attainable_gflops(2.0)
            20.0
        """
        return min(self.peak_gflops, self.bandwidth_gbs * intensity)

    def seconds(self, flops: float, nbytes: float) -> float:
        """The roofline time of ``flops`` FLOPs moving ``nbytes`` bytes: ``max(compute, memory)``, no launch.

        Example:
            >>> Machine("cpu", 1.0, 1.0, "").seconds(2e9, 1e9)
            2.0
        """
        return max(flops / (self.peak_gflops * 1e9), nbytes / (self.bandwidth_gbs * 1e9))

    @property
    def launch_seconds(self) -> float:
        """The fixed cost of launching one op on this device (:data:`LAUNCH_SECONDS`).

        Example:
            >>> Machine("cuda:1", 1.0, 1.0, "").launch_seconds
            8e-06
        """
        return LAUNCH_SECONDS.get(self.device.split(":")[0], LAUNCH_SECONDS["cpu"])

    def to_dict(self) -> dict[str, Any]:
        """The fields and the ridge, as plain values (what the cache file stores, plus ``ridge``).

        Example:
            >>> Machine("cpu", 50.0, 10.0, "")
            Machine(device='cpu', peak_gflops=50.0, bandwidth_gbs=10.0, measured_at='', dtype='float32')
            >>> Machine("cpu", 50.0, 10.0, "").to_dict()["ridge"]
            5.0
        """
        return {**dataclasses.asdict(self), "ridge": self.ridge}


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity in FLOP/byte: ``inf`` for FLOPs that move no bytes, 0 for neither.

    Example:
        >>> intensity(100, 50), intensity(10, 0), intensity(0, 0)
        (2.0, inf, 0.0)
    """
    if nbytes > 0:
        return flops / nbytes
    return math.inf if flops > 0 else 0.0


# FLOP formulas (torch's shape convention: shapes in, ``out_shape=`` the output's) for kernels that
# ``torch.utils.flop_counter`` has none for; each counts its convolution, linear layer or attention (the
# activation and the residual add, like every pointwise op, count 0).

def _mm_flops(input_shape: Any, out_features: int) -> int:
    return 2 * math.prod(input_shape[:-1]) * int(input_shape[-1]) * int(out_features)


def _conv_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_shape, weight_shape, out_shape)


def _conv_transpose_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_shape, weight_shape, out_shape, transposed=True)


def _linear_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(input_shape, weight_shape[0])


def _mkldnn_conv_flop(*args, out_shape=None, **kwargs) -> int:
    # Two overloads with different argument orders: the binary one's second argument is a tensor of the
    # input's rank (the residual), its weight third.
    if len(args) > 2 and isinstance(args[2], torch.Size) and len(args[2]) == len(args[0]):
        return conv_flop_count(args[0], args[2], out_shape)
    return conv_flop_count(args[0], args[1], out_shape)


def _mkldnn_linear_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(input_shape, out_shape[-1])


def _sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


KERNEL_FLOPS: dict[str, Callable[..., int]] = {
    "fxforge::conv_pointwise": _conv_flop,
    "fxforge::linear_pointwise": _linear_flop,
    "fxforge::conv_transpose_pointwise": _conv_transpose_flop,
    "mkldnn::_convolution_transpose_pointwise": _conv_transpose_flop,
    "aten::cudnn_convolution_relu": _conv_flop,
    "aten::cudnn_convolution_add_relu": _conv_flop,
    "aten::_scaled_dot_product_flash_attention_for_cpu": _sdpa_flop,  # as torch counts the CUDA siblings
    "mkldnn::_convolution_pointwise": _mkldnn_conv_flop,
    "mkldnn::_linear_pointwise": _mkldnn_linear_flop,
}
"""FLOP formulas by qualified op name for the kernels ``torch.utils.flop_counter`` lacks."""


def _packet(name: str) -> Any:
    namespace, _, op = name.partition("::")
    try:
        return getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):  # not registered (yet): fxforge's ops, or a build without oneDNN
        return None


def kernel_flop_formulas() -> dict[Any, Callable[..., int]]:
    """:data:`KERNEL_FLOPS` keyed by the op packets registered now (``FlopCounterMode(custom_mapping=...)``).

    Example:
        >>> torch.ops.aten.cudnn_convolution_relu in kernel_flop_formulas()
        True
    """
    packets = {name: _packet(name) for name in KERNEL_FLOPS}
    return {packet: KERNEL_FLOPS[name] for name, packet in packets.items() if packet is not None}


def flop_formula(target: Any) -> Callable[..., int] | None:
    """The FLOP formula of an ATen (or fxforge, oneDNN, cuDNN) op, called as ``formula(*args, out_val=out)``
    with tensors or shapes; None for ops that count no FLOPs (pointwise ops, copies, Python callables).

    Example:
        >>> flop_formula(torch.ops.aten.mm.default) is not None, flop_formula(torch.ops.aten.relu.default)
        (True, None)
    """
    packet = getattr(target, "overloadpacket", target)
    formula = flop_registry.get(packet)
    if formula is not None:
        return formula
    name = getattr(packet, "_qualified_op_name", None)
    return shape_wrapper(KERNEL_FLOPS[name]) if name in KERNEL_FLOPS else None


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return torch.Size(hint(s) for s in value.shape)
    return value


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one ATen node by its :func:`flop_formula`, from the shapes in ``meta["val"]`` (0 for ops
    with none).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(2, 8)
        >>> w = g.placeholder("w"); w.meta["val"] = torch.ones(8, 4)
        >>> mm = g.call_function(torch.ops.aten.mm.default, (x, w)); mm.meta["val"] = torch.ones(2, 4)
        >>> relu = g.call_function(torch.ops.aten.relu.default, (mm,)); relu.meta["val"] = torch.ones(2, 4)
        >>> node_flops(mm), node_flops(relu)     # 2·M·K·N; pointwise ops count none
        (128, 0)
    """
    formula = flop_formula(node.target) if node.op == "call_function" else None
    if formula is None:
        return 0
    args, kwargs = pytree.tree_map(_shape_of, (node.args, node.kwargs))
    val = node.meta.get("val")
    out = [_shape_of(v) for v in val] if isinstance(val, (tuple, list)) else _shape_of(val)
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that cannot read these arguments: count no FLOPs
        return 0


def node_bytes(node: torch.fx.Node) -> int:
    """Bytes the node reads and writes: its tensor inputs and outputs (from ``meta["val"]``).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(10)
        >>> r = g.call_function(torch.ops.aten.relu.default, (x,)); r.meta["val"] = torch.ones(10)
        >>> node_bytes(r)      # 40 read, 40 written
        80
    """
    return sum(value_bytes(v) for v in [*(i.meta.get("val") for i in node.all_input_nodes), node.meta.get("val")])


def is_pointwise(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an elementwise ATen op (``torch.Tag.pointwise``): one a compiler fuses into its users.

    Example:
        >>> g = torch.fx.Graph(); a = g.placeholder("a")
        >>> is_pointwise(g.call_function(torch.ops.aten.relu.default, (a,)))
        True
        >>> is_pointwise(g.call_function(torch.ops.aten.mm.default, (a, a)))
        False
    """
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def node_seconds(node: torch.fx.Node, machine: Machine, *, fused: bool = False) -> float:
    """The roofline estimate of the node's run time on ``machine`` (0 for views and ``getitem``).

    ``fused``: the graph is compiled by a fusing compiler (Inductor), where an elementwise op is computed
    inside the kernel of its users: it costs writing its output once, no read of its own and no launch (an
    upper bound: fused into a user that reads it anyway, it costs nothing).

    Example:
        >>> g = torch.fx.Graph(); a = g.placeholder("a"); a.meta["val"] = torch.ones(1000)
        >>> r = g.call_function(torch.ops.aten.relu.default, (a,)); r.meta["val"] = torch.ones(1000)
        >>> m = Machine("cpu", 100.0, 4.0, "")
        >>> node_seconds(r, m, fused=True), round(node_seconds(r, m) * 1e6, 2)   # 4 KB written; 8 KB + launch
        (1e-06, 5.0)
    """
    if node.op != "call_function" or node.target is operator.getitem or is_view_op(node):
        return 0.0
    if fused and is_pointwise(node):
        return machine.seconds(0, value_bytes(node.meta.get("val")))
    return machine.seconds(node_flops(node), node_bytes(node)) + machine.launch_seconds


def graph_seconds(graph_module: torch.fx.GraphModule, machine: Machine, *, fused: bool = False) -> float:
    """The sum of the estimates over a graph's nodes.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x.view(-1) + 1)    # the view costs nothing: one launch
        >>> graph_seconds(gm, Machine("cpu", 1.0, 1.0, "")) == LAUNCH_SECONDS["cpu"]
        True
    """
    return sum(node_seconds(n, machine, fused=fused) for n in graph_module.graph.nodes)
