"""conv_activation: every call form fuses, outputs equal eager, training is untouched, refusals say why."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import fxforge
from fxforge.lowering import autotune
from fxforge.lowering.autotune import TuningPolicy
from fxforge.lowering.lower import FUSED_OPS, lower, lowered_kernels, make_plan

F = nn.functional
CONV = torch.ops.fxforge.conv_pointwise.default
LINEAR = torch.ops.fxforge.linear_pointwise.default


def fused_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in FUSED_OPS]


def optimized(model: nn.Module, x: torch.Tensor, method: str = "auto", rewrites=None, **force):
    force = {"keep": "fused", **force}
    cap = fxforge.capture(model.eval(), (x,), method=method)
    return fxforge.rewrite(cap, rewrites or ["cleanup", "conv_bn_fold", "conv_activation"], tuning=TuningPolicy(**force))


ACTIVATIONS = {
    "relu": (nn.ReLU(), "relu"),
    "relu_inplace": (nn.ReLU(inplace=True), "relu"),
    "relu6": (nn.ReLU6(), "hardtanh"),
    "hardtanh": (nn.Hardtanh(-0.5, 0.5), "hardtanh"),
    "leaky_relu": (nn.LeakyReLU(0.2), "leaky_relu"),
    "gelu": (nn.GELU(), "gelu"),
    "gelu_tanh": (nn.GELU(approximate="tanh"), "gelu_tanh"),
    "silu": (nn.SiLU(), "silu"),
    "sigmoid": (nn.Sigmoid(), "sigmoid"),
    "tanh": (nn.Tanh(), "tanh"),
    "hardswish": (nn.Hardswish(), "hardswish"),
}


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_conv_bn_activation_modules_become_one_op(name, method):
    activation, fused_name = ACTIVATIONS[name]
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), activation).eval()
    x = torch.randn(2, 3, 10, 10)
    new = optimized(model, x, method, kernel="mkldnn")
    nodes = fused_nodes(new.graph_module)
    assert [n.args[9] for n in nodes] == [fused_name]
    assert new.report.counts == {"conv_bn_fold": 1, "conv_activation": 1}
    assert not any("batch_norm" in str(n.target) for n in new.graph_module.graph.nodes)
    torch.testing.assert_close(new.graph_module(x), model(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lower(new.graph_module)(x), model(x), rtol=1e-4, atol=1e-5)


class CallForms(nn.Module):
    """The same conv+activation reached five ways: module, functional, torch.*, method, in-place method."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.c4, self.c5 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1, stride=(2, 1))
        self.act = nn.ReLU()

    def forward(self, x):
        x = self.act(self.c1(x))
        x = F.relu6(F.conv2d(x, self.c2.weight, self.c2.bias))
        x = torch.sigmoid(self.c3(x))
        x = self.c4(x).tanh()
        return self.c5(x).relu_()


@pytest.mark.parametrize("method", ["fx", "export"])
def test_every_call_form_fuses(method):
    model, x = CallForms().eval(), torch.randn(1, 4, 8, 8)
    new = optimized(model, x, method)
    assert [n.args[9] for n in fused_nodes(new.graph_module)] == ["relu", "hardtanh", "sigmoid", "tanh", "relu"]
    torch.testing.assert_close(new.graph_module(x), model(x))
    assert fused_nodes(new.graph_module)[-1].args[3] == [2, 1]  # asymmetric stride kept


class Residual(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.conv, self.bn, self.inplace = nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6), inplace
        self.down = nn.Conv2d(6, 6, 1)

    def forward(self, x):
        out = self.bn(self.conv(x))
        if self.inplace:
            out += x
            return F.relu(out, inplace=True)
        return torch.relu(x + out) + self.down(x)  # add in either order, then conv + add without activation


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("method", ["fx", "export"])
def test_residual_add_relu_fuses(inplace, method):
    model, x = Residual(inplace).eval(), torch.randn(2, 6, 7, 7)
    new = optimized(model, x, method, kernel="mkldnn")
    nodes = fused_nodes(new.graph_module)
    expected = [("relu", True)] if inplace else [("relu", True), ("none", True)]
    assert [(n.args[9], n.args[7] is not None) for n in nodes] == expected
    torch.testing.assert_close(lower(new.graph_module)(x), model(x), rtol=1e-4, atol=1e-5)


def test_conv1d_and_conv3d_fuse():
    x = torch.randn(2, 3, 9)
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.SiLU()).eval()
    new = optimized(model, x)
    assert [n.args[9] for n in fused_nodes(new.graph_module)] == ["silu"]
    torch.testing.assert_close(new.graph_module(x), model(x))
    model3, x3 = nn.Sequential(nn.Conv3d(2, 3, 3), nn.Hardswish()).eval(), torch.randn(1, 2, 5, 5, 5)
    new3 = optimized(model3, x3, kernel="mkldnn")
    assert len(fused_nodes(new3.graph_module)) == 1
    torch.testing.assert_close(lower(new3.graph_module)(x3), model3(x3), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_linear_activation_fuses(method):
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act = nn.Linear(8, 16), nn.Linear(16, 4), nn.GELU()

        def forward(self, x):
            return F.silu(F.linear(self.act(self.a(x)), self.b.weight, self.b.bias))

    model, x = MLP().eval(), torch.randn(3, 5, 8)
    new = optimized(model, x, method, kernel="mkldnn")
    nodes = fused_nodes(new.graph_module)
    assert [(n.target, n.args[5]) for n in nodes] == [(LINEAR, "gelu"), (LINEAR, "silu")]
    torch.testing.assert_close(lower(new.graph_module)(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_plain_linear_layer_gets_its_kernel_chosen_too(method):
    model, x = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4, bias=False)).eval(), torch.randn(3, 5, 8)
    new = optimized(model, x, method, kernel="mkldnn")
    assert [(n.target, n.args[5], n.args[-1]) for n in fused_nodes(new.graph_module)] == [(LINEAR, "none", "mkldnn")] * 2
    assert [m.what for m in new.report.matches] == ["linear", "linear"]
    fresh = torch.randn(2, 7, 8)  # another shape
    fresh[0, 0, 0] = float("nan")
    torch.testing.assert_close(lower(new.graph_module)(fresh), model(fresh), rtol=1e-5, atol=1e-6, equal_nan=True)


def test_a_plain_linear_layer_stays_on_torchs_kernel_where_that_measured_faster(monkeypatch):
    model, x = nn.Sequential(nn.Linear(8, 16)).eval(), torch.randn(3, 8)

    def blas_faster(calls, budget, **_):
        return {name: (2.0 if name in ("fused", "mkldnn") else 1.0) for name in calls}

    monkeypatch.setattr(autotune, "time_interleaved", blas_faster)
    new = fxforge.rewrite(fxforge.capture(model, (x,)), ["conv_activation"], tuning=TuningPolicy(keep="fused"))
    (node,) = fused_nodes(new.graph_module)
    assert node.args[-1] == "composite"
    assert set(new.report.tuning[0].timings) == {"mkldnn", "composite"}  # both measured
    lowered = lower(new.graph_module)
    assert not fused_nodes(lowered) and lowered_kernels(lowered) == {}  # inlined: F.linear, no custom op
    torch.testing.assert_close(lowered(x), model(x))


def test_a_plain_linear_layer_in_training_mode_is_no_near_miss():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2), nn.Tanh()).train()
    new = fxforge.rewrite(fxforge.capture(model, (torch.randn(2, 8),)), ["conv_activation"])
    assert not fused_nodes(new.graph_module)
    misses = [m for m in new.report.near_misses if m.rule == "conv_activation"]
    assert len(misses) == 1 and misses[0].node == "_2"  # the tanh after the second layer, not the first layer


class NewGELU(nn.Module):
    """transformers' ``NewGELUActivation`` (GPT-2's ``gelu_new``), as it is written there."""

    def forward(self, y):
        return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))


class PowerGELU(nn.Module):
    """The same formula with ``y ** 3`` (an ``operator.pow`` in traced graphs)."""

    def forward(self, y):
        return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y ** 3.0)))


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("gelu", [NewGELU, PowerGELU])
def test_gelu_written_out_becomes_the_op_and_fuses_after_a_linear_layer(gelu, method):
    model = nn.Sequential(nn.Linear(8, 16), gelu(), nn.Linear(16, 4), gelu()).eval()
    new = optimized(model, torch.randn(3, 5, 8), method, kernel="mkldnn")
    assert [(n.target, n.args[5]) for n in fused_nodes(new.graph_module)] == [(LINEAR, "gelu_tanh")] * 2
    assert [m.what for m in new.report.matches].count("gelu(approximate='tanh') written out") == 2
    x = torch.randn(2, 7, 8)  # fresh inputs, another shape
    torch.testing.assert_close(lower(new.graph_module)(x), model(x), rtol=1e-5, atol=1e-6)


def test_gelu_written_out_stays_the_op_when_autotune_undoes_the_fusions(monkeypatch):
    model, x = nn.Sequential(nn.Linear(8, 16), NewGELU()).eval(), torch.randn(3, 8)

    def fused_slower(calls, budget, **_):
        return {name: (2.0 if name in ("fused", "mkldnn") else 1.0) for name in calls}

    monkeypatch.setattr(autotune, "time_interleaved", fused_slower)
    new = fxforge.rewrite(fxforge.capture(model, (x,)), ["conv_activation"])
    assert not fused_nodes(new.graph_module)
    assert [m.what for m in new.report.matches] == ["gelu(approximate='tanh') written out"]
    assert any(n.target is F.gelu and n.kwargs.get("approximate") == "tanh" for n in new.graph_module.graph.nodes)
    torch.testing.assert_close(new.graph_module(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_formula_that_is_not_gelu_is_left_alone():
    class Almost(nn.Module):
        def forward(self, y):  # 0.044 for 0.044715: another function
            return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044 * torch.pow(y, 3.0))))

    new = optimized(nn.Sequential(nn.Linear(8, 8), Almost()), torch.randn(2, 8))
    assert not any("written out" in m.what for m in new.report.matches)


def test_training_mode_is_untouched_and_says_why():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2), nn.Tanh())
    model.train()
    x = torch.randn(4, 3, 8, 8)
    cap = fxforge.capture(model, (x,))
    new = fxforge.rewrite(cap, ["conv_activation"])
    assert not fused_nodes(new.graph_module) and new.report.counts == {}
    reasons = {m.reason for m in new.report.near_misses if m.rule == "conv_activation"}
    assert reasons == {"fused ops are for inference; in training mode eager's ops are kept"}
    assert len([m for m in new.report.near_misses if m.rule == "conv_activation"]) == 1  # linear+tanh; BN blocks conv


def test_refusals_name_the_reason():
    class Broadcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.shared = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)

        def forward(self, x, bias):
            y = self.shared(x)
            return torch.relu(self.conv(x) + bias), torch.sigmoid(y), y

    model, x, bias = Broadcast().eval(), torch.randn(1, 3, 4, 4), torch.randn(2, 3, 1, 1)  # (grows the batch)
    new = fxforge.rewrite(fxforge.capture(model, (x, bias)), ["conv_activation"], tuning=TuningPolicy(keep="fused"))
    reasons = [m.reason for m in new.report.near_misses]
    assert any("the added tensor has shape (2, 3, 1, 1), which does not broadcast onto the layer's output "
               "(1, 3, 4, 4) without changing it" in r for r in reasons)
    assert any("is also used outside the match" in r for r in reasons)
    torch.testing.assert_close(new.graph_module(x, bias), model(x, bias))
    gate = torch.randn(3, 1, 1)  # broadcasts onto the output, leaving it as it is: fused
    new = fxforge.rewrite(fxforge.capture(model, (x, gate)), ["conv_activation"], tuning=TuningPolicy(keep="fused"))
    assert [n.args[9] for n in fused_nodes(new.graph_module)][:1] == ["relu"]
    torch.testing.assert_close(new.graph_module(x, gate), model(x, gate))


def test_autotune_reverts_when_fused_is_slower(monkeypatch):
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval(), torch.randn(1, 3, 16, 16)
    cap = fxforge.capture(model, (x,))

    def slow_fused(calls, budget, **_):
        return {name: (2.0 if name in ("fused", "mkldnn") else 1.0) for name in calls}

    monkeypatch.setattr(autotune, "time_interleaved", slow_fused)
    # channels-last: else "all composite, as captured" reverts without timing the graph
    new = fxforge.rewrite(cap, ["conv_activation"], tuning=TuningPolicy(layout="channels-last"))
    assert new.report.counts == {} and not fused_nodes(new.graph_module)
    graph = next(t for t in new.report.tuning if t.subject == "graph")
    assert graph.choice == "before" and "not faster, undone" in graph.note
    assert graph.timings == {"fused": 2.0, "before": 1.0}


def test_autotune_keeps_the_faster_kernel_and_reports_timings(monkeypatch):
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval(), torch.randn(1, 3, 16, 16)

    def mkldnn_faster(calls, budget, **_):
        return {name: (1.0 if name in ("fused", "mkldnn") else 3.0) for name in calls}

    monkeypatch.setattr(autotune, "time_interleaved", mkldnn_faster)
    new = fxforge.rewrite(fxforge.capture(model, (x,)), ["conv_activation"])
    assert lowered_kernels(new.graph_module) == {"mkldnn": 1}
    subjects = {t.subject: t for t in new.report.tuning}
    assert subjects["graph"].choice == "fused" and subjects["graph"].note.startswith("3.00x")
    node = fused_nodes(new.graph_module)[0].name
    assert subjects[node].timings == {"composite": 3.0, "mkldnn": 1.0}
    assert "conv_activation autotune" in str(new.report) and "Autotune" in new.report._repr_html_()


def test_channels_last_layout_converts_once_at_entry_and_exit():
    model = nn.Sequential(*(m for _ in range(3) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()))).eval()
    x = torch.randn(1, 4, 8, 8)
    new = optimized(model, x, layout="channels-last", kernel="mkldnn")
    gm = new.graph_module
    converts = [n for n in gm.graph.nodes if n.target is torch.ops.aten.contiguous.default]
    assert len(converts) == 2 and converts[0].kwargs == {"memory_format": torch.channels_last}
    out = lower(gm)(x)
    assert out.is_contiguous()
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)


def test_lowered_graph_computes_exactly_what_was_verified():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.Sigmoid()).eval()
    x = torch.randn(2, 3, 12, 12)
    new = optimized(model, x, kernel="mkldnn")
    lowered = lower(new.graph_module)
    assert not fused_nodes(lowered)
    assert any(n.target is torch.ops.mkldnn._convolution_pointwise.default for n in lowered.graph.nodes)
    with torch.no_grad():
        assert torch.equal(lowered(x), new.graph_module(x))


def test_optimized_module_backpropagates_through_fused_ops():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3), nn.Tanh()).eval()
    x = torch.randn(2, 3, 6, 6)
    opt = fxforge.optimize(model, (x,), rewrites=["conv_activation"], tuning=TuningPolicy(keep="fused", kernel="mkldnn"))
    assert opt.report.counts == {"conv_activation": 2}
    opt(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, expected in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_fused_graph_exports_with_its_custom_op():
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval(), torch.randn(1, 3, 8, 8)
    new = optimized(model, x)
    program = torch.export.export(new.graph_module, (x,))
    assert any(n.target is CONV for n in program.graph.nodes)


def test_channels_last_that_cannot_run_is_skipped_with_the_reason():
    class Viewing(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 2)

        def forward(self, x):
            y = torch.relu(self.conv(x))
            return self.fc(y.view(y.shape[0], -1))  # .view needs contiguous memory

    model, x = Viewing().eval(), torch.randn(2, 3, 8, 8)
    new = optimized(model, x, layout="channels-last")
    layout = [t for t in new.report.tuning if t.subject == "layout"]
    assert layout[0].note.startswith("channels-last cannot run this graph")
    assert [n.target for n in fused_nodes(new.graph_module)] == [CONV, LINEAR]  # relu(conv), and fc's kernel
    torch.testing.assert_close(lower(new.graph_module)(x), model(x))


class _FakeClock:
    """``time.perf_counter`` for ``fxforge.lowering.timing``: it moves only when a timed call says it took time, so
    the early stops are tested on the samples given, not on how busy the machine is."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def call(self, counts: dict, name: str, seconds: float):
        def run():
            counts[name] += 1
            self.now += seconds
        return run


@pytest.fixture
def fake_clock(monkeypatch):
    from fxforge.lowering import timing

    clock = _FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    return clock


def test_graph_timing_stops_once_the_winner_is_clear_and_skips_done_warm_ups(fake_clock):
    counts = {"quick": 0, "slow": 0}
    quick, slow = fake_clock.call(counts, "quick", 0.0), fake_clock.call(counts, "slow", 0.003)

    timings = autotune.time_interleaved({"quick": quick, "slow": slow}, 1.0, warmed=("quick",), decisive=0.05)
    assert timings["quick"] < timings["slow"]
    # quick: no warm-up, then two rounds; slow: a warm-up, then two rounds. Without `decisive`, 1 s buys 25.
    assert counts == {"quick": 2, "slow": 3}


def test_kernel_timing_stops_after_one_round_only_when_its_samples_differ_by_a_quarter(fake_clock):
    counts = {"quick": 0, "slow": 0, "close": 0}

    def call(name, seconds):
        return fake_clock.call(counts, name, seconds)

    timings = autotune.time_interleaved({"quick": call("quick", 0.0), "slow": call("slow", 0.004)}, 1.0,
                                        decisive=0.05, decisive_first=0.25)
    assert timings["quick"] < timings["slow"] and counts["quick"] == counts["slow"] == 2  # warm-up, one sample
    counts.update(quick=0, slow=0)
    autotune.time_interleaved({"close": call("close", 0.004), "slow": call("slow", 0.0045)}, 0.001,
                              decisive_first=0.25)
    assert counts["close"] == counts["slow"] == 1 + autotune.MIN_REPS  # 11 % apart: every round is run


def _channels_last(value: torch.Tensor) -> bool:
    return value.is_contiguous(memory_format=torch.channels_last) and not value.is_contiguous()


def _chain(widths=(3, 4, 5, 6, 7)) -> nn.Module:
    pairs = itertools.pairwise(widths)
    return nn.Sequential(*(m for a, b in pairs for m in (nn.Conv2d(a, b, 3, padding=1), nn.ReLU())))


def test_as_captured_is_not_timed_when_the_channels_last_graph_is_faster(monkeypatch):
    model, x = _chain().eval(), torch.randn(1, 3, 8, 8)
    timed = {"channels-last": 0, "as captured": 0}

    def fake_kernels(gm, op_args, values, kernel_call, weight, pool):
        timed["channels-last" if _channels_last(values[0]) else "as captured"] += 1
        return {"composite": 2.0, "mkldnn": 1.0}, ""

    monkeypatch.setattr(autotune, "_time_kernels", fake_kernels)
    monkeypatch.setattr(autotune, "time_interleaved", lambda calls, budget, **_: {"fused": 1.0, "before": 2.0})
    new = fxforge.rewrite(fxforge.capture(model, (x,)), ["conv_activation"])
    layout = next(t for t in new.report.tuning if t.subject == "layout")
    assert timed == {"channels-last": 4, "as captured": 0}
    assert layout.choice == "channels-last" and layout.timings == {"channels-last": 4.0}
    assert "as captured: not timed, the channels-last graph was already faster than the graph before" in layout.note
    assert lowered_kernels(new.graph_module) == {"mkldnn": 4}
    torch.testing.assert_close(lower(new.graph_module)(x), model(x), rtol=1e-4, atol=1e-5)


def test_as_captured_is_tried_when_the_channels_last_graph_is_not_faster(monkeypatch):
    model, x = _chain().eval(), torch.randn(1, 3, 8, 8)
    timed = {"channels-last": 0, "as captured": 0}
    graphs = []

    def fake_kernels(gm, op_args, values, kernel_call, weight, pool):
        layout = "channels-last" if _channels_last(values[0]) else "as captured"
        timed[layout] += 1
        return ({"composite": 2.0, "mkldnn": 1.0} if layout == "channels-last" else {"composite": 10.0, "mkldnn": 9.0}), ""

    def graph_timings(calls, budget, **_):
        graphs.append(1)  # channels-last's graph (timed first) is not faster than the graph before; as captured's is
        return {"fused": 1.0, "before": 1.0} if len(graphs) == 1 else {"fused": 1.0, "before": 2.0}

    monkeypatch.setattr(autotune, "_time_kernels", fake_kernels)
    monkeypatch.setattr(autotune, "time_interleaved", graph_timings)
    new = fxforge.rewrite(fxforge.capture(model, (x,)), ["conv_activation"])
    layout = next(t for t in new.report.tuning if t.subject == "layout")
    assert timed == {"channels-last": 4, "as captured": 4} and len(graphs) == 2
    assert layout.choice == "as captured" and layout.timings == {"as captured": 36.0, "channels-last": 4.0}
    assert "the channels-last graph was not faster than the graph before, the as captured graph was" in layout.note
    assert lowered_kernels(new.graph_module) == {"mkldnn": 4}
    torch.testing.assert_close(lower(new.graph_module)(x), model(x), rtol=1e-4, atol=1e-5)


def test_the_chosen_graph_is_handed_on_lowered_and_its_example_run_is_not_repeated(monkeypatch):
    from fxforge.rewrites import pipeline

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 16, 16)
    checks = []
    check_same = pipeline.check_same

    def spy(reference, candidate, inputs, modules, **options):
        checks.append(sorted(options.get("candidate_outputs") or {}))
        return check_same(reference, candidate, inputs, modules, **options)

    monkeypatch.setattr(pipeline, "check_same", spy)
    cap = fxforge.capture(model, (x,))
    new = fxforge.rewrite(cap, ["conv_bn_fold", "conv_activation"],
                          tuning=TuningPolicy(keep="fused", layout="channels-last", kernel="mkldnn"))
    assert new.report.counts == {"conv_bn_fold": 1, "conv_activation": 2}
    assert checks == [[0]]  # verified together; the example inputs' outputs were autotune's run of the graph
    assert any("verified together" in v for v in new.report.verified)
    gm, run = new.graph_module, new.lowered_run
    lowered = make_plan(new).executable
    assert lowered is run.lowered and lowered_kernels(lowered) == {}  # autotune's lowered graph, not a new one
    with torch.no_grad():
        torch.testing.assert_close(lowered(x), model(x), rtol=1e-4, atol=1e-5)
        inputs = pipeline.verification_inputs(cap)
        torch.testing.assert_close(run.outputs_for(gm, inputs)[0], gm(x), rtol=1e-5, atol=1e-6)
    # Any change to the graph afterwards and both records are dropped.
    node = fused_nodes(gm)[-1]
    node.args = (*node.args[:-3], "sigmoid", [], node.args[-1])
    gm.recompile()
    assert run.outputs_for(gm, inputs) == {} and make_plan(new).executable is not lowered


def test_graph_timing_runs_on_the_verification_inputs_so_verification_does_not_run_the_graph_again(monkeypatch):
    from fxforge.rewrites import pipeline

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 16, 16)
    checks, checked, graph_runs = [], [], []
    check_same = pipeline.check_same

    def spy(reference, candidate, inputs, modules, **options):
        checks.append(sorted(options.get("candidate_outputs") or {}))
        checked.extend(inputs)
        return check_same(reference, candidate, inputs, modules, **options)

    def timings(calls, budget, **_):
        if "fused" not in calls:  # per op: mkldnn wins
            return {name: (1.0 if name == "mkldnn" else 2.0) for name in calls}
        for _ in range(3):  # three rounds, as a real timing makes at least
            for call in calls.values():
                call()
        graph_runs.append(1)
        return {"fused": 1.0, "before": 2.0}

    monkeypatch.setattr(pipeline, "check_same", spy)
    monkeypatch.setattr(autotune, "time_interleaved", timings)
    cap = fxforge.capture(model, (x,))
    new = fxforge.rewrite(cap, ["conv_bn_fold", "conv_activation"])
    assert new.report.counts == {"conv_bn_fold": 1, "conv_activation": 2} and graph_runs == [1]
    # The example inputs' output is the graph's first run; the random inputs' are its timing runs.
    assert checks == [[0, 1, 2]]
    gm = new.graph_module
    remembered = new.lowered_run.outputs_for(gm, checked)
    with torch.no_grad():
        for i, (args, kwargs) in enumerate(checked):
            # (the last verification input holds a NaN: it must come out where eager puts it)
            torch.testing.assert_close(remembered[i], gm(*args, **kwargs), rtol=1e-5, atol=1e-6, equal_nan=True)
            torch.testing.assert_close(remembered[i], model(*args, **kwargs), rtol=1e-4, atol=1e-5, equal_nan=True)
    assert checked[-1][0][0].isnan().any() and remembered[len(checked) - 1].isnan().any()
