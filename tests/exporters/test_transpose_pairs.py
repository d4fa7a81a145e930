"""Transposes around a reshape of size-1 dims become one data movement, with the same values."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_graphs import onnx_applied
from onnxscript import ir
from onnxscript.ir.passes.common import RemoveUnusedNodesPass
from test_onnx import assert_runs_like
from torch import nn

from fxforge import export_onnx
from fxforge.exporters.qkv_slices import SLICES
from fxforge.exporters.transpose_pairs import UNIT_TRANSPOSES, fold_transpose_pairs, fold_unit_transposes


def _value(name: str, shape: list | None) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=None if shape is None else ir.Shape(shape))


def _pair(x_shape: list, p1: list, reshaped: list, p2: list, static: bool = True) -> ir.Model:
    """``Relu(Transpose(Reshape(Transpose(x, p1), reshaped), p2))``."""
    x = _value("x", x_shape if static else None)
    y_shape = [x_shape[d] for d in p1]
    t1 = ir.Node("", "Transpose", [x], attributes=[ir.AttrInt64s("perm", p1)], outputs=[_value("t1", y_shape)])
    target = ir.Value(name="target", const_value=ir.tensor(np.array(reshaped, dtype=np.int64)))
    r = ir.Node("", "Reshape", [t1.outputs[0], target], outputs=[_value("r", reshaped)])
    out_shape = [reshaped[d] for d in p2]
    t2 = ir.Node("", "Transpose", [r.outputs[0]], attributes=[ir.AttrInt64s("perm", p2)],
                 outputs=[_value("t2", out_shape)])
    relu = ir.Node("", "Relu", [t2.outputs[0]], outputs=[_value("y", out_shape)])
    graph = ir.Graph([x], relu.outputs, nodes=[t1, r, t2, relu], initializers=[target], opset_imports={"": 20})
    return ir.Model(graph, ir_version=10)


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("case, transposes_after", [
    # torchvision's attention at batch 1: [L, H, E] -> [H, L, E] -> [1, H, L, E] -> [1, L, H, E]: nothing moves
    (([197, 12, 64], [1, 0, 2], [1, 12, 197, 64], [0, 2, 1, 3]), 0),
    # at batch 2 ([L, B, H, E] as [L, B*H, E] is a merge: refused), here [L, 2, E] with a unit dim added
    (([5, 2, 3], [1, 0, 2], [2, 1, 5, 3], [2, 1, 0, 3]), 0),
    (([4, 3, 5], [2, 0, 1], [5, 1, 4, 3], [0, 3, 1, 2]), 1),  # a real permutation: one transpose instead of two
])
def test_pairs_fold_with_the_same_values(case, transposes_after):
    x = np.random.default_rng(0).standard_normal(case[0]).astype(np.float32)
    model = _pair(*case)
    expected = _run(model, x)
    assert fold_transpose_pairs(model.graph) == 1
    RemoveUnusedNodesPass()(model)  # the first transpose and the reshape, which nothing reads any more
    ops = collections.Counter(node.op_type for node in model.graph)
    assert ops["Transpose"] == transposes_after, ops
    np.testing.assert_array_equal(_run(model, x), expected)


@pytest.mark.parametrize("case", [
    ([4, 6, 5], [1, 0, 2], [3, 2, 4, 5], [0, 2, 1, 3]),  # the reshape splits a dim
    ([4, 6, 5], [1, 0, 2], [24, 5], [1, 0]),  # the reshape merges dims
])
def test_reshapes_that_split_or_merge_are_refused(case):
    model = _pair(*case)
    assert fold_transpose_pairs(model.graph) == 0


def test_unknown_shapes_are_refused():
    model = _pair([197, 12, 64], [1, 0, 2], [1, 12, 197, 64], [0, 2, 1, 3], static=False)
    assert fold_transpose_pairs(model.graph) == 0


@pytest.mark.parametrize("batch", [1, 3])
def test_torch_multihead_attention_export(batch, tmp_path):
    """nn.MultiheadAttention (batch_first, as torchvision's ViT) through the attention rewrite and
    MultiHeadAttention: at batch 1 no transpose is left but the output's, and the file answers as eager at both."""
    torch.manual_seed(0)
    model = nn.MultiheadAttention(64, 4, batch_first=True).eval()

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = model

        def forward(self, x):
            return self.attention(x, x, x, need_weights=False)[0]

    wrapper = SelfAttention().eval()
    path = str(tmp_path / "mha.onnx")
    x = torch.randn(batch, 10, 64)
    result = export_onnx(wrapper, path, (x,))
    assert "attention -> com.microsoft.MultiHeadAttention: 1" in result.translations, result.translations
    if batch == 1:  # q, k and v are read as slices of the projection; the output's transposes are reshapes
        assert f"{SLICES}: 3" in onnx_applied(result.report), result.report
        assert f"{UNIT_TRANSPOSES}: 2" in onnx_applied(result.report), result.report
        graph = onnx.load(path).graph  # one transpose is left: the one whose result is the graph's output
        assert [n.output[0] for n in graph.node if n.op_type == "Transpose"] == [graph.output[0].name]
    assert_runs_like(wrapper, path, torch.randn(batch, 10, 64))


@st.composite
def _pairs(draw):
    """A random x shape (some dims 1), a transpose, a reshape that drops and inserts 1s, another transpose."""
    x_shape = draw(st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=1, max_size=4))
    p1 = draw(st.permutations(range(len(x_shape))))
    big = [x_shape[d] for d in p1 if x_shape[d] != 1]
    reshaped = []
    for size in big:
        reshaped += [1] * draw(st.integers(0, 1)) + [size]
    reshaped += [1] * draw(st.integers(0, 1))
    p2 = draw(st.permutations(range(len(reshaped))))
    return x_shape, list(p1), reshaped, list(p2)


@settings(max_examples=40, deadline=None)
@given(_pairs())
def test_random_pairs_fold_with_the_same_values(case):
    x = np.arange(int(np.prod(case[0])), dtype=np.float32).reshape(case[0])
    model = _pair(*case)
    expected = _run(model, x)
    assert fold_transpose_pairs(model.graph) == 1
    RemoveUnusedNodesPass()(model)
    assert sum(node.op_type == "Transpose" for node in model.graph) <= 1
    np.testing.assert_array_equal(_run(model, x), expected)


# ------------------------------------------------------------------------------------ lone unit transposes

def _lone(x_shape: list, perm: list, static: bool = True) -> ir.Model:
    """``Relu(Transpose(x, perm))``."""
    x = _value("x", x_shape if static else None)
    out_shape = [x_shape[d] for d in perm]
    t = ir.Node("", "Transpose", [x], attributes=[ir.AttrInt64s("perm", perm)], outputs=[_value("t", out_shape)])
    relu = ir.Node("", "Relu", [t.outputs[0]], outputs=[_value("y", out_shape)])
    graph = ir.Graph([x], relu.outputs, nodes=[t, relu], opset_imports={"": 20})
    return ir.Model(graph, ir_version=10)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=1, max_size=5).flatmap(
    lambda shape: st.tuples(st.just(shape), st.permutations(range(len(shape))))))
def test_a_transpose_that_moves_only_size_1_dims_is_a_reshape(case):
    x_shape, perm = case[0], list(case[1])
    x = np.arange(int(np.prod(x_shape)), dtype=np.float32).reshape(x_shape)
    model = _lone(x_shape, perm)
    expected = _run(model, x)
    big = [d for d in perm if x_shape[d] != 1]
    assert fold_unit_transposes(model.graph) == (big == sorted(big))
    assert collections.Counter(node.op_type for node in model.graph)["Transpose"] == (big != sorted(big))
    np.testing.assert_array_equal(_run(model, x), expected)


def test_a_unit_transpose_of_unknown_shape_or_a_graph_output_is_left():
    assert fold_unit_transposes(_lone([1, 197, 768], [1, 0, 2], static=False).graph) == 0
    model = _lone([1, 197, 768], [1, 0, 2])
    transpose = next(node for node in model.graph if node.op_type == "Transpose")
    model.graph.outputs.append(transpose.outputs[0])
    assert fold_unit_transposes(model.graph) == 0
