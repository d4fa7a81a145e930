"""Masks that can hold no -inf (fxforge.rewrites.attention.finite), and what the proof saves: the per-call
patch of rows hidden by -inf, never a difference from eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from fxforge.core.shapes import annotate
from fxforge.rewrites.attention.finite import never_infinite

MIN = torch.finfo(torch.float32).min


def _mask_node(fn, *inputs):
    gm = torch.fx.symbolic_trace(fn)
    annotate(gm, inputs, {})
    return gm.graph.output_node().args[0]


KEEP = torch.tensor([[True, True, False], [False, False, False]])


@pytest.mark.parametrize("fn, finite", [
    (lambda keep: torch.where(keep, 0.0, MIN)[:, None, None, :], True),
    (lambda keep: torch.zeros(keep.shape).masked_fill(~keep, MIN).unsqueeze(1).expand(2, 4, 3), True),
    (lambda keep: (1.0 - keep.to(torch.float32)) * MIN, False),  # a product: may overflow
    (lambda keep: torch.where(keep, 0.0, MIN) + torch.where(keep, 0.0, MIN), False),  # MIN + MIN = -inf
    (lambda keep: torch.zeros(keep.shape).masked_fill(~keep, float("-inf")), False),
    (lambda keep: torch.where(keep, 0.0, MIN).to(torch.float16), False),  # MIN overflows float16
    (lambda keep: torch.where(keep, 0.0, MIN).to(torch.float64), True),
    (lambda keep: keep.to(torch.float32), True),  # a cast of bools
    (lambda keep: keep.long().to(torch.float16), False),  # integers can pass float16's range
])
def test_finite_masks_are_read_from_how_they_are_built(fn, finite):
    assert never_infinite(_mask_node(fn, KEEP)) is finite


def test_a_mask_read_from_an_input_proves_nothing():
    assert never_infinite(_mask_node(lambda mask: mask[:, None, None, :], torch.zeros(2, 3))) is False


class PaddedAttention(nn.Module):
    """transformers' form: the padding mask arrives as 0/1 and becomes ``where(keep, 0, value)``."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, q, k, v, attention_mask):
        mask = torch.where(attention_mask.bool(), 0.0, self.value)[:, None, None, :]
        return F.softmax(q @ k.transpose(-1, -2) * q.size(-1) ** -0.5 + mask, dim=-1) @ v


def _call(seed: int, batch: int = 2):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, 2, 5, 8, generator=gen) for _ in range(3))
    mask = torch.ones(batch, 5, dtype=torch.long)
    mask[1] = 0  # every key of the second sequence hidden
    return q, k, v, mask


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("value, patched", [(MIN, False), (float("-inf"), True)])
def test_the_row_patch_is_left_out_only_where_no_row_can_differ(value, patched, method):
    model = PaddedAttention(value)
    example = _call(0)
    new = fxforge.rewrite(fxforge.capture(model, example, method=method), ["attention"])
    assert new.report.counts == {"attention": 1}, new.report.rolled_back
    assert ("rows with every key masked" in new.report.matches[0].what) is patched
    call = _call(7, batch=3)
    with torch.no_grad():
        eager, got = model(*call), new.graph_module(*call)
    assert eager[1].isnan().all() if patched else eager[1].isfinite().all()  # -inf: NaN rows; MIN: uniform
    torch.testing.assert_close(got, eager, equal_nan=True)


def test_a_query_row_with_an_infinity_is_nan_as_in_eager():
    model = PaddedAttention(MIN)
    new = fxforge.rewrite(fxforge.capture(model, _call(0)), ["attention"])
    q, k, v, mask = _call(3)
    q[0, 1, 2, 4] = float("inf")
    q[0, 0, 3, 0] = float("nan")
    with torch.no_grad():
        eager, got = model(q, k, v, mask), new.graph_module(q, k, v, mask)
    assert eager[0, 1, 2].isnan().all() and eager[0, 0, 3].isnan().all()
    torch.testing.assert_close(got, eager, equal_nan=True)
