"""Reduced precision for matrix products and convolutions (issue 51, bfloat16/float16 on the native target):
the graph transform in every call form, the choice of layers by sensitivity, and ``optimize(precision=...)``
against eager float32 on fresh inputs, changed weights, new sizes and gradient calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from fxforge.core.accuracy import Tolerance, agreement
from fxforge.lowering import int8_speed, precision_stage
from fxforge.lowering.int8 import int8_layers, quantize_layers
from fxforge.lowering.int8_ranges import observe_inputs
from fxforge.lowering.lower import derived_values
from fxforge.lowering.precision import reduce_layers, reducible
from fxforge.lowering.precision_choice import choose_layers


class FunctionalNet(nn.Module):
    """Weights held as parameters and used through functional calls and ``@`` (no layer modules)."""

    def __init__(self):
        super().__init__()
        self.conv_w, self.conv_b = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.3), nn.Parameter(torch.randn(8))
        self.proj = nn.Parameter(torch.randn(8 * 6 * 6, 16) * 0.05)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        y = F.relu(F.conv2d(x, self.conv_w, self.conv_b))
        return self.head(torch.tanh(y.flatten(1) @ self.proj))


class ConvBnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1, groups=4), nn.ReLU())
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.pool(self.body(x)).flatten(1))


class TokenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)
        self.conv = nn.Conv1d(32, 32, 3, padding=1)

    def forward(self, x):  # [batch, tokens, 32]
        y = x + self.down(F.gelu(self.up(x)))
        return self.conv(y.transpose(1, 2)).transpose(1, 2)


MODELS = {
    "functional": (FunctionalNet, (2, 3, 8, 8)),
    "conv_bn": (ConvBnNet, (2, 3, 12, 12)),
    "tokens": (TokenMLP, (2, 7, 32)),
}


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    factory, shape = MODELS[name]
    model = factory().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model, torch.randn(shape)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return agreement([want], [got]).relative_error


def _reduce_every_layer(gm: torch.fx.GraphModule, x: torch.Tensor, precision: str) -> tuple[torch.dtype, float]:
    """Every layer of ``gm`` in ``precision``: the dtype its weights are then held in, and the error allowed."""
    if precision == "bf16":
        layers = reducible(gm)
        assert len(layers) >= 2, [n.target for n in gm.graph.nodes]
        reduce_layers(gm, layers, torch.bfloat16)
        return torch.bfloat16, 0.03
    layers = int8_layers(gm)
    assert len(layers) >= 2, [n.target for n in gm.graph.nodes]
    quantize_layers(gm, layers, observe_inputs(gm, [(x,), (torch.randn(x.shape),)], [n.name for n in layers]))
    assert not int8_layers(gm)
    return torch.int8, 0.05


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_layer_reduced_stays_close_and_follows_the_weights(name, method, precision):
    model, x = _model(name)
    new = fxforge.rewrite(fxforge.capture(model, (x,), method=method))
    gm = new.graph_module
    dtype, allowed = _reduce_every_layer(gm, x, precision)
    assert any(b.dtype == dtype for b in gm.buffers()), f"the weights were not held in {dtype}"
    values = derived_values(gm, gm)
    fresh = torch.randn(x.shape)
    with torch.no_grad():
        got, want = gm(fresh), model(fresh)
        assert got.dtype == torch.float32 and 0 < _relative(got, want) < allowed
        for p in model.parameters():  # an optimizer step in place: the reduced copies follow
            p.mul_(0.9).add_(0.01)
        assert values.refresh_if_stale()
        assert _relative(gm(fresh), model(fresh)) < allowed


class Cancelling(nn.Module):
    """``b(h) - c(h)`` of two nearly equal layers: rounding their inputs (bfloat16, int8) swamps the difference."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(32, 8)
        with torch.no_grad():
            self.c.weight.copy_(self.b.weight + 1e-3 * torch.randn_like(self.b.weight))
            self.c.bias.copy_(self.b.bias)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h) - self.c(h)


def test_a_layer_whose_rounding_is_amplified_stays_in_float32_with_the_reason():
    torch.manual_seed(0)
    model = Cancelling().eval()
    gm = torch.fx.symbolic_trace(model)
    calls = [(torch.randn(8, 16),), (torch.randn(8, 16),)]
    choice = choose_layers(gm, calls, torch.bfloat16, Tolerance(relative_error=0.05))
    assert choice.reduced == ["a"], choice.layers
    kept = {layer.name: layer for layer in choice.layers if layer.dtype == "float32"}
    assert set(kept) == {"b", "c"}
    assert all(layer.reason.startswith("kept in float32: relative error") for layer in kept.values())
    assert choice.agreement.relative_error <= 0.05
    reduce_layers(gm, [n for n in gm.graph.nodes if n.name in choice.reduced], torch.bfloat16)
    fresh = torch.randn(8, 16)
    with torch.no_grad():
        assert _relative(gm(fresh), model(fresh)) <= 0.05


@pytest.fixture
def reduced_is_faster(monkeypatch):
    """Timings that say the reduced graph is faster (the machine's real timings decide in use, not in a test)."""
    def timed(calls, *args, **kwargs):
        for call in calls.values():
            call()
        return {name: (1.0 if name == "float32" else 0.5) for name in calls}

    monkeypatch.setattr(precision_stage, "time_interleaved", timed)
    monkeypatch.setattr(int8_speed, "time_interleaved", timed)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_optimize_in_bfloat16_answers_within_the_tolerance_on_fresh_inputs(name, reduced_is_faster):
    model, x = _model(name)
    opt = fxforge.optimize(model, (x,), precision="bf16", tolerance=0.03)
    assert any(note.startswith("precision bf16: ") and " layers in bf16" in note for note in opt.report.notes), \
        opt.report.notes
    layers = [t for t in opt.report.tuning if t.rule == "precision" and t.subject != "graph"]
    assert layers and all(t.choice in ("bfloat16", "float32") for t in layers)
    with torch.no_grad():
        for fresh in (torch.randn(x.shape), torch.randn(x.shape) * 3 + 1):
            assert 0 < _relative(opt(fresh), model(fresh)) <= 0.03  # (reduced: not float32's answer)
        fresh = torch.randn(1, *x.shape[1:])  # a new size: a plan of its own, its layers chosen again
        assert _relative(opt(fresh), model(fresh)) <= 0.03
        if x.dim() == 4:
            fresh = torch.randn(x.shape).to(memory_format=torch.channels_last)
            assert _relative(opt(fresh), model(fresh)) <= 0.03
        for p in model.parameters():
            p.data.mul_(-1.5)  # .data: no version bump
        fresh = torch.randn(x.shape)
        assert _relative(opt(fresh), model(fresh)) <= 0.03


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_calls_that_record_gradients_get_float32_and_eagers_gradients(reduced_is_faster, precision):
    model, x = _model("tokens")
    twin = _model("tokens")[0]
    opt = fxforge.optimize(model, (x,), precision=precision)
    assert any(n.startswith(f"precision {precision}: ") and " layers in " in n for n in opt.report.notes)
    fresh = torch.randn(x.shape)
    with pytest.warns(Warning):
        opt(fresh).square().sum().backward()
    twin(fresh).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_reduced_graph_that_is_not_faster_is_not_kept(monkeypatch):
    monkeypatch.setattr(precision_stage, "time_interleaved",
                        lambda calls, *a, **k: {name: (1.0 if name == "float32" else 1.2) for name in calls})
    model, x = _model("tokens")
    opt = fxforge.optimize(model, (x,), precision="bf16")
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)  # float32
    note = next(n for n in opt.report.notes if n.startswith("precision bf16"))
    assert note.startswith("precision bf16: float32 kept: ") and "1.2 ms against float32's 1 ms" in note


def test_no_layer_within_a_tiny_tolerance_keeps_float32_with_the_reason():
    model, x = _model("tokens")
    opt = fxforge.optimize(model, (x,), precision="bf16", tolerance=1e-7)
    assert "precision bf16: float32 kept: no layer keeps the tolerance in bfloat16" in " ".join(opt.report.notes)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_bad_precision_options_are_refused_before_anything_runs():
    model, x = _model("tokens")
    with pytest.raises(ValueError, match=r"precision='int4': expected one of float32, bf16"):
        fxforge.optimize(model, (x,), precision="int4")
    with pytest.raises(ValueError, match="tolerance=-1: expected a positive number"):
        fxforge.optimize(model, (x,), precision="bf16", tolerance=-1)
    with pytest.raises(ValueError, match="target='inductor' takes precision='int8'.*not 'bf16'"):
        fxforge.optimize(model, (x,), target="inductor", precision="bf16")


def test_a_forward_with_defaults_and_keyword_arguments_gets_its_precision(reduced_is_faster):
    class HubStyle(nn.Module):
        """A forward as transformers writes it: named inputs with defaults, then ``**kwargs``."""

        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, pixel_values=None, labels=None, return_dict=None, **kwargs):
            return {"features": self.down(torch.relu(self.up(pixel_values)))}

    torch.manual_seed(0)
    model, x = HubStyle().eval(), torch.randn(2, 7, 32)
    for precision in ("bf16", "int8"):
        opt = fxforge.optimize(model, (x,), precision=precision)
        assert any(n.startswith(f"precision {precision}: ") and " layers in " in n for n in opt.report.notes), \
            opt.report.notes
        with torch.no_grad():
            fresh = torch.randn(2, 7, 32)
            assert 0 < _relative(opt(fresh)["features"], model(fresh)["features"]) <= 0.05


class SharedInputs(nn.Module):
    """Three projections of one value (q, k, v), a chain of two linear layers and a residual."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        mixed = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1) @ self.v(x)
        return x + self.down(self.up(mixed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shared_casts_drop_round_trips_and_duplicates_without_changing_a_bit(monkeypatch, dtype):
    from fxforge.lowering import precision

    torch.manual_seed(0)
    model, x = SharedInputs().eval(), torch.randn(2, 5, 16)

    def reduced(share: bool) -> torch.fx.GraphModule:
        if not share:
            monkeypatch.setattr(precision, "share_casts", lambda gm: 0)
        gm = torch.fx.symbolic_trace(model)
        reduce_layers(gm, [n for n in reducible(gm) if n.op == "call_module"], dtype)
        monkeypatch.undo()
        return gm

    def casts(gm: torch.fx.GraphModule, to: torch.dtype) -> int:
        return sum(1 for n in gm.graph.nodes if n.op == "call_method" and n.target == "to" and n.args[1] == to
                   and n.args[0].op != "get_attr")

    shared, plain = reduced(True), reduced(False)
    # x once for q, k and v (was 3 casts); up's result goes to down in dtype (no float32 and back).
    assert casts(plain, dtype) == 5 and casts(shared, dtype) == 2
    assert casts(plain, torch.float32) == 5 and casts(shared, torch.float32) == 4
    with torch.no_grad():
        assert torch.equal(shared(x), plain(x))
        assert Tolerance().refusal(agreement([model(x)], [shared(x)])) is None
