"""The differential fuzz suite for budgeted checkpointing (issue 22): random conv programs in training mode,
optimized under a random memory budget, take eager's step: outputs, input and parameter gradients, and
BatchNorm statistics; and the plan they run fits its budget by simulation.

``make test`` runs the ``short`` profile; ``make fuzz`` runs ``long`` (``FXFORGE_FUZZ=long``).
"""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

import fxforge
from fxforge.training import BudgetError
from tests.fuzz.programs import conv_nets


def _step(module, x, seed):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)  # dropout draws the same masks in both
    out = module(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n.removeprefix("model."): p.grad for n, p in module.named_parameters()}


# (Programs eager cannot train and budgets below what recomputation reaches are filtered by design: many
# draws may be, which Hypothesis's health check would count against the test.)
@settings(suppress_health_check=[*settings().suppress_health_check, HealthCheck.filter_too_much])
@given(program=conv_nets(), fraction=st.sampled_from([0.6, 0.75, 0.9]), seed=st.integers(0, 2**16))
def test_a_checkpointed_step_is_eagers(program, fraction, seed):
    model, shape = program
    model.mutate_input = False  # an input changed in place is the suite's other property's business
    model.train()
    eager = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()  # the step in float64: how far float32 rounding takes eager's gradients
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    try:
        copy.deepcopy(model)(x)
    except ValueError as error:  # BatchNorm over one value per channel: not a program eager can train
        note(str(error))
        assume(False)
    try:
        # The plan as simulated (check=False): the numbers of its step are the property here; the check that
        # measures a plan and plans again is tests/training/test_module.py's.
        optimized = fxforge.optimize(model, (x,), memory_budget=fraction, check=False)
    except BudgetError as error:
        note(str(error))
        assume(False)  # a budget below what recomputation reaches is refused, with the reason: no step to check
    plan = optimized.plan
    note(str(plan))
    assert plan.predicted_activation_peak_bytes <= plan.budget_bytes
    fresh = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))
    got, got_input_grad, got_grads = _step(optimized, fresh, seed)
    want, want_input_grad, want_grads = _step(eager, fresh, seed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_input_grad, want_input_grad, rtol=1e-4, atol=1e-5)
    assert set(got_grads) == set(want_grads)
    exact_grads = None
    for name, grad in got_grads.items():
        if want_grads[name] is None:
            assert grad is None or not grad.any(), name
            continue
        try:
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=name)
        except AssertionError:
            # A gradient that is zero but for rounding (a BatchNorm's bias before another BatchNorm, which takes
            # out the mean of what flows back), or a sum whose terms cancel to a thousandth of their size (a
            # scale after BatchNorm and tanh: -3.2e-4 from terms near 1), differs by rounding alone: within a
            # few times eager's own error, or 1e-4 of the step's largest gradient (a fresh-clone run met a
            # checkpointed scale's gradient 1.6e-5 from float64 where eager's was 4.3e-7, the step's largest
            # gradient near 1)
            if exact_grads is None:
                exact_grads = _step(exact, fresh.double(), seed)[2]
            scale = max(float(g.abs().max()) for g in exact_grads.values() if g is not None)
            noise = float((want_grads[name].double() - exact_grads[name]).abs().max())
            error = float((grad.double() - exact_grads[name]).abs().max())
            assert error <= max(4 * noise, 1e-5, 1e-4 * scale), (
                f"{name}: error {error:.3g} against float64, eager's {noise:.3g}, the step's largest gradient "
                f"{scale:.3g}")
    for got_buffer, want_buffer in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(got_buffer, want_buffer, rtol=1e-5, atol=1e-6)
