"""attention: every form of hand-written attention becomes one SDPA call with outputs (and gradients) equal
to eager's, on traced and exported graphs; every near miss is refused with its reason."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fxforge
from fxforge.rewrites.attention import LARGE_NEGATIVE, SDPA_HAS_GQA
from fxforge.rewrites.registry import DEFAULT, UnknownRewriteError, resolve

F = nn.functional
B, H, L, D = 2, 4, 6, 8
MIN = torch.finfo(torch.float32).min
METHODS = ["fx", "export"]


def _inputs(seed: int = 0, kv_heads: int = H, dead_row: bool = False) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, H, L, D] and a padding mask ``keep`` [B, L] (True: attend); the second sequence is padded,
    or entirely padding with ``dead_row`` (every key masked)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=gen)
    k, v = (torch.randn(B, kv_heads, L, D, generator=gen) for _ in range(2))
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[1, 2 if not dead_row else 0:] = False
    return q, k, v, keep


class Form(nn.Module):
    """One way to write attention: ``fn(self, q, k, v, keep)``, with a causal buffer and constants to use."""

    def __init__(self, fn, dropout: float = 0.0):
        super().__init__()
        self.fn = fn
        self.drop = nn.Dropout(dropout)
        self.softmax = nn.Softmax(dim=-1)
        self.register_buffer("causal", torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16))
        self.register_buffer("inv_temperature", torch.tensor(0.3))
        self.temperature = nn.Parameter(torch.tensor(0.7))
        self.register_buffer("relative", torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(0)))
        self.head_scale = nn.Parameter(torch.linspace(0.5, 2.0, H))
        self.register_buffer("window_mask", torch.zeros(2, L, L).index_fill(2, torch.arange(L // 2, L), -100.0)
                             * torch.arange(2).view(2, 1, 1))  # Swin's: the second window sees half its keys

    def forward(self, q, k, v, keep):
        return self.fn(self, q, k, v, keep)


def rewritten(fn, inputs, method: str, training: bool = False, dropout: float = 0.0):
    model = Form(fn, dropout).train(training)
    cap = fxforge.capture(model, inputs, method=method)
    return model, fxforge.rewrite(cap, ["attention"])


def sdpa_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    targets = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
    return [n for n in gm.graph.nodes if n.target in targets]


def softmaxes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if "softmax" in str(n.target)]


def nan_query_guard(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes after each SDPA call that give NaN in query rows with a NaN, as eager does."""
    guard = []
    for sdpa in sdpa_nodes(gm):
        where = next(n for n in sdpa.users if "where" in str(n.target))
        condition = where.args[0]
        total = condition.args[0]  # isnan(sum(q * 0))
        guard += [where, condition, total, total.args[0]]
    return guard


def assert_replaced(model, new, inputs, count: int = 1) -> list[torch.fx.Node]:
    """``count`` SDPA calls, no softmax left, outputs equal eager's (NaN where eager has NaN)."""
    assert not new.report.rolled_back, new.report.rolled_back
    assert new.report.counts.get("attention", 0) == count, [n.reason for n in new.report.near_misses]
    nodes = sdpa_nodes(new.graph_module)
    assert len(nodes) == count and not softmaxes(new.graph_module)
    with torch.no_grad():
        torch.testing.assert_close(new.graph_module(*inputs), model(*inputs), rtol=1e-5, atol=1e-5, equal_nan=True)
    return nodes


def reasons(new) -> list[str]:
    return [n.reason for n in new.report.near_misses if n.rule == "attention"]


# --------------------------------------------------------------------------------------------------
# Accepted forms: name -> (attention, what SDPA is called with)


def basic(self, q, k, v, keep):
    return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


def torch_calls_and_power_scale(self, q, k, v, keep):
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    return torch.softmax(scores, -1).matmul(v)


def method_softmax_mt_no_scale(self, q, k, v, keep):
    return (q @ k.mT).softmax(-1) @ v


def permute_and_softmax_module(self, q, k, v, keep):
    return torch.matmul(self.softmax(q @ k.permute(0, 1, 3, 2) * 0.3), v)


def k_not_transposed(self, q, k, v, keep):  # K already laid out [.., D, S]
    kt = k.transpose(-1, -2).contiguous()
    return (q @ kt / 2).softmax(dim=3) @ v


def einsum_any_layout(self, q, k, v, keep):  # q, k, v as [B, L, H, D]; output [B, L, H, D]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    probs = torch.einsum("bqhd,bkhd->bhqk", q, k).mul(0.2).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def einsum_ellipsis(self, q, k, v, keep):
    return torch.einsum("...qk,...kd->...qd", torch.einsum("...qd,...kd->...qk", q, k).softmax(-1), v)


def bmm_heads_in_batch(self, q, k, v, keep):
    q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    return torch.bmm(F.softmax(torch.bmm(q, k.transpose(1, 2)) / 3.0, dim=-1), v)


def additive_after_scale(self, q, k, v, keep):
    mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, MIN)[:, None, None, :]
    return F.softmax(q @ k.transpose(-1, -2) * 0.25 + mask, dim=-1) @ v


def additive_before_scale(self, q, k, v, keep):
    bias = torch.arange(L, dtype=q.dtype).view(1, 1, 1, L) * 0.1  # an ALiBi-like bias, then padding
    return F.softmax((q @ k.transpose(-1, -2) + bias - 1e4 * (~keep[:, None, None, :]).to(q.dtype)) / 4, -1) @ v


def fill_minus_inf(self, q, k, v, keep):
    scores = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~keep[:, None, None, :], float("-inf"))
    return F.softmax(scores, dim=-1) @ v


def where_finfo_min(self, q, k, v, keep):
    return F.softmax(torch.where(keep[:, None, None, :], q @ k.transpose(-1, -2), MIN), dim=-1) @ v


def fill_in_place_large_negative(self, q, k, v, keep):
    scores = q @ k.transpose(-1, -2)
    scores.masked_fill_(~keep[:, None, None, :], -1e9)
    return F.softmax(scores, -1) @ v


def causal_buffer(self, q, k, v, keep):  # (symbolic tracing cannot slice a buffer by a traced size)
    scores = (q @ k.transpose(-1, -2)).masked_fill(self.causal[:, :, :L, :L] == 0, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


def causal_from_shapes(self, q, k, v, keep):
    length = q.size(-2)
    mask = torch.triu(torch.full((length, length), float("-inf")), diagonal=1)
    return F.softmax(q @ k.transpose(-1, -2) * 0.5 + mask, dim=-1) @ v


def sliding_window(self, q, k, v, keep):  # constant, not causal: passed as a mask, no row fix needed
    i = torch.arange(q.size(-2))
    window = (i[:, None] - i[None, :]).abs() <= 1
    return F.softmax(torch.where(window, q @ k.transpose(-1, -2), float("-inf")), dim=-1) @ v


def constant_keep_all(self, q, k, v, keep):
    everything = q.new_ones(q.size(-2), q.size(-2), dtype=torch.bool)
    return F.softmax((q @ k.transpose(-1, -2)).masked_fill(~everything, MIN), dim=-1) @ v


def fill_then_additive(self, q, k, v, keep):  # GPT-Neo: causal where(...), then the padding mask added
    scores = torch.where(self.causal[:, :, :L, :L], q @ k.transpose(-1, -2), torch.tensor(MIN))
    padding = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, MIN)[:, None, None, :]
    return F.softmax(scores + padding, dim=-1) @ v


def casts_around_softmax(self, q, k, v, keep):
    probs = F.softmax((q @ k.transpose(-1, -2)).float(), dim=-1, dtype=torch.float32).type_as(q)
    return probs.to(v.dtype) @ v


def scale_on_q_and_k(self, q, k, v, keep):
    return F.softmax((q * 0.5) @ (k / 3).transpose(-1, -2), dim=-1) @ v


def tensor_scales(self, q, k, v, keep):
    return F.softmax(q @ k.transpose(-1, -2) * self.inv_temperature / self.temperature, dim=-1) @ v


def gqa_repeat_interleave(self, q, k, v, keep):
    k, v = k.repeat_interleave(2, dim=1), torch.repeat_interleave(v, 2, dim=1)
    return F.softmax(q @ k.transpose(-1, -2) * 0.1, -1) @ v


def gqa_repeat_kv(self, q, k, v, keep):  # transformers' repeat_kv
    def repeat(x):
        b, heads, length, dim = x.shape
        return x[:, :, None, :, :].expand(b, heads, 2, length, dim).reshape(b, heads * 2, length, dim)

    return F.softmax(q @ repeat(k).transpose(2, 3) * 0.1, -1) @ repeat(v)


def dropout_forms(self, q, k, v, keep):
    probs = self.drop(F.softmax(q @ k.transpose(-1, -2), -1))
    return F.dropout(probs, p=0.1, training=False) @ v


def two_attentions(self, q, k, v, keep):
    first = F.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v
    return torch.softmax(first @ k.transpose(-1, -2) * 0.3, -1) @ v


def bool_mask_added(self, q, k, v, keep):  # torch promotes the bool mask to 0.0 / 1.0 before adding
    return F.softmax(q @ k.transpose(-1, -2) * 0.25 + keep[:, None, None, :], dim=-1) @ v


def int_keep_filled(self, q, k, v, keep):  # an int64 0/1 keep mask, as tokenizers return it
    mask = keep.long()[:, None, None, :]
    return F.softmax((q @ k.transpose(-1, -2) * 0.25).masked_fill(mask == 0, float("-inf")), dim=-1) @ v


def int_keep_added(self, q, k, v, keep):
    mask = keep.long()[:, None, None, :]
    return F.softmax(q @ k.transpose(-1, -2) * 0.25 + (1 - mask) * MIN, dim=-1) @ v


def int_mask_added(self, q, k, v, keep):  # an integer bias added as it is (promoted to float)
    return F.softmax(q @ k.transpose(-1, -2) * 0.25 + keep.long()[:, None, None, :] * -3, dim=-1) @ v


def constant_tensor_added(self, q, k, v, keep):  # a buffer the graph never changes: a float mask
    return F.softmax(q @ k.transpose(-1, -2) + self.relative[:, :L, :L], dim=-1) @ v


def per_head_scale(self, q, k, v, keep):  # a learned scale per head (cosine attention's logit scale)
    mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, MIN)[:, None, None, :]
    return F.softmax((q @ k.transpose(-1, -2) + mask) * self.head_scale.view(1, H, 1, 1), dim=-1) @ v


def expand_as_scores(self, q, k, v, keep):  # DistilBERT: the mask expanded to the scores' shape
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    mask = (keep.long() == 0).view(q.size(0), 1, 1, k.size(-2)).expand_as(scores)
    return F.softmax(scores.masked_fill(mask, torch.finfo(scores.dtype).min), dim=-1) @ v


def expand_to_scores_shape(self, q, k, v, keep):
    scores = q @ k.transpose(-1, -2) * 0.25
    bias = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, -1e9)[:, None, None, :]
    return F.softmax(scores + bias.expand(scores.shape), dim=-1) @ v


def bmm_views_around_mask(self, q, k, v, keep):  # MBart/PLBart: 3-d bmm, the 4-d mask added to a view
    mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, MIN)[:, None, None, :].expand(B, 1, L, L)
    q, k, v = q.reshape(B * H, L, D) * 0.3, k.reshape(B * H, L, D), v.reshape(B * H, L, D)
    attn = torch.bmm(q, k.transpose(1, 2))
    attn = attn.view(B, H, L, L) + mask
    attn = attn.view(B * H, L, L)
    return torch.bmm(F.softmax(attn, dim=-1), v).view(B, H, L, D)


def shifted_windows(self, q, k, v, keep):  # timm Swin: batch is windows x images; a mask buffer per window
    windows = self.window_mask.shape[0]
    attn = q @ k.transpose(-2, -1) * 0.3
    attn = attn.view(-1, windows, H, L, L) + self.window_mask.unsqueeze(1).unsqueeze(0)
    attn = attn.view(-1, H, L, L)
    return self.softmax(attn) @ v


def window_mask_made_in_forward(self, q, k, v, keep):
    mask = torch.zeros(2, L, L)
    mask[1, :, L // 2:] = -100.0  # a statement changing the mask after it is made
    attn = (q @ k.transpose(-2, -1)).view(-1, 2, H, L, L) + mask.unsqueeze(1).unsqueeze(0)
    return self.softmax(attn.view(-1, H, L, L)) @ v


def windows_with_padding(self, q, k, v, keep):  # masks added in two views of the scores
    padding = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, MIN)[:, None, None, None, :]
    attn = (q @ k.transpose(-2, -1)).view(B, 1, H, L, L) + padding
    attn = attn.view(B, H, L, L).view(B * H, 1, L, L) + torch.arange(H, dtype=q.dtype).repeat(B).view(-1, 1, 1, 1)
    return attn.view(B, H, L, L).softmax(-1) @ v


ACCEPTED = {
    "basic": (basic, {"scale": 1 / math.sqrt(D)}),
    "torch_calls_and_power_scale": (torch_calls_and_power_scale, {"scale": D ** -0.5}),
    "method_softmax_mt_no_scale": (method_softmax_mt_no_scale, {"scale": 1.0}),
    "permute_and_softmax_module": (permute_and_softmax_module, {"scale": 0.3}),
    "k_not_transposed": (k_not_transposed, {"scale": 0.5}),
    "einsum_any_layout": (einsum_any_layout, {"scale": 0.2}),
    "einsum_ellipsis": (einsum_ellipsis, {"scale": 1.0}),
    "bmm_heads_in_batch": (bmm_heads_in_batch, {"scale": 1 / 3.0}),
    # (masks that hold finfo.min or -1e9, never -inf, need no fix: a row they hide is uniform in eager and
    # SDPA alike; bool and integer masks hold no infinity either)
    "additive_after_scale": (additive_after_scale, {"scale": 0.25, "mask": torch.float32}),
    "additive_before_scale": (additive_before_scale, {"scale": 0.25, "mask": torch.float32, "row_fix": True}),
    "fill_minus_inf": (fill_minus_inf, {"scale": 0.25, "mask": torch.bool, "row_fix": True}),
    "where_finfo_min": (where_finfo_min, {"scale": 1.0, "mask": torch.bool, "row_fix": True}),
    "fill_in_place_large_negative": (fill_in_place_large_negative, {"mask": torch.bool, "row_fix": True}),
    "causal_buffer": (causal_buffer, {"is_causal": True}),
    "causal_from_shapes": (causal_from_shapes, {"scale": 0.5, "is_causal": True}),
    "sliding_window": (sliding_window, {"mask": torch.bool}),
    "constant_keep_all": (constant_keep_all, {}),
    "fill_then_additive": (fill_then_additive, {"mask": torch.float32, "row_fix": True}),
    "casts_around_softmax": (casts_around_softmax, {"scale": 1.0}),
    "scale_on_q_and_k": (scale_on_q_and_k, {"scale": 1.0}),
    "tensor_scales": (tensor_scales, {"scale": 1.0}),
    "gqa_repeat_interleave": (gqa_repeat_interleave, {"scale": 0.1, "gqa": True}),
    "gqa_repeat_kv": (gqa_repeat_kv, {"scale": 0.1, "gqa": True}),
    "dropout_forms": (dropout_forms, {}),
    "bool_mask_added": (bool_mask_added, {"scale": 0.25, "mask": torch.float32}),
    "int_keep_filled": (int_keep_filled, {"scale": 0.25, "mask": torch.bool, "row_fix": True}),
    "int_keep_added": (int_keep_added, {"scale": 0.25, "mask": torch.float32, "row_fix": True}),
    "int_mask_added": (int_mask_added, {"scale": 0.25, "mask": torch.float32}),
    "constant_tensor_added": (constant_tensor_added, {"scale": 1.0, "mask": torch.float32}),
    "per_head_scale": (per_head_scale, {"scale": 1.0, "mask": torch.float32, "row_fix": True}),
    "expand_as_scores": (expand_as_scores, {"scale": 1 / math.sqrt(D), "mask": torch.bool, "row_fix": True}),
    "expand_to_scores_shape": (expand_to_scores_shape, {"scale": 0.25, "mask": torch.float32}),
    "bmm_views_around_mask": (bmm_views_around_mask, {"scale": 1.0, "mask": torch.float32}),
    "shifted_windows": (shifted_windows, {"scale": 0.3, "mask": torch.float32}),
    "windows_with_padding": (windows_with_padding, {"scale": 1.0, "mask": torch.float32, "row_fix": True}),
}
# fx captures the mask made in forward as a constant; export as ops, changed by a statement (so: not a constant)
ACCEPTED_ALIKE = {"window_mask_made_in_forward": window_mask_made_in_forward}


def _kwarg(node: torch.fx.Node, name: str, index: int):
    return node.kwargs.get(name, node.args[index] if len(node.args) > index else None)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_every_form_becomes_one_sdpa_with_eager_outputs(name, method):
    fn, expected = ACCEPTED[name]
    inputs = _inputs(kv_heads=H // 2 if expected.get("gqa") else H)
    model, new = rewritten(fn, inputs, method)
    (node,) = assert_replaced(model, new, inputs)
    mask = _kwarg(node, "attn_mask", 3)
    if "scale" in expected:
        scale = node.kwargs["scale"]
        scale = scale.meta["val"] if isinstance(scale, torch.fx.Node) else scale  # traced: computed from sizes
        assert scale == pytest.approx(expected["scale"], rel=1e-6)
    assert bool(node.kwargs["is_causal"]) == expected.get("is_causal", False)
    assert (mask.meta["val"].dtype if mask is not None else None) == expected.get("mask")
    assert ("rows with every key masked" in new.report.matches[0].what) == expected.get("row_fix", False)
    if expected.get("gqa"):
        assert node.kwargs["enable_gqa"] is SDPA_HAS_GQA
        assert node.args[1].meta["val"].shape[1] == (H // 2 if SDPA_HAS_GQA else H)
    gm = new.graph_module
    if method == "export":  # the graph stays ATen
        assert all(isinstance(n.target, torch._ops.OpOverload) or n.target.__module__ == "_operator"
                   for n in gm.graph.nodes if n.op == "call_function"), gm.graph


@pytest.mark.parametrize("method", METHODS)
def test_two_attentions_in_one_graph(method):
    inputs = _inputs()
    model, new = rewritten(two_attentions, inputs, method)
    assert_replaced(model, new, inputs, count=2)


class Inline(nn.Module):
    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        return F.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("method", METHODS)
def test_the_report_names_the_users_line(method):
    q, k, v, _ = _inputs()
    new = fxforge.rewrite(fxforge.capture(Inline(), (q, k, v), method=method), ["attention"])
    (match,) = new.report.matches
    assert match.what == f"attention -> scaled_dot_product_attention(scale={1 / math.sqrt(D):.4g})"
    assert "test_attention.py" in match.source and "scores = q @ k.transpose(-2, -1)" in match.source
    assert "attention -> scaled_dot_product_attention" in str(new.report)


@pytest.mark.parametrize("method", METHODS)
def test_causal_masks_are_not_materialised(method):
    inputs = _inputs()
    for fn in (causal_buffer, causal_from_shapes):
        _model, new = rewritten(fn, inputs, method)
        calls = [n for n in new.graph_module.graph.nodes if n.op in ("call_function", "call_method")]
        calls = [n for n in calls if n not in nan_query_guard(new.graph_module)]
        assert calls == sdpa_nodes(new.graph_module), new.graph_module.graph  # nothing left of the mask
        assert "is_causal=True" in new.report.matches[0].what


def padding_spread_over_queries(self, q, k, v, keep):
    """transformers' mask builders: a [B, 1, 1, S] padding mask AND-ed with an always-true query condition
    (``q_idx >= 0``) into a [B, 1, L, S] mask."""
    rows = torch.arange(q.shape[-2]).view(1, 1, -1, 1) >= 0
    mask = torch.where(rows & keep[:, None, None, :], 0.0, -1e9)
    return torch.softmax(q @ k.transpose(-2, -1) / 8 + mask, dim=-1) @ v


@pytest.mark.parametrize("method", METHODS)
def test_a_padding_mask_reaches_sdpa_without_the_query_dim(method):
    inputs = _inputs()
    model, new = rewritten(padding_spread_over_queries, inputs, method)
    [sdpa] = assert_replaced(model, new, inputs)
    # The always-true condition is dropped: SDPA broadcasts a [B, 1, 1, S] mask, no L x S tensor is built.
    assert tuple(sdpa.kwargs["attn_mask"].meta["val"].shape) == (B, 1, 1, L)


def test_a_mask_from_tensor_data_is_never_taken_for_a_constant():
    def data_dependent(self, q, k, v, keep):
        limit = q.abs().sum().item()  # huge for these inputs: every key is kept, but only for them
        return F.softmax((q @ k.transpose(-1, -2)).masked_fill(torch.arange(L) >= limit, float("-inf")), -1) @ v

    inputs = _inputs()
    model, new = rewritten(data_dependent, inputs, "fx")
    assert_replaced(model, new, inputs)
    assert "attn_mask=<bool>" in new.report.matches[0].what  # computed at run time, not dropped
    small = (inputs[0] * 1e-3, *inputs[1:])
    torch.testing.assert_close(new.graph_module(*small), model(*small), equal_nan=True)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_fill_and_additive_mask(dtype, method):
    def neo_style(self, q, k, v, keep):  # finfo(bfloat16).min becomes -inf in float16 scores
        scores = torch.where(keep[:, None, None, :], q @ k.transpose(-1, -2) * 0.3, torch.finfo(torch.bfloat16).min)
        return F.softmax(scores + torch.zeros(1, 1, 1, L, dtype=q.dtype), -1) @ v

    q, k, v, keep = _inputs()
    inputs = (q.to(dtype), k.to(dtype), v.to(dtype), keep)
    model, new = rewritten(neo_style, inputs, method)
    assert new.report.counts == {"attention": 1}
    torch.testing.assert_close(new.graph_module(*inputs), model(*inputs), rtol=2e-2, atol=2e-2)


def test_three_dimensional_inputs_run_as_four_dimensional():
    inputs = _inputs()
    _model, new = rewritten(bmm_heads_in_batch, inputs, "fx")
    (node,) = sdpa_nodes(new.graph_module)
    assert node.args[0].meta["val"].ndim == 4  # SDPA's fast kernels take [B, H, L, D]


class WindowedAttention(nn.Module):
    """Attention over windows, with q, k and v [B, G, H, P, E] (torchvision's MaxVit: einsum over five dims)
    and a learned bias of shape ``bias_shape`` added to the scores; with ``keep`` a padding mask too."""

    def __init__(self, bias_shape: tuple[int, ...]):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.bias = nn.Parameter(torch.randn(*bias_shape))

    def forward(self, x, keep=None):
        qkv = self.qkv(x).reshape(x.size(0), x.size(1), x.size(2), 3, 2, 8).permute(3, 0, 1, 4, 2, 5)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = torch.einsum("bghid,bghjd->bghij", q, k) * 0.35 + self.bias
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        return torch.einsum("bghij,bghjd->bghid", scores.softmax(-1), v)


# bias shapes: broadcast over every leading dim, over the batch only, per window and head, per batch item
FIVE_D_BIASES = [(1, 2, 5, 5), (2, 5, 5), (3, 1, 5, 5), (2, 3, 2, 5, 5), (2, 1, 1, 5, 5)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bias_shape", FIVE_D_BIASES)
def test_attention_over_more_than_four_dims_runs_as_four_dimensional(bias_shape, method):
    torch.manual_seed(0)
    model = WindowedAttention(bias_shape).eval()
    x = torch.randn(2, 3, 5, 16)
    new = fxforge.rewrite(fxforge.capture(model, (x,), method=method), ["attention"])
    assert new.report.counts == {"attention": 1}, reasons(new)
    (node,) = sdpa_nodes(new.graph_module)
    assert node.args[0].meta["val"].ndim == 4  # [B*G, H, P, E]: torch.onnx's SDPA takes only 4-d inputs
    x = torch.randn(2, 3, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(new.graph_module(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_a_five_dimensional_padding_mask_keeps_eager_rows(method):
    torch.manual_seed(0)
    model = WindowedAttention((1, 2, 5, 5)).eval()
    x, keep = torch.randn(2, 3, 5, 16), torch.ones(2, 3, 1, 1, 5, dtype=torch.bool)
    keep[1, 2, ..., 3:] = False
    keep[0, 1] = False  # a window with every key masked: NaN rows, as eager gives
    new = fxforge.rewrite(fxforge.capture(model, (x, keep), method=method), ["attention"])
    assert new.report.counts == {"attention": 1}, reasons(new)
    x = torch.randn(2, 3, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(new.graph_module(x, keep), model(x, keep), rtol=1e-5, atol=1e-5, equal_nan=True)


# --------------------------------------------------------------------------------------------------
# Rows in which every key is masked, and training


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fn", [fill_minus_inf, where_finfo_min, fill_in_place_large_negative, fill_then_additive,
                                additive_after_scale])
def test_rows_with_every_key_masked_equal_eager(fn, method):
    inputs = _inputs(dead_row=True)  # eager: NaN rows with -inf, uniform rows with finite fills
    model, new = rewritten(fn, inputs, method)
    assert_replaced(model, new, inputs)
    with torch.no_grad():
        eager = model(*inputs)
    assert eager[1].isnan().all() if fn is fill_minus_inf else eager.isfinite().all()


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_a_query_row_with_a_nan_gives_eager_nan_rows(name):
    fn, expected = ACCEPTED[name]
    inputs = _inputs(kv_heads=H // 2 if expected.get("gqa") else H, dead_row=True)
    model, new = rewritten(fn, inputs, "fx")
    q, k, v, keep = _inputs(seed=3, kv_heads=H // 2 if expected.get("gqa") else H, dead_row=True)
    q[0, 1, 2, 3] = q[1, 0, 0, 0] = float("nan")  # a visible row, and a row every key of which may be hidden
    with torch.no_grad():
        eager, got = model(q, k, v, keep), new.graph_module(q, k, v, keep)
    assert eager.isnan().any()
    # NaN exactly where eager has it; the values loosely (a row hidden by -1e4 in float32 rounds differently)
    torch.testing.assert_close(got, eager, rtol=1e-3, atol=1e-3, equal_nan=True)


class MaskInput(nn.Module):
    """Attention with the additive mask as an input, as transformers' models take it after their mask helpers."""

    def forward(self, q, k, v, mask):
        return F.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v


def _additive(keep: torch.Tensor, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, value)[:, None, None, :]


@pytest.mark.parametrize("method", METHODS)
def test_an_additive_mask_padded_only_at_call_time_gives_eager_nan_rows(method):
    q, k, v, keep = _inputs()
    example = (q, k, v, _additive(torch.ones_like(keep), float("-inf")))  # nothing padded in the example
    model = MaskInput()
    new = fxforge.rewrite(fxforge.capture(model, example, method=method), ["attention"])
    assert new.report.counts == {"attention": 1}, new.report.rolled_back
    q, k, v, keep = _inputs(seed=5, dead_row=True)
    call = (q, k, v, _additive(keep, float("-inf")))
    with torch.no_grad():
        eager, got = model(*call), new.graph_module(*call)
    assert eager[1].isnan().all() and eager[0].isfinite().all()
    torch.testing.assert_close(got, eager, equal_nan=True)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("value", [-1e4, torch.finfo(torch.bfloat16).min, float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rows_a_low_precision_additive_mask_hides_equal_eager(dtype, value, method):
    value = max(value, torch.finfo(dtype).min) if value != float("-inf") else value  # representable in dtype
    q, k, v, keep = (t.to(dtype) if t.is_floating_point() else t for t in _inputs())
    model = MaskInput()
    new = fxforge.rewrite(fxforge.capture(model, (q, k, v, _additive(keep, value, dtype)), method=method),
                          ["attention"])
    assert new.report.counts == {"attention": 1}, new.report.rolled_back
    q, k, v, keep = (t.to(dtype) if t.is_floating_point() else t for t in _inputs(seed=7, dead_row=True))
    call = (q, k, v, _additive(keep, value, dtype))
    with torch.no_grad():
        eager, got = model(*call), new.graph_module(*call)
    # eager's hidden row: the scores are absorbed into the mask value, a uniform softmax (NaN with -inf)
    want = torch.full_like(eager[1], float("nan")) if value == float("-inf") else v[1].float().mean(-2, True)
    torch.testing.assert_close(eager[1].float(), want.expand_as(eager[1]).float(), equal_nan=True, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, eager, equal_nan=True, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("method", METHODS)
def test_an_example_mask_holding_minus_inf_is_rewritten_not_rolled_back(method):
    q, k, v, keep = _inputs()  # the second sequence is padded in the example
    model = MaskInput()
    new = fxforge.rewrite(fxforge.capture(model, (q, k, v, _additive(keep, float("-inf"))), method=method),
                          ["attention"])
    assert not new.report.rolled_back and new.report.counts == {"attention": 1}
    call = _inputs(seed=9)
    call = (*call[:3], _additive(call[3], float("-inf")))
    torch.testing.assert_close(new.graph_module(*call), model(*call), equal_nan=True)


def test_a_nan_in_a_key_a_fill_hides_gives_nan_rows_never_other_numbers():
    """A documented difference: eager's fill replaces the NaN score of a hidden key (its row stays finite
    when that key's value is finite); SDPA adds the mask to the NaN score, so the row is NaN. The row is
    NaN, never a different finite number."""
    inputs = _inputs()
    model, new = rewritten(fill_minus_inf, inputs, "fx")
    q, k, v, keep = _inputs(seed=11)
    k[1, 0, L - 1, 0] = float("nan")  # a padded key of the second sequence; its value stays finite
    with torch.no_grad():
        eager, got = model(q, k, v, keep), new.graph_module(q, k, v, keep)
    assert eager.isfinite().all()
    same = got.isfinite()
    assert got[1, 0].isnan().all() and same[0].all() and same[1, 1:].all()
    torch.testing.assert_close(got[same], eager[same])


def _gradients(fn, inputs, graph, model):
    q, k, v, keep = (t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
    model.zero_grad()
    out = graph(q, k, v, keep)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return [out, q.grad, k.grad, v.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["basic", "where_finfo_min", "additive_before_scale", "causal_buffer", "tensor_scales",
                                  "gqa_repeat_kv", "einsum_any_layout", "fill_then_additive", "per_head_scale",
                                  "bool_mask_added"])
def test_gradients_in_training_equal_eager(name, method):
    fn, expected = ACCEPTED[name]
    inputs = _inputs(kv_heads=H // 2 if expected.get("gqa") else H, dead_row=name == "where_finfo_min")
    model, new = rewritten(fn, inputs, method, training=True)
    assert new.report.counts == {"attention": 1}
    for got, want in zip(_gradients(fn, inputs, new.graph_module, model), _gradients(fn, inputs, model, model)):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dropout_with_p_zero_is_replaced_in_training():
    inputs = _inputs()
    model, new = rewritten(dropout_forms, inputs, "fx", training=True, dropout=0.0)
    assert_replaced(model, new, inputs)


# --------------------------------------------------------------------------------------------------
# Refusals, each pinned by its reason


def over_other_dim(self, q, k, v, keep):
    return F.softmax(q @ k.transpose(-1, -2), dim=-2) @ v


def soft_capped(self, q, k, v, keep):
    return F.softmax(torch.tanh(q @ k.transpose(-1, -2) / 5) * 5, dim=-1) @ v


def gated_scores(self, q, k, v, keep):
    gate = torch.sigmoid(q.sum(-1, keepdim=True) + k.sum(-1).unsqueeze(-2))
    return F.softmax((q @ k.transpose(-1, -2)) * gate, dim=-1) @ v


def gated_probabilities(self, q, k, v, keep):
    return (F.softmax(q @ k.transpose(-1, -2), dim=-1) * 0.5) @ v


def masked_after_softmax(self, q, k, v, keep):
    return F.softmax(q @ k.transpose(-1, -2), dim=-1).masked_fill(~keep[:, None, None, :], 0.0) @ v


def probabilities_returned(self, q, k, v, keep):
    probs = F.softmax(q @ k.transpose(-1, -2), dim=-1)
    return probs @ v, probs


def scores_reused(self, q, k, v, keep):
    scores = q @ k.transpose(-1, -2)
    return F.softmax(scores, dim=-1) @ v + scores.mean()


def two_contracted_dims(self, q, k, v, keep):  # contracts heads and head dim: not per-head attention
    return torch.einsum("bqk,bkd->bqd", torch.einsum("bhqd,bhkd->bqk", q, k).softmax(-1), v[:, 0])


def values_over_queries(self, q, k, v, keep):  # the value product sums over the queries, not the keys
    return torch.einsum("bhqk,bhqd->bhkd", torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(-1), v)


def probabilities_second(self, q, k, v, keep):
    return v.transpose(-1, -2) @ F.softmax(q @ k.transpose(-1, -2), dim=-1)


def small_fill(self, q, k, v, keep):
    return F.softmax((q @ k.transpose(-1, -2)).masked_fill(~keep[:, None, None, :], -5.0), dim=-1) @ v


def large_fill_with_additive(self, q, k, v, keep):
    scores = (q @ k.transpose(-1, -2)).masked_fill(~keep[:, None, None, :], -1e9)
    return F.softmax(scores + torch.arange(L, dtype=q.dtype) * 0.1, dim=-1) @ v


def lower_precision(self, q, k, v, keep):
    return F.softmax((q @ k.transpose(-1, -2)).half(), dim=-1).float() @ v


def broadcast_key(self, q, k, v, keep):
    return F.softmax(q @ k[:, :1].transpose(-1, -2), dim=-1) @ v


def scores_as_their_own_mask(self, q, k, v, keep):
    scores = q @ k.transpose(-1, -2)
    return F.softmax(scores + scores, dim=-1) @ v


def dropout_in_training(self, q, k, v, keep):
    return self.drop(F.softmax(q @ k.transpose(-1, -2), dim=-1)) @ v


REFUSED = {
    "over_other_dim": (over_other_dim, "softmax over dim 2 of 4, not the last (key) dim"),
    "soft_capped": (soft_capped, ("the scores are soft-capped (cap * tanh(scores / cap), as Gemma 2 writes them) "
                                  "before softmax: scaled_dot_product_attention has no soft cap")),
    "gated_scores": (gated_scores, ("an element-wise tensor gate (mul by sigmoid of shape (2, 4, 6, 6)) is applied to "
                                   "the scores before softmax")),
    "gated_probabilities": (gated_probabilities,
                            "mul between softmax and the value product (only casts, dropout and views of the batch dims may be there)"),
    "masked_after_softmax": (masked_after_softmax,
                             "masked_fill between softmax and the value product (only casts, dropout and views of the batch dims may be there)"),
    "probabilities_returned": (probabilities_returned,
                               "the attention probabilities (softmax) are also used by output (returned or reused)"),
    "scores_reused": (scores_reused, "the attention scores (matmul) are also used by mean"),
    "two_contracted_dims": (two_contracted_dims,
                            "the scores einsum 'bhqd,bhkd->bqk' contracts over 2 dims, not one head dim"),
    "values_over_queries": (values_over_queries, ("the value einsum 'bhqk,bhqd->bhkd' does not contract the values "
                                                 "over the softmax (key) dim")),
    "probabilities_second": (probabilities_second,
                             "the attention probabilities are the second operand of matmul_1, not the first"),
    "small_fill": (small_fill, "the fill value -5.0 does not mask: only -inf and values <= -10000 hide a key"),
    "large_fill_with_additive": (large_fill_with_additive, ("a fill with -1000000000.0 combined with an additive mask "
                                 "has no exact SDPA mask (only -inf or finfo(torch.float32).min combine in "
                                 "torch.float32)")),
    "lower_precision": (lower_precision, "half casts the attention to torch.float16, below the query's torch.float32"),
    "scores_as_their_own_mask": (scores_as_their_own_mask, "matmul is both an input of the attention and part of it"),
    "broadcast_key": (broadcast_key, ("query (2, 4, 6, 8), key (2, 1, 6, 8) and value (2, 4, 6, 8) do not line up "
                                     "without broadcasting")),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(REFUSED))
def test_near_misses_are_refused_with_their_reason(name, method):
    fn, reason = REFUSED[name]
    inputs = _inputs()
    _model, new = rewritten(fn, inputs, method)
    assert new.report.counts.get("attention", 0) == 0
    if method == "export":  # exported graphs name nodes after the ATen op
        reason = reason.replace("half casts", "to casts")
    assert reasons(new) == [reason]
    assert "test_attention.py" in new.report.near_misses[0].source
    assert softmaxes(new.graph_module)


@pytest.mark.parametrize("method", METHODS)
def test_active_dropout_in_training_is_refused(method):
    inputs = _inputs()
    _model, new = rewritten(dropout_in_training, inputs, method, training=True, dropout=0.1)
    assert new.report.counts.get("attention", 0) == 0
    assert reasons(new) == [("dropout (p=0.1) on the attention probabilities is active in training mode: SDPA's "
                            "dropout draws different random numbers, so the result could not be verified")]


def test_an_input_changed_in_place_meanwhile_is_refused():
    def mutated(self, q, k, v, keep):
        q = q * 1.0
        probs = F.softmax(q @ k.transpose(-1, -2), dim=-1)
        q.mul_(2.0)  # after the scores read q, before the value product
        return probs @ v + q

    inputs = _inputs()
    model, new = rewritten(mutated, inputs, "fx")
    assert reasons(new) == ["mul (or a view of it) is changed in place"]
    torch.testing.assert_close(new.graph_module(*inputs), model(*inputs))


def test_a_softmax_that_is_not_attention_is_no_near_miss():
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(D, 3)

        def forward(self, x):
            return F.softmax(self.head(x), dim=1)

    new = fxforge.rewrite(fxforge.capture(Classifier().eval(), (torch.randn(2, D),)), ["attention"])
    assert new.report.counts == {} and reasons(new) == []


def test_fill_values_at_the_threshold():
    assert LARGE_NEGATIVE == -1e4

    def at_threshold(self, q, k, v, keep):
        return F.softmax((q @ k.transpose(-1, -2)).masked_fill(~keep[:, None, None, :], -1e4), dim=-1) @ v

    inputs = _inputs()
    model, new = rewritten(at_threshold, inputs, "fx")
    assert_replaced(model, new, inputs)


# --------------------------------------------------------------------------------------------------
# Registry, the default pipeline, real models


def test_attention_is_built_in_and_runs_by_default_after_the_fusions():
    # after conv_activation (its linear fusions never touch attention's products), before memory_reorder
    assert DEFAULT.index("conv_activation") < DEFAULT.index("attention") < DEFAULT.index("memory_reorder")
    assert [p.name for p in resolve(["attention"])] == ["attention"]
    with pytest.raises(UnknownRewriteError, match="conv_activation, attention"):
        resolve(["nope"])


@pytest.mark.parametrize("method", METHODS)
def test_default_rewrites_replace_the_example_encoder(method):
    """Separate q/k/v projections with a masked_fill padding mask, and a fused qkv (chunk) with an additive one."""
    from examples.models import EXAMPLES

    model, inputs = EXAMPLES["transformer_encoder"]()
    new = fxforge.rewrite(fxforge.capture(model, inputs, method=method))
    assert new.report.counts["attention"] == 2 and not new.report.rolled_back
    torch.testing.assert_close(new.graph_module(*inputs), model(*inputs))


def _tiny_llama(dropout: float = 0.0):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      attention_dropout=dropout, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaModel(config)


def test_transformers_llama_one_causal_gqa_sdpa_per_layer():
    model = _tiny_llama().eval()
    inputs = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}
    new = fxforge.rewrite(fxforge.capture(model, inputs), ["attention"])
    assert new.report.counts == {"attention": 2} and not new.report.rolled_back
    assert all("is_causal=True" in m.what and "enable_gqa" in m.what for m in new.report.matches)
    with torch.no_grad():
        torch.testing.assert_close(new.graph_module(**inputs).last_hidden_state, model(**inputs).last_hidden_state)


def test_transformers_llama_padding_mask_in_training():
    model = _tiny_llama().train()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, -3:] = 0
    inputs = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)),
              "attention_mask": mask}
    new = fxforge.rewrite(fxforge.capture(model, inputs), ["attention"])
    assert new.report.counts == {"attention": 2} and "attn_mask=<float>" in new.report.matches[0].what
    grads = []
    for graph in (model, new.graph_module):
        model.zero_grad()
        graph(**inputs).last_hidden_state.pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for got, want in zip(*grads):  # float32 noise: both are ~1e-4 of the largest gradient from float64's
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4 * float(want.abs().max()))


# --------------------------------------------------------------------------------------------------
# Forms that are exactly SDPA though they are written otherwise


def _same_seed(fn, *inputs):
    torch.manual_seed(0)
    return fn(*inputs)


class DropoutAfter(nn.Module):
    """Dropout on the attention's output in training; the value product's output laid out as ``out`` says
    (an einsum writes its own layout: here not SDPA's)."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def forward(self, q, k, v):
        probs = torch.einsum("bhqd,bhkd->bhqk", q, k).mul(0.3).softmax(-1)
        return F.dropout(torch.einsum(f"bhqk,bhkd->{self.out}", probs, v), 0.5, training=self.training)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("out", ["bhqd", "bqhd", "hbqd", "qdbh"])
def test_dropout_after_the_attention_in_training_drops_eager_elements(out, method):
    """SDPA returns its own memory layout; the replacement copies its output into eager's, so dropout (which
    draws in memory order) drops the same elements under the same seed and the pass is not rolled back."""
    q, k, v, _ = _inputs()
    model = DropoutAfter(out).train()
    new = fxforge.rewrite(fxforge.capture(model, (q, k, v), method=method), ["attention"])
    assert new.report.counts == {"attention": 1} and not new.report.rolled_back, new.report.rolled_back
    q, k, v, _ = _inputs(seed=2)
    q[0, 1, 2, 3] = float("nan")
    got, want = _same_seed(new.graph_module, q, k, v), _same_seed(model, q, k, v)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, equal_nan=True)


# The forms above that were refused or rolled back before (and the integer masks): fresh inputs, a sequence
# every key of which is masked (eager: NaN rows with -inf, the mean of v with finite fills) and a NaN query.
EXACT_FORMS = ["bool_mask_added", "int_keep_filled", "int_keep_added", "int_mask_added", "constant_tensor_added",
               "per_head_scale", "expand_as_scores", "expand_to_scores_shape", "bmm_views_around_mask", "shifted_windows",
               "windows_with_padding", "window_mask_made_in_forward"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", EXACT_FORMS)
def test_exact_forms_equal_eager_on_fresh_inputs(name, method):
    fn = ACCEPTED_ALIKE[name] if name in ACCEPTED_ALIKE else ACCEPTED[name][0]
    model, new = rewritten(fn, _inputs(), method)
    assert new.report.counts == {"attention": 1} and not new.report.rolled_back, reasons(new)
    for seed in (3, 4):
        q, k, v, keep = _inputs(seed=seed, dead_row=True)
        q[0, 1, 2, 3] = float("nan")
        with torch.no_grad():
            eager, got = model(q, k, v, keep), new.graph_module(q, k, v, keep)
        assert eager[0, 1, 2].isnan().all()
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("method", METHODS)
def test_a_scale_that_differs_along_the_keys_is_refused(method):
    def per_key_scale(self, q, k, v, keep):  # not one number per score matrix: no scale SDPA (or q) can take
        return F.softmax((q @ k.transpose(-1, -2)) * (keep.to(q.dtype) + 1)[:, None, None, :], dim=-1) @ v

    _model, new = rewritten(per_key_scale, _inputs(), method)
    assert new.report.counts.get("attention", 0) == 0
    (reason,) = reasons(new)
    assert reason.startswith("an element-wise tensor gate (mul by ") and "of shape (2, 1, 1, 6)) is applied" in reason


class DistilBertMask(nn.Module):
    """DistilBERT's masking, as written there: the fill value a tensor made from ``finfo(scores.dtype)``."""

    def forward(self, q, k, v, keep):
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        mask = (keep == 0).view(q.size(0), 1, 1, k.size(-2)).expand_as(scores)
        scores = scores.masked_fill(mask, torch.tensor(torch.finfo(scores.dtype).min))
        return F.softmax(scores, dim=-1) @ v


def test_distilbert_mask_expanded_as_the_scores_under_export():
    """(fx cannot trace ``torch.tensor`` of a traced ``finfo``: ``expand_as_scores`` is the traceable form.)"""
    model = DistilBertMask()
    new = fxforge.rewrite(fxforge.capture(model, _inputs(), method="export"), ["attention"])
    [sdpa] = assert_replaced(model, new, _inputs())
    assert tuple(sdpa.kwargs["attn_mask"].meta["val"].shape) == (B, 1, 1, L)  # SDPA broadcasts, no expand
    q, k, v, keep = _inputs(seed=6, dead_row=True)
    with torch.no_grad():
        torch.testing.assert_close(new.graph_module(q, k, v, keep), model(q, k, v, keep), equal_nan=True)


@pytest.mark.parametrize("method", METHODS)
def test_a_mask_expanded_as_the_scores_and_used_elsewhere_is_refused(method):
    def expanded_mask_returned(self, q, k, v, keep):
        scores = q @ k.transpose(-1, -2)
        mask = keep[:, None, None, :].expand_as(scores)
        return F.softmax(scores.masked_fill(~mask, MIN), dim=-1) @ v, mask

    _model, new = rewritten(expanded_mask_returned, _inputs(), method)
    assert new.report.counts.get("attention", 0) == 0
    (reason,) = reasons(new)  # the fill's condition reads the scores' shape through an expand that stays
    assert reason.endswith(", an input of the attention, is computed from its matmul"), reason


def _attend(q, k, v, keep):
    return F.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(~keep[:, None, None, :], float("-inf")), -1) @ v


class Regions(nn.Module):
    """Attention inside a region that torch.export may turn into a higher-order op with a subgraph."""

    def __init__(self, region: str):
        super().__init__()
        self.region = region

    def forward(self, q, k, v, keep):
        if self.region == "checkpoint":
            return torch.utils.checkpoint.checkpoint(_attend, q, k, v, keep, use_reentrant=False)
        region = torch.no_grad() if self.region == "no_grad" else torch.autocast("cpu", enabled=self.region == "autocast")
        with region:
            out = _attend(q, k, v, keep)
        return out + 1


@pytest.mark.parametrize("region, count", [("checkpoint", 1), ("no_grad", 1), ("autocast off", 1)])
@pytest.mark.parametrize("training", [False, True])
def test_attention_inside_higher_order_op_subgraphs_is_replaced(region, count, training):
    model = Regions(region).train(training)
    cap = fxforge.capture(model, _inputs(), method="export")
    new = fxforge.rewrite(cap, ["attention"])
    assert new.report.counts == {"attention": count} and not new.report.rolled_back, reasons(new)
    for seed in (3, 4):
        q, k, v, keep = _inputs(seed=seed, dead_row=True)
        with torch.no_grad():
            torch.testing.assert_close(new.graph_module(q, k, v, keep), model(q, k, v, keep), equal_nan=True)
    # the graph before the pass (which verification and rollback run) keeps its own subgraphs
    assert all(softmaxes(sub) for sub in cap.graph_module.children() if isinstance(sub, torch.fx.GraphModule))


def test_attention_inside_an_enabled_autocast_region_is_a_near_miss():
    new = fxforge.rewrite(fxforge.capture(Regions("autocast"), _inputs(), method="export"), ["attention"])
    assert new.report.counts == {}
    (reason,) = reasons(new)
    assert reason.startswith("the attention is inside a wrap_with_autocast subgraph (submod_"), reason
    assert reason.endswith("), which could change its precision or semantics")


@pytest.mark.parametrize("method", METHODS)
def test_views_that_do_not_come_back_to_the_products_layout_are_refused(method):
    def softmax_over_a_view(self, q, k, v, keep):
        attn = torch.bmm(q.reshape(B * H, L, D), k.reshape(B * H, L, D).transpose(1, 2)).view(B, H, L, L)
        return (attn + keep[:, None, None, :]).softmax(-1) @ v

    def rows_regrouped(self, q, k, v, keep):
        attn = (q @ k.transpose(-2, -1)).view(B, H, L // 2, 2 * L)
        return (attn + 1.0).view(B, H, L, L).softmax(-1) @ v

    for fn, reason in ((softmax_over_a_view, ("the scores reach softmax as (2, 4, 6, 6), not in the layout of their "
                                             "product (8, 6, 6)")),
                       (rows_regrouped, ("a view of the scores from (2, 4, 3, 12) to (2, 4, 6, 6) changes their last "
                                        "two (query, key) dims"))):
        _model, new = rewritten(fn, _inputs(), method)
        assert new.report.counts.get("attention", 0) == 0 and reasons(new) == [reason]
