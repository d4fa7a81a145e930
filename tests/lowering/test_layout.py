"""layout: channels-last conversions, and optimize with them raises no warning from fxforge's code."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxforge
from fxforge.core.shapes import annotate
from fxforge.lowering.autotune import TuningPolicy
from fxforge.lowering.layout import to_channels_last


@pytest.mark.parametrize("layout", ["channels-last", "as captured", None])
def test_optimize_conv_relu_raises_no_warning(layout):
    # The channels-last layout once passed ``Node.__ne__`` as a predicate: it answers NotImplemented, whose
    # truth value is deprecated (a TypeError in newer Pythons), so with warnings as errors the whole
    # conv_activation pass rolled back. Every warning is an error here, whatever module it names.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fxforge.optimize(model, (x,), tuning=TuningPolicy(keep="fused", kernel="mkldnn", layout=layout))
        with torch.no_grad():
            out = opt(x)
    assert opt.report.counts == {"conv_activation": 1}
    assert not opt.report.rolled_back
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)


def test_channels_last_conversion_keeps_its_own_input():
    conv = nn.Conv2d(3, 4, 1)
    gm = torch.fx.symbolic_trace(conv)
    x = torch.randn(1, 3, 4, 4)
    annotate(gm, (x,), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert to_channels_last(gm) == 2
    gm.recompile()
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    (convert,) = placeholder.users  # only the conversion reads the input; everything else reads the conversion
    assert convert.kwargs == {"memory_format": torch.channels_last} and len(convert.users) == 1
    out = gm(x)
    assert out.is_contiguous()
    torch.testing.assert_close(out, conv(x))
