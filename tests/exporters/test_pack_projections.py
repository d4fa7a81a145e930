"""Projections of one input over few rows: one product and a Split, same values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_graphs import onnx_applied, op_counts, run_graph
from onnxscript import ir
from test_onnx import assert_runs_like
from torch import nn

from fxforge import export_onnx
from fxforge.exporters.onnx_ir import constant_value, float_value
from fxforge.exporters.pack_projections import (
    MAX_ROWS,
    PACK_PROJECTIONS,
    _projections_graph,
    pack_projections,
)


def _run(graph: ir.Graph, x: np.ndarray) -> list[np.ndarray]:
    return run_graph(graph, {"x": x})


@pytest.mark.parametrize("outputs", [[8, 8, 8], [8, 2, 2], [16, 16]])
@pytest.mark.parametrize("bias", [True, False])
def test_projections_of_one_input_become_one_product(outputs, bias):
    graph = _projections_graph(tokens=5, width=8, outputs=outputs, bias=bias)
    x = np.random.default_rng(1).standard_normal([1, 5, 8]).astype(np.float32)
    x[0, 3, 2] = np.nan  # a NaN row stays in its row of every output
    expected = _run(graph, x)
    assert pack_projections(graph) == 1
    ops = op_counts(graph)
    assert (ops["MatMul"], ops["Split"], ops["Add"]) == (1, 1, int(bias))
    for got, want in zip(_run(graph, x), expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_gemm_is_read_as_a_projection():
    rng = np.random.default_rng(0)
    x = float_value("x", [4, 8])
    nodes, numbers = [], []
    for k in range(2):
        w, b = (constant_value(f"w{k}", rng.standard_normal((6, 8)).astype(np.float32)),
                constant_value(f"b{k}", rng.standard_normal(6).astype(np.float32)))
        numbers += [w, b]
        nodes.append(ir.Node("", "Gemm", [x, w, b], attributes=[ir.AttrInt64("transB", 1)],
                             outputs=[float_value(f"y{k}", [4, 6])]))
    graph = ir.Graph([x], [n.outputs[0] for n in nodes], nodes=nodes, initializers=numbers,
                     opset_imports={"": 20})
    consumers = [ir.Node("", "Relu", [n.outputs[0]], outputs=[float_value(f"r{k}", [4, 6])]) for k, n in enumerate(nodes)]
    for node in consumers:
        graph.append(node)
    graph.outputs[:] = [node.outputs[0] for node in consumers]
    data = rng.standard_normal([4, 8]).astype(np.float32)
    expected = _run(graph, data)
    assert pack_projections(graph) == 1
    assert op_counts(graph)["Gemm"] == 0
    for got, want in zip(_run(graph, data), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_more_rows_than_pay_are_left():
    graph = _projections_graph(tokens=MAX_ROWS + 1, width=8, outputs=[8, 8, 8], bias=True)
    assert pack_projections(graph) == 0
    assert op_counts(graph)["MatMul"] == 3


def test_a_dynamic_row_count_is_left():
    graph = _projections_graph(tokens=5, width=8, outputs=[8, 8], bias=False)
    graph.inputs[0].shape = ir.Shape([1, "tokens", 8])
    assert pack_projections(graph) == 0


def test_mixed_biases_and_graph_outputs_are_left():
    graph = _projections_graph(tokens=5, width=8, outputs=[8, 8], bias=True)
    add = next(node for node in graph if node.op_type == "Add")
    bias = add.inputs[1]
    add.outputs[0].replace_all_uses_with(add.inputs[0])  # the first projection without its bias now
    graph.remove(add, safe=True)
    graph.initializers.pop(bias.name)
    assert pack_projections(graph) == 0  # one with a bias, one without: nothing to pack with

    graph = _projections_graph(tokens=5, width=8, outputs=[8, 8], bias=False)
    identity = next(node for node in graph if node.op_type == "Identity")
    graph.outputs[0] = identity.inputs[0]  # a product that is a graph output keeps its name and node
    assert pack_projections(graph) == 0


class TinyEncoderLayer(nn.Module):
    """BERT's attention (q, k, v from three linear layers of one input, with biases) and a LLaMA-style gated
    MLP (gate and up from one input, without biases)."""

    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 48):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, n, c = x.shape
        y = self.norm1(x)
        q, k, v = (p(y).reshape(b, n, self.heads, c // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def test_an_encoder_layer_runs_like_eager(tmp_path):
    torch.manual_seed(0)
    model = TinyEncoderLayer().eval()
    path = str(tmp_path / "layer.onnx")
    result = export_onnx(model, path, (torch.randn(1, 9, 32),))
    assert f"{PACK_PROJECTIONS}: 2" in onnx_applied(result.report), result.report
    graph = onnx.load(path).graph
    weights = {init.name: tuple(init.dims) for init in graph.initializer}
    shapes = sorted(weights[n.input[1]] for n in graph.node if n.op_type in ("MatMul", "Attention")
                    and n.input[1] in weights)
    assert shapes == [(32, 32), (32, 96), (32, 96), (48, 32)], shapes  # q|k|v (in Attention) and gate|up
    x = torch.randn(1, 9, 32)
    x[0, 4, 1] = float("nan")  # a NaN token: every query reads its key, as in eager
    assert_runs_like(model, path, x)
    assert_runs_like(model, path, torch.randn(1, 9, 32) * 20)
    with torch.no_grad():
        model.q.weight.mul_(2)  # the file is a snapshot of the weights: a new export packs the new ones
    export_onnx(model, path, (torch.randn(1, 9, 32),))
    assert_runs_like(model, path, torch.randn(1, 9, 32))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(1, 9), min_size=2, max_size=4), st.booleans(),
       st.lists(st.sampled_from(["whole", "columns", "relu"]), min_size=4, max_size=4), st.booleans())
def test_random_projections_answer_as_before(rows, widths, bias, readers, flat):
    """Random widths, biases, row counts and readers (whole, column slices, an op): the same values after."""
    rng = np.random.default_rng(rows * 31 + sum(widths))
    shape = [rows, 6] if flat else [1, rows, 6]
    x = float_value("x", shape)
    nodes, numbers, outputs = [], [], []
    for k, width in enumerate(widths):
        weight = constant_value(f"w{k}", rng.standard_normal((6, width)).astype(np.float32))
        numbers.append(weight)
        out_shape = [*shape[:-1], width]
        nodes.append(ir.Node("", "MatMul", [x, weight], outputs=[float_value(f"xw{k}", out_shape)]))
        if bias:
            b = constant_value(f"b{k}", rng.standard_normal(width).astype(np.float32))
            numbers.append(b)
            nodes.append(ir.Node("", "Add", [nodes[-1].outputs[0], b], outputs=[float_value(f"p{k}", out_shape)]))
        product = nodes[-1].outputs[0]
        if readers[k] == "columns" and width >= 2:  # two column slices of the product
            for j, (begin, end) in enumerate(((0, width // 2), (width // 2, width))):
                bounds = [constant_value(f"c{k}{j}{w}", np.array([v], np.int64)) for w, v in (("s", begin), ("e", end), ("a", -1))]
                numbers += bounds
                piece = [*shape[:-1], end - begin]
                nodes.append(ir.Node("", "Slice", [product, *bounds], outputs=[float_value(f"s{k}{j}", piece)]))
                nodes.append(ir.Node("", "Identity", nodes[-1].outputs, outputs=[float_value(f"y{k}{j}", piece)]))
                outputs.append(nodes[-1].outputs[0])
        else:
            nodes.append(ir.Node("", "Relu" if readers[k] == "relu" else "Identity", [product],
                                 outputs=[float_value(f"y{k}", out_shape)]))
            outputs.append(nodes[-1].outputs[0])
    graph = ir.Graph([x], outputs, nodes=nodes, initializers=numbers, opset_imports={"": 20}, name="random")
    data = rng.standard_normal(shape).astype(np.float32)
    expected = _run(graph, data)
    assert pack_projections(graph) == 1
    sliced = any(reader == "columns" and width >= 2 for reader, width in zip(readers, widths))
    assert op_counts(graph)["MatMul"] == 1 and op_counts(graph)["Split"] == (0 if sliced else 1)  # slices read the columns
    for got, want in zip(_run(graph, data), expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
