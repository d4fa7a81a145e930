"""Verification inputs keep masks and special values; differences beyond float32 tolerance are judged
against a float64 run: rounding is kept, error is not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxforge
from fxforge.core import verify
from fxforge.core.verify import Float64Reference, random_like, within_rounding


def test_random_inputs_keep_additive_masks_and_the_examples_special_values():
    neg_inf_mask = torch.tensor([[0.0, 0.0, float("-inf")]])
    finfo_mask = torch.tensor([[0.0, torch.finfo(torch.float32).min, 0.0]])
    large_negative = torch.tensor([[-1e9, 0.0, 0.0]])
    data = torch.tensor([1.0, float("nan"), -2.0, float("inf"), 0.5, 3.0])
    for seed in (1, 2):
        masks = random_like((neg_inf_mask, finfo_mask, large_negative), seed)
        assert all(torch.equal(m, e) for m, e in zip(masks, (neg_inf_mask, finfo_mask, large_negative)))
        drawn = random_like(data, seed)
        assert torch.isnan(drawn[1]) and torch.isposinf(drawn[3])
        others = drawn[[0, 2, 4, 5]]
        assert torch.isfinite(others).all() and not torch.equal(others, data[[0, 2, 4, 5]])


def test_within_rounding_keeps_rounding_and_refuses_a_real_error():
    torch.manual_seed(0)
    exact = torch.randn(1000, dtype=torch.float64)
    ref = (exact + torch.randn(1000, dtype=torch.float64) * 1e-6).float()
    rounding = (exact + torch.randn(1000, dtype=torch.float64) * 3e-6).float()
    assert within_rounding(ref, rounding, exact).ok
    assert not within_rounding(ref, (exact * 1.001).float(), exact).ok  # a 0.1 % error
    assert not within_rounding(ref, rounding, None).ok


def test_float64_reference_runs_a_copy_in_float64_and_leaves_the_graph_alone():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), nn.Tanh()))
    x = torch.randn(2, 3)
    exact = Float64Reference(gm, [((x,), {})])
    assert exact(0).dtype == torch.float64 and exact(0) is exact(0)
    torch.testing.assert_close(exact(0).float(), gm(x))
    assert all(p.dtype == torch.float32 for p in gm.parameters())


def _deep_conv_bn(blocks: int = 54, channels: int = 16) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(blocks) for m in (nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                                 nn.BatchNorm2d(channels), nn.ReLU())]
    model = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), *layers)
    with torch.no_grad():
        for _ in range(3):  # statistics of real activations
            model.train()(torch.randn(4, 3, 16, 16))
    return model.eval()


def test_fifty_folds_are_not_rolled_back_for_rounding_and_a_real_error_still_is(monkeypatch):
    model, x = _deep_conv_bn(), torch.randn(1, 3, 16, 16)
    # A float32 tolerance so tight that the folds' rounding alone exceeds it: only the float64 judge keeps them.
    monkeypatch.setitem(verify._TOLERANCES, torch.float32, (1e-9, 1e-9))
    cap = fxforge.capture(model, (x,))
    new = fxforge.rewrite(cap, ["conv_bn_fold"])
    assert new.report.counts == {"conv_bn_fold": 54} and new.report.rolled_back == []
    assert any("by rounding only" in line for line in new.report.verified)

    def off_by_a_tenth_of_a_percent(gm, ctx):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(output):
            scaled = gm.graph.call_function(torch.mul, (output.args[0], 1.001))
        output.args = (scaled,)
        ctx.matched("output scaled by 1.001", [scaled])

    wrong = fxforge.rewrite(cap, ["conv_bn_fold", fxforge.Pass("wrong", off_by_a_tenth_of_a_percent)])
    assert [r.rule for r in wrong.report.rolled_back] == ["wrong"] and wrong.report.counts == {"conv_bn_fold": 54}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_random_inputs_of_gpu_tensors_are_on_the_gpu():
    example = torch.tensor([[0.5, float("nan"), 2.0]], device="cuda")
    fresh = random_like((example,), seed=1)[0]
    assert fresh.device == example.device and torch.isnan(fresh[0, 1]) and not torch.equal(fresh, example)


def test_float32_work_on_a_gpu_that_allows_tf32_is_judged_at_tf32s_rounding(monkeypatch):
    from fxforge.core.verify import TF32_SCALE, compare_outputs, tf32_scale

    matmul = torch.backends.cuda.matmul.allow_tf32  # a flag of torch's C++ side, set and put back by hand
    try:
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
        assert tf32_scale(torch.device("cpu")) == 1.0 and tf32_scale(torch.device("cuda")) == TF32_SCALE
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        torch.backends.cuda.matmul.allow_tf32 = False
        assert tf32_scale(torch.device("cuda")) == 1.0
        torch.backends.cuda.matmul.allow_tf32 = True
        assert tf32_scale(torch.device("cuda")) == TF32_SCALE
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
    reference = torch.ones(4)
    rounded = reference + 2e-4  # what ResNet-50's convolutions differ by under TF32 (an H200)
    assert not compare_outputs(reference, rounded).ok
    assert compare_outputs(reference, rounded, rtol_scale=TF32_SCALE).ok
    assert not compare_outputs(reference, reference + 0.1, rtol_scale=TF32_SCALE).ok  # a real error still is


def test_isolating_after_a_data_edit_puts_back_the_edited_values_not_an_older_copy():
    """A buffer edited through ``.data`` keeps its version; the snapshot taken before the edit must not be
    what a later block's restore writes back (through dynamo this undid a user's BatchNorm edit: error 0.6)."""
    holder = nn.Module().eval()  # (in eval mode a buffer is put back only where the block changed it)
    holder.register_buffer("stat", torch.zeros(3))
    with verify.isolated(holder):
        pass
    holder.stat.data.add_(1.0)
    with verify.isolated(holder):
        holder.stat.add_(5.0)
    assert holder.stat.tolist() == [1.0, 1.0, 1.0]
    holder.stat.data = torch.full((3,), 2.0)
    with verify.isolated(holder):
        holder.stat.mul_(0.0)
    assert holder.stat.tolist() == [2.0, 2.0, 2.0]


def test_isolating_restores_a_buffer_that_requires_grad():
    """Dynamo's host modules hold the model's parameters as buffers; fx's containers are in training mode, so
    they are always put back, and the copy into a tensor that requires grad must not record (it raised)."""
    holder = nn.Module()  # training mode: always restored
    holder.register_buffer("weight", torch.ones(3, requires_grad=True))
    with verify.isolated(holder), torch.no_grad():
        holder.weight.mul_(2.0)
    assert holder.weight.tolist() == [1.0, 1.0, 1.0] and holder.weight.requires_grad
