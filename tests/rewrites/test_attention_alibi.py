"""Issue 50: ALiBi-style biases (BLOOM's ``baddbmm``) become SDPA's float mask; soft-capped scores (Gemma 2) are
refused with that reason."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fxforge


class AlibiAttention(nn.Module):
    """BLOOM's attention written by hand: the bias added inside ``baddbmm``, softmax over [B, H, L, S], the
    probabilities viewed back to [B * H, L, S] for the value product."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)])
        self.register_buffer("slopes", slopes)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = (t.reshape(b * self.heads, n, self.head_dim) for t in (q, k, v))
        alibi = (self.slopes[:, None] * torch.arange(n)[None, :]).repeat(b, 1)[:, None, :]  # [B*H, 1, S]
        scores = alibi.baddbmm(q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(self.head_dim))
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.view(b, self.heads, n, n).masked_fill(causal, torch.finfo(x.dtype).min)
        probs = torch.softmax(scores, -1).view(b * self.heads, n, n)
        return self.out(torch.bmm(probs, v).view(b, self.heads, n, self.head_dim).transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_alibi_bias_added_by_baddbmm_becomes_sdpas_float_mask(method):
    model, x = AlibiAttention().eval(), torch.randn(2, 10, 32)
    new = fxforge.rewrite(fxforge.capture(model, (x,), method=method), "default")
    assert new.report.counts.get("attention") == 1, new.report
    ops = [n.target for n in new.graph_module.graph.nodes if n.op == "call_function"]
    assert any("scaled_dot_product_attention" in str(t) for t in ops)
    assert not any("baddbmm" in str(t) or "softmax" in str(t) for t in ops)
    with torch.no_grad():
        for fresh in (x, torch.randn(2, 10, 32) * 3):
            torch.testing.assert_close(new.graph_module(fresh), model(fresh), rtol=1e-5, atol=1e-5)


def test_a_baddbmm_that_makes_no_scores_stays_one_call():
    class Affine(nn.Module):
        def forward(self, bias, a, b):
            return torch.baddbmm(bias, a, b, alpha=0.5).relu()

    inputs = (torch.randn(2, 3, 3), torch.randn(2, 3, 4), torch.randn(2, 4, 3))
    new = fxforge.rewrite(fxforge.capture(Affine().eval(), inputs), "default")
    assert any("baddbmm" in str(n.target) for n in new.graph_module.graph.nodes)


def test_bloom_attention_is_replaced():
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=64)
    model, ids = transformers.BloomModel(config).eval(), torch.randint(0, 64, (2, 9))
    new = fxforge.rewrite(fxforge.capture(model, (ids,)), "default")
    assert new.report.counts.get("attention") == 1, [m.reason for m in new.report.near_misses]
    with torch.no_grad():
        torch.testing.assert_close(new.graph_module(ids)[0], model(ids)[0], rtol=1e-4, atol=1e-5)


def test_soft_capped_scores_are_refused_with_the_reason():
    class SoftCapped(nn.Module):
        def forward(self, q, k, v):
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            scores = torch.tanh(scores / 50.0) * 50.0
            return torch.softmax(scores, -1) @ v

    inputs = tuple(torch.randn(1, 2, 6, 8) for _ in range(3))
    new = fxforge.rewrite(fxforge.capture(SoftCapped().eval(), inputs), "default")
    assert "attention" not in new.report.counts
    reasons = [m.reason for m in new.report.near_misses if m.rule == "attention"]
    assert any("soft-capped" in r and "no soft cap" in r for r in reasons), reasons
