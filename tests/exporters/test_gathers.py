"""Rows moved by several data-movement ops become one Gather (or a Reshape where they cancel), same values."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_graphs import onnx_applied, run_graph
from onnxscript import ir
from test_onnx import assert_runs_like
from torch import nn

from fxforge import export_onnx
from fxforge.exporters.gathers import CANCELLED, GATHERS, _rolled_graph, gather_moved_rows
from fxforge.exporters.onnx_ir import constant_value, float_value


def _run(graph: ir.Graph, x: np.ndarray) -> np.ndarray:
    return run_graph(graph, {"x": x})[0]


def _ops(graph: ir.Graph) -> collections.Counter:
    return collections.Counter(node.op_type for node in graph)


def _moves(x_shape: list, moves: list) -> ir.Graph:
    """``Relu`` of ``moves`` applied to the graph input ``x``: each ``(op_type, operands, attributes)``, the
    operands constants; a move whose operands are ``"self"`` is a ``Concat`` of the value with itself."""
    x = float_value("x", x_shape)
    value, nodes, numbers = x, [], []
    for step, (op_type, operands, attributes) in enumerate(moves):
        inputs = [value]
        if operands == "self":
            inputs = [value, value]
        else:
            for k, operand in enumerate(operands):
                numbers.append(constant_value(f"c{step}_{k}", np.array(operand, np.int64)))
                inputs.append(numbers[-1])
        nodes.append(ir.Node("", op_type, inputs, outputs=[ir.Value(name=f"m{step}", type=x.type)],
                             attributes=[ir.convenience.convert_attribute(k, v) for k, v in attributes.items()]))
        value = nodes[-1].outputs[0]
    relu = ir.Node("", "Relu", [value], outputs=[ir.Value(name="y", type=x.type)])
    nodes.append(relu)
    return ir.Graph([x], relu.outputs, nodes=nodes, initializers=numbers, opset_imports={"": 20}, name="moves")


def _check(graph: ir.Graph, x_shape: list, expected_counts: dict) -> ir.Graph:
    x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
    before = _run(graph, x)
    assert gather_moved_rows(graph) == expected_counts
    np.testing.assert_array_equal(_run(graph, x), before)
    return graph


def test_a_roll_is_one_gather():
    graph = _check(_rolled_graph(tokens=6, channels=8, shift=2), [6, 8], {GATHERS: 1})
    assert _ops(graph) == {"Reshape": 1, "Gather": 1, "Relu": 1}


def _shifted_windows(grid: int = 4, window: int = 2, channels: int = 8, shift: int = 1) -> ir.Graph:
    """Swin's ``roll`` (two Slices and a Concat per axis), zero ``Pad`` and window partition, as ONNX."""
    x = float_value("x", [1, grid, grid, channels])
    nodes, numbers = [], []

    def number(values):
        numbers.append(constant_value(f"n{len(numbers)}", np.array(values, np.int64)))
        return numbers[-1]

    def node(op_type, inputs, **attributes):
        nodes.append(ir.Node("", op_type, inputs, outputs=[ir.Value(name=f"v{len(nodes)}", type=x.type)],
                             attributes=[ir.convenience.convert_attribute(k, v) for k, v in attributes.items()]))
        return nodes[-1].outputs[0]

    value = node("Pad", [x, number([0] * 8)])
    for axis in (1, 2):
        tail = node("Slice", [value, number([shift]), number([grid]), number([axis])])
        head = node("Slice", [value, number([0]), number([shift]), number([axis])])
        value = node("Concat", [tail, head], axis=axis)
    parts = grid // window
    value = node("Reshape", [value, number([1, parts, window, parts, window, channels])])
    value = node("Transpose", [value], perm=[0, 1, 3, 2, 4, 5])
    value = node("Reshape", [value, number([parts * parts, window * window, channels])])
    relu = ir.Node("", "Relu", [value], outputs=[ir.Value(name="y", type=x.type)])
    nodes.append(relu)
    return ir.Graph([x], relu.outputs, nodes=nodes, initializers=numbers, opset_imports={"": 20}, name="windows")


def test_shifted_windows_are_one_gather():
    graph = _check(_shifted_windows(), [1, 4, 4, 8], {GATHERS: 1})
    assert _ops(graph) == {"Reshape": 1, "Gather": 1, "Relu": 1}


def test_a_patch_merge_is_one_gather_and_a_reshape():
    """x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2] side by side along the channels."""
    x = float_value("x", [1, 4, 4, 8])
    numbers, pieces = [], []
    for k, (row, column) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
        bounds = [constant_value(f"{what}{k}", np.array(v, np.int64)) for what, v in (
            ("s", [row, column]), ("e", [4, 4]), ("a", [1, 2]), ("p", [2, 2]))]
        numbers += bounds
        pieces.append(ir.Node("", "Slice", [x, *bounds], outputs=[ir.Value(name=f"piece{k}", type=x.type)]))
    merged = ir.Node("", "Concat", [p.outputs[0] for p in pieces], attributes=[ir.AttrInt64("axis", -1)],
                     outputs=[ir.Value(name="merged", type=x.type, shape=ir.Shape([1, 2, 2, 32]))])
    relu = ir.Node("", "Relu", merged.outputs, outputs=[ir.Value(name="y", type=x.type)])
    graph = ir.Graph([x], relu.outputs, nodes=[*pieces, merged, relu], initializers=numbers,
                     opset_imports={"": 20}, name="merge")
    graph = _check(graph, [1, 4, 4, 8], {GATHERS: 1})
    assert _ops(graph) == {"Reshape": 2, "Gather": 1, "Relu": 1}


def test_copies_that_cancel_out_are_a_reshape():
    graph = _check(_moves([1, 5, 4, 16], [("Transpose", [], {"perm": [0, 2, 1, 3]}),
                                          ("Transpose", [], {"perm": [0, 2, 1, 3]})]), [1, 5, 4, 16], {CANCELLED: 1})
    assert _ops(graph) == {"Reshape": 1, "Relu": 1}


@pytest.mark.parametrize("x_shape, moves", [
    ([6, 4], [("Slice", [[2], [6], [0]], {}), ("Concat", "self", {"axis": 0})]),  # rows of 4: too short
    ([6, 8], [("Transpose", [], {"perm": [1, 0]}), ("Slice", [[0], [4], [0]], {})]),  # the rows themselves move
    ([6, 8], [("Slice", [[1], [6], [0]], {})]),  # one copy: nothing to save
    ([6, 8], [("Slice", [[0], [6], [1], [1]], {}), ("Slice", [[5], [-7], [0], [-1]], {})]),  # a reversed slice
])
def test_other_moves_are_left(x_shape, moves):
    graph = _moves(x_shape, moves)
    assert gather_moved_rows(graph) == {}


@pytest.mark.parametrize("reader", ["Relu", "graph output"])
def test_a_move_read_in_between_is_left(reader):
    graph = _rolled_graph(tokens=6, channels=8, shift=2)
    tail = next(node for node in graph if node.op_type == "Slice")
    if reader == "graph output":  # as a returned KV cache is
        graph.outputs.append(tail.outputs[0])
    else:
        relu = ir.Node("", "Relu", tail.outputs, outputs=[ir.Value(name="also", type=tail.outputs[0].type)])
        graph.append(relu)
        graph.outputs.append(relu.outputs[0])
    assert gather_moved_rows(graph) == {}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.integers(1, 3)), min_size=1, max_size=3),
       st.sampled_from([[0, 1, 2, 3], [0, 2, 1, 3]]))
def test_random_rolls_and_transposes_answer_as_before(rolls, perm):
    """Rolls of a [1, 4, 4, 8] grid along random axes by random shifts, then a transpose of the grid."""
    moves = []
    for axis, shift in rolls:
        moves += [("Slice", [[shift], [4], [axis]], {}), ("Slice", [[0], [shift], [axis]], {})]
    x = float_value("x", [1, 4, 4, 8])
    value, nodes, numbers = x, [], []
    for k in range(0, len(moves), 2):
        pieces = []
        for op_type, operands, _ in moves[k:k + 2]:
            inputs = [value]
            for operand in operands:
                numbers.append(constant_value(f"n{len(numbers)}", np.array(operand, np.int64)))
                inputs.append(numbers[-1])
            nodes.append(ir.Node("", op_type, inputs, outputs=[ir.Value(name=f"v{len(nodes)}", type=x.type)]))
            pieces.append(nodes[-1].outputs[0])
        nodes.append(ir.Node("", "Concat", pieces, attributes=[ir.AttrInt64("axis", moves[k][1][2][0])],
                             outputs=[ir.Value(name=f"v{len(nodes)}", type=x.type)]))
        value = nodes[-1].outputs[0]
    nodes.append(ir.Node("", "Transpose", [value], attributes=[ir.AttrInt64s("perm", perm)],
                         outputs=[ir.Value(name="moved", type=x.type)]))
    nodes.append(ir.Node("", "Relu", nodes[-1].outputs, outputs=[ir.Value(name="y", type=x.type)]))
    graph = ir.Graph([x], nodes[-1].outputs, nodes=nodes, initializers=numbers, opset_imports={"": 20}, name="g")
    grid = np.arange(16).reshape(1, 4, 4)
    for axis, shift in rolls:
        grid = np.roll(grid, -shift, axis=axis)
    moved = np.transpose(grid[..., None], perm).reshape(-1)
    _check(graph, [1, 4, 4, 8], {CANCELLED if np.array_equal(moved, np.arange(16)) else GATHERS: 1})


class ShiftedWindowBlock(nn.Module):
    """torchvision's Swin in small: a shifted-window attention (roll, pad, window partition, SDPA, reverse,
    roll back) with a residual, then a patch merge (four strided slices side by side, a norm, a linear)."""

    def __init__(self, channels: int = 16, heads: int = 2, window: int = 2, shift: int = 1):
        super().__init__()
        self.heads, self.window, self.shift = heads, window, shift
        self.norm = nn.LayerNorm(channels)
        self.qkv, self.proj = nn.Linear(channels, 3 * channels), nn.Linear(channels, channels)
        self.merge_norm, self.reduce = nn.LayerNorm(4 * channels), nn.Linear(4 * channels, 2 * channels)

    def forward(self, x):  # x: [B, H, W, C]
        b, h, w, c = x.shape
        y = F.pad(self.norm(x), (0, 0, 0, (-w) % self.window, 0, (-h) % self.window))
        y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        ph, pw, k = y.shape[1], y.shape[2], self.window
        y = y.view(b, ph // k, k, pw // k, k, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, k * k, c)
        q, kk, v = self.qkv(y).reshape(y.shape[0], k * k, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, kk, v).transpose(1, 2).reshape(-1, k * k, c)
        y = self.proj(y).view(b, ph // k, pw // k, k, k, c).permute(0, 1, 3, 2, 4, 5).reshape(b, ph, pw, c)
        y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))[:, :h, :w, :]
        x = x + y
        merged = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduce(self.merge_norm(merged))


def test_a_shifted_window_block_answers_as_eager(tmp_path):
    torch.manual_seed(0)
    model = ShiftedWindowBlock().eval()
    path = str(tmp_path / "swin.onnx")
    result = export_onnx(model, path, (torch.randn(1, 8, 8, 16),))
    gathered = [line for line in onnx_applied(result.report) if line.startswith(GATHERS)]
    assert gathered and int(gathered[0].rsplit(": ", 1)[1]) >= 3, result.report  # roll+windows, back, merge
    ops = collections.Counter(node.op_type for node in onnx.load(path).graph.node)
    assert not {"Concat", "Pad"} & set(ops), ops
    x = torch.randn(1, 8, 8, 16)
    x[0, 3, 5, 2] = float("nan")  # a NaN token: its window's rows, as in eager
    assert_runs_like(model, path, x)
    assert_runs_like(model, path, torch.randn(1, 8, 8, 16) * 10)
