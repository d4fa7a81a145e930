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

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx import Node

from fxforge.core.captured import Captured
from fxforge.core.derived import Derived, DerivedValues
from fxforge.core.nodes import constant_tensor, copy_graph_module
from fxforge.core.plan import Plan
from fxforge.core.symbolic import hint, size_expr
from fxforge.lowering import kernels  # noqa: F401 - registers the fused ops' oneDNN and cuDNN kernels
from fxforge.lowering.buckets import BucketedKernel, BucketTable, bucket_key, tables_of
from fxforge.lowering.kernels import kernels_for
from fxforge.rewrites import fused_ops

# A fused op's node meta key: its kernel was set by the user's tuning policy, not measured, so a graph with
# symbolic sizes runs that kernel at every size instead of choosing one per shape bucket.
KERNEL_SET = "fxforge_kernel_set"
# fused op -> its name in fxforge.rewrites.fused_ops' kernel table
FUSED_OPS = {
    torch.ops.fxforge.conv_pointwise.default: "conv_pointwise",
    torch.ops.fxforge.linear_pointwise.default: "linear_pointwise",
    torch.ops.fxforge.conv_transpose_pointwise.default: "conv_transpose_pointwise",
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
    op calls. A fused op whose input has symbolic sizes (a shape-generic graph) becomes a
    :class:`~fxforge.lowering.buckets.BucketedKernel` instead, which runs the kernel chosen per shape bucket
    (unless the tuning policy set its kernel). Parameters and buffers are shared with ``graph_module``; prepacked weights are new
    non-persistent buffers of the copy, each with its :class:`PackRecipe` in ``meta["fxforge_packs"]``.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> lower(gm)(-torch.ones(1)).tolist()
        [0.0]
    """
    if not lowered_kernels(graph_module):
        return graph_module
    new = copy_graph_module(graph_module)
    graph = new.graph
    packs = new.meta.setdefault("fxforge_packs", {})
    tables: dict[str, BucketTable] = {}

    def graph_args(node: Node, op: str, kernel: str, weight: torch.Tensor, args: tuple) -> list:
        """A kernel call's arguments as graph values: the op's weight as the op reads it, each prepacked
        weight as a new buffer (with the recipe that packs it again)."""
        *op_args, _ = node.args
        call_args = []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                if arg is weight:
                    arg = node.args[1]
                else:
                    name = f"_fxforge_packed_{len(packs)}"
                    new.register_buffer(name, arg, persistent=False)
                    packs[name] = PackRecipe(weight, (op, kernel, tuple(op_args), position))
                    arg = graph.get_attr(name)
            call_args.append(arg)
        return call_args

    for node, op, weight in list(fused_calls(new)):
        *op_args, kernel = node.args
        fn, args = fused_ops.kernel_or_composite(op, kernel, op_args[0], weight, *op_args[2:])
        dims = () if node.meta.get(KERNEL_SET) else _dynamic_dims(op_args[0])
        with graph.inserting_before(node):
            result = _bucketed(node, op, kernel, weight, dims, tables, graph_args) if dims else None
            composite = fn in (fused_ops.conv_pointwise_composite, fused_ops.linear_pointwise_composite,
                               fused_ops.conv_transpose_pointwise_composite)
            if result is None and composite:  # inlined: plain ops, no custom-op dispatch
                tracer = torch.fx.proxy.GraphAppendingTracer(graph)
                proxied = [torch.fx.Proxy(a, tracer) if isinstance(a, Node) else a for a in op_args]
                result = fn(*proxied).node
            elif result is None:
                result = graph.call_function(fn, tuple(graph_args(node, op, kernel, weight, args)))
        result.meta.update(node.meta)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
    graph.lint()
    new.recompile()
    return new


def _dynamic_dims(input: Any) -> tuple[int, ...]:
    """The dims of a fused op's input whose size is symbolic (none in a graph captured for one shape)."""
    value = input.meta.get("val") if isinstance(input, Node) else None
    if not isinstance(value, torch.Tensor):
        return ()
    return tuple(d for d, size in enumerate(value.shape) if not isinstance(size_expr(size), int))


def _bucketed(node: Node, op: str, kernel: str, weight: torch.Tensor, dims: tuple[int, ...],
              tables: dict[str, BucketTable], graph_args: Callable[..., list]) -> Node | None:
    """A :class:`~fxforge.lowering.buckets.BucketedKernel` call for a fused op with symbolic input sizes: every
    kernel that can run it, the one autotune chose at the example's sizes seeding the example's bucket.
    None where only one kernel can run it (nothing to choose)."""
    graph = node.graph
    *op_args, _ = node.args
    value = op_args[0].meta["val"]
    runnable = {}
    for candidate in kernels_for(value.device):
        call = fused_ops.kernel_call(op, candidate, op_args[0], weight, *op_args[2:])
        if not isinstance(call, str):
            runnable[candidate] = call
    if len(runnable) < 2:
        return None
    flat: list = []
    calls: dict[str, tuple[Callable, int, int]] = {}
    for candidate, (fn, args) in runnable.items():
        start = len(flat)
        flat.extend(graph_args(node, op, candidate, weight, args))
        calls[candidate] = (fn, start, len(flat))
    shape = tuple(None if d in dims else hint(size) for d, size in enumerate(value.shape))
    config = repr((op, shape, tuple(weight.shape), str(weight.dtype), str(value.dtype),
                   [a for a in op_args[2:] if not isinstance(a, Node)],
                   [i for i, a in enumerate(op_args) if isinstance(a, Node)]))
    table = tables.get(config)
    if table is None:
        table = tables[config] = BucketTable(op, dims, shape, node.name, kernel, config)
        table.seed(bucket_key([hint(s) for s in value.shape], dims), kernel if kernel in calls else "composite")
    return graph.call_function(BucketedKernel(table, calls, op), (op_args[0], *flat))


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


@dataclasses.dataclass(frozen=True)
class PackRecipe:
    """How a prepacked weight is made from the weight it packs, kept so that it can be made again when the
    weight changes (see :mod:`fxforge.core.derived`).

    Attributes:
        weight: the weight it packs (a parameter, or a folded constant).
        call: ``(op, kernel, the op's arguments, where in the kernel's arguments the packed weight stands)``.
    """

    weight: torch.Tensor
    call: tuple

    def compute(self) -> torch.Tensor:
        """The weight packed again, as it is now (the packing cache is keyed on its version)."""
        op, kernel, op_args, position = self.call
        return fused_ops.kernel_or_composite(op, kernel, op_args[0], self.weight, *op_args[2:])[1][position]


def derived_values(rewritten: torch.fx.GraphModule, executable: torch.fx.GraphModule) -> DerivedValues:
    """The values a plan computed from the model's tensors: the rewritten graph's folded constants that it
    still reads, then the executable's prepacked weights (which may pack a folded constant).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
        >>> new = fxforge.rewrite(fxforge.capture(model, (torch.randn(1, 3, 8, 8),)), ["conv_bn_fold"])
        >>> len(derived_values(new.graph_module, new.graph_module))  # the folded weight and bias
        2
    """
    read = {n.target for n in rewritten.graph.nodes if n.op == "get_attr"}
    items = [Derived(getattr(rewritten, name), recipe.sources, recipe.compute)
             for name, recipe in rewritten.meta.get("fxforge_folds", {}).items() if name in read]
    for name, recipe in executable.meta.get("fxforge_packs", {}).items():
        replace = functools.partial(executable.register_buffer, name, persistent=False)
        items.append(Derived(getattr(executable, name), (recipe.weight,), recipe.compute, replace))
    return DerivedValues(items)


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
    lowered = run.lowered if run is not None and run.lowers(captured.graph_module) else lower(captured.graph_module)
    for table in tables_of(lowered):  # each bucket's choice, as it is made, goes to this plan's report
        table.report = captured.report
    return Plan(captured, lowered, derived_values(captured.graph_module, lowered))


def plain_plan(captured: Captured) -> Plan:
    """A :class:`~fxforge.core.plan.Plan` that runs the rewritten graph as it is (no lowering): for calls
    that record gradients or run under autocast, whose graphs hold no fused ops; its folded constants, if
    any, are still kept in step with their sources.

    Example:
        >>> plan = plain_plan(fxforge.capture(torch.nn.ReLU(), (torch.ones(2),)))
        >>> plan.executable is plan.captured.graph_module
        True
    """
    gm = captured.graph_module
    return Plan(captured, gm, derived_values(gm, gm))

