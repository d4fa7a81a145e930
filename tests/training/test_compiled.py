"""fxforge.optimize(model.train(), inputs, memory_budget=..., target="inductor"): the plan's forward and backward
graphs compiled by Inductor keep the plan's saved values and give eager's outputs, gradients, dropout masks and
batch-norm statistics (to float rounding: Inductor's fused kernels are not bitwise eager's) (issue 22)."""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch

import fxforge
from fxforge.core.costs import Machine, is_pointwise
from fxforge.training import CheckpointedModule, checkpointing
from tests.training.models import conv_bn, gpt2, ids, images, vit

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
    model = gpt2(dropout=0.1)
    eager = copy.deepcopy(model)
    compiled = fxforge.optimize(model, (ids(0),), memory_budget="60%", target="inductor")
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


def test_batch_norm_statistics_and_gradients_follow_eager():
    model = conv_bn()
    eager = copy.deepcopy(model)
    compiled = fxforge.optimize(model, (images(0, batch=8),), memory_budget="70%", target="inductor")
    assert compiled.plan.recomputed
    for seed in (5, 6):
        _close_step(compiled, eager, images(seed, batch=8), 0)
    for (name, got), want in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6, msg=name)


def test_a_target_that_runs_no_training_step_is_refused():
    model = torch.nn.Linear(4, 4).train()
    for target in ("onnxruntime", "auto"):
        with pytest.raises(TypeError, match=f"target='{target}' does not run"):
            fxforge.optimize(model, (torch.randn(2, 4),), memory_budget="60%", target=target)
    step = fxforge.optimize(model, (torch.randn(2, 4),), memory_budget="100%", target="inductor", check=False)
    assert step.compiled and step.target == "inductor"


def test_the_plan_saves_convolutions_and_recomputes_what_inductor_fuses(monkeypatch):
    """Traced with Inductor's decompositions, a batch norm is statistics plus elementwise ops: under a budget the
    plan keeps the convolutions' outputs and recomputes the normalization and the ReLU after them (costed at
    one write each, fused by Inductor), not a convolution."""
    # The costs are this class of machine's roofline, not one measured while another test worker was busy
    # (a halved bandwidth made a convolution look cheaper to recompute than its ReLU under ``-n 2``).
    machine = Machine("cpu", peak_gflops=225.0, bandwidth_gbs=47.0, measured_at="fixed for this test")
    monkeypatch.setattr(checkpointing, "measure_machine", lambda device=None, **_: machine)
    model = conv_bn(layers=6)
    # The plan as simulated: measured, the step holds a convolution backward's scratch beyond it, and the
    # check's plan for the budget less that recomputes convolutions too.
    compiled = fxforge.optimize(model, (images(0, batch=8),), memory_budget="70%", target="inductor",
                                check=False)
    plan = compiled.plan
    step = plan.step
    targets = {n.target for n in step.joint.graph.nodes if n.op == "call_function"}
    assert not any("batch_norm" in str(t) for t in targets)  # decomposed
    recomputed = [n for n in step.backward.graph.nodes if n.name in plan.recomputed]
    assert recomputed and plan.predicted_activation_peak_bytes <= plan.budget_bytes
    assert not [n.name for n in recomputed if n.target is torch.ops.aten.convolution.default]
    assert any(n.target is torch.ops.aten.relu.default and is_pointwise(n) for n in recomputed)
    assert torch.ops.aten.convolution.default in {n.target for n in step.saved_nodes()}


def test_a_fraction_is_of_the_models_own_activations_not_of_the_decomposed_step():
    """Traced with Inductor's decompositions, a ViT's step holds 10 % more unconstrained than the model's own
    (a layer norm's decomposition saves its intermediates). A fraction budget is of what the model holds, for
    either target: at "100 %" the compiled plan holds no more than eager does, where it recomputed nothing and
    held those 10 % more before."""
    model, x = vit(), images(0, batch=8)
    native = fxforge.optimize(model, (x,), memory_budget="100%", check=False).plan
    compiled = fxforge.optimize(model, (x,), memory_budget="100%", target="inductor", check=False).plan
    assert native.recomputed == []
    assert compiled.unconstrained_activation_bytes == native.unconstrained_activation_bytes == compiled.budget_bytes
    assert compiled.recomputed and compiled.predicted_activation_peak_bytes <= compiled.budget_bytes


def test_a_fresh_process_plans_a_model_with_max_pooling():
    """Inductor's max-pool decomposition asks its lowerings whether to apply; in a process that has compiled
    nothing yet they are not imported, and the trace failed (``torch._inductor`` has no ``lowering``)."""
    import subprocess
    import sys

    # 100 % of the model's own activations: the decomposed step holds more and recomputes to fit.
    program = (
        "import torch, fxforge\n"
        "m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),\n"
        "                        torch.nn.Flatten(), torch.nn.Linear(8 * 7 * 7, 2)).train()\n"
        "o = fxforge.optimize(m, (torch.randn(2, 3, 16, 16),), memory_budget='100%', target='inductor')\n"
        "print(type(o).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], check=False, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "CheckpointedModule"


def _layouts_compiled_with(monkeypatch) -> list[bool]:
    """Inductor's ``layout_optimization`` setting at each graph fxforge compiles."""
    from torch._inductor import compile_fx, config

    seen, inner = [], compile_fx.compile_fx_inner

    def recording(*args, **kwargs):
        seen.append(config.layout_optimization)
        return inner(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", recording)
    return seen


def test_a_checked_plan_compiles_with_layout_optimization_and_an_unchecked_one_without(monkeypatch):
    """Channels-last convolutions hold copies the plan does not simulate: only a plan whose step the check
    measures compiles with them (and still gives eager's outputs, gradients and statistics). SiLU, not ReLU:
    channels-last kernels round differently, and a ReLU whose input lies within that rounding of zero lets a
    whole gradient through or not (on this stack a weight perturbed by 1e-6 moves eager's own gradients by 5e-3,
    as layout optimization does, in torch.compile too)."""
    seen = _layouts_compiled_with(monkeypatch)
    model = conv_bn(activation=torch.nn.SiLU)
    eager = copy.deepcopy(model)
    checked = fxforge.optimize(model, (images(0, batch=8),), memory_budget="85%", target="inductor")
    assert checked.layout_optimization and checked.plan.layout_optimization
    assert seen and all(seen)
    assert "layout optimization on" in str(checked.plan)
    assert checked.plan.measured_bytes <= checked.plan.budget_bytes
    _close_step(checked, eager, images(3, batch=8), 0)
    for (name, got), want in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6, msg=name)

    seen.clear()
    unchecked = fxforge.optimize(conv_bn(), (images(0, batch=8),), memory_budget="70%", target="inductor",
                                 check=False)
    assert unchecked.plan.layout_optimization is False and "layout optimization off" in str(unchecked.plan)
    assert seen and not any(seen)
    native = fxforge.optimize(conv_bn(), (images(0, batch=8),), memory_budget="70%", check=False)
    assert native.plan.layout_optimization is None


def test_where_no_plan_fits_with_layout_optimization_the_step_is_planned_without_it(monkeypatch):
    """Here the step measures a budget's worth over whenever it is compiled with layout optimization: after the
    re-plans, the step is planned, compiled and checked again without it, and fits with no warning."""
    seen = _layouts_compiled_with(monkeypatch)
    measure = CheckpointedModule._measure

    def over_with_layouts(self, *args):
        over = measure(self, *args)
        return over + self.plan.budget_bytes if self.layout_optimization else over

    monkeypatch.setattr(CheckpointedModule, "_measure", over_with_layouts)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fxforge")
        # 85 %: without layout optimization this stack's convolutions hold 1 MiB of scratch beyond the plan
        # (the check plans again with it kept back), which at 70 % leaves no plan that fits.
        compiled = fxforge.optimize(conv_bn(), (images(0, batch=8),), memory_budget="85%", target="inductor")
    assert not compiled.layout_optimization and compiled.plan.layout_optimization is False
    assert True in seen and seen[-1] is False
    assert compiled.plan.measured_bytes <= compiled.plan.budget_bytes


def test_the_forward_saves_the_parameters_not_channels_last_copies_and_keeps_eagers_strides():
    """Under layout optimization Inductor would hand the backward a channels-last copy of every convolution
    weight (and of the input), held from the forward to the backward beside the plan's saved values; fxforge
    has it save the parameters themselves (the backward converts each right before its use). Outputs and
    gradients keep eager's strides."""
    model = conv_bn(activation=torch.nn.SiLU)
    eager = copy.deepcopy(model)
    compiled = fxforge.optimize(model, (images(0, batch=8),), memory_budget="100%", target="inductor")
    assert compiled.layout_optimization
    x = images(4, batch=8)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = compiled(x)
    weights = {p.data_ptr() for n, p in model.named_parameters() if p.dim() == 4}
    saved_weights = [t for t in packed if t.dim() == 4 and t.shape[0] == 16 and t.shape[2:] == (3, 3)]
    assert saved_weights and {t.data_ptr() for t in saved_weights} <= weights
    assert out.stride() == eager(x).stride()
    out.float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad.stride() == p.stride(), name


def test_where_neither_layout_fits_the_closer_plan_is_kept(monkeypatch):
    """Here every step measures over its budget, 1 KiB with layout optimization and a budget's worth without:
    the layout-optimized plan, the closer, is kept (with the warning that says it is over)."""
    seen = _layouts_compiled_with(monkeypatch)
    measure = CheckpointedModule._measure

    def always_over(self, *args):
        over = max(measure(self, *args), 0)
        return over + (1024 if self.layout_optimization else self.plan.budget_bytes)

    monkeypatch.setattr(CheckpointedModule, "_measure", always_over)
    with pytest.warns(UserWarning, match="over its budget"):
        compiled = fxforge.optimize(conv_bn(activation=torch.nn.SiLU), (images(0, batch=8),), memory_budget="85%",
                                    target="inductor")
    assert compiled.layout_optimization and compiled.plan.layout_optimization
    assert True in seen and False in seen
    eager = conv_bn(activation=torch.nn.SiLU)
    _close_step(compiled, eager, images(3, batch=8), 0)


@pytest.mark.parametrize("onednn_wins", [True, False])
def test_matrix_products_run_on_onednn_only_where_it_measured_faster(monkeypatch, onednn_wins):
    from fxforge.lowering import gemm

    if not gemm.onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    timed = []
    monkeypatch.setattr(gemm, "time_product", lambda p: timed.append(p) or {"blas": 2.0,
                                                                           "onednn": 1.0 if onednn_wins else 3.0})
    model = gpt2(dropout=0.0)
    eager = copy.deepcopy(model)
    compiled = fxforge.optimize(model, (ids(0),), memory_budget="60%", target="inductor")
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
