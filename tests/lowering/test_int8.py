"""Int8 plans: the int8 ops against float32, the graph rewrite on users' models (its module, functional and
exported captures with changing weights are in ``test_precision.py``, beside bf16's), inputs beyond the
calibration, and ``precision="int8"``/``"auto"`` end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from fxforge.core.accuracy import Tolerance, agreement
from fxforge.lowering import int8_speed, precision_stage
from fxforge.lowering.int8 import Int8Reduction, int8_layers, quantize_layers
from fxforge.lowering.int8_ops import input_qparams, weight_int8, weight_scale
from fxforge.lowering.int8_ranges import observe_inputs
from fxforge.lowering.precision_choice import choose_layers
from tests.lowering.test_precision import MODELS, Cancelling, _model


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return agreement([want], [got]).relative_error


def _int8_linear(x, w, b=None):
    return torch.ops.fxforge.int8_linear(x, weight_int8(w), weight_scale(w), b)


def _int8_conv(x, w, b, low, high, stride=1, padding=1, dilation=1, groups=1, activation="none"):
    pair = lambda v: [v, v]
    return torch.ops.fxforge.int8_conv(x, weight_int8(w), weight_scale(w), b, pair(stride), pair(padding),
                                       pair(dilation), groups, *input_qparams(low, high), activation)


@pytest.mark.parametrize("shape", [(64, 96), (1, 96), (2, 5, 96), (3, 1, 1, 96)])
def test_int8_linear_is_close_to_float32_for_every_batch_shape(shape):
    torch.manual_seed(0)
    x, w, b = torch.randn(shape), torch.randn(48, 96), torch.randn(48)
    y = _int8_linear(x, w, b)
    assert y.shape == (*shape[:-1], 48) and y.dtype == torch.float32
    assert 0 < _relative(y, F.linear(x, w, b)) < 0.02


def test_int8_linear_rows_of_zeros_and_of_special_values_answer_as_eager():
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    x[1] = 0
    torch.testing.assert_close(_int8_linear(x, w, b)[1], b)  # (a row of zeros: exactly the bias)
    x[2, 3] = float("nan")
    got, want = _int8_linear(x, w, b), F.linear(x, w, b)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    x[2, 3] = float("inf")  # (where a weight rounds to 0, inf * 0 is NaN where eager has inf: finite where eager is)
    got, want = _int8_linear(x, w, b), F.linear(x, w, b)
    assert torch.equal(got.isfinite(), want.isfinite()) and not got.isfinite().all()


@pytest.mark.parametrize("groups, stride, dilation", [(1, 1, 1), (4, 2, 1), (16, 1, 2)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_int8_conv_is_close_to_float32_and_keeps_the_input_layout(groups, stride, dilation, channels_last):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 16, 12, 12), torch.randn(32, 16 // groups, 3, 3), torch.randn(32)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    for activation in ("none", "relu"):
        y = _int8_conv(x, w, b, float(x.min()), float(x.max()), stride, dilation, dilation, groups, activation)
        want = F.conv2d(x, w, b, stride, dilation, dilation, groups)
        want = F.relu(want) if activation == "relu" else want
        assert y.shape == want.shape and 0 < _relative(y, want) < 0.03
        assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_int8_conv_inputs_beyond_the_calibration_are_quantized_in_a_wider_range_and_not_finite_in_float32():
    from fxforge.lowering import int8_ops

    torch.manual_seed(0)
    x, w = torch.rand(1, 4, 6, 6), torch.randn(4, 4, 3, 3)
    low, high = 0.0, 1.0
    for beyond in (x * 1.05, x * 1.5, x - 0.5, x * 8):  # (clamping into [0, 1] would be 5-700 % off)
        assert _relative(_int8_conv(beyond, w, None, low, high), F.conv2d(beyond, w, padding=1)) < 0.03
    far = x * 20  # beyond ten widths: the float32 convolution answers (the weights' rounding alone)
    scale, zero = input_qparams(low, high)
    assert int8_ops.covering_qparams(far, scale, zero) is None
    assert _relative(_int8_conv(far, w, None, low, high), F.conv2d(far, w, padding=1)) < 0.01
    x[0, 1, 2, 2] = float("nan")
    got, want = _int8_conv(x, w, None, low, high), F.conv2d(x, w, padding=1)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()


def test_a_widened_range_is_whole_steps_of_the_calibrated_width_so_few_are_packed():
    from fxforge.lowering.int8_ops import covering_qparams

    scale, zero = input_qparams(-1.0, 1.0)
    ranges = {covering_qparams(torch.tensor([-1.0, 1.0 + 0.01 * k]), scale, zero) for k in range(1, 100)}
    # overshoots of 1 % .. 99 % of the width 2 need 1 or 2 steps of 0.5: two ranges, not 99
    assert len(ranges) == 2
    assert covering_qparams(torch.tensor([0.0, 0.5]), scale, zero) == (scale, zero)
    assert covering_qparams(torch.tensor([float("inf")]), scale, zero) is None


def test_the_int8_ops_have_fake_implementations_for_export():
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            w, v = torch.randn(8, 3, 3, 3), torch.randn(5, 8 * 4 * 4)
            self.register_buffer("wq", weight_int8(w)); self.register_buffer("ws", weight_scale(w))
            self.register_buffer("vq", weight_int8(v)); self.register_buffer("vs", weight_scale(v))

        def forward(self, x):
            y = torch.ops.fxforge.int8_conv(x, self.wq, self.ws, None, [2, 2], [1, 1], [1, 1], 1, 0.01, 128, "relu")
            return torch.ops.fxforge.int8_linear(y.flatten(1), self.vq, self.vs, None)

    x = torch.randn(2, 3, 8, 8)
    exported = torch.export.export(Both(), (x,))
    targets = {str(n.target) for n in exported.graph.nodes}
    assert {"fxforge.int8_conv.default", "fxforge.int8_linear.default"} <= targets
    torch.testing.assert_close(exported.module()(x), Both.__call__(exported.module(), x))


def test_the_layers_int8_breaks_stay_in_float32_with_the_reason():
    torch.manual_seed(0)
    model = Cancelling().eval()
    gm = torch.fx.symbolic_trace(model)
    calls = [(torch.randn(8, 16),), (torch.randn(8, 16),)]
    choice = choose_layers(gm, calls, Int8Reduction({}), Tolerance(relative_error=0.05, top1=None))
    assert choice.reduced == ["a"], choice.layers
    kept = {layer.name: layer for layer in choice.layers if layer.dtype == "float32"}
    assert set(kept) == {"b", "c"} and all("relative error" in layer.reason for layer in kept.values())


def _kernels_faster(calls, *args, **kwargs):
    """Layer timings that say every int8 kernel beats float32 (the machine decides in use, not in a test)."""
    for call in calls.values():
        call()
    return {name: (1.0 if name == "float32" else 0.5) for name in calls}


def _timings(order: dict[str, float]):
    def timed(calls, *args, **kwargs):
        for call in calls.values():
            call()
        return {name: order[name] for name in calls}
    return timed


@pytest.mark.parametrize("name", sorted(MODELS))
def test_optimize_in_int8_answers_within_the_tolerance_on_fresh_inputs(name, monkeypatch):
    monkeypatch.setattr(precision_stage, "time_interleaved", _timings({"float32": 1.0, "int8": 0.5}))
    monkeypatch.setattr(int8_speed, "time_interleaved", _kernels_faster)
    model, x = _model(name)
    opt = fxforge.optimize(model, (x,), target="native", precision="int8", tolerance={"relative_error": 0.05})
    assert any(note.startswith("precision int8: ") and " layers in int8" in note for note in opt.report.notes), \
        opt.report.notes
    layers = [t for t in opt.report.tuning if t.rule == "precision" and t.subject != "graph"]
    assert layers and {t.choice for t in layers} <= {"int8", "float32"} and "int8" in {t.choice for t in layers}
    with torch.no_grad():
        for fresh in (torch.randn(x.shape), torch.randn(x.shape) * 1.5 + 0.2):
            assert 0 < _relative(opt(fresh), model(fresh)) <= 0.05  # (int8: not float32's answer)
        fresh = torch.randn(1, *x.shape[1:])  # a new size: a plan of its own
        assert _relative(opt(fresh), model(fresh)) <= 0.05
        if x.dim() == 4:
            fresh = torch.randn(x.shape).to(memory_format=torch.channels_last)
            got = opt(fresh)
            assert _relative(got, model(fresh)) <= 0.05
        fresh = torch.randn(x.shape)
        fresh.view(-1)[3] = float("nan")
        got, want = opt(fresh), model(fresh)
        assert torch.equal(got.isnan(), want.isnan())
        for p in model.parameters():
            p.data.mul_(-1.5)  # .data: no version bump; the int8 weights follow
        fresh = torch.randn(x.shape)
        assert _relative(opt(fresh), model(fresh)) <= 0.05


@pytest.mark.parametrize("fastest", ["int8", "bf16", "float32"])
def test_auto_keeps_the_fastest_precision_within_the_tolerance(fastest, monkeypatch):
    order = {"float32": 1.0, "bf16": 0.7, "int8": 0.8}
    order[fastest] = 0.3
    if fastest == "float32":
        order.update(bf16=1.0, int8=1.2)
    monkeypatch.setattr(precision_stage, "time_interleaved", _timings(order))
    monkeypatch.setattr(int8_speed, "time_interleaved", _kernels_faster)
    model, x = _model("tokens")
    opt = fxforge.optimize(model, (x,), target="native", precision="auto", tolerance={"relative_error": 0.05})
    graph = [t for t in opt.report.tuning if t.rule == "precision" and t.subject == "graph"]
    assert [t.choice for t in graph] == [fastest]
    notes = " ".join(opt.report.notes)
    assert "precision bf16: " in notes and "precision int8: " in notes
    with torch.no_grad():
        fresh = torch.randn(x.shape)
        error = _relative(opt(fresh), model(fresh))
        assert error <= 0.05 and (error == 0) == (fastest == "float32")


def test_a_users_metric_decides_and_top1_can_be_left_out():
    model, x = _model("conv_bn")
    gm = fxforge.rewrite(fxforge.capture(model, (x,))).graph_module
    calls = [(x,), (torch.randn(x.shape),)]
    ranges = observe_inputs(gm, calls, [n.name for n in int8_layers(gm)])
    never = Tolerance(relative_error=1.0, cosine=0.0, top1=None, metric=lambda r, c: -1.0, metric_at_least=0.0)
    refused = choose_layers(gm, calls, Int8Reduction(ranges), never)
    assert refused.reduced == [] and "the user's metric -1.0 below 0.0" in refused.refusal
    same_class = Tolerance(relative_error=1.0, cosine=0.0, top1=None,
                           metric=lambda r, c: float((r.argmax(1) == c.argmax(1)).double().mean()), metric_at_least=1.0)
    chosen = choose_layers(gm, calls, Int8Reduction(ranges), same_class)
    assert chosen.reduced and chosen.agreement.metric == 1.0
    with pytest.raises(ValueError, match="expected a positive number"):
        Tolerance.of({"relative": 0.1})


def test_int8_plans_serve_every_size_of_a_dynamic_plan_and_calls_in_inference_mode(monkeypatch):
    monkeypatch.setattr(precision_stage, "time_interleaved", _timings({"float32": 1.0, "int8": 0.5}))
    monkeypatch.setattr(int8_speed, "time_interleaved", _kernels_faster)
    model, x = _model("conv_bn")
    opt = fxforge.optimize(model, (x,), target="native", precision="int8", dynamic=True,
                           tolerance={"relative_error": 0.05, "top1": None})
    assert "precision int8: " in " ".join(opt.report.notes) and "dynamic sizes" in " ".join(opt.report.notes)
    with torch.no_grad():
        for shape in [(2, 3, 12, 12), (3, 3, 16, 16), (4, 3, 10, 14)]:
            fresh = torch.randn(shape)
            assert 0 < _relative(opt(fresh), model(fresh)) <= 0.05, shape
    with torch.inference_mode():
        fresh = torch.randn(2, 3, 12, 12)
        assert 0 < _relative(opt(fresh), model(fresh)) <= 0.05


def test_layers_called_with_keyword_inputs_are_read_or_left_as_they_are():
    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.c = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(4, 3, 3, 3))

        def forward(self, x, image):
            return F.linear(input=x, weight=self.w), F.conv2d(input=image, weight=self.c, padding=1)

    torch.manual_seed(0)
    model = Keywords().eval()
    gm = torch.fx.symbolic_trace(model)
    calls = [(torch.randn(4, 16), torch.randn(1, 3, 6, 6))]
    layers = int8_layers(gm)
    assert len(layers) == 2
    quantize_layers(gm, layers, observe_inputs(gm, calls, [n.name for n in layers]))
    assert not int8_layers(gm)
    with torch.no_grad():
        for got, want in zip(gm(*calls[0]), model(*calls[0])):
            assert 0 < _relative(got, want) < 0.05


def test_an_int8_reduction_without_convolutions_offers_the_linear_layers_alone():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3, 3, 3))

        def forward(self, x):
            return F.conv2d(x, self.w).flatten(1)

    modules = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(16, 2)))
    assert [n.name for n in Int8Reduction({}).layers(modules)] == ["_0", "_2"]
    assert [n.name for n in Int8Reduction({}, convolutions=False).layers(modules)] == ["_2"]
    assert Int8Reduction({}, convolutions=False).layers(torch.fx.symbolic_trace(Functional())) == []


def test_the_per_tensor_kernel_is_close_follows_weight_and_bias_and_keeps_nan():
    from fxforge.lowering.int8_ops import dynamic_kernel_exists, linear_int8_tensor

    if not dynamic_kernel_exists():
        pytest.skip("this torch has no quantized::linear_dynamic")
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 7, 64), torch.randn(32, 64), torch.randn(32)
    wq, ws = weight_int8(w), weight_scale(w)
    assert _relative(linear_int8_tensor(x, wq, ws, b), F.linear(x, w, b)) < 0.03
    with torch.no_grad():  # the packed weight and bias follow in-place changes of either
        wq.neg_()
        b.mul_(3)
    assert _relative(linear_int8_tensor(x, wq, ws, b), F.linear(x, -w, b)) < 0.03
    x[1, 3, 5] = float("nan")
    got, want = linear_int8_tensor(x, wq, ws, b), F.linear(x, -w, b)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()


def test_layer_speeds_time_each_shape_once_and_keep_the_faster_int8_kernel(monkeypatch):
    from fxforge.lowering.int8_speed import PER_TENSOR, layer_speeds

    timed = []

    def per_tensor_fastest(calls, *args, **kwargs):
        timed.append(sorted(calls))
        for call in calls.values():
            call()
        return {name: {"float32": 1.0, PER_TENSOR: 0.3}.get(name, 0.6) for name in calls}

    monkeypatch.setattr(int8_speed, "time_interleaved", per_tensor_fastest)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)).eval()
    gm = torch.fx.symbolic_trace(model)
    speeds = layer_speeds(gm, (torch.randn(4, 16),), ["_0", "_1", "_2"], {})
    assert len(timed) == 2  # _0 and _1 share a shape
    assert {speed.kernel for speed in speeds.values()} == {PER_TENSOR} and all(s.faster for s in speeds.values())


@pytest.mark.parametrize("kernel", ["per tensor", "static"])
@pytest.mark.parametrize("change", ["none", "scale .data", "reassign parameter"])
def test_a_plan_on_each_linear_kernel_answers_within_the_tolerance(monkeypatch, change, kernel):
    from fxforge.lowering.int8_ops import dynamic_kernel_exists
    from tests.fuzz.programs import STATE_CHANGES

    if kernel == "per tensor" and not dynamic_kernel_exists():
        pytest.skip("this torch has no quantized::linear_dynamic")
    monkeypatch.setattr(precision_stage, "time_interleaved", _timings({"float32": 1.0, "int8": 0.5}))
    monkeypatch.setattr(int8_speed, "time_interleaved", lambda calls, *a, **k: (
        [call() for call in calls.values()], {n: {"float32": 1.0, kernel: 0.3}.get(n, 0.6) for n in calls})[1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).eval()
    opt = fxforge.optimize(model, (torch.randn(4, 16, 64),), precision="int8")
    assert any(f"int8 ({kernel})" in t.note for t in opt.report.tuning if t.rule == "precision")
    STATE_CHANGES[change](model, 7)
    with torch.no_grad():
        for fresh in (torch.randn(3, 9, 64), 3 * torch.randn(2, 16, 64)):  # (a static range met and overshot)
            assert Tolerance().refusal(agreement([model(fresh)], [opt(fresh)])) is None


def test_the_static_linear_kernel_is_close_widens_its_range_and_keeps_nan():
    from fxforge.lowering.int8_ops import linear_int8_static

    torch.manual_seed(0)
    x, w, b = torch.randn(2, 7, 64), torch.randn(32, 64), torch.randn(32)
    wq, ws = weight_int8(w), weight_scale(w)
    scale, zero = input_qparams(-4.0, 4.0)
    assert _relative(linear_int8_static(x, wq, ws, b, scale, zero), F.linear(x, w, b)) < 0.03
    assert _relative(linear_int8_static(5 * x, wq, ws, b, scale, zero), F.linear(5 * x, w, b)) < 0.03  # widened
    x[1, 3, 5] = float("nan")
    got, want = linear_int8_static(x, wq, ws, b, scale, zero), F.linear(x, w, b)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()


def test_the_per_tensor_op_exports_through_its_fake_implementation():
    class Tensorwise(nn.Module):
        def __init__(self):
            super().__init__()
            w = torch.randn(8, 16)
            self.register_buffer("wq", weight_int8(w))
            self.register_buffer("ws", weight_scale(w))

        def forward(self, x):
            y = torch.ops.fxforge.int8_linear_tensor(x, self.wq, self.ws, None)
            return torch.ops.fxforge.int8_linear_static(y, self.wq[:, :8], self.ws, None, 0.05, 128)

    exported = torch.export.export(Tensorwise(), (torch.randn(3, 16),))
    targets = {str(n.target) for n in exported.graph.nodes}
    assert {"fxforge.int8_linear_tensor.default", "fxforge.int8_linear_static.default"} <= targets
