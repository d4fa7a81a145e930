"""OptimizedModule: shared state, one graph per signature, training equal to eager, eager fallback."""

import copy
import warnings

import pytest
import torch
from torch import nn

import fxforge
from fxforge.runtime.plans import FallbackWarning


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(x.mean((2, 3)))


class Gated(nn.Module):
    """Data-dependent control flow in the root: neither fx nor export can capture it."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return -x


def test_state_dict_keys_and_objects_are_the_models():
    model = ConvNet().eval()
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),))
    assert list(opt.state_dict()) == list(model.state_dict())
    assert opt.conv.weight is model.conv.weight
    assert dict(opt.named_parameters()).keys() == dict(model.named_parameters()).keys()
    # a checkpoint saved from either loads into the other
    fresh = ConvNet()
    fresh.load_state_dict(opt.state_dict())
    opt.load_state_dict(fresh.state_dict())


@pytest.mark.parametrize("dynamic", [None, False])
def test_new_batch_sizes_share_one_plan_or_recapture_with_dynamic_false(dynamic):
    model = ConvNet().eval()
    opt = fxforge.optimize(model, dynamic=dynamic)
    for batch in (1, 2, 1, 3):
        x = torch.randn(batch, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
    # None: batch 1's torch.fx plan, which serves batches 2 and 3 once checked against eager; False: one plan per
    # batch size
    assert opt.plans_built == len(opt.cache.plans) == (1 if dynamic is None else 3)
    assert opt.cache.plans_reused == (2 if dynamic is None else 0)
    assert {k: v for k, v in opt.report.counts.items() if k != "conv_activation"} == {"cleanup": 1, "conv_bn_fold": 1}


def test_training_mode_equals_eager_outputs_gradients_and_running_stats():
    torch.manual_seed(0)
    model = ConvNet().train()
    twin = copy.deepcopy(model)
    opt = fxforge.optimize(twin)
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(1)
    expected = model(x)
    expected.sum().backward()
    torch.manual_seed(1)
    actual = opt(x)
    actual.sum().backward()
    torch.testing.assert_close(actual, expected)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    torch.testing.assert_close(twin.bn.running_mean, model.bn.running_mean)
    torch.testing.assert_close(twin.bn.running_var, model.bn.running_var)
    assert int(twin.bn.num_batches_tracked) == int(model.bn.num_batches_tracked) == 1


def test_train_and_eval_get_their_own_graphs():
    model = ConvNet()
    opt = fxforge.optimize(model)
    x = torch.randn(2, 3, 8, 8)
    opt.train()
    opt(x)
    opt.eval()
    assert not model.training and not model.bn.training
    torch.testing.assert_close(opt(x), model(x))
    assert len(opt.cache.plans) == 2


def test_capture_failure_with_a_whole_graph_method_falls_back_to_eager_with_one_warning():
    opt = fxforge.optimize(Gated(), method="fx")  # one graph asked for: no dynamo
    x = torch.ones(3)
    with pytest.warns(FallbackWarning, match="running Gated eagerly for inputs \\(float32\\[3\\]\\)"):
        assert opt(x).tolist() == [2.0, 2.0, 2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt(-x).tolist() == [1.0, 1.0, 1.0]  # same signature: no second warning, still eager
    # the report says the model runs eagerly and why (it was None, so opt.report.counts raised)
    assert opt.report.method == "eager" and opt.report.counts == {}
    assert "running Gated eagerly for inputs (float32[3])" in opt.report.notes[0]


def test_capture_failure_with_method_auto_runs_the_graphs_between_breaks_without_a_warning():
    opt = fxforge.optimize(Gated())
    x = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt(x).tolist() == [2.0, 2.0, 2.0]
        assert opt(-x).tolist() == [1.0, 1.0, 1.0]
    assert opt.report.method == "dynamo" and opt.dynamo is not None
    assert [b.code for b in opt.report.breaks] == ["if x.sum() > 0:"]
    assert "captured through TorchDynamo" in opt.report.notes[0]


def test_loading_new_weights_clears_graphs():
    model = ConvNet().eval()
    opt = fxforge.optimize(model, (torch.randn(1, 3, 8, 8),))
    other = ConvNet().eval()
    opt.load_state_dict(other.state_dict())
    assert not opt.cache.plans
    x = torch.randn(1, 3, 8, 8)
    torch.testing.assert_close(opt(x), other(x))


def test_dtype_change_and_attribute_passthrough():
    model = ConvNet().eval()
    model.config = {"name": "convnet"}
    opt = fxforge.optimize(model)
    assert opt.config == {"name": "convnet"}
    opt.double()
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    assert opt(x).dtype == torch.float64 and model.conv.weight.dtype == torch.float64


def test_eval_graphs_follow_weights_changed_in_place_and_training_steps():
    """Folded and prepacked weights are snapshots: an in-place change or a training step re-optimizes."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    opt = fxforge.optimize(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model[0].weight.mul_(2)
        torch.testing.assert_close(opt(x), model(x))
    opt.train()
    opt(x * 3 + 1).sum().backward()  # BatchNorm's running statistics move
    opt.eval()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_the_runtime_runs_the_lowered_graph_autotune_timed():
    from fxforge.lowering import lower as lowering
    from fxforge.lowering.autotune import TuningPolicy

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 12, 12)
    lowered = []
    lower = lowering.lower

    def spy(gm):
        lowered.append(lower(gm))
        return lowered[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("fxforge.lowering.autotune.lower", spy)  # what autotune lowers and times
        opt = fxforge.optimize(model, (x,), tuning=TuningPolicy(keep="fused", layout="channels-last", kernel="mkldnn"))
    assert opt.report.counts["conv_activation"] == 2
    executable = next(iter(opt.cache.plans.values())).executable
    assert any(executable is timed for timed in lowered)  # the runtime did not lower (and pack) it again
    assert not any(n.target is torch.ops.fxforge.conv_pointwise.default for n in executable.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
