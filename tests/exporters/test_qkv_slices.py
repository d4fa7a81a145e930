"""q, k and v unpacked from one projection (Swin's and timm ViT's form) reach ONNX Runtime's MultiHeadAttention
as slices of that projection, with a scalar factor of q moved into the attention's scale, and the file
answers as the model does."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_graphs import onnx_applied, run_graph
from onnxscript import ir
from test_onnx import assert_runs_like, onnx_ops
from torch import nn

from fxforge import export_onnx
from fxforge.exporters.onnx_ir import constant_value, float_value
from fxforge.exporters.projected_attention import PROJECTED_ATTENTION
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
    assert f"{SLICES}: 3" in onnx_applied(result.report) and f"{SCALE}: 1" in onnx_applied(result.report), result.report
    # q, k and v, the slices' columns, are then projected inside ORT's Attention (projected_attention)
    assert f"{PROJECTED_ATTENTION}: 1" in onnx_applied(result.report), result.report
    assert five_d_transposes(path) == 0 and onnx_ops(path)["Slice"] == 0
    attention = next(n for n in onnx.load(path).graph.node if n.op_type == "Attention")
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
    assert f"{SLICES}: 3" in onnx_applied(result.report), result.report
    assert not any(line.startswith(SCALE) for line in onnx_applied(result.report))
    assert five_d_transposes(path) == 0
    for batch in (1, 4):
        assert_runs_like(model, path, torch.randn(batch, 10, 48))


class TorchMultiheadAttention(nn.Module):
    """torch's ``nn.MultiheadAttention`` as torchvision's ViT calls it (batch first, self-attention)."""

    def __init__(self, dim: int = 48, heads: int = 4):
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("batch", [1, 2])
def test_torch_multihead_attention_reads_columns(batch, tmp_path):
    """Its q, k and v are unpacked by unflatten, unsqueeze, transpose, squeeze and select. At batch 1 the replay
    finds each a block of the projection's columns, and the transpose of the whole projection goes; at batch 2
    the projection's rows are (token, batch) and the attention's (batch, token): not a slice, left."""
    torch.manual_seed(0)
    model = TorchMultiheadAttention().eval()
    path = str(tmp_path / "mha.onnx")
    result = export_onnx(model, path, (torch.randn(batch, 10, 48),))
    ops = onnx_ops(path)
    if batch == 1:
        assert f"{SLICES}: 3" in onnx_applied(result.report), result.report
        assert f"{PROJECTED_ATTENTION}: 1" in onnx_applied(result.report), result.report  # the slices' columns
        assert five_d_transposes(path) == 0 and "Gather" not in ops and ops["Slice"] == 0, ops
    else:
        assert not any(line.startswith(SLICES) for line in onnx_applied(result.report)), result.report
        assert five_d_transposes(path) == 1, ops
    x = torch.randn(batch, 10, 48)
    x[0, 3, 5] = float("nan")  # a NaN token: its query row and every row's key at it
    assert_runs_like(model, path, x)
    assert_runs_like(model, path, torch.randn(batch, 10, 48) * 30)


def _moved_attention(source_shape: list, moves: list) -> ir.Graph:
    """MultiHeadAttention (1 head) whose q, k and v are all ``moves`` applied to the graph input ``qkv``:
    each move is ``(op_type, constant operands, attributes, output shape)``."""
    source = float_value("qkv", source_shape)
    value, nodes, numbers = source, [], []
    for step, (op_type, operands, attributes, shape) in enumerate(moves):
        inputs = [value]
        for k, operand in enumerate(operands):
            numbers.append(constant_value(f"c{step}_{k}", np.array(operand, np.int64)))
            inputs.append(numbers[-1])
        nodes.append(ir.Node("", op_type, inputs, outputs=[float_value(f"m{step}", shape)], attributes=[
            ir.convenience.convert_attribute(k, v) for k, v in attributes.items()]))
        value = nodes[-1].outputs[0]
    output = float_value("y", list(value.shape))
    nodes.append(ir.Node("com.microsoft", "MultiHeadAttention", [value, value, value], outputs=[output],
                         attributes=[ir.AttrInt64("num_heads", 1)]))
    return ir.Graph([source], [output], nodes=nodes, initializers=numbers,
                    opset_imports={"": 20, "com.microsoft": 1}, name="moved")


UNPACK_THIRD_1 = [("Reshape", [[2, 4, 3, 8]], {}, [2, 4, 3, 8]), ("Transpose", [], {"perm": [2, 0, 1, 3]}, [3, 2, 4, 8]),
                  ("Gather", [1], {"axis": 0}, [2, 4, 8])]


@pytest.mark.parametrize("moves", [
    UNPACK_THIRD_1,  # [2, 4, 24] -> [2, 4, 3, 8] -> [3, 2, 4, 8] -> third 1: columns 8:16
    UNPACK_THIRD_1 + [("Slice", [[0], [1], [1]], {}, [2, 1, 8])],  # and token 0 of each batch row (dead rows)
])
def test_a_moved_block_becomes_a_slice(moves):
    graph = _moved_attention([2, 4, 24], moves)
    qkv = np.random.default_rng(0).standard_normal([2, 4, 24]).astype(np.float32)
    expected = _run(graph, qkv)
    assert read_qkv_as_slices(graph) == {SLICES: 3}
    attention = _node(graph, "MultiHeadAttention")
    assert [value.producer().op_type for value in attention.inputs] == ["Slice"] * 3
    np.testing.assert_allclose(_run(graph, qkv), expected, rtol=0, atol=0)


@pytest.mark.parametrize("moves", [
    # tokens and batch swap places: the rows come out in another order
    [("Transpose", [], {"perm": [1, 0, 2]}, [4, 2, 24]), ("Slice", [[0], [8], [2]], {}, [4, 2, 8])],
    # every other column: not one block
    [("Reshape", [[2, 4, 8, 3]], {}, [2, 4, 8, 3]), ("Gather", [0], {"axis": 3}, [2, 4, 8])],
    # all the columns: a reshape's case, left to the transposes' rule
    [("Transpose", [], {"perm": [0, 1, 2]}, [2, 4, 24])],
])
def test_a_moved_input_that_is_not_a_block_of_columns_is_left(moves):
    assert read_qkv_as_slices(_moved_attention([2, 4, 24], moves)) == {}


# ------------------------------------------------------------------------------------------- IR-level rule

def _run(graph: ir.Graph, qkv: np.ndarray) -> np.ndarray:
    return run_graph(graph, {"qkv": qkv})[0]


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
