"""fxforge.optimize(model.train(), inputs, memory_budget=...): eager's outputs, gradients and statistics
under the budget, measured (issue 22)."""

from __future__ import annotations

import copy

import pytest
import torch

import fxforge
from fxforge.training import BudgetError, CheckpointedModule
from fxforge.training.measure import measure_step
from tests.training.models import gpt2, ids, images, llama, resnet


def _step(module: torch.nn.Module, x: torch.Tensor, seed: int):
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = module(x)
    logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def _same_step(optimized, eager, x, seed):
    got, got_grads = _step(optimized, x, seed)
    want, want_grads = _step(eager, x, seed)
    assert torch.equal(got, want)
    names = {n.removeprefix("model.") for n in got_grads}
    assert names == set(want_grads)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name.removeprefix("model.")], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2_dropout", "llama"])
def test_outputs_and_gradients_are_eagers_on_fresh_inputs(build):
    model = build()
    eager = copy.deepcopy(model)
    optimized = fxforge.optimize(model, (ids(0),), memory_budget="60%")
    assert isinstance(optimized, CheckpointedModule) and optimized.plan.recomputed
    for seed in (1, 2):  # dropout draws the same masks as eager for a seed
        _same_step(optimized, eager, ids(seed), seed)


def test_batch_norm_statistics_and_gradients_follow_eager():
    model = resnet()
    eager = copy.deepcopy(model)
    optimized = fxforge.optimize(model, (images(0, batch=8, size=64),), memory_budget="75%")
    assert optimized.plan.recomputed
    _same_step(optimized, eager, images(5, batch=8, size=64), 0)
    for (name, got), want in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


def test_the_measured_step_fits_the_plan():
    model = gpt2(dropout=0.0, layers=4)
    x = ids(0, seq=128)
    loss = lambda out: out.logits.pow(2).mean()
    eager = measure_step(model, (x,), {}, loss=loss, optimizer=torch.optim.AdamW)
    for budget in ("70%", "45%"):
        optimized = fxforge.optimize(model, (x,), memory_budget=budget, loss=loss)
        measured = measure_step(optimized, (x,), {}, loss=loss, optimizer=torch.optim.AdamW)
        plan = optimized.plan
        assert measured.peak_bytes <= plan.predicted_peak_bytes * 1.01, str(plan)
        activation_peak = max(measured.forward_peak_bytes, measured.backward_peak_bytes) - measured.persistent_bytes
        assert activation_peak - measured.gradient_bytes <= plan.budget_bytes
        assert measured.peak_bytes < eager.peak_bytes


def test_eval_mode_and_no_grad_run_the_model_itself():
    model = gpt2(dropout=0.0)
    optimized = fxforge.optimize(model, (ids(0),), memory_budget="70%")
    with torch.no_grad():
        torch.testing.assert_close(optimized(ids(1)).logits, model(ids(1)).logits)
    optimized.eval()
    assert not model.training
    torch.testing.assert_close(optimized(ids(2)).logits, model(ids(2)).logits)


def test_a_new_shape_and_a_replaced_parameter_plan_again():
    model = gpt2(dropout=0.0)
    eager = copy.deepcopy(model)
    optimized = fxforge.optimize(model, (ids(0),), memory_budget="70%")
    assert optimized.plans == 1
    _same_step(optimized, eager, ids(3, seq=48), 0)
    assert optimized.plans == 2
    with torch.no_grad():
        replacement = torch.nn.Parameter(model.lm_head.weight.clone() * 0.5)
    model.lm_head.weight = replacement
    eager.lm_head.weight = torch.nn.Parameter(replacement.detach().clone())
    eager.transformer.wte.weight = eager.lm_head.weight
    model.transformer.wte.weight = model.lm_head.weight
    _same_step(optimized, eager, ids(4), 0)
    assert optimized.plans == 3


def test_an_optimizer_stepping_the_parameters_is_seen():
    model = gpt2(dropout=0.0)
    eager = copy.deepcopy(model)
    optimized = fxforge.optimize(model, (ids(0),), memory_budget="70%")
    for module in (optimized, eager):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for seed in range(2):
            _step(module, ids(seed), seed)
            opt.step()
    _same_step(optimized, eager, ids(7), 0)


def test_usage_errors():
    model = gpt2(dropout=0.0)
    with pytest.raises(ValueError, match="eval mode"):
        fxforge.optimize(copy.deepcopy(model).eval(), (ids(0),), memory_budget="60%")
    with pytest.raises(TypeError, match="needs example_inputs"):
        fxforge.optimize(model, memory_budget="60%")
    with pytest.raises(TypeError, match="not target='onnxruntime'"):
        fxforge.optimize(model, (ids(0),), memory_budget="60%", target="onnxruntime")
    with pytest.raises(ValueError, match="memory_budget 'half'"):
        fxforge.optimize(model, (ids(0),), memory_budget="half")
    with pytest.raises(BudgetError, match="below what recomputation reached"):
        fxforge.optimize(model, (ids(0),), memory_budget="5%")


def test_a_signature_no_plan_fits_runs_eagerly_after_one_warning():
    model = gpt2(dropout=0.0)
    optimized = fxforge.optimize(model, (ids(0),), memory_budget="75%")
    optimized.memory_budget = "5%"  # as if these inputs could not be fitted
    with pytest.warns(UserWarning, match="no checkpointing plan fits these inputs"):
        out = optimized(ids(1, seq=16))
    torch.testing.assert_close(out.logits, model(ids(1, seq=16)).logits)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimized(ids(2, seq=16))  # the same signature: eager, no second warning
    assert optimized.plans == 1
