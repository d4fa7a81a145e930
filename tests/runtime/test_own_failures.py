"""Issue 50: fxforge's own failures are bugs, never a fallback; any input layout gives the same answer.

A fallback to eager is for what the model cannot do (a capture the tracers refuse, a compiler that refuses
it). An exception inside fxforge's pipeline (verification, a pass's machinery, lowering) reaches the caller.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxforge
from fxforge.core.verify import random_like, with_special_values
from fxforge.runtime.fallbacks import FallbackWarning

LAYOUTS = {
    "channels_last": lambda x: x.contiguous(memory_format=torch.channels_last),
    "transposed": lambda x: x.transpose(2, 3).contiguous().transpose(2, 3),
    "sliced": lambda x: torch.cat([x, x], 3)[..., ::2],
    "expanded": lambda x: x[:1].expand_as(x),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_conv_relu_on_any_input_layout_is_optimized_without_a_fallback(layout):
    # the one line: channels-last input crashed verification, and optimize ran the model eagerly
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU()).eval()
    x = LAYOUTS[layout](torch.randn(2, 3, 12, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        opt = fxforge.optimize(model, (x,))
        with torch.no_grad():
            for fresh in (x, LAYOUTS[layout](torch.randn(2, 3, 12, 12)), torch.randn(2, 3, 12, 12)):
                torch.testing.assert_close(opt(fresh), model(fresh))
    assert opt.report.method != "eager" and not opt.report.rolled_back


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_verification_inputs_keep_the_examples_strides_and_take_a_nan(layout):
    x = LAYOUTS[layout](torch.randn(2, 3, 4, 5))
    (drawn,) = random_like((x,), seed=1)
    assert drawn.shape == x.shape and (drawn.stride() == x.stride() or layout in ("expanded", "sliced"))
    (special,) = with_special_values((x,))
    assert torch.isnan(special[0, 0, 0, 0]) and int(torch.isnan(special).sum()) == 1


def test_an_exception_inside_the_pipeline_reaches_the_caller(monkeypatch):
    from fxforge.lowering import build

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in lowering")

    monkeypatch.setattr(build, "make_plan", broken)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    opt = fxforge.optimize(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with pytest.raises(RuntimeError, match="a bug in lowering"), torch.no_grad():
            opt(torch.randn(1, 3, 8, 8))


def test_what_the_model_cannot_do_still_falls_back_with_a_warning():
    class Gated(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    opt = fxforge.optimize(Gated(), method="fx")
    with pytest.warns(FallbackWarning, match="eagerly"):
        assert opt(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]


def test_a_float_dynamo_passes_as_a_tensor_keeps_its_value_in_verification():
    # dynamo passes a module's float attribute (a dropout probability) to its graph as a 0-d tensor; verification
    # drew it at random (p = -0.6), the graph raised, and the model had run eagerly without a word
    class DropThenBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.drop, self.fc = nn.Conv2d(3, 4, 3), nn.Dropout(0.3), nn.Linear(4, 2)

        def forward(self, x):
            h = self.fc(self.drop(torch.relu(self.conv(x)).mean((2, 3))))
            return h * 2 if h.sum() > 0 else h - 1

    model, x = DropThenBranch().eval(), torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        opt = fxforge.optimize(model, (x,))
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
    assert opt.report.method == "dynamo"
    (kept,) = random_like((torch.tensor(0.3, dtype=torch.float64),), seed=2)
    assert kept.item() == 0.3
