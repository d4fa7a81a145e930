"""Reduced precision on a GPU (issue 51): bf16, fp16 and int8 plans of CUDA models against eager float32 on fresh
inputs, int8's cuBLAS product where it runs and float32 where it cannot. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from fxforge.core.accuracy import Tolerance, agreement
from fxforge.lowering.int8_ops import int_mm_runs, linear_int8, weight_int8, weight_scale

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Block(nn.Module):
    """A transformer MLP with a residual, the layer int8 and bf16 reduce."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.down(F.gelu(self.up(x))))


class ConvHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 32, 3, padding=1), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).mean((2, 3)))


def test_int8_linear_runs_cublas_where_it_can_and_float32_where_it_cannot():
    torch.manual_seed(0)
    w = torch.randn(64, 128, device="cuda")
    wq, ws = weight_int8(w), weight_scale(w)
    many, few = torch.randn(32, 128, device="cuda"), torch.randn(8, 128, device="cuda")
    assert int_mm_runs(many, wq) and not int_mm_runs(few, wq)
    assert not int_mm_runs(torch.randn(32, 100, device="cuda"), torch.zeros(64, 100, dtype=torch.int8))
    y = linear_int8(many, wq, ws, None)
    assert y.device.type == "cuda" and y.dtype == torch.float32
    exact = F.linear(many, w)
    assert float((y - exact).abs().max() / exact.abs().max()) < 0.02
    dequantized = F.linear(few, wq.float() * ws[:, None])
    torch.testing.assert_close(linear_int8(few, wq, ws, None), dequantized)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "int8", "auto"])
def test_a_cuda_plan_in_reduced_precision_answers_within_the_tolerance_on_fresh_inputs(precision):
    torch.manual_seed(0)
    model = Block().cuda().eval()
    x = torch.randn(8, 64, 256, device="cuda")
    plan = fxforge.optimize(model, (x,), precision=precision)
    assert any(note.startswith("precision ") for note in plan.report.notes), plan.report.notes
    for shape in [(8, 64, 256), (4, 96, 256)]:
        fresh = torch.randn(shape, device="cuda")
        with torch.no_grad():
            found = agreement([model(fresh)], [plan(fresh)])
        assert Tolerance().refusal(found) is None, (precision, found)


def test_int8_on_a_gpu_leaves_the_convolutions_in_float32():
    torch.manual_seed(0)
    model = ConvHead().cuda().eval()
    x = torch.randn(32, 3, 16, 16, device="cuda")
    # (top-1 not held: a random 16-way head's near-tied rows would refuse any rounding; the choice of layers is
    # what this checks)
    plan = fxforge.optimize(model, (x,), precision="int8", tolerance={"top1": None})
    layers = {t.subject: t.choice for t in plan.report.tuning if t.rule == "precision" and t.subject != "graph"}
    assert "int8" in layers.values(), layers  # (the linear head)
    assert not any("conv" in name for name in layers), layers
    with torch.no_grad():
        fresh = torch.randn(32, 3, 16, 16, device="cuda")
        assert Tolerance(top1=None).refusal(agreement([model(fresh)], [plan(fresh)])) is None
