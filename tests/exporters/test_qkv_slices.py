"""q, k and v unpacked from one projection (Swin's and timm ViT's form) reach ONNX Runtime's MultiHeadAttention
as slices of that projection, with a scalar factor of q moved into the attention's scale, and the file
answers as the model does."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from onnxscript import ir
from test_onnx import assert_runs_like, onnx_ops
from torch import nn

from fxforge import export_onnx
from fxforge.exporters.qkv_slices import SCALE, SLICES, _unpacked_attention_graph, read_qkv_as_slices


class WindowAttention(nn.Module):
    """torchvision's ``shifted_window_attention`` core: one qkv projection, ``qkv[i]`` after a 5-d permute, q
    scaled by d ** -0.5 before ``q @ k^T``, a relative position bias added."""

    def __init__(self, dim: int = 32, heads: int = 2, tokens: int = 16):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(1, heads, tokens, tokens) * 0.1)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * (c // self.heads) ** -0.5
        attn = torch.softmax(q.matmul(k.transpose(-2, -1)) + self.bias, dim=-1)
        return self.proj(attn.matmul(v).transpose(1, 2).reshape(b, n, c))


class TimmAttention(nn.Module):
    """timm's ``Attention`` (fused path): ``unbind(0)`` of the permuted projection, then SDPA."""

    def __init__(self, dim: int = 48, heads: int = 3):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


def five_d_transposes(path: str) -> int:
    graph = onnx.load(path).graph
    return sum(1 for node in graph.node if node.op_type == "Transpose"
               and any(a.name == "perm" and len(a.ints) == 5 for a in node.attribute))


def test_window_attention_reads_slices_and_folds_the_scale(tmp_path):
    torch.manual_seed(0)
    model = WindowAttention().eval()
    path = str(tmp_path / "window.onnx")
    result = export_onnx(model, path, (torch.randn(3, 16, 32),))
    assert f"{SLICES}: 3" in result.translations and f"{SCALE}: 1" in result.translations, result.translations
    assert five_d_transposes(path) == 0 and onnx_ops(path)["Slice"] == 3
    attention = next(n for n in onnx.load(path).graph.node if n.op_type == "MultiHeadAttention")
    assert next(a.f for a in attention.attribute if a.name == "scale") == np.float32(16 ** -0.5)
    x = torch.randn(3, 16, 32)
    x[1, 4, 7] = float("nan")  # a NaN token: its query row and every row's key at it
    assert_runs_like(model, path, x)
    assert_runs_like(model, path, torch.randn(3, 16, 32) * 30)


def test_timm_attention_reads_slices(tmp_path):
    torch.manual_seed(0)
    model = TimmAttention().eval()
    path = str(tmp_path / "timm.onnx")
    result = export_onnx(model, path, (torch.randn(2, 10, 48),), dynamic_batch=True)
    assert f"{SLICES}: 3" in result.translations, result.translations
    assert not any(line.startswith(SCALE) for line in result.translations)
    assert five_d_transposes(path) == 0
    for batch in (1, 4):
        assert_runs_like(model, path, torch.randn(batch, 10, 48))


# ------------------------------------------------------------------------------------------- IR-level rule

def _run(graph: ir.Graph, qkv: np.ndarray) -> np.ndarray:
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=10))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"qkv": qkv})[0]


def _node(graph: ir.Graph, op_type: str) -> ir.Node:
    return next(node for node in graph if node.op_type == op_type)


def test_another_permutation_is_left():
    graph = _unpacked_attention_graph(tokens=4, heads=2, head=8)
    _node(graph, "Transpose").attributes["perm"] = ir.AttrInt64s("perm", [2, 0, 1, 3, 4])  # heads and tokens swapped
    assert read_qkv_as_slices(graph) == {}


def test_a_reshape_that_regroups_batch_and_tokens_is_left():
    """[1, 4, 3C] -> [4, 1, 3, h, d] splits the same last axis but makes each row a batch: not the slices."""
    graph = _unpacked_attention_graph(tokens=4, heads=2, head=8)
    five_d = _node(graph, "Reshape").outputs[0]
    five_d.shape = ir.Shape([4, 1, 3, 2, 8])
    assert read_qkv_as_slices(graph) == {}


def test_a_scaled_value_is_left():
    """A factor of v is not a factor of the scores: v keeps its Mul and its unpacking."""
    graph = _unpacked_attention_graph(tokens=4, heads=2, head=8, scale_q=0.5)
    mul = _node(graph, "Mul")
    gathers = [node for node in graph if node.op_type == "Gather"]
    mul.replace_input_with(0, gathers[2].outputs[0])  # the factor now multiplies v
    q_transpose = next(node for node in graph if node.op_type == "Transpose" and node.inputs[0] is mul.outputs[0])
    v_transpose = next(node for node in graph if node.op_type == "Transpose" and node.inputs[0] is gathers[2].outputs[0])
    q_transpose.replace_input_with(0, gathers[0].outputs[0])
    v_transpose.replace_input_with(0, mul.outputs[0])
    assert read_qkv_as_slices(graph) == {SLICES: 2}
    attention = _node(graph, "MultiHeadAttention")
    assert attention.inputs[2].producer().op_type == "Reshape" and attention.attributes.get_float("scale") == 1.0


def test_a_factor_that_is_not_a_scalar_is_left():
    graph = _unpacked_attention_graph(tokens=4, heads=2, head=8, scale_q=0.5)
    factor = _node(graph, "Mul").inputs[1]
    factor.const_value = ir.tensor(np.full((8,), 0.5, np.float32))  # per-channel: not a factor of q @ k^T
    assert read_qkv_as_slices(graph) == {SLICES: 2}
    assert _node(graph, "MultiHeadAttention").attributes.get_float("scale") == 1.0


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 20), heads=st.integers(1, 4), head=st.sampled_from([4, 8, 16]),
       scale_q=st.sampled_from([None, 0.125, 0.3, 2.0]), form=st.sampled_from(["gather", "slice", "split"]),
       seed=st.integers(0, 2**16))
def test_random_unpacked_attentions_answer_as_before(tokens, heads, head, scale_q, form, seed):
    qkv = np.random.default_rng(seed).standard_normal((1, tokens, 3 * heads * head)).astype(np.float32)
    expected = _run(_unpacked_attention_graph(tokens, heads, head, scale_q, form), qkv)
    graph = _unpacked_attention_graph(tokens, heads, head, scale_q, form)
    assert read_qkv_as_slices(graph)[SLICES] == 3
    np.testing.assert_allclose(_run(graph, qkv), expected, rtol=1e-5, atol=1e-6)
