"""fxforge.optimize(model.train(), inputs, memory_budget=..., target="inductor"): the plan's forward and backward
graphs compiled by Inductor keep the plan's saved values and give eager's outputs, gradients, dropout masks and
batch-norm statistics (to float rounding: Inductor's fused kernels are not bitwise eager's) (issue 22). Here GPT-2;
the convolution, ViT and layout-optimization tests are in test_compiled_layouts.py (two files, so that
``--dist loadfile`` spreads them over the workers)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import fxforge
from fxforge.training import CheckpointedModule
from tests.training.models import gpt2, ids

# Inductor reorders float arithmetic inside its fused kernels: float32 rounding, not bitwise equality.
RTOL, ATOL = 1e-5, 1e-5


def _step(module: torch.nn.Module, x: torch.Tensor, seed: int):
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = module(x)
    logits = out.logits if hasattr(out, "logits") else out
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n.removeprefix("model."): p.grad for n, p in module.named_parameters()
                             if p.grad is not None}


def _close_step(compiled, eager, x, seed):
    got, got_grads = _step(compiled, x, seed)
    want, want_grads = _step(eager, x, seed)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert set(got_grads) == set(want_grads)
    # Against the largest gradient: a conv bias before a batch norm has a gradient of float noise only.
    scale = max(float(g.abs().max()) for g in want_grads.values())
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=ATOL * scale, msg=name)


def _saved(module: torch.nn.Module, x: torch.Tensor) -> Counter:
    """(shape, dtype) of every tensor the forward saves for the backward (autograd's pack hook sees them)."""
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        module(x)
    return Counter((tuple(t.shape), t.dtype) for t in packed)


@pytest.fixture(scope="module")
def gpt2_inductor():
    model = gpt2(dropout=0.1, layers=1)
    eager = copy.deepcopy(model)
    compiled = fxforge.optimize(model, (ids(0),), memory_budget="80%", target="inductor")
    return model, eager, compiled


def test_outputs_gradients_and_dropout_are_eagers_on_fresh_inputs(gpt2_inductor):
    _, eager, compiled = gpt2_inductor
    assert isinstance(compiled, CheckpointedModule) and compiled.target == "inductor"
    assert compiled.plan.recomputed
    for seed in (1, 2):  # dropout draws eager's masks for a seed (a different mask would differ by O(1))
        _close_step(compiled, eager, ids(seed), seed)


def test_the_forward_saves_the_plans_values(gpt2_inductor):
    _, _, compiled = gpt2_inductor
    plan = compiled.plan
    want = Counter((tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in plan.step.saved_nodes())
    assert len(plan.saved) == sum(want.values())
    assert _saved(compiled, ids(3)) == want


def test_a_new_shape_plans_and_compiles_again(gpt2_inductor):
    _, eager, compiled = gpt2_inductor
    plans = compiled.plans
    _close_step(compiled, eager, ids(4, seq=48), 4)
    # Planned for the new shape (twice where its measured step gives recomputation back).
    planned = compiled.plans
    assert planned > plans
    _close_step(compiled, eager, ids(5), 5)  # the first signature's compiled step is kept
    assert compiled.plans == planned


def test_eval_mode_and_no_grad_run_the_model_itself(gpt2_inductor):
    model, _, compiled = gpt2_inductor

    def same(x):  # bitwise: the model's own eager ops run (dropout, in train mode, with the same seed)
        torch.manual_seed(0)
        got = compiled(x).logits
        torch.manual_seed(0)
        return torch.equal(got, model(x).logits)

    plans = compiled.plans
    with torch.no_grad():
        assert same(ids(6, seq=40))
    compiled.eval()
    try:
        assert not model.training
        assert same(ids(7, seq=40))
    finally:
        compiled.train()
    assert compiled.plans == plans  # nothing was planned nor compiled for these


def test_a_target_that_runs_no_training_step_is_refused():
    model = torch.nn.Linear(4, 4).train()
    for target in ("onnxruntime", "auto"):
        with pytest.raises(TypeError, match=f"target='{target}' does not run"):
            fxforge.optimize(model, (torch.randn(2, 4),), memory_budget="60%", target=target)
    step = fxforge.optimize(model, (torch.randn(2, 4),), memory_budget="100%", target="inductor", check=False)
    assert step.compiled and step.target == "inductor"


@pytest.mark.parametrize("onednn_wins", [True, False])
def test_matrix_products_run_on_onednn_only_where_it_measured_faster(monkeypatch, onednn_wins):
    from fxforge.lowering import gemm

    if not gemm.onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    timed = []
    monkeypatch.setattr(gemm, "time_product", lambda p: timed.append(p) or {"blas": 2.0,
                                                                           "onednn": 1.0 if onednn_wins else 3.0})
    model = gpt2(dropout=0.0, layers=1)
    eager = copy.deepcopy(model)
    # Unchecked: one plan, its two graphs compiled once (the check would measure it and may plan again).
    compiled = fxforge.optimize(model, (ids(0),), memory_budget="80%", target="inductor", check=False)
    _close_step(compiled, eager, ids(1), seed=1)  # the backward compiles here
    routed = compiled.plan.compile_record["onednn_matmuls"]
    assert timed  # the products of both graphs were measured
    assert (routed > 0) == onednn_wins
    assert f"matrix products on oneDNN (measured faster than BLAS here): {routed}" in compiled.plan.lines()
    _close_step(compiled, eager, ids(2), seed=2)


def test_the_op_by_op_runner_keeps_blas(monkeypatch):
    from fxforge.lowering import gemm

    monkeypatch.setattr(gemm, "time_product", lambda p: pytest.fail("the native target timed a product"))
    compiled = fxforge.optimize(gpt2(dropout=0.0), (ids(0),), memory_budget="60%")
    compiled(ids(1)).logits.sum().backward()
    assert compiled.plan.compile_record is None
    assert not any("oneDNN" in line for line in compiled.plan.lines())
