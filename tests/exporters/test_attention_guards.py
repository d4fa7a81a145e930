"""The attention rewrite's NaN and ``-inf`` row guards leave an export for ONNX Runtime's CPU provider where
MultiHeadAttention gives those rows itself, and stay where its kernel would not (GroupQueryAttention)."""

from __future__ import annotations

import collections
import math

import numpy as np
import onnx
import pytest
import torch
from ir_graphs import onnx_applied
from onnxscript import ir
from torch import nn

import fxforge
from fxforge import export_onnx
from fxforge.core.plan import CallConditions
from fxforge.exporters.attention_guards import (
    CONSTANT_WHERE,
    NAN_GUARD,
    drop_attention_guards,
    multi_head_attention_keeps_nan_rows,
)
from fxforge.exporters.onnx import _export, write_checked
from fxforge.exporters.ort_module import OnnxRuntimeModule
from fxforge.rewrites.attention.guards import NAN_ROWS
from fxforge.rewrites.pipeline import rewrite


class BiasedAttention(nn.Module):
    """Self-attention with a learned additive bias per head (swin's relative positions), optionally plus a
    shifted-window mask built from shapes by ``new_zeros`` and slice assignment, as swin builds it."""

    def __init__(self, length: int = 8, shifted: bool = False):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.bias = nn.Parameter(torch.randn(4, length, length))
        self.shifted = shifted

    def forward(self, x):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, 4, 8).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * 8 ** -0.5 + self.bias
        if self.shifted:
            region = x.new_zeros((length,))
            region[length // 2:] = 1.0
            mask = region[None, :] - region[:, None]
            scores = scores + mask.masked_fill(mask != 0, -100.0)
        return (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, length, 32)


class PaddedAttention(nn.Module):
    """BERT's form (separate projections, a [B, 1, 1, L] additive padding mask from the caller), attending
    from ``x`` to ``memory``: a NaN in ``x`` is a NaN in one query row only."""

    def __init__(self, causal: bool = False):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(32, 32) for _ in range(3))
        self.causal = causal

    def forward(self, x, memory, keep):
        b, length, _ = x.shape
        q, k, v = (p(t).view(b, length, 4, 8).transpose(1, 2) for p, t in ((self.q, x), (self.k, memory),
                                                                           (self.v, memory)))
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)
        if self.causal:
            scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        else:
            scores = scores + torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
        return (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, length, 32)


def ops(path: str) -> collections.Counter:
    return collections.Counter(node.op_type for node in onnx.load(path).graph.node)


def assert_nan_rows_as_eager(model: nn.Module, path: str, *inputs: torch.Tensor, nan_rows: int | None = None) -> None:
    with torch.no_grad():
        expected, actual = model(*inputs), OnnxRuntimeModule(path)(*inputs)
    assert nan_rows is None or int(expected.isnan().all(-1).sum()) == nan_rows
    assert torch.equal(expected.isnan(), actual.isnan())
    torch.testing.assert_close(actual.nan_to_num(), expected.nan_to_num(), rtol=1e-4, atol=1e-5)


def with_nan(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 3, 5] = float("nan")  # one token
    return x


def test_the_installed_runtime_keeps_nan_rows():
    assert multi_head_attention_keeps_nan_rows()


@pytest.mark.parametrize("shifted", [False, True])
def test_guards_on_a_biased_attention_are_dropped(shifted, tmp_path):
    torch.manual_seed(0)
    model = BiasedAttention(shifted=shifted).eval()
    path = str(tmp_path / "biased.onnx")
    result = export_onnx(model, path, (torch.randn(2, 8, 32),))
    assert f"dropped: {NAN_GUARD}: 1" in onnx_applied(result.report), result.report
    assert any(line.startswith(f"dropped: {CONSTANT_WHERE}") for line in onnx_applied(result.report)), result.report
    assert result.report.counts["onnx attention_guards"] >= 2, result.report.counts
    found = ops(path)
    assert found["MultiHeadAttention"] + found["Attention"] == 1  # Attention where it projects q, k, v itself
    assert not {"IsNaN", "Where", "ScatterND", "ConstantOfShape"} & set(found), found
    assert_nan_rows_as_eager(model, path, torch.randn(2, 8, 32))
    assert_nan_rows_as_eager(model, path, with_nan(torch.randn(2, 8, 32)))


def test_a_bias_row_of_minus_infinity_keeps_its_guard(tmp_path):
    """A weight with a row of -inf: the constant condition is not all False, so that Where stays (eager: NaN)."""
    torch.manual_seed(0)
    model = BiasedAttention().eval()
    with torch.no_grad():
        model.bias[1, 4] = float("-inf")
    path = str(tmp_path / "inf.onnx")
    result = export_onnx(model, path, (torch.randn(2, 8, 32),))
    assert f"dropped: {NAN_GUARD}: 1" in onnx_applied(result.report), result.report
    assert ops(path)["Where"] == 1
    assert_nan_rows_as_eager(model, path, torch.randn(2, 8, 32))


def test_guard_under_a_run_time_padding_mask_is_dropped(tmp_path):
    """The masked form runs MultiHeadAttention in both branches of an If: the export writes the guard as one op
    (the rewrite's guards_as_ops), which the translation leaves to MultiHeadAttention in both branches; no
    ONNX rule has a guard to drop afterwards."""
    torch.manual_seed(0)
    model = PaddedAttention().eval()
    keep = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    path = str(tmp_path / "padded.onnx")
    result = export_onnx(model, path, (torch.randn(2, 8, 32), torch.randn(2, 8, 32), keep))
    assert any(line.startswith("NaN-row guard left to MultiHeadAttention") for line in result.translations), result
    assert not any(line.startswith(f"dropped: {NAN_GUARD}") for line in onnx_applied(result.report)), result.report
    assert "IsNaN" not in ops(path) and "If" in ops(path)
    for mask in (keep, torch.ones(2, 8, dtype=torch.bool), torch.tensor([[False] * 8, [True] * 8])):
        assert_nan_rows_as_eager(model, path, with_nan(torch.randn(2, 8, 32)), torch.randn(2, 8, 32), mask,
                                 nan_rows=1)  # the query row of x's NaN only


def test_group_query_attention_keeps_its_guard(tmp_path):
    """ORT's GroupQueryAttention answers a number in a query row holding a NaN: the guard stays."""
    torch.manual_seed(0)
    model = PaddedAttention(causal=True).eval()
    keep = torch.ones(2, 8, dtype=torch.bool)
    path = str(tmp_path / "causal.onnx")
    result = export_onnx(model, path, (torch.randn(2, 8, 32), torch.randn(2, 8, 32), keep))
    found = ops(path)
    assert found["GroupQueryAttention"] == 1 and found["IsNaN"] == 1, found
    assert not any(line.startswith(f"dropped: {NAN_GUARD}") for line in onnx_applied(result.report)), result.report
    assert_nan_rows_as_eager(model, path, with_nan(torch.randn(2, 8, 32)), torch.randn(2, 8, 32), keep, nan_rows=1)


# ------------------------------------------------------------------------------- guards written as one op


def _rewritten_with_guards_as_ops(model: nn.Module, inputs: tuple) -> fxforge.Captured:
    """``model`` captured and rewritten for calls whose kernels the export's translation chooses (what the
    ONNX path passes: ``CallConditions(guards_as_ops=True)``), verified as every rewrite is."""
    captured = fxforge.capture(model, inputs)
    return rewrite(captured, conditions=CallConditions(guards_as_ops=True))


def _calls(captured, target) -> int:
    return sum(node.target is target for node in captured.graph_module.graph.nodes)


@pytest.mark.parametrize("causal", [False, True])
def test_guards_as_ops_leave_nan_rows_to_the_kernel_that_keeps_them(causal, tmp_path):
    """The rewrite writes the NaN-row guard as fxforge::nan_rows (verified against eager, NaN rows included);
    the translation drops it under MultiHeadAttention and writes it out under GroupQueryAttention (whose CPU
    kernel answers a number there): no ONNX rule has to find it afterwards."""
    torch.manual_seed(0)
    model = PaddedAttention(causal=causal).eval()
    keep = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    inputs = (torch.randn(2, 8, 32), torch.randn(2, 8, 32), keep)
    new = _rewritten_with_guards_as_ops(model, inputs)
    assert new.report.counts.get("attention") == 1 and not new.report.rolled_back, new.report
    assert _calls(new, NAN_ROWS) == 1 and _calls(new, torch.isnan) == 0
    plain = rewrite(fxforge.capture(model, inputs))  # the default: the guard as torch ops, as before
    assert _calls(plain, NAN_ROWS) == 0 and _calls(plain, torch.isnan) == 1

    result, _ = write_checked(new, str(tmp_path / "m.onnx"))
    found = ops(result.path)
    assert not any(line.startswith(f"dropped: {NAN_GUARD}") for line in onnx_applied(result.report)), result.report
    if causal:
        assert found["GroupQueryAttention"] == 1 and found["IsNaN"] == 1, found
    else:
        assert not {"IsNaN", "ReduceSum", "Identity"} & set(found), found
        assert "NaN-row guard left to MultiHeadAttention, which gives NaN there itself: 1" in result.translations
    for mask in (keep, torch.ones(2, 8, dtype=torch.bool)):
        assert_nan_rows_as_eager(model, result.path, with_nan(torch.randn(2, 8, 32)), torch.randn(2, 8, 32), mask,
                                 nan_rows=1)


def test_guards_as_ops_keep_the_guard_in_a_file_for_another_provider(tmp_path):
    """Only ORT's CPU MultiHeadAttention was probed to keep NaN rows: a file for another provider keeps the guard."""
    torch.manual_seed(0)
    model = PaddedAttention().eval()
    inputs = (torch.randn(2, 8, 32), torch.randn(2, 8, 32), torch.ones(2, 8, dtype=torch.bool))
    path = str(tmp_path / "cuda.onnx")
    _export(_rewritten_with_guards_as_ops(model, inputs), path, 20, False, None, "MultiHeadAttention", cpu=False)
    found = ops(path)
    assert found["IsNaN"] == 1 and found["If"] == 1, found


def test_guards_as_ops_keep_the_guard_where_the_attention_stays_plain(tmp_path):
    torch.manual_seed(0)
    model = PaddedAttention().eval()
    inputs = (torch.randn(2, 8, 32), torch.randn(2, 8, 32), torch.ones(2, 8, dtype=torch.bool))
    new = _rewritten_with_guards_as_ops(model, inputs)
    result, _ = write_checked(new, str(tmp_path / "plain.onnx"), attention="plain")
    found = ops(result.path)
    assert found["IsNaN"] == 1 and "Softmax" in found, found
    assert_nan_rows_as_eager(model, result.path, with_nan(torch.randn(2, 8, 32)), *inputs[1:], nan_rows=1)


def test_nan_rows_op_is_the_guard():
    out, q = torch.randn(2, 4, 5, 3), torch.randn(2, 4, 5, 8)
    q[1, 2, 3, 0], q[0, 0, 1, 7] = float("nan"), float("-inf")
    expected = torch.where(torch.isnan((q * 0).sum(-1, keepdim=True)), float("nan"), out)
    assert torch.equal(NAN_ROWS(out, q).isnan(), expected.isnan())
    assert int(NAN_ROWS(out, q).isnan().all(-1).sum()) == 2


# ---------------------------------------------------------------------------------------------- the rule on IR


def _guarded_graph(query_of_attention: bool) -> tuple[ir.Graph, ir.Node]:
    """``Where(IsNaN(ReduceSum(Mul(a, 0), [-1])), NaN, MultiHeadAttention(q, q, q))``, with ``a`` the
    attention's query (through a Transpose) or another tensor."""
    def value(name: str, shape: list | None = None) -> ir.Value:
        return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=None if shape is None else ir.Shape(shape))

    def constant(name: str, array: np.ndarray) -> ir.Value:
        return ir.Value(name=name, const_value=ir.tensor(array))

    q, other = value("q", [1, 2, 4, 8]), value("other", [1, 2, 4, 8])
    zero, axes, nan = (constant("zero", np.array(0.0, np.float32)), constant("axes", np.array([-1])),
                       constant("nan", np.array(np.nan, np.float32)))
    bsd = ir.Node("", "Transpose", [q], attributes=[ir.AttrInt64s("perm", [0, 2, 1, 3])], outputs=[value("t")])
    attention = ir.Node("com.microsoft", "MultiHeadAttention", [bsd.outputs[0]] * 3, outputs=[value("a")])
    mul = ir.Node("", "Mul", [q if query_of_attention else other, zero], outputs=[value("m", [1, 2, 4, 8])])
    reduce = ir.Node("", "ReduceSum", [mul.outputs[0], axes], outputs=[value("r")])
    isnan = ir.Node("", "IsNaN", [reduce.outputs[0]], outputs=[value("n")])
    where = ir.Node("", "Where", [isnan.outputs[0], nan, attention.outputs[0]], outputs=[value("w")])
    relu = ir.Node("", "Relu", [where.outputs[0]], outputs=[value("y")])
    graph = ir.Graph([q, other], relu.outputs, nodes=[bsd, attention, mul, reduce, isnan, where, relu],
                     initializers=[zero, axes, nan])
    return graph, relu


@pytest.mark.parametrize("query_of_attention", [True, False])
@pytest.mark.parametrize("nan_rows_kept", [True, False])
def test_rule_needs_the_attentions_query_and_a_runtime_that_keeps_nan_rows(query_of_attention, nan_rows_kept):
    graph, relu = _guarded_graph(query_of_attention)
    dropped = drop_attention_guards(graph, nan_rows_kept=nan_rows_kept)
    if query_of_attention and nan_rows_kept:
        assert dropped == {NAN_GUARD: 1} and relu.inputs[0].name == "a"
    else:
        assert dropped == {} and relu.inputs[0].name == "w"
