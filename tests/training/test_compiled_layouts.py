"""fxforge.optimize(model.train(), inputs, memory_budget=..., target="inductor") on convolution and ViT models: the
plan's compiled graphs keep eager's batch-norm statistics and gradients, the plan's choices under Inductor's
decompositions, and Inductor's layout optimization only where the checked step fits with it (issue 22). The
GPT-2 tests are in test_compiled.py (split in two files so that ``--dist loadfile`` spreads them over workers)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fxforge
from fxforge.core.costs import Machine, is_pointwise
from fxforge.training import CheckpointedModule, checkpointing
from fxforge.training import module as training_module
from tests.training.models import conv_bn, images, vit
from tests.training.test_compiled import RTOL, _close_step


@pytest.fixture(scope="module")
def checked_conv_bn():
    """One checked plan of a conv / batch-norm stack under 85 %, compiled (with layout optimization), its eager
    twin, and Inductor's ``layout_optimization`` at each graph the optimize compiled. The tests that use it
    run each input through both alike, so their batch-norm statistics stay comparable. SiLU, not ReLU:
    channels-last kernels round differently, and a ReLU whose input lies within that rounding of zero lets a
    whole gradient through or not (on this stack a weight perturbed by 1e-6 moves eager's own gradients by
    5e-3, as layout optimization does, in torch.compile too)."""
    model = conv_bn(activation=torch.nn.SiLU)
    eager = copy.deepcopy(model)
    with pytest.MonkeyPatch.context() as patch:
        seen = _layouts_compiled_with(patch)
        compiled = fxforge.optimize(model, (images(0, batch=8),), memory_budget="85%", target="inductor")
    return model, eager, compiled, list(seen)


def test_batch_norm_statistics_and_gradients_follow_eager(checked_conv_bn):
    model, eager, compiled, _ = checked_conv_bn
    assert compiled.plan.recomputed
    for seed in (5, 6):
        _close_step(compiled, eager, images(seed, batch=8), 0)
    for (name, got), want in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6, msg=name)


def test_a_checked_plan_compiles_with_layout_optimization(checked_conv_bn):
    """Channels-last convolutions hold copies the plan does not simulate: a plan whose step the check measures
    compiles with them, and fits (its outputs, gradients and statistics are eager's:
    :func:`test_batch_norm_statistics_and_gradients_follow_eager`)."""
    _, _, checked, seen = checked_conv_bn
    assert checked.layout_optimization and checked.plan.layout_optimization
    assert seen and all(seen)
    assert "layout optimization on" in str(checked.plan)
    assert checked.plan.measured_bytes <= checked.plan.budget_bytes


def test_the_forward_saves_the_parameters_not_channels_last_copies_and_keeps_eagers_strides(checked_conv_bn):
    """Under layout optimization Inductor would hand the backward a channels-last copy of every convolution
    weight (and of the input), held from the forward to the backward beside the plan's saved values; fxforge
    has it save the parameters themselves (the backward converts each right before its use). Outputs and
    gradients keep eager's strides."""
    model, eager, compiled, _ = checked_conv_bn
    assert compiled.layout_optimization
    x = images(4, batch=8)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = compiled(x)
    weights = {p.data_ptr() for n, p in model.named_parameters() if p.dim() == 4}
    saved_weights = [t for t in packed if t.dim() == 4 and t.shape[0] == 16 and t.shape[2:] == (3, 3)]
    assert saved_weights and {t.data_ptr() for t in saved_weights} <= weights
    assert out.stride() == eager(x).stride()  # both forwards on x: their statistics move alike
    model.zero_grad(set_to_none=True)
    out.float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad.stride() == p.stride(), name


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
    model, x = vit(layers=1), images(0, batch=8)
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

    # 100 % of the model's own activations: the decomposed step holds more and recomputes to fit. Unchecked:
    # the trace is what failed, and the check would measure the plan and may plan and compile it again.
    program = (
        "import torch, fxforge\n"
        "m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),\n"
        "                        torch.nn.Flatten(), torch.nn.Linear(8 * 7 * 7, 2)).train()\n"
        "o = fxforge.optimize(m, (torch.randn(2, 3, 16, 16),), memory_budget='100%', target='inductor',\n"
        "                     check=False)\n"
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


def test_an_unchecked_plan_compiles_without_layout_optimization(monkeypatch):
    """Channels-last convolutions hold copies the plan does not simulate: a plan whose step the check does not
    measure compiles without them (the checked one with them: :func:`checked_conv_bn`)."""
    seen = _layouts_compiled_with(monkeypatch)
    unchecked = fxforge.optimize(conv_bn(), (images(0, batch=8),), memory_budget="70%", target="inductor",
                                 check=False)
    assert unchecked.plan.layout_optimization is False and "layout optimization off" in str(unchecked.plan)
    assert seen and not any(seen)
    native = fxforge.optimize(conv_bn(), (images(0, batch=8),), memory_budget="70%", check=False)
    assert native.plan.layout_optimization is None


def test_where_no_plan_fits_with_layout_optimization_the_step_is_planned_without_it(monkeypatch):
    """Here the step measures a budget's worth over whenever it is compiled with layout optimization: no plan
    made again with that kept back fits, and the step is planned, compiled and checked again without it, and
    fits with no warning."""
    seen = _layouts_compiled_with(monkeypatch)
    measure = CheckpointedModule._measure

    def over_with_layouts(self, *args):
        over = measure(self, *args)
        if not self.layout_optimization:
            return over
        self.plan.measured_bytes += self.plan.budget_bytes
        return over + self.plan.budget_bytes

    monkeypatch.setattr(CheckpointedModule, "_measure", over_with_layouts)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fxforge")
        # 85 %: without layout optimization this stack's convolutions hold 1 MiB of scratch beyond the plan
        # (the check plans again with it kept back), which at 70 % leaves no plan that fits.
        compiled = fxforge.optimize(conv_bn(), (images(0, batch=8),), memory_budget="85%", target="inductor")
    assert not compiled.layout_optimization and compiled.plan.layout_optimization is False
    assert True in seen and seen[-1] is False
    assert compiled.plan.measured_bytes <= compiled.plan.budget_bytes


def test_where_neither_layout_fits_the_closer_plan_is_kept(monkeypatch):
    """Here every step measures over its budget, 1 KiB with layout optimization and a budget's worth without:
    the layout-optimized plan, the closer, is kept (with the warning that says it is over). One plan for each
    layout: the plans made again after a step over its budget are test_module.py's."""
    seen = _layouts_compiled_with(monkeypatch)
    monkeypatch.setattr(training_module, "CHECK_REPLANS", 0)
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
    assert compiled.plan.compile_record["convolutions"] > 0
    eager = conv_bn(activation=torch.nn.SiLU)
    _close_step(compiled, eager, images(3, batch=8), 0)


def test_a_step_without_convolutions_is_not_planned_again_without_layout_optimization(monkeypatch):
    """Inductor's layout optimization lays out convolutions only: where a conv-free step measures over its budget
    with it, the same graphs without it would measure the same, so nothing is compiled a second time (the first
    build of a GPT-2 step took twice as long)."""
    seen = _layouts_compiled_with(monkeypatch)
    monkeypatch.setattr(training_module, "CHECK_REPLANS", 0)
    measure = CheckpointedModule._measure
    monkeypatch.setattr(CheckpointedModule, "_measure", lambda self, *args: max(measure(self, *args), 0) + 1024)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.GELU()))).train()
    eager = copy.deepcopy(mlp)
    x = torch.randn(32, 64)
    with pytest.warns(UserWarning, match="over its budget"):
        compiled = fxforge.optimize(mlp, (x,), memory_budget="85%", target="inductor")
    assert compiled.plan.compile_record["convolutions"] == 0
    assert seen and set(seen) == {True} and compiled.layout_optimization
    compiled(x).sum().backward()
    eager(x).sum().backward()
    for (name, p), q in zip(mlp.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
