"""Issue 50: the attention rewrite hands SDPA inputs its fused kernels take (masks of 4 dims, a unit stride on the
head dim) and leaves the attention as written where torch would run SDPA's math kernel (LeViT's q/k head dim 16
against v's 64: SDPA was slower than eager there), except for a target that chooses its own kernels (ONNX)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend

import fxforge
from fxforge.core.plan import CallConditions
from fxforge.rewrites.attention.kernel_choice import chosen_kernel


class BiasedAttention(nn.Module):
    """LeViT's attention: a learned bias per head over [L, S] (a 3-d mask), values wider than queries and keys."""

    def __init__(self, dim: int = 32, heads: int = 2, key_dim: int = 8, value_dim: int = 8, tokens: int = 9):
        super().__init__()
        self.heads, self.key_dim, self.value_dim = heads, key_dim, value_dim
        self.qkv = nn.Linear(dim, heads * (2 * key_dim + value_dim))
        self.bias = nn.Parameter(torch.randn(heads, tokens, tokens))
        self.proj = nn.Linear(heads * value_dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, self.heads, -1).split([self.key_dim, self.key_dim, self.value_dim], 3)
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) * self.key_dim ** -0.5 + self.bias
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class KeysTransposed(nn.Module):
    """K made as a [B, H, D, S] tensor (``q @ k_t``): transposed back, its head dim is not contiguous."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k_t = self.k(x).view(b, n, self.heads, -1).permute(0, 2, 3, 1).contiguous()
        v = self.v(x).view(b, n, self.heads, -1).transpose(1, 2)
        return (torch.softmax(q @ k_t / 8 ** 0.5, -1) @ v).transpose(1, 2).reshape(b, n, d)


def _sdpa_calls(gm):
    return [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("model", [BiasedAttention(), KeysTransposed()], ids=["bias_3d", "keys_transposed"])
def test_the_replacement_reaches_torchs_fused_kernel(model, method):
    x = torch.randn(2, 9, 32)
    new = fxforge.rewrite(fxforge.capture(model.eval(), (x,), method=method), "default")
    assert new.report.counts.get("attention") == 1, new.report
    (call,) = _sdpa_calls(new.graph_module)
    q, k, v = (a.meta["val"] for a in call.args[:3])
    mask = call.kwargs.get("attn_mask")
    assert mask is None or mask.meta["val"].ndim == 4
    assert chosen_kernel(q, k, v, None if mask is None else mask.meta["val"]) == SDPBackend.FLASH_ATTENTION
    with torch.no_grad():
        torch.testing.assert_close(new.graph_module(x * 2), model(x * 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_attention_that_sdpa_would_run_in_its_math_kernel_is_left_as_written(method):
    model, x = BiasedAttention(value_dim=32).eval(), torch.randn(2, 9, 32)
    captured = fxforge.capture(model, (x,), method=method)
    new = fxforge.rewrite(captured, "default")
    assert new.report.counts.get("attention") is None
    assert any(m.reason == "SDPA would run its math kernel (q and k have head dim 8, v 32): slower than the "
               "attention as written" for m in new.report.near_misses), new.report.near_misses
    assert not _sdpa_calls(new.graph_module)
    for_onnx = fxforge.rewrite(captured, "default", conditions=CallConditions(guards_as_ops=True))
    assert for_onnx.report.counts.get("attention") == 1  # ONNX Runtime chooses its own kernel
    with torch.no_grad():
        torch.testing.assert_close(for_onnx.graph_module(x), model(x), rtol=1e-5, atol=1e-5)


def test_the_choice_is_asked_of_torch_on_small_stand_ins_whatever_the_length():
    def long(head_dim):  # [1, 2, 4096, head_dim] with no memory behind it: only the stand-ins are real
        return torch.empty_strided((1, 2, 4096, head_dim), (0, 0, head_dim, 1))

    assert chosen_kernel(long(64), long(64), long(64), None) == SDPBackend.FLASH_ATTENTION
    assert chosen_kernel(long(64), long(64), long(64), torch.empty_strided((4096, 4096), (0, 1))) \
        == SDPBackend.FLASH_ATTENTION
    assert chosen_kernel(long(64), long(64), long(256), None) == SDPBackend.MATH
