"""``fxforge.export_onnx``: translations of fxforge's fused ops and of attention, checked and validated files,
atomic writes, and errors that name the op and the user's line.

Every export here is validated by ``export_onnx`` itself (ONNX Runtime against PyTorch on the example
inputs); the tests also run the file on fresh inputs and count the ONNX ops, so a translation that is
right only on the example, or that silently falls back to another form, fails.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter

import onnx
import pytest
import torch
import torch.nn.functional as F
from ir_graphs import onnx_applied
from torch import nn

import fxforge
from fxforge import export_onnx
from fxforge.core.verify import Comparison, compare_outputs
from fxforge.exporters import ExportError, OnnxRuntimeModule
from fxforge.exporters.residual_norm import RESIDUAL_NORM
from fxforge.rewrites import fused_ops

TOLERANCE = 10.0  # rtol_scale, as export_onnx validates


def onnx_ops(path: str) -> Counter:
    """``Counter`` of the file's ops, ``domain:Op`` for non-default domains."""
    model = onnx.load(path, load_external_data=False)
    return Counter(f"{n.domain}:{n.op_type}" if n.domain else n.op_type for n in model.graph.node)


def assert_runs_like(model: nn.Module, path: str, *inputs: torch.Tensor) -> None:
    """The ONNX file in ONNX Runtime gives the model's outputs on ``inputs`` (not the example inputs)."""
    with torch.no_grad():
        expected = model(*inputs)
        actual = OnnxRuntimeModule(path)(*inputs)
    result = compare_outputs(expected, actual, rtol_scale=TOLERANCE)
    assert result.ok, result.reason


# ---------------------------------------------------------------------------------------------- activations

SCALARS = {"hardtanh": [-0.5, 0.7], "leaky_relu": [0.2]}
# The ONNX op each activation must appear as (besides Conv / Gemm / MatMul).
ACTIVATION_OPS = {"none": set(), "relu": {"Relu"}, "hardtanh": {"Clip"}, "leaky_relu": {"LeakyRelu"},
                  "gelu": {"Gelu"}, "gelu_tanh": {"Gelu"}, "silu": {"Sigmoid", "Mul"}, "sigmoid": {"Sigmoid"},
                  "tanh": {"Tanh"}, "hardswish": {"HardSwish"}, "hardsigmoid": {"HardSigmoid"}}


class FusedConv(nn.Module):
    """Calls ``fxforge::conv_pointwise`` directly (a graph as the conv_activation rewrite leaves it)."""

    def __init__(self, activation: str, dims: int = 2, residual: bool = False, bias: bool = True, stride: int = 1,
                 dilation: int = 1, groups: int = 1):
        super().__init__()
        conv = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1](4, 8, 3, bias=bias, groups=groups)
        self.weight, self.bias = conv.weight, conv.bias
        self.activation, self.scalars = activation, SCALARS.get(activation, [])
        self.dims, self.residual = dims, residual
        self.stride, self.dilation = [stride] * dims, [dilation] * dims
        self.groups = groups

    def forward(self, x, other=None):
        return torch.ops.fxforge.conv_pointwise(x, self.weight, self.bias, self.stride, [1] * self.dims,
                                                self.dilation, self.groups, other, "add", self.activation,
                                                self.scalars, "composite")


class FusedLinear(nn.Module):
    def __init__(self, activation: str, bias: bool = True):
        super().__init__()
        linear = nn.Linear(6, 5, bias=bias)
        self.weight, self.bias = linear.weight, linear.bias
        self.activation, self.scalars = activation, SCALARS.get(activation, [])

    def forward(self, x):
        return torch.ops.fxforge.linear_pointwise(x, self.weight, self.bias, None, "add", self.activation,
                                                  self.scalars, "composite")


def test_every_activation_has_a_case():
    assert set(ACTIVATION_OPS) == set(fused_ops.ACTIVATIONS)


@pytest.mark.parametrize("activation", list(fused_ops.ACTIVATIONS))
def test_conv_pointwise_activation(activation, tmp_path):
    model = FusedConv(activation).eval()
    path = str(tmp_path / "conv.onnx")
    result = export_onnx(model, path, (torch.randn(2, 4, 9, 9),), rewrites=[])
    suffix = "" if activation == "none" else f" + {activation}"
    assert result.translations == [f"fxforge::conv_pointwise -> Conv{suffix}: 1"]
    ops = onnx_ops(path)
    assert ops["Conv"] == 1 and ACTIVATION_OPS[activation] <= set(ops)
    assert not any(op.startswith("pkg.") or "fxforge" in op for op in ops)
    # kernel_shape spelled out, as torch.onnx's own Conv: ORT then builds the same optimized graph as for
    # a plain export (MobileNetV2: identical optimized graphs, so fxforge-ort vs ort there is A/A noise)
    assert list(_attribute(path, "Conv", "kernel_shape")) == list(model.weight.shape[2:])
    assert_runs_like(model, path, torch.randn(2, 4, 9, 9) * 3)


@pytest.mark.parametrize("activation", list(fused_ops.ACTIVATIONS))
def test_linear_pointwise_activation(activation, tmp_path):
    model = FusedLinear(activation).eval()
    path = str(tmp_path / "linear.onnx")
    export_onnx(model, path, (torch.randn(3, 7, 6),), rewrites=[])  # 3-d input: MatMul + Add
    ops = onnx_ops(path)
    assert ops["MatMul"] == 1 and ACTIVATION_OPS[activation] <= set(ops)
    assert_runs_like(model, path, torch.randn(3, 7, 6) * 3)


class SubtractedTransposedAndResidual(nn.Module):
    """The fused forms beyond conv + activation: conv - gate, act(conv_transpose), act(linear + residual)."""

    def __init__(self):
        super().__init__()
        self.conv, self.up, self.fc = nn.Conv2d(4, 4, 3, padding=1), nn.ConvTranspose2d(4, 4, 2, stride=2), nn.Linear(8, 8)

    def forward(self, x, gate, rows):
        y = torch.relu(self.conv(x) - gate)
        return F.hardsigmoid(self.up(y)), torch.tanh(self.fc(rows) + rows)


def test_binary_transposed_and_linear_residual_translations(tmp_path):
    model, path = SubtractedTransposedAndResidual().eval(), str(tmp_path / "m.onnx")
    inputs = (torch.randn(2, 4, 6, 6), torch.randn(1, 4, 1, 1), torch.randn(5, 8))
    result = export_onnx(model, path, inputs)
    assert set(result.translations) == {"fxforge::conv_pointwise -> Conv + Sub + relu: 1",
                                        "fxforge::conv_transpose_pointwise -> ConvTranspose + hardsigmoid: 1",
                                        "fxforge::linear_pointwise -> Gemm + Add + tanh: 1"}
    ops = onnx_ops(path)
    assert ops["Sub"] == 1 and ops["ConvTranspose"] == 1 and ops["HardSigmoid"] == 1
    assert_runs_like(model, path, *(torch.randn(t.shape) * 3 for t in inputs))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gelu_before_opset_20_is_its_formula(activation, tmp_path):
    model = FusedConv(activation).eval()
    path = str(tmp_path / "gelu18.onnx")
    result = export_onnx(model, path, (torch.randn(1, 4, 8, 8),), rewrites=[], opset=18)
    ops = onnx_ops(path)
    assert result.opset == 18 and "Gelu" not in ops
    assert ("Erf" if activation == "gelu" else "Tanh") in ops
    assert_runs_like(model, path, torch.randn(1, 4, 8, 8) * 3)


def test_linear_2d_is_gemm_and_no_bias(tmp_path):
    model = FusedLinear("relu", bias=False).eval()
    path = str(tmp_path / "gemm.onnx")
    export_onnx(model, path, (torch.randn(4, 6),), rewrites=[])
    assert onnx_ops(path)["Gemm"] == 1
    assert_runs_like(model, path, torch.randn(4, 6))


@pytest.mark.parametrize("case", [
    {"dims": 1, "residual": True}, {"dims": 3, "activation": "silu"}, {"dims": 2, "bias": False, "stride": 2},
    {"dims": 2, "dilation": 2, "groups": 2, "activation": "hardtanh"},
], ids=["conv1d-residual", "conv3d", "no-bias-stride", "dilated-grouped"])
def test_conv_forms(case, tmp_path):
    case = dict(case)
    activation = case.pop("activation", "relu")
    model = FusedConv(activation, **case).eval()
    dims = case["dims"]
    x = torch.randn(2, 4, *[10] * dims)
    inputs = (x, torch.randn_like(model(x))) if case.get("residual") else (x,)
    path = str(tmp_path / "conv.onnx")
    result = export_onnx(model, path, inputs, rewrites=[])
    assert ("+ Add" in result.translations[0]) == bool(case.get("residual"))
    fresh = (torch.randn_like(inputs[0]), *(torch.randn_like(t) for t in inputs[1:]))
    assert_runs_like(model, path, *fresh)


# ---------------------------------------------------------------------------------------------- rewritten graphs

class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


def _randomize_bn(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def test_rewritten_cnn_exports_fused_ops(tmp_path):
    torch.manual_seed(0)
    model = _randomize_bn(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
        Block(8),
        nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.BatchNorm2d(8), nn.SiLU(),
        nn.Flatten(), nn.Linear(8 * 7 * 7, 10), nn.GELU(),
    ))
    path = str(tmp_path / "cnn.onnx")
    result = export_onnx(model, path, (torch.randn(2, 3, 16, 16),), dynamic_batch=True)
    counts = result.report.counts
    assert counts["conv_bn_fold"] == 4 and counts["conv_activation"] == 5
    assert sorted(result.translations) == [
        "fxforge::conv_pointwise -> Conv + Add + relu: 1", "fxforge::conv_pointwise -> Conv + hardtanh: 1",
        "fxforge::conv_pointwise -> Conv + relu: 1", "fxforge::conv_pointwise -> Conv + silu: 1",
        "fxforge::linear_pointwise -> Gemm + gelu: 1"]
    ops = onnx_ops(path)
    assert ops["Conv"] == 4 and "BatchNormalization" not in ops
    assert list(result.validation) == ["example inputs", "batch 3", "batch 1"]
    assert any("conv_activation kept without timing" in n for n in result.report.notes)
    assert_runs_like(model, path, torch.randn(5, 3, 16, 16))


# ---------------------------------------------------------------------------------------------- attention

class Attention(nn.Module):
    """SDPA over projected q, k, v; ``mask_kind`` picks the mask form."""

    def __init__(self, heads=4, kv_heads=4, head_size=8, mask_kind="none", causal=False, scale=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_size = heads, kv_heads, head_size
        self.q = nn.Linear(32, heads * head_size)
        self.kv = nn.Linear(32, 2 * kv_heads * head_size)
        self.mask_kind, self.causal, self.scale = mask_kind, causal, scale

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_size).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_size).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, scale=self.scale,
                                           enable_gqa=self.kv_heads != self.heads)
        return y.transpose(1, 2).reshape(b, s, -1)


def _mask(kind: str, b: int, s: int):
    gen = torch.Generator().manual_seed(3)
    if kind == "float [B,1,1,L]":
        mask = torch.zeros(b, 1, 1, s)
        mask[:, ..., -2:] = float("-inf")  # padding: the last two keys
        return mask
    if kind == "bool [B,1,S,L]":
        keep = torch.rand(b, 1, s, s, generator=gen) > 0.3
        keep[..., 0] = True  # no row without a key
        return keep
    if kind == "float [S,L]":
        return torch.randn(s, s, generator=gen)
    return None


ATTENTION_CASES = {
    "no mask": {},
    "float [B,1,1,L]": {"mask_kind": "float [B,1,1,L]"},
    "bool [B,1,S,L]": {"mask_kind": "bool [B,1,S,L]"},
    "float [S,L]": {"mask_kind": "float [S,L]"},
    "causal": {"causal": True},
    "scale": {"scale": 0.3},
    "gqa": {"heads": 4, "kv_heads": 2, "mask_kind": "float [B,1,1,L]"},
    "causal gqa": {"heads": 4, "kv_heads": 2, "causal": True},
}
MHA, GQA = "com.microsoft:MultiHeadAttention", "com.microsoft:GroupQueryAttention"
MASK_CHECKED = "attention mask checked at run time (a mask that masks nothing: flash attention): 1"
KV_SLICED = "q, k, v read as slices of their packed projection: 2"  # k and v, columns of the kv projection
UNIT_TRANSPOSED = "Transpose that moves only size-1 dims -> Reshape: 3"  # 3-d q, k, v as one head
PACKED = "projections of one input -> one MatMul and a Split: 1"  # q and kv
PROJECTED = "MultiHeadAttention over q, k, v projected from one input -> com.microsoft.Attention: 1"
ATTENTION = "com.microsoft:Attention"


def all_onnx_ops(path: str) -> Counter:
    """Like :func:`onnx_ops`, with the nodes of subgraphs (an ``If``'s branches) counted too."""
    def walk(graph):
        for node in graph.node:
            yield f"{node.domain}:{node.op_type}" if node.domain else node.op_type
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    yield from walk(attribute.g)

    return Counter(walk(onnx.load(path, load_external_data=False).graph))


def _attribute(path: str, op_type: str, name: str):
    node = next(n for n in onnx.load(path, load_external_data=False).graph.node if n.op_type == op_type)
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_becomes_an_ort_attention_kernel(case, tmp_path):
    torch.manual_seed(0)
    model = Attention(**ATTENTION_CASES[case]).eval()
    x = torch.randn(2, 6, 32)
    mask = _mask(model.mask_kind, 2, 6)
    inputs = (x,) if mask is None else (x, mask)
    path = str(tmp_path / "attention.onnx")
    result = export_onnx(model, path, inputs, rewrites=[])
    ops, every = onnx_ops(path), all_onnx_ops(path)
    # the q and kv projections packed into one (12 rows); inside ORT's Attention where it projects them itself
    assert "Softmax" not in every and every["MatMul"] + every[ATTENTION] == 1
    if model.causal:  # causal self-attention: GroupQueryAttention, key/value heads read in place
        assert result.translations == ["attention -> com.microsoft.GroupQueryAttention (causal): 1"]
        assert onnx_applied(result.report) == [KV_SLICED, PACKED], result.report
        assert ops[GQA] == 1 and MHA not in every and "Expand" not in ops
        assert _attribute(path, "GroupQueryAttention", "kv_num_heads") == model.kv_heads
    elif mask is None or mask.shape[-2] != 1:  # a full [.., S, L] mask is not checked at run time
        assert result.translations == ["attention -> com.microsoft.MultiHeadAttention: 1"]
        assert onnx_applied(result.report) == [KV_SLICED, PACKED, PROJECTED], result.report
        assert ops[ATTENTION] == 1 and MHA not in ops and "If" not in ops
    else:  # a key padding mask: checked at run time, MultiHeadAttention without it (flash) or with it
        assert result.translations == ["attention -> com.microsoft.MultiHeadAttention: 1", MASK_CHECKED]
        assert onnx_applied(result.report) == [PACKED], result.report
        assert ops["If"] == 1 and MHA not in ops and every[MHA] == 2
    assert_runs_like(model, path, torch.randn(2, 6, 32) * 2, *inputs[1:])
    if mask is not None:  # a mask that masks nothing (the If's other branch)
        nothing = torch.ones_like(mask) if mask.dtype == torch.bool else torch.zeros_like(mask)
        assert_runs_like(model, path, torch.randn(2, 6, 32), nothing)


def test_attention_mask_check_sees_every_element(tmp_path):
    # One masked key in one batch row, one head-broadcast mask: the masked branch must run.
    model = Attention(mask_kind="float [B,1,1,L]").eval()
    path = str(tmp_path / "attention.onnx")
    export_onnx(model, path, (torch.randn(2, 6, 32), torch.zeros(2, 1, 1, 6)), rewrites=[])
    mask = torch.zeros(2, 1, 1, 6)
    mask[1, 0, 0, 3] = float("-inf")
    assert_runs_like(model, path, torch.randn(2, 6, 32), mask)
    mask = torch.zeros(2, 1, 1, 6)
    mask[0, 0, 0, 5] = 0.5  # a bias that is not a padding mask
    assert_runs_like(model, path, torch.randn(2, 6, 32), mask)


def test_causal_attention_with_odd_head_size_stays_multi_head(tmp_path):
    # GroupQueryAttention's CPU kernel needs head sizes that are multiples of 8.
    model = Attention(head_size=12, causal=True).eval()
    path = str(tmp_path / "attention.onnx")
    result = export_onnx(model, path, (torch.randn(2, 6, 32),), rewrites=[], dynamic_batch=True)
    assert result.translations == [
        "attention -> com.microsoft.MultiHeadAttention: 1",
        ("causal attention as MultiHeadAttention: head size 12 is not a multiple of 8 (GroupQueryAttention's CPU "
         "kernel needs that)")]
    assert onnx_ops(path)[MHA] == 1 and _attribute(path, "MultiHeadAttention", "unidirectional") == 1
    assert_runs_like(model, path, torch.randn(3, 6, 32))


def test_causal_attention_with_dynamic_batch(tmp_path):
    model = Attention(heads=4, kv_heads=1, causal=True).eval()
    path = str(tmp_path / "attention.onnx")
    result = export_onnx(model, path, (torch.randn(1, 6, 32),), dynamic_batch=True)
    assert list(result.validation) == ["example inputs", "batch 2", "batch 3"]
    assert onnx_ops(path)[GQA] == 1
    assert_runs_like(model, path, torch.randn(4, 6, 32))


def test_attention_with_dynamic_batch(tmp_path):
    model = Attention(mask_kind="float [B,1,1,L]").eval()
    path = str(tmp_path / "attention.onnx")
    result = export_onnx(model, path, (torch.randn(2, 6, 32), _mask("float [B,1,1,L]", 2, 6)), dynamic_batch=True)
    assert list(result.validation) == ["example inputs", "batch 3", "batch 1"]
    assert_runs_like(model, path, torch.randn(4, 6, 32), _mask("float [B,1,1,L]", 4, 6))


class CrossCausal(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class AnyRank(nn.Module):
    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_attention_3d_is_one_head(tmp_path):
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 4)
    mask = torch.randn(2, 5, 7)
    path = str(tmp_path / "three_d.onnx")
    result = export_onnx(AnyRank().eval(), path, (q, k, v, mask), rewrites=[])
    assert result.translations == ["attention -> com.microsoft.MultiHeadAttention: 1"]
    assert onnx_applied(result.report) == [UNIT_TRANSPOSED] and result.report.counts == {"onnx unit_transposes": 3}
    assert "Transpose" not in onnx_ops(path)
    assert_runs_like(AnyRank(), path, torch.randn(2, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 4), mask * 2)


def test_attention_3d_causal_and_bool_mask(tmp_path):
    q, k, v = torch.randn(2, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    path = str(tmp_path / "causal.onnx")
    result = export_onnx(CrossCausal().eval(), path, (q, k, v), rewrites=[])
    assert result.translations == ["attention -> com.microsoft.GroupQueryAttention (causal): 1"]
    assert onnx_applied(result.report) == [UNIT_TRANSPOSED], result.report
    assert_runs_like(CrossCausal(), path, torch.randn(2, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8))
    keep = torch.ones(2, 1, 6, dtype=torch.bool)  # a key padding mask, broadcast over the queries
    keep[1, :, -2:] = False
    path = str(tmp_path / "bool.onnx")
    result = export_onnx(AnyRank().eval(), path, (q, k, v, keep), rewrites=[])
    assert result.translations == ["attention -> com.microsoft.MultiHeadAttention: 1", MASK_CHECKED]
    assert onnx_applied(result.report) == [UNIT_TRANSPOSED], result.report
    assert_runs_like(AnyRank(), path, q * 2, k, v, keep)
    assert_runs_like(AnyRank(), path, q, k, v, torch.ones_like(keep))


def test_attention_kept_plain_with_reason(tmp_path):
    shapes = [(1, 2, 4, 8), (1, 2, 6, 8), (1, 2, 6, 8)]
    path = str(tmp_path / "plain.onnx")
    result = export_onnx(CrossCausal().eval(), path, tuple(torch.randn(*s) for s in shapes), rewrites=[])
    kept = [t for t in result.translations if t.startswith("attention kept")]
    assert len(kept) == 1 and "is_causal with query and key lengths that may differ" in kept[0]
    assert "test_onnx.py" in kept[0] and "scaled_dot_product_attention(q, k, v, is_causal=True)" in kept[0]
    assert MHA not in all_onnx_ops(path) and GQA not in all_onnx_ops(path) and "Softmax" in onnx_ops(path)
    assert_runs_like(CrossCausal(), path, *(torch.randn(*s) for s in shapes))


def test_attention_neither_can_carry_falls_back_naming_op_and_line(tmp_path):
    # 5-d attention: MultiHeadAttention cannot take it, and torch.onnx's dynamo translation refuses it too; the
    # TorchScript exporter writes the file, and the fallback's reason names the op and the user's line.
    inputs = tuple(torch.randn(2, 2, 2, 4, 8) for _ in range(3))
    model = AnyRank().eval()
    result = export_onnx(model, str(tmp_path / "m.onnx"), inputs, rewrites=[])
    assert "aten::scaled_dot_product_attention" in result.fallback
    assert "scaled_dot_product_attention(q, k, v, attn_mask=mask)" in result.fallback
    assert_runs_like(model, result.path, *(torch.randn(2, 2, 2, 4, 8) for _ in range(3)))


class WindowAttention(nn.Module):
    """Hand-written attention over windows, q, k, v [B, G, H, P, E] with a relative-position bias [1, H, P, P]
    (torchvision's MaxVit): plain export takes it as MatMul/Softmax; the rewrite makes it one SDPA."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.bias = nn.Parameter(torch.randn(1, 2, 5, 5))

    def forward(self, x):
        qkv = self.qkv(x).reshape(x.size(0), x.size(1), x.size(2), 3, 2, 8).permute(3, 0, 1, 4, 2, 5)
        scores = torch.einsum("bghid,bghjd->bghij", qkv[0], qkv[1]) * 0.35 + self.bias
        return torch.einsum("bghij,bghjd->bghid", scores.softmax(-1), qkv[2])


@pytest.mark.parametrize("attention", ["MultiHeadAttention", "plain"])
def test_attention_over_five_dims_exports_after_the_rewrite(attention, tmp_path):
    # SDPA on 5-d inputs made every export fail after fxforge's own rewrite: it is called on 4-d ones now
    model, path = WindowAttention().eval(), str(tmp_path / "windows.onnx")
    result = export_onnx(model, path, (torch.randn(2, 3, 5, 16),), attention=attention)
    assert result.report.counts.get("attention") == 1
    assert_runs_like(model, path, torch.randn(2, 3, 5, 16))


def test_attention_plain_on_request(tmp_path):
    model = Attention().eval()
    path = str(tmp_path / "plain.onnx")
    result = export_onnx(model, path, (torch.randn(1, 6, 32),), attention="plain")
    assert result.translations == [] and "Softmax" in onnx_ops(path)  # no attention kernel
    assert onnx_applied(result.report) == [PACKED], result.report


# ---------------------------------------------------------------------------------------------- models

try:
    from examples.models import EXAMPLES
except ImportError:  # pragma: no cover - the examples are part of the repository
    EXAMPLES = {}
from models import TRANSFORMERS

DONE_WHEN = ["bert", "gpt2", "llama", "vit", "resnet"]


def _export_and_check(model, inputs, path):
    result = export_onnx(model, path, inputs, dynamic_batch=True)
    onnx.checker.check_model(path, full_check=True)
    assert list(result.validation) == ["example inputs", "batch 3", "batch 1"]
    assert all(error < 1e-3 for error in result.validation.values())
    assert set(os.listdir(os.path.dirname(path))) == {os.path.basename(path)}
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_models(name, tmp_path):
    model, inputs = EXAMPLES[name]()
    _export_and_check(model, inputs, str(tmp_path / f"{name}.onnx"))


@pytest.mark.slow
@pytest.mark.parametrize("name", DONE_WHEN)
def test_transformers_models(name, tmp_path):
    model, inputs = TRANSFORMERS[name]()
    result = _export_and_check(model, inputs, str(tmp_path / f"{name}.onnx"))
    if name != "resnet":  # causal self-attention (GPT-2, LLaMA) as GroupQueryAttention, the others MultiHeadAttention
        kernels = {"attention -> com.microsoft.MultiHeadAttention: 2",
                   "attention -> com.microsoft.GroupQueryAttention (causal): 2"}
        assert len(kernels & set(result.translations)) == 1, result.translations
    # LayerNorm after a residual add (BERT, GPT-2, ViT) is kept apart from it for ORT's CPU provider; LLaMA's
    # RMSNorm and ResNet have none
    separated = any(line.startswith(RESIDUAL_NORM) for line in onnx_applied(result.report))
    assert separated == (name in ("bert", "gpt2", "vit")), result.report
    assert {"input_ids", "pixel_values"} & set(result.dynamic)


# ---------------------------------------------------------------------------------------------- atomic writes

class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.relu(self.conv(x))


def _fail_validation(monkeypatch):
    monkeypatch.setattr("fxforge.exporters.program.compare_outputs",
                        lambda *a, **k: Comparison(False, 1.0, "output: simulated mismatch"))


@pytest.mark.parametrize("external_data", [False, True])
def test_failed_validation_leaves_nothing(external_data, tmp_path, monkeypatch):
    _fail_validation(monkeypatch)
    path = tmp_path / "m.onnx"
    with pytest.raises(ExportError, match="simulated mismatch") as info:
        export_onnx(Small().eval(), str(path), (torch.randn(1, 3, 8, 8),), external_data=external_data)
    assert info.value.stage == "validation"
    assert os.listdir(tmp_path) == []


def test_failed_export_keeps_the_existing_file(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"the previous model")
    _fail_validation(monkeypatch)
    with pytest.raises(ExportError):
        export_onnx(Small().eval(), str(path), (torch.randn(1, 3, 8, 8),))
    assert path.read_bytes() == b"the previous model" and os.listdir(tmp_path) == ["m.onnx"]


def test_failed_checker_leaves_nothing(tmp_path, monkeypatch):
    def reject(*args, **kwargs):
        raise onnx.checker.ValidationError("simulated checker failure")

    monkeypatch.setattr(onnx.checker, "check_model", reject)
    with pytest.raises(ExportError, match="onnx.checker") as info:
        export_onnx(Small().eval(), str(tmp_path / "m.onnx"), (torch.randn(1, 3, 8, 8),))
    assert info.value.stage == "checker" and os.listdir(tmp_path) == []


def test_external_data_written_beside_the_model(tmp_path):
    path = tmp_path / "m.onnx"
    export_onnx(Small().eval(), str(path), (torch.randn(1, 3, 8, 8),), external_data=True)
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    assert OnnxRuntimeModule(str(path))(torch.randn(1, 3, 8, 8)).shape == (1, 4, 6, 6)


# ---------------------------------------------------------------------------------------------- errors

@torch.library.custom_op("fxtest::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _mystery_fake(x):
    return torch.empty_like(x)


class Unexportable(nn.Module):
    def forward(self, x):
        y = x.relu()
        return torch.ops.fxtest.mystery(y) + 1  # no ONNX translation for this op


@pytest.mark.parametrize("method", ["fx", "export"])
def test_unexportable_op_names_op_and_line(method, tmp_path):
    with pytest.raises(ExportError) as info:
        export_onnx(Unexportable().eval(), str(tmp_path / "m.onnx"), (torch.ones(2, 3),), method=method)
    error = info.value
    assert error.stage == "translation" and error.op == "fxtest::mystery"
    assert "test_onnx.py" in error.source and "torch.ops.fxtest.mystery(y) + 1" in error.source
    assert "no ONNX translation for fxtest::mystery" in str(error) and error.source in str(error)
    assert os.listdir(tmp_path) == []


class ConvDoubled(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x).relu() * 2


def test_a_rewrite_that_makes_the_export_fail_is_left_out_of_it(tmp_path):
    # a user rule whose replacement has no ONNX translation: the model exports without it, the other rewrites
    # kept, and the report says which rewrite was left out and why
    from fxforge.rewrites.pattern import Rule

    doubled = Rule("mystery_double", lambda x: x * 2, lambda x: torch.ops.fxtest.mystery(x))
    model, path = ConvDoubled().eval(), str(tmp_path / "m.onnx")
    native = fxforge.rewrite(fxforge.capture(model, (torch.randn(1, 3, 8, 8),)), ["default", doubled])
    assert native.report.counts.get("mystery_double") == 1  # the rule itself holds
    result = export_onnx(model, path, (torch.randn(1, 3, 8, 8),), rewrites=["default", doubled])
    assert "mystery_double" not in result.report.counts and result.report.counts.get("conv_activation") == 1
    (note,) = [n for n in result.report.notes if "left out of the ONNX export" in n]
    assert note.startswith("mystery_double left out") and "fxtest::mystery" in note
    assert result.left_out == note
    assert_runs_like(model, path, torch.randn(1, 3, 8, 8))
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_bad_arguments(tmp_path):
    model, inputs = Small().eval(), (torch.randn(1, 3, 8, 8),)
    with pytest.raises(ValueError, match="opset 17"):
        export_onnx(model, str(tmp_path / "m.onnx"), inputs, opset=17)
    with pytest.raises(ValueError, match="not both"):
        export_onnx(model, str(tmp_path / "m.onnx"), inputs, dynamic_batch=True, dynamic_shapes={})
    with pytest.raises(FileNotFoundError, match="no folder"):
        export_onnx(model, str(tmp_path / "missing" / "m.onnx"), inputs)
    with pytest.raises(ValueError, match="example_inputs"):
        export_onnx(model, str(tmp_path / "m.onnx"))
    with pytest.raises(TypeError, match="nn.Module or a Captured"):
        export_onnx(lambda x: x, str(tmp_path / "m.onnx"), inputs)
    captured = fxforge.capture(Small().train(), inputs)
    with pytest.raises(ExportError, match="training mode"):
        export_onnx(captured, str(tmp_path / "m.onnx"))
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------- options

def test_training_model_exported_in_eval_mode_and_restored(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    result = export_onnx(model, str(tmp_path / "m.onnx"), (torch.randn(3, 4),))
    assert model.training and model[1].training
    assert "Dropout" not in onnx_ops(result.path)


def test_dynamic_shapes_pass_through(tmp_path):
    model = nn.Linear(4, 2).eval()
    rows = torch.export.Dim("rows")
    path = str(tmp_path / "m.onnx")
    result = export_onnx(model, path, (torch.randn(3, 4),), dynamic_shapes={"input": {0: rows}})
    assert result.dynamic == {"input": {0: "rows"}}
    assert_runs_like(model, path, torch.randn(7, 4))


def test_captured_is_exported_as_is(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    captured = fxforge.capture(model, (torch.randn(1, 3, 8, 8),))
    result = export_onnx(captured, str(tmp_path / "m.onnx"))
    assert result.translations == [] and result.report.counts == {}
    assert Counter(onnx_ops(result.path)) == Counter({"Conv": 1, "Relu": 1})


def test_export_is_quiet(tmp_path, capfd):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_onnx(Attention(mask_kind="float [B,1,1,L]").eval(), str(tmp_path / "m.onnx"),
                    (torch.randn(2, 6, 32), _mask("float [B,1,1,L]", 2, 6)), dynamic_batch=True)
    out, err = capfd.readouterr()
    assert out == "" and err == "" and [str(w.message) for w in caught] == []


def test_export_of_a_padded_batch_of_one_is_quiet(tmp_path, caplog):
    # BERT's mask at batch 1: the exporter's constant folder logged a node it could not evaluate.
    model, inputs = TRANSFORMERS["bert"]()
    with caplog.at_level(logging.WARNING):
        export_onnx(model.eval(), str(tmp_path / "m.onnx"), {k: v[:1] for k, v in inputs.items()})
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("method", ["fx", "export"])
def test_dynamic_batch_from_a_batch_of_one(method, tmp_path):
    model = Small().eval()
    path = str(tmp_path / "m.onnx")
    result = export_onnx(model, path, (torch.randn(1, 3, 8, 8),), dynamic_batch=True, method=method)
    assert result.captured.method == method and list(result.validation) == ["example inputs", "batch 2", "batch 3"]
    assert result.dynamic == {"x": {0: "batch"}}
    assert_runs_like(model, path, torch.randn(6, 3, 8, 8))
