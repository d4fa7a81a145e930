"""LeViT exports through fxforge's ONNX rules (issue 50): its subsampling (a reshape to the token grid, two strided
slices, a reshape back) keeps the first rows of its source in order, which the ``gathers`` rule took for copies
that cancel out and wrote as a ``Reshape`` to fewer elements, which ONNX Runtime rejects. Such a result is a
gather of the rows it keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ir_graphs import onnx_applied, run_graph
from onnxscript import ir

import fxforge
from fxforge.core.verify import compare_outputs
from fxforge.exporters.gathers import CANCELLED, GATHERS, gather_moved_rows
from fxforge.exporters.onnx_ir import constant_value, float_value
from fxforge.exporters.ort_module import OnnxRuntimeModule
from tests.capture.test_no_trace import small_levit


def _subsample(tokens: int, stride: int, channels: int = 32) -> ir.Graph:
    """LeViT's ``x.view(B, r, r, C)[:, ::stride, ::stride].reshape(B, -1, C)`` of ``x`` [1, tokens, C], as ONNX."""
    side, kept = int(tokens ** 0.5), int(tokens ** 0.5) // stride
    x = float_value("x", [1, tokens, channels])
    numbers, nodes = [], []

    def number(values):
        numbers.append(constant_value(f"n{len(numbers)}", np.array(values, np.int64)))
        return numbers[-1]

    def node(op_type, inputs):
        nodes.append(ir.Node("", op_type, inputs, outputs=[ir.Value(name=f"v{len(nodes)}", type=x.type)]))
        return nodes[-1].outputs[0]

    value = node("Reshape", [x, number([1, side, side, channels])])
    value = node("Slice", [value, number([0]), number([side]), number([1]), number([stride])])
    value = node("Slice", [value, number([0]), number([side]), number([2]), number([stride])])
    value = node("Reshape", [value, number([1, kept * kept, channels])])
    relu = ir.Node("", "Relu", [value], outputs=[ir.Value(name="y", type=x.type)])
    nodes.append(relu)
    return ir.Graph([x], relu.outputs, nodes=nodes, initializers=numbers, opset_imports={"": 20}, name="subsample")


@pytest.mark.parametrize("tokens, stride", [(4, 2), (16, 2), (16, 4), (64, 2)])
def test_subsampled_rows_are_a_gather_not_a_reshape(tokens, stride):
    graph = _subsample(tokens, stride)
    x = np.random.default_rng(0).standard_normal([1, tokens, 32]).astype(np.float32)
    expected = run_graph(graph, {"x": x})[0]
    assert gather_moved_rows(graph) == {GATHERS: 1}  # (with only the first row kept, not CANCELLED)
    assert {node.op_type for node in graph} == {"Reshape", "Gather", "Relu"}
    np.testing.assert_array_equal(run_graph(graph, {"x": x})[0], expected)


def test_every_row_kept_in_order_still_cancels_out():
    graph = _subsample(16, 1)  # slices with step 1 keep every row: nothing moves
    x = np.random.default_rng(1).standard_normal([1, 16, 32]).astype(np.float32)
    expected = run_graph(graph, {"x": x})[0]
    assert gather_moved_rows(graph) == {CANCELLED: 1}
    np.testing.assert_array_equal(run_graph(graph, {"x": x})[0], expected)


def test_levit_exports_and_runs_like_eager(tmp_path):
    model, _ = small_levit()
    path = str(tmp_path / "levit.onnx")
    result = fxforge.export_onnx(model, path, (torch.randn(1, 3, 64, 64),))
    assert any(line.startswith(GATHERS) for line in onnx_applied(result.report)), onnx_applied(result.report)
    session = OnnxRuntimeModule(path)
    for _ in range(2):
        x = torch.randn(1, 3, 64, 64)
        with torch.no_grad():
            expected = model(x)
        hidden, pooled = session(x)
        assert expected.last_hidden_state.abs().mean() > 1e-2
        assert compare_outputs(expected.last_hidden_state, hidden).ok
        assert compare_outputs(expected.pooler_output, pooled).ok
