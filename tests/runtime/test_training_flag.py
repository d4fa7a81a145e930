"""The optimized module's ``training`` flag is the model's (issue 50, "No state change unseen"): ``model.train()``
or ``model.eval()`` called on the model itself is seen by every module that stands for it (the native target's
optimized module, a decorated class, auto's eager module, the ONNX Runtime module that exports the model, a
checkpointed training step), and each answers as the model does in that mode."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fxforge
from fxforge.targets.auto import EagerModule
from fxforge.targets.onnxruntime import onnxruntime_module


class Net(nn.Module):
    """Dropout and BatchNorm: training mode changes the output and the running statistics."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.drop(self.bn(self.fc(x)).relu()))


def _net() -> Net:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.train()(torch.randn(16, 8))  # running statistics of real activations
    return model.eval()


def _same_in_both_modes(opt: nn.Module, model: nn.Module) -> None:
    """Against a copy of the model in the same mode, on fresh inputs, with the same random numbers: eval mode
    (exact), then training mode (dropout's masks and BatchNorm's batch statistics: eager's)."""
    twin = copy.deepcopy(model)
    for mode in (False, True):
        model.train(mode)
        twin.train(mode)
        assert opt.training is mode and all(m.training is mode for m in opt.modules())
        x = torch.randn(6, 8)
        with torch.no_grad():
            torch.manual_seed(1)
            actual = opt(x)
            torch.manual_seed(1)
            expected = twin(x)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean)


def test_model_train_on_the_original_is_seen_by_the_optimized_module():
    model = _net()
    opt = fxforge.optimize(model)
    with torch.no_grad():
        opt(torch.randn(6, 8))
    assert opt.training is False
    model.train()
    assert opt.training is True
    model.eval()
    assert opt.training is False
    _same_in_both_modes(opt, model)


def test_train_and_eval_on_the_optimized_module_still_set_the_model():
    model = _net()
    opt = fxforge.optimize(model)
    assert opt.train() is opt and model.training and model.drop.training
    assert opt.eval() is opt and not model.training and not model.drop.training
    opt.training = True  # as nn.Module allows: the flag itself (the model's, here)
    assert model.training and not model.drop.training


def test_a_copy_follows_its_own_model():
    model = _net()
    opt = copy.deepcopy(fxforge.optimize(model))
    opt.original.train()
    assert opt.training and not model.training


def test_a_decorated_class_is_the_model_itself():
    Fast = fxforge.optimize(Net)
    torch.manual_seed(0)
    model = Fast().eval()
    with torch.no_grad():
        model(torch.randn(6, 8))
    model.train()
    assert model.training and model.drop.training


def test_auto_eager_module_follows_the_model():
    model = _net()
    eager = EagerModule(model)
    model.train()
    assert eager.training is True
    model.eval()
    assert eager.training is False
    _same_in_both_modes(eager, model)


def test_onnxruntime_module_follows_the_model():
    model = _net()
    module = onnxruntime_module(model)
    model.train()
    assert module.training is True
    model.eval()
    assert module.training is False
    module.train()
    assert model.training and model.drop.training  # set through it, as on the optimized module
    model.eval()
    x = torch.randn(6, 8)
    with torch.no_grad():
        torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)


def test_checkpointed_step_follows_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)).train()
    x = torch.randn(4, 8)
    step = fxforge.optimize(model, (x,), memory_budget="100%")
    model.eval()  # the model itself: calls are plain forwards, as the model's are
    assert step.training is False
    with torch.no_grad():
        torch.testing.assert_close(step(x), model(x))
    model.train()
    assert step.training is True
    step.eval()
    assert not model.training and not model[0].training
