"""MultiHeadAttention over q, k, v projected from one input -> ORT's Attention: same values, NaN included."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_graphs import onnx_applied, op_counts, run_graph
from models import TRANSFORMERS
from onnxscript import ir
from test_onnx import Attention, _mask, all_onnx_ops, assert_runs_like
from torch import nn

from fxforge import export_onnx
from fxforge.exporters import OnnxRuntimeModule, projected_attention
from fxforge.exporters.onnx_ir import constant_value, float_value
from fxforge.exporters.projected_attention import (
    MAX_KEYS,
    PROJECTED_ATTENTION,
    _split_attention_graph,
    attention_matches_multi_head,
    project_attention,
)

MSFT = "com.microsoft"


def _run(graph: ir.Graph, feeds: dict) -> np.ndarray:
    return run_graph(graph, feeds)[0]


def _ops(graph: ir.Graph) -> collections.Counter:
    return op_counts(graph, subgraphs=True)


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=1e-5, atol=1e-5)


def test_this_onnxruntime_passes_the_probe():
    assert attention_matches_multi_head()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf])
def test_split_thirds_become_one_attention(bias, bad):
    graph = _split_attention_graph(tokens=6, width=16, heads=2, bias=bias, batch=2)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((2, 6, 16)).astype(np.float32)}
    if bias:
        feeds["attention_bias"] = rng.standard_normal((2, 2, 6, 6)).astype(np.float32)
        feeds["attention_bias"][1, 0, 2, :] = -np.inf  # a row hidden entirely: NaN there, as before
    if bad is not None:
        feeds["x"][0, 4, 1] = bad  # a bad token: every query of its batch row reads it
    expected = _run(graph, feeds)
    assert project_attention(graph) == 1
    assert _ops(graph)["MultiHeadAttention"] == 0 and _ops(graph)["Attention"] == 1
    _assert_same(_run(graph, feeds), expected)


def _separate_projections_graph(tokens: int, *, biases=(True, False, True), x_for_v: bool = False,
                                 widths=None, regroup: bool = False, width: int = 16, heads: int = 2,
                                 batch: int = 1) -> ir.Graph:
    """MultiHeadAttention (``heads``, scale 0.3) over three separate projections of x [batch, tokens, width]
    (or [tokens, 1, width] reshaped to [1, tokens, width] with ``regroup``); v of another input with
    ``x_for_v``."""
    rng = np.random.default_rng(0)
    widths = widths or (width,) * 3
    shape = [tokens, 1, width] if regroup else [batch, tokens, width]
    x, other = float_value("x", shape), float_value("other", shape)
    nodes, numbers = [], []
    parts = []
    for k, (name, part) in enumerate(zip("qkv", widths)):
        weight = constant_value(f"w{name}", (rng.standard_normal((shape[-1], part)) * 0.25).astype(np.float32))
        numbers.append(weight)
        source = other if x_for_v and name == "v" else x
        nodes.append(ir.Node("", "MatMul", [source, weight], outputs=[float_value(f"{name}w", [*shape[:2], part])]))
        if biases[k]:
            bias = constant_value(f"b{name}", rng.standard_normal(part).astype(np.float32))
            numbers.append(bias)
            nodes.append(ir.Node("", "Add", [nodes[-1].outputs[0], bias], outputs=[float_value(name, [*shape[:2], part])]))
        if regroup:
            target = constant_value(f"shape_{name}", np.array([1, tokens, part], np.int64))
            numbers.append(target)
            nodes.append(ir.Node("", "Reshape", [nodes[-1].outputs[0], target],
                                 outputs=[float_value(f"{name}_rows", [1, tokens, part])]))
        parts.append(nodes[-1].outputs[0])
    out = [1 if regroup else batch, tokens, widths[2]]
    attention = ir.Node(MSFT, "MultiHeadAttention", parts, attributes=[ir.AttrInt64("num_heads", heads),
                                                                       ir.AttrFloat32("scale", 0.3)],
                        outputs=[float_value("o", out)])
    identity = ir.Node("", "Identity", attention.outputs, outputs=[float_value("y", out)])
    return ir.Graph([x, other], identity.outputs, nodes=[*nodes, attention, identity], initializers=numbers,
                    opset_imports={"": 20, MSFT: 1}, name="separate")


@pytest.mark.parametrize("regroup", [False, True])
def test_separate_projections_and_a_regrouped_batch_become_one_attention(regroup):
    graph = _separate_projections_graph(7, regroup=regroup)
    rng = np.random.default_rng(1)
    shape = [7, 1, 16] if regroup else [1, 7, 16]
    feeds = {"x": rng.standard_normal(shape).astype(np.float32), "other": rng.standard_normal(shape).astype(np.float32)}
    expected = _run(graph, feeds)
    assert project_attention(graph) == 1
    attention = next(node for node in graph if node.op_type == "Attention")
    assert attention.attributes.get_float("scale") == pytest.approx(0.3)
    assert (attention.inputs[0].producer() is not None) == regroup  # x read through one Reshape
    _assert_same(_run(graph, feeds), expected)


@pytest.mark.parametrize("case", ["another input for v", "widths differ", "too many keys"])
def test_other_attentions_are_left(case):
    graph = {"another input for v": lambda: _separate_projections_graph(5, x_for_v=True),
             "widths differ": lambda: _separate_projections_graph(5, widths=(16, 16, 8)),
             "too many keys": lambda: _separate_projections_graph(MAX_KEYS + 1)}[case]()
    assert project_attention(graph) == 0
    assert _ops(graph)["MultiHeadAttention"] == 1


def test_a_key_padding_mask_or_a_read_second_output_is_left():
    graph = _split_attention_graph(tokens=5, width=8, heads=2)
    attention = next(node for node in graph if node.op_type == "MultiHeadAttention")
    mask = ir.Value(name="mask", type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([1, 5]))
    graph.inputs.append(mask)
    attention.resize_inputs(5)
    attention.replace_input_with(4, mask)
    assert project_attention(graph) == 0


def test_nothing_changes_where_the_probe_fails(monkeypatch):
    monkeypatch.setattr(projected_attention, "attention_matches_multi_head", lambda: False)
    graph = _split_attention_graph(tokens=5, width=8, heads=2)
    assert project_attention(graph) == 0


@pytest.mark.parametrize("mask_kind", ["none", "bool [B,1,S,L]"])
def test_exported_attention_runs_like_eager(mask_kind, tmp_path):
    torch.manual_seed(0)
    model = Attention(mask_kind=mask_kind).eval()
    mask = _mask(mask_kind, 2, 6)
    inputs = (torch.randn(2, 6, 32),) if mask is None else (torch.randn(2, 6, 32), mask)
    path = str(tmp_path / "attention.onnx")
    result = export_onnx(model, path, inputs, rewrites=[])
    every = all_onnx_ops(path)
    assert any(t.startswith(PROJECTED_ATTENTION) for t in onnx_applied(result.report)), result.report
    assert every[f"{MSFT}:MultiHeadAttention"] == 0 and every["MatMul"] == 0, every  # q, k, v inside Attention
    x = torch.randn(2, 6, 32)
    x[1, 3, 5] = float("nan")  # a NaN token: its batch row is NaN, the other row is not
    assert_runs_like(model, path, x, *inputs[1:])
    assert_runs_like(model, path, torch.randn(2, 6, 32) * 10, *inputs[1:])
    if mask is not None:  # the If's other branch: a mask that masks nothing
        nothing = torch.ones_like(mask) if mask.dtype == torch.bool else torch.zeros_like(mask)
        assert_runs_like(model, path, torch.randn(2, 6, 32), nothing)


def test_both_branches_of_a_checked_padding_mask_become_attention(tmp_path):
    model, inputs = TRANSFORMERS["bert"]()  # q, k, v: three linear layers; a [B, L] padding mask
    model.eval()
    path = str(tmp_path / "bert.onnx")
    result = export_onnx(model, path, inputs)
    assert f"{PROJECTED_ATTENTION}: 4" in onnx_applied(result.report), result.report  # 2 layers x 2 branches
    every = all_onnx_ops(path)
    assert every[f"{MSFT}:MultiHeadAttention"] == 0 and every["If"] == 2, every
    ids, mask = inputs["input_ids"], inputs["attention_mask"].clone()
    with torch.no_grad():
        for attention_mask in (torch.ones_like(mask), mask.index_fill(1, torch.tensor([ids.shape[1] - 1]), 0)):
            expected = model(input_ids=ids, attention_mask=attention_mask).last_hidden_state
            actual = OnnxRuntimeModule(path)(ids, attention_mask)[0]  # the file's inputs in order
            assert torch.allclose(actual, expected, atol=1e-5)


class SequenceFirst(nn.Module):
    """``nn.MultiheadAttention`` on [tokens, batch, C] (torchvision's ViT encoder form)."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(32, 4)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        y = self.norm(x)
        return x + F.gelu(self.attention(y, y, y, need_weights=False)[0])


def test_a_sequence_first_attention_at_batch_one_reads_its_input_regrouped(tmp_path):
    torch.manual_seed(0)
    model = SequenceFirst().eval()
    path = str(tmp_path / "attention.onnx")
    result = export_onnx(model, path, (torch.randn(9, 1, 32),))
    assert f"{PROJECTED_ATTENTION}: 1" in onnx_applied(result.report), result.report
    x = torch.randn(9, 1, 32)
    x[4, 0, 0] = float("inf")
    assert_runs_like(model, path, x)
    assert_runs_like(model, path, torch.randn(9, 1, 32) * 5)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 12), st.sampled_from([(1, 8), (2, 8), (2, 16), (4, 16)]),
       st.booleans(), st.sampled_from(["split", "separate"]), st.sampled_from([None, "nan", "inf", "-inf row"]))
def test_random_attentions_answer_as_before(batch, tokens, heads_width, bias, form, bad):
    """Random batch, token count, heads, width, attention bias and bad values, packed or separate projections."""
    heads, width = heads_width
    if form == "split":
        graph = _split_attention_graph(tokens=tokens, width=width, heads=heads, bias=bias, batch=batch)
    else:
        graph = _separate_projections_graph(tokens, biases=(bias, not bias, True), width=width, heads=heads,
                                            batch=batch)
    rng = np.random.default_rng(tokens * 7 + batch)
    feeds = {value.name: rng.standard_normal([int(d) for d in value.shape]).astype(np.float32) for value in graph.inputs}
    if bad in ("nan", "inf"):
        feeds["x"][batch - 1, tokens // 2, 0] = float(bad)
    if bad == "-inf row" and "attention_bias" in feeds:
        feeds["attention_bias"][0, heads - 1, tokens - 1, :] = -np.inf
    expected = _run(graph, feeds)
    assert project_attention(graph) == 1
    _assert_same(_run(graph, feeds), expected)
