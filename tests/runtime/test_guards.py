"""Guards: every change a user makes to the model after optimize is seen, and the next call answers as eager
does (issue 18). Each situation the issue lists has a test named after it; every comparison is against the
model itself on fresh inputs."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxforge
from fxforge.lowering.autotune import TuningPolicy
from fxforge.runtime.plans import MAX_REBUILDS, FallbackWarning


class Net(nn.Module):
    """conv -> BatchNorm -> relu (folded and fused), a float the forward reads, a mask buffer, dropout."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)
        self.temperature = 1.0
        self.register_buffer("mask", torch.ones(4))

    def forward(self, x):
        x = self.act(self.bn(self.conv(x)))
        x = self.drop(x.mean((2, 3)))
        return self.head(x) * self.mask / self.temperature


def trained_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    model = Net()
    with torch.no_grad():
        for _ in range(3):  # BatchNorm statistics of real activations
            model.train()(torch.randn(4, 3, 8, 8))
    return model.eval()


def fresh(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 8)


def same(opt: nn.Module, model: nn.Module, x: torch.Tensor | None = None) -> None:
    """Under no_grad (the inference plan), the optimized module answers as the model does."""
    x = fresh() if x is None else x
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.fixture
def pair():
    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    same(opt, model)
    assert opt.report.counts.get("conv_bn_fold") == 1  # the weights these tests change are folded
    return opt, model


# ------------------------------------------------------------------------------------- weights changed


def test_weight_scaled_through_data_is_seen(pair):
    opt, model = pair
    with torch.no_grad():
        model.conv.weight.data.mul_(2.0)  # no version-counter bump
    same(opt, model)


def test_bn_weight_scaled_through_data_is_seen(pair):
    opt, model = pair
    model.bn.weight.data.mul_(-1.5)
    same(opt, model)


def test_weight_data_assigned_is_seen(pair):
    opt, model = pair
    model.conv.weight.data = torch.randn_like(model.conv.weight)
    same(opt, model)


def test_parameter_reassigned_is_seen(pair):
    opt, model = pair
    model.conv.weight = nn.Parameter(torch.randn_like(model.conv.weight))
    same(opt, model)


def test_buffer_reassigned_is_seen(pair):
    opt, model = pair
    model.bn.running_var = torch.rand(8) + 0.5
    same(opt, model)


def test_mask_buffer_reassigned_is_seen(pair):
    opt, model = pair
    model.mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    same(opt, model)


def test_load_state_dict_with_assign_is_seen(pair):
    opt, model = pair
    other = trained_net(seed=1)
    model.load_state_dict(other.state_dict(), assign=True)  # the torch.load(mmap=True) flow
    same(opt, model)
    same(opt, other)


def test_load_state_dict_copy_is_seen(pair):
    opt, model = pair
    model.load_state_dict(trained_net(seed=2).state_dict())
    same(opt, model)


def test_vector_to_parameters_is_seen(pair):
    opt, model = pair
    vector = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vector * 0.5 + 0.1, model.parameters())
    same(opt, model)


def test_ema_update_through_data_is_seen(pair):
    opt, model = pair
    teacher = trained_net(seed=3)
    for _ in range(3):
        for p, q in zip(model.parameters(), teacher.parameters()):
            p.data.mul_(0.9).add_(q.data, alpha=0.1)
        same(opt, model)


def test_in_place_update_under_no_grad_is_seen(pair):
    opt, model = pair
    with torch.no_grad():
        model.bn.running_mean.add_(1.0)
        model.conv.bias.zero_()
    same(opt, model)


def test_a_weight_left_alone_is_not_recomputed(pair):
    opt, model = pair
    plan = opt.plan_for(fresh())
    folded = plan.derived.items[0].tensor.clone()
    model.head.weight.data.mul_(2.0)  # touched, but not a source of anything derived
    same(opt, model)
    assert torch.equal(plan.derived.items[0].tensor, folded)


def test_optimizer_step_in_eval_mode_is_seen():
    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt(fresh()).square().sum().backward()  # eval mode, grad on: eager's gradients
        optimizer.step()
        optimizer.zero_grad()
        same(opt, model)


# ------------------------------------------------------------------------------------- modes


def test_mc_dropout_inside_an_eval_model_drops():
    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    same(opt, model)
    model.drop.train()  # Monte-Carlo dropout: only the dropout layer in training mode
    x = fresh()
    with torch.no_grad():
        torch.manual_seed(7)
        expected = model(x)
        torch.manual_seed(7)
        actual = opt(x)
    torch.testing.assert_close(actual, expected)
    assert not torch.equal(actual, model.eval()(x).detach())


def test_bn_train_alone_uses_batch_statistics_and_updates_them():
    model, twin = trained_net(), trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    same(opt, model)
    model.bn.train()
    twin.bn.train()
    x = fresh(4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), twin(x))
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, twin.bn.running_var)
    model.bn.eval()
    twin.bn.eval()
    same(opt, twin)  # the folded weights follow the moved statistics


# ------------------------------------------------------------------------------------- Python state


def test_float_attribute_change_is_seen(pair):
    opt, model = pair
    model.temperature = 3.0
    same(opt, model)


def test_bn_eps_change_is_seen(pair):
    opt, model = pair
    model.bn.eps = 0.5
    same(opt, model)


def test_submodule_replaced_is_seen(pair):
    opt, model = pair
    model.act = nn.Tanh()
    same(opt, model)
    model.head = nn.Linear(8, 4)
    same(opt, model)


def test_a_model_that_sets_state_every_call_falls_back_with_one_warning():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls = self.calls + 1
            return self.linear(x) * self.calls

    model, twin = Counting().eval(), Counting().eval()
    twin.load_state_dict(model.state_dict())
    opt = fxforge.optimize(model)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(MAX_REBUILDS + 4):
            with torch.no_grad():
                torch.testing.assert_close(opt(x), twin(x))
    assert model.calls == twin.calls
    assert sum(issubclass(w.category, FallbackWarning) for w in caught) == 1


# ------------------------------------------------------------------------------------- hooks


def test_forward_hooks_on_the_root_fire():
    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    model.register_forward_hook(lambda m, args, out: seen.append("post") or out * 2)
    x = fresh()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    assert seen == ["pre", "post", "pre", "post"]


@pytest.mark.parametrize("where", ["conv", "bn", "act"])
def test_forward_hooks_on_folded_and_fused_modules_fire(where):
    """Grad-CAM and feature extraction: a hooked module stays a real module call, and the rest is optimized."""
    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    same(opt, model)
    features = []
    getattr(model, where).register_forward_hook(lambda m, args, out: features.append(out.detach().clone()))
    x = fresh()
    with torch.no_grad():
        actual = opt(x)
        expected = model(x)
    torch.testing.assert_close(actual, expected)
    assert len(features) == 2
    torch.testing.assert_close(features[0], features[1])


def test_a_hook_that_changes_the_output_of_a_block_is_kept():
    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    model.conv.register_forward_hook(lambda m, args, out: out * 0.0)
    same(opt, model)


def test_removing_a_hook_goes_back_to_the_optimized_plan():
    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    handle = model.bn.register_forward_hook(lambda m, args, out: out + 1)
    same(opt, model)
    handle.remove()
    same(opt, model)
    assert opt.report.counts.get("conv_bn_fold") == 1


def test_full_backward_hook_on_a_submodule_fires():
    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    grads = []
    model.head.register_full_backward_hook(lambda m, gin, gout: grads.append(gout[0].clone()))
    x = fresh()
    opt(x).sum().backward()
    model(x).sum().backward()
    assert len(grads) == 2
    torch.testing.assert_close(grads[0], grads[1])


def test_global_module_hooks_run_eagerly_with_a_warning():
    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    names = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: names.append(type(m).__name__))
    try:
        with pytest.warns(FallbackWarning, match="every module"):
            same(opt, model)
    finally:
        handle.remove()
    assert names.count("Conv2d") == 2
    same(opt, model)


# ------------------------------------------------------------------------------------- gradients


def test_eval_mode_with_grad_gives_every_parameter_eagers_gradient():
    """Frozen-BN fine-tuning, saliency, Fisher information: folded parameters still get their gradients."""
    model, twin = trained_net(), trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    x = fresh().requires_grad_()
    with pytest.warns(fxforge.runtime.plans.GradientsWarning, match="no_grad"):
        opt(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    twin(x2).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    torch.testing.assert_close(x.grad, x2.grad)


def test_double_backward_through_conv_and_relu():
    """A gradient penalty: the gradient of a gradient, as eager computes it."""
    model, twin = trained_net(), trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    x = fresh()
    for module in (opt, twin):
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(module(xi).sum(), xi, create_graph=True)
        g.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_first_call_under_inference_mode_then_a_grad_call():
    model, twin = trained_net(), trained_net()
    opt = fxforge.optimize(model)  # the plan is built on the first call
    x = fresh()
    with torch.inference_mode():
        torch.testing.assert_close(opt(x), twin(x))
    opt(x).sum().backward()
    twin(x).sum().backward()
    torch.testing.assert_close(model.conv.weight.grad, twin.conv.weight.grad)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), twin(x))


def test_parameters_made_under_inference_mode():
    with torch.inference_mode():
        model = trained_net()
    opt = fxforge.optimize(model)
    x = fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with torch.inference_mode():
            torch.testing.assert_close(opt(x), model(x))
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
    assert opt.report.counts.get("conv_bn_fold") == 1


# ------------------------------------------------------------------------------------- autocast


def as_close_as_eager(actual: torch.Tensor, expected: torch.Tensor, model: nn.Module, x: torch.Tensor) -> None:
    """Folding BatchNorm into a convolution rounds the folded weight to the low precision once, where eager
    rounds the convolution's output: both are low-precision computations of one function. The optimized
    result must be as close to the float64 result as eager's is (within 4x), not bit-identical."""
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
    eager_error = float((expected.double() - exact).abs().max())
    error = float((actual.double() - exact).abs().max())
    assert error <= 4 * eager_error + 1e-6, (error, eager_error)


@pytest.mark.parametrize("activation", [nn.ReLU, nn.SiLU])
@pytest.mark.parametrize("kernel", [None, "mkldnn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_gives_eagers_dtypes_and_values(dtype, kernel, activation):
    """The fused op's output is the model's: its dtype is autocast's choice for a convolution."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), activation())
    with torch.no_grad():
        model.train()(fresh(4))
    model.eval()
    tuning = TuningPolicy(kernel=kernel, keep="fused") if kernel else TuningPolicy()
    opt = fxforge.optimize(model, (fresh(),), tuning=tuning)  # the inference plan: fused kernels
    x = fresh()
    with torch.no_grad(), torch.autocast("cpu", dtype):
        actual, expected = opt(x), model(x)
    assert actual.dtype == expected.dtype == dtype
    as_close_as_eager(actual, expected, model, x)
    same(opt, model)  # and outside autocast, float32 again
    with torch.no_grad():
        assert opt(x).dtype == torch.float32


def test_autocast_with_the_mask_promotion_of_the_model():
    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    x = fresh()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        actual, expected = opt(x), model(x)
    assert actual.dtype == expected.dtype
    as_close_as_eager(actual, expected, model, x)


# ------------------------------------------------------------------------------------- decorated classes


def test_a_subclass_of_a_decorated_class_applies_its_forward_once():
    @fxforge.optimize
    class Base(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x)

    class Child(Base):
        def forward(self, x):
            return super().forward(x) + 1

    child = Child().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(child(x), child.linear(x) + 1)
        base = Base().eval()
        torch.testing.assert_close(base(x), base.linear(x))


# ------------------------------------------------------------------------------------- inputs changed in place


class HalvesItsInput(nn.Module):
    """Changes its input in place before a conv -> BatchNorm -> relu (folded, fused) reads it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x):
        x.mul_(0.5)
        return self.body(x)


@pytest.mark.parametrize("tuning", [TuningPolicy(), TuningPolicy(keep="fused", layout="channels-last", kernel="mkldnn")],
                         ids=["measured", "channels-last"])
@pytest.mark.parametrize("example", [True, False], ids=["example inputs", "first call"])
def test_an_input_changed_in_place_is_changed_once_where_eager_changes_it(example, tuning):
    torch.manual_seed(0)
    model = HalvesItsInput()
    with torch.no_grad():
        model.train()(fresh(4))
    model.eval()
    x = fresh()
    original = x.clone()
    opt = fxforge.optimize(model, (x,) if example else None, tuning=tuning)
    torch.testing.assert_close(x, original, rtol=0, atol=0)  # optimizing never runs the caller's tensor
    for _ in range(2):  # the first call (capturing when there was no example) and a planned one
        y = fresh()
        mine = y.clone()
        with torch.no_grad():
            out = opt(y)
            expected = model(mine)
        torch.testing.assert_close(y, mine, rtol=0, atol=0)  # halved once, in the caller's tensor
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- copies


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_of_an_optimized_module_is_an_independent_optimized_model(how, tmp_path):
    import pickle

    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    same(opt, model)
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(opt))
    else:
        torch.save(opt, tmp_path / "opt.pt")
        twin = torch.load(tmp_path / "opt.pt", weights_only=False)
    assert twin.original is not model and twin.conv.weight is twin.original.conv.weight
    same(twin, twin.original)
    with torch.no_grad():
        twin.original.conv.weight.mul_(-1.0)  # the copy's weights are its own
    same(twin, twin.original)
    same(opt, model)
    assert twin.report.counts.get("conv_bn_fold") == 1  # the copy is optimized too, on its first call


def test_a_copy_of_a_decorated_instance_plans_for_its_own_weights():
    @fxforge.optimize
    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

        def forward(self, x):
            return self.body(x)

    model = Small().eval()
    x = fresh()
    with torch.no_grad():
        model(x)
        twin = copy.deepcopy(model)
        twin.body[0].weight.mul_(2.0)
        torch.testing.assert_close(twin(x), twin.body(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x), model.body(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("edit", ["ema through .data", "scale through .data"])
def test_a_data_edit_reaches_a_prepacked_weight_that_is_not_folded(edit):
    """oneDNN's prepacked copy of a plain (unfolded) weight is remade after a ``.data`` edit, which leaves the
    weight's version as it was (found by the fuzz suite: channels-last, mkldnn, EMA)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.ReLU(), nn.Conv2d(4, 2, 1, bias=False)).eval()
    policy = TuningPolicy(keep="fused", layout="channels-last", kernel="mkldnn")
    opt = fxforge.optimize(model, (fresh(),), tuning=policy)
    same(opt, model)
    for p in model.parameters():
        if edit == "ema through .data":
            p.data.mul_(0.9).add_(torch.randn(p.shape), alpha=0.1)
        else:
            p.data.mul_(-2.0)
    same(opt, model)


def test_threads_calling_right_after_a_data_edit_all_see_it():
    """One thread notices a ``.data`` edit and recomputes the folded weights; the others wait for it instead
    of running the old ones (found by the fuzz suite's long profile: a threaded call after ``p.data.mul_``)."""
    import threading

    model = trained_net()
    opt = fxforge.optimize(model, (fresh(),))
    x = fresh()
    for round_ in range(12):
        with torch.no_grad():
            model.conv.weight.data.mul_(1.5 if round_ % 2 else 1 / 1.5)
            expected = model(x)
        start, results = threading.Barrier(4), [None] * 4

        def call(i: int, start: threading.Barrier = start, results: list = results) -> None:
            start.wait()
            with torch.no_grad():
                results[i] = opt(x)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for got in results:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def same_draws(opt: nn.Module, eager: nn.Module, x: torch.Tensor) -> None:
    """From one seed, the optimized call gives eager's output (dropout masks included) and leaves the
    generator where eager's call leaves it."""
    results = []
    for module in (opt, eager):
        with torch.no_grad():
            torch.manual_seed(5)
            results.append((module(x), torch.get_rng_state()))
    (got, after_optimized), (expected, after_eager) = results
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(after_optimized, after_eager)


@pytest.mark.parametrize("tuning", [TuningPolicy(), TuningPolicy(kernel="composite", keep="fused")],
                         ids=["measured", "composite"])
@pytest.mark.parametrize("example", [True, False], ids=["example inputs", "first call"])
def test_building_a_plan_leaves_the_callers_random_numbers_alone(example, tuning):
    """The call that builds a plan (here the first one after ``dropout.train()``) draws the dropout mask eager
    draws: capture and verification run the model with its dropout, and must not move the caller's RNG
    (found by the fuzz suite's long profile)."""
    model = trained_net()
    twin = copy.deepcopy(model)
    opt = fxforge.optimize(model, (fresh(),) if example else None, tuning=tuning)
    x = fresh()
    for module in (model, twin):
        module.drop.train()  # MC-dropout: a new plan, built by the next call
    same_draws(opt, twin, x)


def test_a_build_that_draws_random_numbers_leaves_the_callers_generator_alone():
    """Whatever a build draws (capture and checks run models with dropout; the fuzz suite found a model whose
    build moved the generator, so that call's dropout mask differed from eager's), the caller's generator
    is where eager would leave it."""
    from fxforge.lowering.build import plan_builder
    from fxforge.runtime.native import OptimizedModule

    model = trained_net()
    model.drop.train()
    real = plan_builder(model)

    def drawing_build(*args):
        torch.rand(100)
        return real(*args)

    opt = OptimizedModule(model, drawing_build)
    x = fresh()
    same_draws(opt, model, x)
