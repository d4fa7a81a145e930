"""The cost model (fxforge.core.costs): the roofline estimate, and the same under a fusing compiler, where an
elementwise op costs writing its output once (issue 22); one model for checkpointing, the pipeline planner and
the profiler (issue 47)."""

from __future__ import annotations

import torch

from fxforge.core.costs import Machine, is_pointwise, node_seconds

MACHINE = Machine("cpu", 100.0, 10.0, "")


def _graph():
    g = torch.fx.Graph()
    a = g.placeholder("a")
    a.meta["val"] = torch.ones(256, 256)
    nodes = {}
    for name, target, args in [("relu", torch.ops.aten.relu.default, (a,)),
                               ("add", torch.ops.aten.add.Tensor, (a, a)),
                               ("mm", torch.ops.aten.mm.default, (a, a)),
                               ("sum", torch.ops.aten.sum.dim_IntList, (a, [1])),
                               ("t", torch.ops.aten.t.default, (a,))]:
        node = g.call_function(target, args)
        node.meta["val"] = torch.ones(256) if name == "sum" else torch.ones(256, 256)
        nodes[name] = node
    return nodes


def test_elementwise_ops_are_pointwise_and_the_others_are_not():
    nodes = _graph()
    assert is_pointwise(nodes["relu"]) and is_pointwise(nodes["add"])
    assert not is_pointwise(nodes["mm"]) and not is_pointwise(nodes["sum"]) and not is_pointwise(nodes["t"])


def test_a_fused_elementwise_op_costs_one_write_of_its_output_and_no_launch():
    nodes = _graph()
    written = 256 * 256 * 4 / (MACHINE.bandwidth_gbs * 1e9)
    assert node_seconds(nodes["add"], MACHINE, fused=True) == written
    # Unfused it reads its input (``a + a``: one tensor), writes its output and is launched.
    assert node_seconds(nodes["add"], MACHINE) > 2 * written


def test_fusion_does_not_change_what_matrix_products_reductions_and_views_cost():
    nodes = _graph()
    for name in ("mm", "sum", "t"):
        assert node_seconds(nodes[name], MACHINE, fused=True) == node_seconds(nodes[name], MACHINE)
    assert node_seconds(nodes["t"], MACHINE) == 0.0
