"""What recomputing a forward node costs: a roofline estimate from its FLOPs and the bytes it moves.

``seconds = max(flops / peak, bytes / bandwidth) + launch``, with the peak FLOP rate and the copy
bandwidth measured once per machine (:func:`fxforge.runtime.roofline.measure_machine`), FLOPs from
``torch.utils.flop_counter``'s formulas (matrix products, convolutions, attention), and bytes the sizes
of the node's tensor inputs and outputs. Views and ``getitem`` cost nothing (they copy no data). The
estimate ranks choices; the benchmark measures the real step time.

Example:
    >>> from fxforge.runtime.roofline import Machine
    >>> g = torch.fx.Graph(); a = g.placeholder("a"); a.meta["val"] = torch.ones(64, 64)
    >>> mm = g.call_function(torch.ops.aten.mm.default, (a, a)); mm.meta["val"] = torch.ones(64, 64)
    >>> node_flops(mm)
    524288
    >>> round(node_seconds(mm, Machine("cpu", 100.0, 10.0, "")) * 1e6, 2)   # 5.24 us of compute + launch
    8.24
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from fxforge.core.memory import value_bytes
from fxforge.core.nodes import is_view_op
from fxforge.core.symbolic import hint
from fxforge.runtime.roofline import Machine

LAUNCH_SECONDS = {"cpu": 3e-6, "cuda": 8e-6}
"""A fixed cost per op on top of the roofline time (dispatch and kernel launch)."""


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return torch.Size(hint(s) for s in value.shape)
    return value


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one ATen node by ``torch.utils.flop_counter``'s formulas (0 for ops it has none for)."""
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0
    args, kwargs = pytree.tree_map(_shape_of, (node.args, node.kwargs))
    out = _shape_of(node.meta.get("val")) if not isinstance(node.meta.get("val"), (tuple, list)) else \
        [_shape_of(v) for v in node.meta["val"]]
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that cannot read these arguments: count no FLOPs
        return 0


def node_bytes(node: torch.fx.Node) -> int:
    """Bytes the node reads and writes: its tensor inputs and outputs."""
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
    """
    if node.op != "call_function" or node.target is operator.getitem or is_view_op(node):
        return 0.0
    if fused and is_pointwise(node):
        return value_bytes(node.meta.get("val")) / (machine.bandwidth_gbs * 1e9)
    compute = node_flops(node) / (machine.peak_gflops * 1e9)
    memory = node_bytes(node) / (machine.bandwidth_gbs * 1e9)
    launch = LAUNCH_SECONDS.get(machine.device.split(":")[0], LAUNCH_SECONDS["cpu"])
    return max(compute, memory) + launch


def graph_seconds(graph_module: torch.fx.GraphModule, machine: Machine, *, fused: bool = False) -> float:
    """The sum of the estimates over a graph's nodes."""
    return sum(node_seconds(n, machine, fused=fused) for n in graph_module.graph.nodes)
