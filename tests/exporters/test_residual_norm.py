"""Residual adds before a LayerNormalization are exported as ``Sum`` for ONNX Runtime's CPU provider, so that
ORT runs ``Sum`` + ``LayerNormalization`` instead of its slower fused ``SkipLayerNormalization``; bias adds
and exports for CUDA keep ``Add``."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch
from ir_graphs import onnx_applied
from onnxscript import ir
from test_onnx import assert_runs_like
from torch import nn

from fxforge import export_onnx
from fxforge.exporters.export import captured_for_export
from fxforge.exporters.onnx import _export
from fxforge.exporters.ort_module import session_options
from fxforge.exporters.residual_norm import RESIDUAL_NORM, residual_refusal, separate_residual_adds


class PostNorm(nn.Module):
    """``norm(x + linear(x))``, BERT's residual block."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.linear, self.norm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden)

    def forward(self, x):
        return self.norm(x + self.linear(x))


class PreNorm(nn.Module):
    """``h = x + linear(norm1(x)); h + linear2(norm2(h))``, GPT-2's: the residual sum has two users."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.linear1, self.linear2 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        h = x + self.linear1(self.norm1(x))
        return h + self.linear2(self.norm2(h))


class BiasNorm(nn.Module):
    """``norm(x + bias)``: the add broadcasts a [hidden] parameter, it is not a residual."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.bias, self.norm = nn.Parameter(torch.randn(hidden)), nn.LayerNorm(hidden)

    def forward(self, x):
        return self.norm(x + self.bias)


def producers_of_norms(path: str) -> list[str]:
    """The op type producing each LayerNormalization's input, in file order."""
    graph = onnx.load(path).graph
    producer = {out: node.op_type for node in graph.node for out in node.output}
    return [producer.get(node.input[0], "graph input") for node in graph.node if node.op_type == "LayerNormalization"]


def ort_optimized_ops(path: str, tmp_path) -> set[str]:
    """The op types in the graph ONNX Runtime's CPU provider optimizes ``path`` into."""
    options = session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return {node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node}


@pytest.mark.parametrize("dynamic_batch", [False, True])
def test_residual_add_becomes_sum_and_ort_keeps_layer_norm(dynamic_batch, tmp_path):
    torch.manual_seed(0)
    model = PostNorm().eval()
    path = str(tmp_path / "post.onnx")
    result = export_onnx(model, path, (torch.randn(2, 5, 16),), dynamic_batch=dynamic_batch)
    assert f"{RESIDUAL_NORM}: 1" in onnx_applied(result.report), result.report
    assert result.report.counts["onnx residual_norm"] == 1
    assert f"onnx residual_norm: {RESIDUAL_NORM} [" in str(result.report)
    assert RESIDUAL_NORM not in " ".join(result.translations)  # a rule's line, not a translation's
    assert producers_of_norms(path) == ["Sum"]
    optimized = ort_optimized_ops(path, tmp_path)
    assert "LayerNormalization" in optimized and "SkipLayerNormalization" not in optimized
    assert_runs_like(model, path, torch.randn(3 if dynamic_batch else 2, 5, 16))


def test_residual_sum_with_two_users(tmp_path):
    torch.manual_seed(0)
    model = PreNorm().eval()
    path = str(tmp_path / "pre.onnx")
    result = export_onnx(model, path, (torch.randn(1, 7, 16),))
    assert f"{RESIDUAL_NORM}: 1" in onnx_applied(result.report)  # norm1 reads the graph input, norm2 the residual sum
    assert producers_of_norms(path) == ["graph input", "Sum"]
    assert "SkipLayerNormalization" not in ort_optimized_ops(path, tmp_path)
    assert_runs_like(model, path, torch.randn(1, 7, 16))


def test_bias_add_stays_add_with_reason(tmp_path):
    model = BiasNorm().eval()
    path = str(tmp_path / "bias.onnx")
    result = export_onnx(model, path, (torch.randn(2, 4, 16),))
    assert producers_of_norms(path) == ["Add"]
    assert not any(line.startswith(RESIDUAL_NORM) for line in onnx_applied(result.report))
    (miss,) = [miss for miss in result.report.near_misses if miss.rule == "residual_norm"]
    assert miss.stage == "onnx" and miss.reason.startswith("an operand is broadcast"), miss
    assert miss.source and "test_residual_norm.py" in miss.source, miss  # the user's line, from torch.onnx's trace
    assert "onnx residual_norm refused at" in str(result.report)


def test_export_for_cuda_keeps_add(tmp_path):
    model = PostNorm().eval()
    captured = captured_for_export(model, (torch.randn(2, 5, 16),))
    path = str(tmp_path / "cuda.onnx")
    exported = _export(captured, path, 20, False, None, "MultiHeadAttention", cpu=False)
    assert producers_of_norms(path) == ["Add"]
    assert not exported["matches"] and not exported["near_misses"]


def _value(name: str, shape: list | None) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=None if shape is None else ir.Shape(shape))


def test_rule_on_ir_graphs():
    x, r, s = _value("x", ["batch", 4]), _value("r", ["batch", 4]), _value("s", ["batch", 4])
    add = ir.Node("", "Add", [x, r], outputs=[s])
    scale = ir.Node("", "Add", [x, r], outputs=[_value("w", ["batch", 4])])  # feeds the norm's scale, not its input
    norm = ir.Node("", "LayerNormalization", [s, scale.outputs[0]], outputs=[_value("y", ["batch", 4])])
    graph = ir.Graph([x, r], norm.outputs, nodes=[add, scale, norm])
    assert separate_residual_adds(graph) == (1, [])
    assert (norm.inputs[0].producer().op_type, scale.op_type) == ("Sum", "Add")
    assert norm.inputs[0].name == "s"  # the Sum's value keeps the Add's name
    assert separate_residual_adds(graph) == (0, [])  # a Sum is not rewritten again

    unknown = ir.Node("", "Add", [_value("a", None), _value("b", [4])], outputs=[_value("c", [4])])
    assert residual_refusal(unknown) == "operand shapes not known at export time"
    other_dim = ir.Node("", "Add", [_value("a", ["batch", 4]), _value("b", ["n", 4])], outputs=[_value("c", ["batch", 4])])
    assert residual_refusal(other_dim).startswith("an operand is broadcast")
