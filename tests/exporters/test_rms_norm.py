"""RMS norms are written in the form ONNX Runtime fuses into ``SimplifiedLayerNormalization``, with the
model's values, and only where that form is the one ORT fuses."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_graphs import onnx_applied, run_graph
from onnxscript import ir
from test_onnx import assert_runs_like
from torch import nn

from fxforge import export_onnx
from fxforge.exporters.onnx_ir import onnxruntime_optimized
from fxforge.exporters.ort_module import OnnxRuntimeModule
from fxforge.exporters.rms_norm import (
    RMS_NORM,
    _fused,
    _norm_graph,
    divide_rms_norms,
    onnxruntime_fuses_rms_norm,
)


class HandWrittenRMSNorm(nn.Module):
    """The norm as transformers' LLaMA, Mistral, Qwen and T5 write it (weight on the left or the right)."""

    def __init__(self, hidden: int, weight_first: bool = True, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.eps, self.weight_first = eps, weight_first

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed if self.weight_first else normed * self.weight


class Block(nn.Module):
    def __init__(self, norm: nn.Module, hidden: int = 32):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(hidden, hidden), norm, nn.Linear(hidden, 8)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


def _optimized_ops(path: str) -> collections.Counter:
    return collections.Counter(node.op_type for node in onnxruntime_optimized(path).node)


def test_the_probe_tells_the_fused_form_from_torchs():
    assert onnxruntime_fuses_rms_norm()
    assert not _fused(divided=False)  # torch's Reciprocal form runs as separate kernels


@pytest.mark.parametrize("norm", ["weight_first", "weight_last", "torch.nn.RMSNorm"])
def test_norm_is_fused_with_the_models_values(norm, tmp_path):
    torch.manual_seed(0)
    module = nn.RMSNorm(32, eps=1e-6) if norm == "torch.nn.RMSNorm" else HandWrittenRMSNorm(32, norm == "weight_first")
    model = Block(module).eval()
    path = str(tmp_path / "norm.onnx")
    result = export_onnx(model, path, (torch.randn(2, 5, 32),))
    assert f"{RMS_NORM}: 1" in onnx_applied(result.report), result.report
    ops = _optimized_ops(path)
    assert ops["SimplifiedLayerNormalization"] == 1 and not ops["Reciprocal"], ops
    x = torch.randn(2, 5, 32)
    x[1, 2, 3] = float("nan")  # a NaN row stays NaN, the other rows as eager
    x[0, 4, :] = 0.0  # an all-zero row: eps keeps it finite
    assert_runs_like(model, path, x)


def test_llama_norms_are_fused(tmp_path):
    from models import TRANSFORMERS  # tests/corpus, put on the path by conftest.py

    model, inputs = TRANSFORMERS["llama"]()  # 2 layers: two norms each and the final one
    path = str(tmp_path / "llama.onnx")
    result = export_onnx(model, path, inputs)
    assert f"{RMS_NORM}: 5" in onnx_applied(result.report), result.report
    assert _optimized_ops(path)["SimplifiedLayerNormalization"] == 5
    fresh = {"input_ids": torch.randint(1, 90, inputs["input_ids"].shape), "attention_mask": inputs["attention_mask"]}
    with torch.no_grad():
        expected = model(**fresh)[0]
        actual = OnnxRuntimeModule(path, result.io)(**fresh)[0]
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------- IR-level rule

def _run(graph: ir.Graph, x: np.ndarray) -> np.ndarray:
    return run_graph(graph, {"x": x})[0]


def _node(graph: ir.Graph, op_type: str) -> ir.Node:
    return next(node for node in graph if node.op_type == op_type)


def test_a_norm_without_weight_is_left():
    """ORT fuses only a norm scaled by a weight; a bare Div would be slower than torch's Mul."""
    graph = _norm_graph(hidden=8)
    scale = next(node for node in graph if node.op_type == "Mul" and node.inputs[0].name == "weight")
    graph.outputs[0] = scale.inputs[1]
    graph.remove(scale, safe=True)
    assert divide_rms_norms(graph, fuses=True) == 0


def test_a_reciprocal_of_another_tensor_is_left():
    graph = _norm_graph(hidden=8)
    other = ir.Value(name="other", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 4, 8]))
    graph.inputs.append(other)
    _node(graph, "Pow").replace_input_with(0, other)  # the root mean square of another tensor
    assert divide_rms_norms(graph, fuses=True) == 0


def test_a_mean_over_another_axis_is_left():
    graph = _norm_graph(hidden=8)
    mean = _node(graph, "ReduceMean")
    axes = ir.Value(name="axes1", const_value=ir.tensor(np.array([1], dtype=np.int64)))
    graph.register_initializer(axes)
    mean.replace_input_with(1, axes)
    assert divide_rms_norms(graph, fuses=True) == 0


def test_a_runtime_that_does_not_fuse_changes_nothing():
    graph = _norm_graph(hidden=8)
    assert divide_rms_norms(graph, fuses=False) == 0
    assert _node(graph, "Reciprocal") is not None


@settings(max_examples=25, deadline=None)
@given(hidden=st.integers(1, 96), seed=st.integers(0, 2**16))
def test_random_norms_answer_as_before(hidden, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((1, 4, hidden)) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
    x[0, rng.integers(0, 4)] = 0.0  # one all-zero row (eps alone under the root)
    graph = _norm_graph(hidden=hidden)
    expected = _run(graph, x)
    assert divide_rms_norms(graph, fuses=True) == 1
    np.testing.assert_allclose(_run(graph, x), expected, rtol=2e-6, atol=1e-6)
