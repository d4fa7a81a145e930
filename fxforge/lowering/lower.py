"""Lowering: the graph a ``Captured`` holds, turned into the graph that actually runs (a ``Plan``).

Rewrites leave fused ops (``fxforge::conv_pointwise``, ``fxforge::linear_pointwise``) in the graph, each
with the kernel autotune chose. Calling a custom op from Python costs tens of microseconds of dispatch,
as much as a small convolution, so :func:`lower` replaces each fused op by a direct call of its kernel:
oneDNN's fused op on a prepacked weight (packed once, here), cuDNN's fused op, or the plain torch ops
of the composite. It is the same function the custom op calls (:func:`fxforge.rewrites.fused_ops.kernel_call`
with the kernels of :mod:`fxforge.lowering.kernels`), so the lowered graph computes exactly what was verified.

Autotune lowers the graph it chooses in order to time it and hands that lowered graph on with the
``Captured`` (:class:`~fxforge.core.captured.LoweredRun`); :func:`make_plan` uses it while the graph
still computes the same function, so the same graph is not lowered (copied, packed) twice.

The lowered graph has no autograd for oneDNN's and cuDNN's fused ops: the runtime uses it only when no
gradient is needed, and the captured graph (whose custom ops have autograd) otherwise.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    >>> cap = fxforge.rewrite(fxforge.capture(model, (torch.randn(1, 3, 8, 8),)), ["conv_activation"])
    >>> x = torch.randn(1, 3, 8, 8)
    >>> torch.allclose(lower(cap.graph_module)(x), model(x), atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.fx import Node

from fxforge.core.captured import Captured
from fxforge.core.nodes import constant_tensor, copy_graph_module
from fxforge.core.plan import Plan
from fxforge.lowering import kernels  # noqa: F401 - registers the fused ops' oneDNN and cuDNN kernels
from fxforge.rewrites import fused_ops

# fused op -> its name in fxforge.rewrites.fused_ops' kernel table
FUSED_OPS = {
    torch.ops.fxforge.conv_pointwise.default: "conv_pointwise",
    torch.ops.fxforge.linear_pointwise.default: "linear_pointwise",
}


def fused_calls(graph_module: torch.fx.GraphModule) -> Iterator[tuple[Node, str, torch.Tensor]]:
    """``(node, its op name, its real weight)`` for each fused op whose weight is a parameter or buffer.

    Only these can be lowered or timed: oneDNN packs the weight ahead of the call.

    Example:
        >>> list(fused_calls(torch.fx.symbolic_trace(torch.nn.ReLU())))
        []
    """
    for node in graph_module.graph.nodes:
        op = FUSED_OPS.get(node.target) if node.op == "call_function" else None
        weight = constant_tensor(graph_module, node.args[1]) if op and not node.kwargs else None
        if weight is not None:
            yield node, op, weight


def lower(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``graph_module`` with every fused op replaced by a direct call of its chosen kernel.

    A graph without fused ops is returned as it is.

    Fused ops whose weight is not a parameter or buffer of the graph (computed at run time) stay custom
    op calls. Parameters and buffers are shared with ``graph_module``; prepacked weights are new
    non-persistent buffers of the copy.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> lower(gm)(-torch.ones(1)).tolist()
        [0.0]
    """
    if not lowered_kernels(graph_module):
        return graph_module
    new = copy_graph_module(graph_module)
    graph = new.graph
    packed = 0
    for node, op, weight in list(fused_calls(new)):
        *op_args, kernel = node.args
        fn, args = fused_ops.kernel_or_composite(op, kernel, op_args[0], weight, *op_args[2:])
        with graph.inserting_before(node):
            if fn in (fused_ops.conv_pointwise_composite, fused_ops.linear_pointwise_composite):
                tracer = torch.fx.proxy.GraphAppendingTracer(graph)
                proxied = [torch.fx.Proxy(a, tracer) if isinstance(a, Node) else a for a in op_args]
                result = fn(*proxied).node
            else:
                call_args = []
                for arg in args:
                    if isinstance(arg, torch.Tensor):
                        if arg is weight:
                            arg = node.args[1]
                        else:
                            name = f"_fxforge_packed_{packed}"
                            packed += 1
                            new.register_buffer(name, arg, persistent=False)
                            arg = graph.get_attr(name)
                    call_args.append(arg)
                result = graph.call_function(fn, tuple(call_args))
        result.meta.update(node.meta)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
    graph.lint()
    new.recompile()
    return new


def lowered_kernels(graph_module: torch.fx.GraphModule) -> dict[str, int]:
    """How many fused ops of each kernel a graph holds (``{"mkldnn": 3}``), for reports and tests.

    Example:
        >>> lowered_kernels(torch.fx.symbolic_trace(torch.nn.ReLU()))
        {}
    """
    counts: dict[str, int] = {}
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target in FUSED_OPS:
            counts[node.args[-1]] = counts.get(node.args[-1], 0) + 1
    return counts


def make_plan(captured: Captured) -> Plan:
    """The :class:`~fxforge.core.plan.Plan` for a rewritten graph: it and its lowered form.

    The lowered graph autotune built and ran (``captured.lowered_run``) is used while the graph still
    computes the function it lowered; otherwise the graph is lowered here.

    Example:
        >>> plan = make_plan(fxforge.capture(torch.nn.ReLU(), (torch.ones(2),)))
        >>> plan.executable is plan.captured.graph_module  # no fused op: nothing to lower
        True
    """
    run = captured.lowered_run
    if run is not None and run.lowers(captured.graph_module):
        return Plan(captured, run.lowered)
    return Plan(captured, lower(captured.graph_module))

