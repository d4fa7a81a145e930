"""Memory planning a user can act on (issue 48, item 4), through the API: an unreachable budget says the least
reachable one (and that one is reachable), a plan says its measured figure against its budget, recomputed work
is named by the user's modules and source lines, and a checkpointed step on user-style models is eager's."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import fxforge
from fxforge.training import BudgetError, plan_checkpointing

sys.path.insert(0, str(Path(__file__).parents[1] / "user_models"))
from hand_written import USER_MODELS


def _deep(width: int = 128, depth: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])


class Encoder(torch.nn.Module):
    """A model written with a ModuleDict of stages and functional activations (a style not in hand_written)."""

    def __init__(self, width: int = 64, depth: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleDict({f"stage{i}": torch.nn.Linear(width, width) for i in range(depth)})
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        for layer in self.layers.values():
            x = torch.sigmoid(layer(x)) * x
        return self.head(x)


def test_an_unreachable_budget_names_the_least_reachable_one_and_that_one_is_reachable():
    model, x = _deep().train(), torch.randn(256, 128)
    with pytest.raises(BudgetError) as caught:
        plan_checkpointing(model, (x,), "10%", optimizer=None, check=False)
    error = caught.value
    assert error.least_budget.endswith("%") and 10 < int(error.least_budget[:-1]) <= 100
    assert f"the least reachable budget is {error.least_budget}" in str(error)
    assert error.least_bytes < error.unconstrained_bytes
    plan = plan_checkpointing(model, (x,), error.least_budget, optimizer=None, check=False)
    assert plan.predicted_activation_peak_bytes <= plan.budget_bytes and plan.fits


def test_a_byte_budget_below_the_optimizer_step_names_that_step_as_the_least():
    with pytest.raises(BudgetError) as caught:
        plan_checkpointing(_deep().train(), (torch.randn(64, 128),), 1000)
    assert isinstance(caught.value.least_budget, int) and caught.value.least_budget > 1000
    assert "the least reachable budget is at least" in str(caught.value)


def test_the_plan_says_its_measured_figure_against_its_budget():
    plan = plan_checkpointing(_deep().train(), (torch.randn(256, 128),), "80%", optimizer=None)
    assert plan.measured_bytes is not None
    assert plan.over_budget_bytes == plan.measured_bytes - plan.budget_bytes
    assert plan.fits == (plan.over_budget_bytes <= 0)
    line = str(plan).splitlines()[-1]
    assert line.startswith("measured on one step: activation peak ")
    assert ("fits the budget of" in line) == plan.fits and ("OVER the budget of" in line) == (not plan.fits)
    unmeasured = plan_checkpointing(_deep().train(), (torch.randn(256, 128),), "80%", optimizer=None, check=False)
    assert unmeasured.over_budget_bytes is None and unmeasured.fits


@pytest.mark.parametrize("name, budget", [("unet", "70%"), ("gpt", "80%")])
def test_recomputed_work_is_named_by_the_users_modules_and_lines(name, budget):
    case = USER_MODELS[name]()
    model = case.model.train()
    plan = plan_checkpointing(model, case.inputs, budget, check=False)
    groups = plan.recomputed_by_module()
    assert groups, plan
    modules = set(dict(model.named_modules()))
    assert {module for module, _, _ in groups} <= modules
    assert any(module for module, _, _ in groups)  # named below the root
    lines = [line for _, sources, _ in groups for line in sources]
    assert lines and all("hand_written.py:" in line for line in lines), lines
    named = {node for _, _, nodes in groups for node in nodes}
    assert named <= set(plan.recomputed)
    assert not any(n.startswith(("detach", "t_", "view", "expand", "getitem")) or n == "t" for n in named)  # views


def test_module_names_in_a_model_dict_of_stages():
    model = Encoder().train()
    plan = plan_checkpointing(model, (torch.randn(512, 64),), "70%", optimizer=None, check=False)
    groups = plan.recomputed_by_module()
    assert groups and {m for m, _, _ in groups} <= set(dict(model.named_modules()))
    assert any(m.startswith("layers.stage") for m, _, _ in groups) or any(
        "test_actionable.py:" in line for _, lines, _ in groups for line in lines)


@pytest.mark.parametrize("name, budget", [("unet", "70%"), ("gpt", "80%"), ("lstm", "95%")])
def test_a_checkpointed_user_model_trains_as_eager(name, budget):
    """The step fxforge runs under a budget: the same outputs and parameter gradients as eager's (the U-Net's
    batch norms in train mode, the GPT's tied weights, the LSTM's fused kernel)."""
    case = USER_MODELS[name]()
    model = case.model.train()
    eager = copy.deepcopy(model)
    optimized = fxforge.optimize(model, case.inputs, memory_budget=budget)
    fresh = case.inputs
    got = optimized(*fresh)
    want = eager(*fresh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.float().pow(2).mean().backward()
    want.float().pow(2).mean().backward()
    grads = {n.removeprefix("model."): p.grad for n, p in optimized.named_parameters()}
    for n, p in eager.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
