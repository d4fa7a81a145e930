"""SDPA calls given eager's inputs: a causal mask becomes is_causal, an all-true one goes, repeated K/V become
enable_gqa (issue 22: the training step is planned and predicted on what eager runs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fxforge
from fxforge.core.shapes import annotate
from fxforge.rewrites.attention.sdpa_calls import simplify_sdpa_calls
from tests.training.models import ids, llama


def _traced(module, *inputs):
    gm = torch.fx.symbolic_trace(module)
    annotate(gm, inputs, {})
    return gm


def _sdpa(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.scaled_dot_product_attention]


MIN = torch.finfo(torch.float32).min


class Masked(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v):
        i = torch.arange(q.size(-2))
        if self.kind == "causal":
            keep = i[None, :] <= i[:, None]
        elif self.kind == "strict":  # key < query: not SDPA's causal (the diagonal is hidden too)
            keep = (i[None, :] < i[:, None]) | (i[:, None] == 0)
        else:  # "everywhere": q_idx >= 0 spread over the keys
            keep = (i[:, None] >= 0) & (i[None, :] >= 0)
        additive = torch.where(keep, 0.0, MIN)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive if self.kind != "bool" else keep)


def test_a_causal_mask_becomes_is_causal_with_the_same_numbers():
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    gm = _traced(Masked("causal"), q, k, v)
    want = gm(q, k, v)
    assert len(simplify_sdpa_calls(gm)) == 1
    (node,) = _sdpa(gm)
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None
    got = gm(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    want_grads = torch.autograd.grad(_traced(Masked("causal"), q, k, v)(q, k, v).sum(), (q, k, v))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_mask_true_everywhere_is_dropped_and_others_are_kept():
    q = torch.randn(1, 2, 8, 16)
    gm = _traced(Masked("everywhere"), q, q, q)
    want = gm(q, q, q)
    assert "mask true everywhere dropped" in simplify_sdpa_calls(gm)[0]
    torch.testing.assert_close(gm(q, q, q), want)
    strict = _traced(Masked("strict"), q, q, q)
    assert simplify_sdpa_calls(strict) == []  # key < query is not SDPA's causal triangle
    torch.testing.assert_close(strict(q, q, q), Masked("strict")(q, q, q))


def test_a_padding_mask_from_the_inputs_is_left_alone():
    def attend(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])

    q = torch.randn(2, 2, 8, 16)
    keep = torch.rand(2, 8) > 0.3
    gm = _traced(attend, q, q, q, keep)
    assert simplify_sdpa_calls(gm) == []


def test_repeated_keys_and_values_become_enable_gqa():
    def attend(q, k, v):
        b, h, s, d = k.shape
        k = k[:, :, None].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)
        v = v[:, :, None].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    gm = _traced(attend, q, kv, kv)
    want = gm(q, kv, kv)
    (change,) = simplify_sdpa_calls(gm)
    assert "enable_gqa=True (2 query heads per kv head)" in change
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "expand"]
    torch.testing.assert_close(gm(q, kv, kv), want)


def test_llama_captured_calls_sdpa_as_eager_does():
    model = llama()
    gm = fxforge.capture(model, (ids(0),)).graph_module
    changes = simplify_sdpa_calls(gm)
    assert len(changes) == 2 and all("is_causal=True" in c and "enable_gqa" in c for c in changes)
    torch.testing.assert_close(gm(ids(1)).logits, model(ids(1)).logits, rtol=1e-5, atol=1e-5)
