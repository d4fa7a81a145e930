"""Kernel choices per shape bucket: a shape-generic plan times its fused ops' kernels once per bucket of
sizes, on the first call there, runs what won, lists each choice in its report, and still answers as eager."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import fxforge
from fxforge.lowering import buckets
from fxforge.lowering.autotune import TuningPolicy
from fxforge.lowering.buckets import BucketedKernel, bucket_key
from fxforge.lowering.kernels import mkldnn_available
from fxforge.lowering.timing import time_interleaved


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU()).eval()  # two ops, one configuration


def _bucketed_nodes(opt) -> list:
    plan = opt.cache.last
    return [n for n in plan.executable.graph.nodes if isinstance(n.target, BucketedKernel)]


class _Timings:
    """Stands in for the timing: ``winner`` is fastest; counts the timings asked for, runs every kernel once."""

    def __init__(self, winner: str):
        self.winner, self.asked = winner, 0

    def __call__(self, calls, *args, **kwargs):
        self.asked += 1
        for call in calls.values():
            call()
        return {name: (1.0 if name == self.winner else 2.0) for name in calls}


@pytest.mark.skipif(not mkldnn_available(), reason="needs oneDNN: with one kernel there is nothing to choose")
@pytest.mark.parametrize("winner", ["composite", "mkldnn"])
def test_each_new_bucket_is_timed_once_reported_and_answers_as_eager(monkeypatch, winner):
    monkeypatch.setenv("FXFORGE_AUTOTUNE_CACHE", "0")
    model = _model()
    opt = fxforge.optimize(model, (torch.randn(4, 10, 16),), dynamic=True, tuning=TuningPolicy(keep="fused"))
    timings = _Timings(winner)
    monkeypatch.setattr(buckets, "time_interleaved", timings)
    with torch.no_grad():
        for shape, asked in [((4, 10, 16), 0), ((3, 11, 16), 0), ((8, 50, 16), 1), ((6, 70, 16), 1), ((2, 3, 16), 2)]:
            x = torch.randn(shape)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
            assert timings.asked == asked, shape  # the example's bucket (40 rows, 33..64) was chosen by autotune
        assert opt.plans_built == 1 and len(_bucketed_nodes(opt)) == 2
        lines = [str(t) for t in opt.report.tuning if "bucket" in t.subject]
        assert len(lines) == 2, lines  # 257..512 rows and 5..8 rows: one line each for both ops (one configuration)
        assert any("257..512" in line and f": {winner} (" in line for line in lines), lines
        assert all("and 1 more ops like it" in line for line in lines), lines
        # the weights change: the chosen kernel (a prepacked weight for oneDNN) follows them
        model[0].weight.data.mul_(-2)
        x = torch.randn(7, 60, 16)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_kernel_the_tuning_policy_sets_runs_at_every_size():
    model = _model()
    opt = fxforge.optimize(model, (torch.randn(4, 10, 16),), dynamic=True,
                           tuning=TuningPolicy(keep="fused", kernel="composite"))
    with torch.no_grad():
        x = torch.randn(9, 33, 16)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    assert _bucketed_nodes(opt) == [] and not any("bucket" in t.subject for t in opt.report.tuning)


def test_a_plan_for_one_shape_has_no_buckets():
    model = _model()
    opt = fxforge.optimize(model, (torch.randn(4, 10, 16),), dynamic=False, tuning=TuningPolicy(keep="fused"))
    with torch.no_grad():
        opt(torch.randn(4, 10, 16))
    assert _bucketed_nodes(opt) == []


def test_bucket_of_the_rows_in_the_dynamic_dims():
    assert bucket_key((4, 10, 16), (0, 1)) == bucket_key((2, 32, 16), (0, 1)) == 6  # 40 and 64 rows: 33..64
    assert bucket_key((4, 17, 16), (0, 1)) == 7 and bucket_key((1, 1, 16), (0, 1)) == 0


def test_timing_inside_a_call_stops_after_one_round_past_its_limit():
    ran = {"a": 0, "b": 0}

    def slow(name):
        def call():
            ran[name] += 1
            time.sleep(0.02)
        return call

    time_interleaved({"a": slow("a"), "b": slow("b")}, budget_s=10.0, limit_s=0.01)
    assert ran == {"a": 2, "b": 2}  # a warm-up and one timed round each, not MIN_REPS rounds
