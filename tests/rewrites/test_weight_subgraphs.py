"""Issue 50: values a graph computes from weights alone (LeViT's attention biases gathered from a table, BEiT's
interpolated bias) are computed once and again when a weight changes, never for calls that record gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxforge
from fxforge.rewrites import weight_subgraphs

WHAT = "computed from weights alone"


class TableBias(nn.Module):
    """LeViT's attention biases: a parameter table gathered by an index buffer on every call, then a bias scale."""

    def __init__(self, tokens: int = 6, heads: int = 2):
        super().__init__()
        self.table = nn.Parameter(torch.randn(heads, 2 * tokens))
        self.scale = nn.Parameter(torch.rand(heads) + 0.5)
        index = (torch.arange(tokens)[:, None] - torch.arange(tokens)[None, :]).abs()
        self.register_buffer("index", index)
        self.proj = nn.Linear(tokens, tokens)

    def forward(self, x):  # x: [B, heads, tokens, tokens]
        bias = self.table[:, self.index] * self.scale[:, None, None]
        return self.proj(torch.softmax(x + bias, -1))


def _folds(report) -> int:
    return sum(WHAT in m.what for m in report.matches)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_gathered_bias_is_folded_and_follows_every_change_of_its_weights(method):
    model = TableBias().eval()
    x = torch.randn(3, 2, 6, 6)
    opt = fxforge.optimize(model, (x,), method=method)
    assert _folds(opt.report) == 1, opt.report
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.table.add_(1.0)  # in place
        torch.testing.assert_close(opt(x), model(x))
        model.scale.data.mul_(3.0)  # through .data: the version stays
        torch.testing.assert_close(opt(x), model(x))
    model.table = nn.Parameter(torch.randn(2, 12))  # a new parameter
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_calls_that_record_gradients_compute_it_and_get_eagers_gradients():
    model = TableBias().eval()
    twin = TableBias().eval()
    twin.load_state_dict(model.state_dict())
    opt = fxforge.optimize(model, (torch.randn(3, 2, 6, 6),))
    x = torch.randn(3, 2, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt(x).sum().backward()
    twin(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_graph_for_autocast_calls_computes_it_per_call_as_eager_does():
    """Under autocast the value is eager's own computation in autocast's precision: no float32 copy is folded
    (verification would catch one by its dtype and roll the pass back; the pass does not try)."""
    from fxforge.core.plan import CallConditions
    from fxforge.lowering.build import rewrite

    model = TableBias().eval()
    x = torch.randn(3, 2, 6, 6)
    captured = fxforge.capture(model, (x,))
    under = rewrite(captured, ["weight_fold"], conditions=CallConditions(autocast=(("cpu", torch.bfloat16),)))
    assert _folds(under.report) == 0 and _folds(rewrite(captured, ["weight_fold"]).report) == 1
    assert not under.report.rolled_back, under.report.rolled_back  # refused, not folded in float32 and rolled back
    opt = fxforge.optimize(model, (x,))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        got, want = opt(x), model(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


class Left(nn.Module):
    """What stays per call: views of a weight alone, and a weight the forward writes into."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("steps", torch.zeros(4))

    def forward(self, x):
        self.steps.add_(1.0)
        return x @ self.weight.t() + self.steps


def test_views_of_a_weight_and_weights_written_into_are_left_per_call():
    model = Left().eval()
    gm = torch.fx.symbolic_trace(model)
    from fxforge.rewrites.passes import PassContext
    ctx = PassContext("weight_fold", training=False, method="fx")
    weight_subgraphs.fold_weight_subgraphs(gm, ctx)
    assert not ctx.matches


def test_a_value_larger_than_its_weights_and_the_limit_is_left_per_call(monkeypatch):
    monkeypatch.setattr(weight_subgraphs, "MAX_BYTES", 64)
    model = TableBias(tokens=8, heads=4).eval()  # the bias (1 KiB) outweighs table, scale and index (784 B)
    opt = fxforge.optimize(model, (torch.randn(1, 4, 8, 8),))
    assert _folds(opt.report) == 0
    monkeypatch.setattr(weight_subgraphs, "MAX_BYTES", 1024)
    assert _folds(fxforge.optimize(model, (torch.randn(1, 4, 8, 8),)).report) == 1


def test_in_default_after_attention_which_reads_masks_where_the_model_keeps_them():
    from fxforge.rewrites.registry import DEFAULT
    assert DEFAULT.index("attention") < DEFAULT.index("weight_fold") < DEFAULT.index("memory_reorder")
