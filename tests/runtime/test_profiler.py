"""fxforge.profile: exact FLOP counts, bytes, verdicts, groupings, comparison, memory and plots."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import matplotlib
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from fxforge.core.memory import simulate_peak
from fxforge.lowering.autotune import TuningPolicy
from fxforge.runtime import roofline
from fxforge.runtime.profile import Profile
from fxforge.runtime.profile.flops import FLOP_FORMULAS, flop_counter
from fxforge.runtime.profile.op_names import op_type

matplotlib.use("Agg")
F32 = 4
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(autouse=True)
def _machine(monkeypatch):
    """A fixed machine (ridge 5 FLOP/byte), so verdicts are known and nothing is measured."""
    machine = roofline.Machine("cpu", 100.0, 20.0, "fixed")
    monkeypatch.setattr("fxforge.runtime.profile.measure.measure_machine", lambda device=None, **kw: machine)
    return machine


def _profile(model, *inputs, **kwargs) -> Profile:
    return fxforge.profile(model, inputs, warmup=0, repeat=2, **kwargs)


def _row(p: Profile, op: str):
    rows = p.table[p.table["op"] == op]
    assert len(rows) == 1, p.table[["node", "op"]]
    return rows.iloc[0]


# ------------------------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("shape", [(5, 32), (2, 3, 32)])
def test_linear_flops(shape):
    layer = nn.Linear(32, 16)
    p = _profile(layer, torch.randn(*shape))
    rows = math.prod(shape[:-1])
    row = _row(p, "linear")
    assert row["flops"] == 2 * rows * 32 * 16
    assert row["bytes"] == (rows * 32 + 16 * 32 + 16 + rows * 16) * F32  # input, weight, bias read; output written
    assert row["intensity"] == pytest.approx(row["flops"] / row["bytes"])


def test_conv2d_flops_with_stride_and_padding():
    conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
    p = _profile(conv, torch.randn(2, 3, 17, 17))
    h = (17 + 2 * 1 - 3) // 2 + 1  # 9
    assert _row(p, "conv2d")["flops"] == 2 * 2 * h * h * 3 * 3 * 3 * 8


def test_conv2d_functional_and_rectangular_kernel():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 4, 3, 5))

        def forward(self, x):
            return F.conv2d(x, self.w, padding=(0, 2), stride=(1, 2))

    p = _profile(Net(), torch.randn(1, 4, 10, 12))
    out_h, out_w = 10 - 3 + 1, (12 + 4 - 5) // 2 + 1
    assert _row(p, "conv2d")["flops"] == 2 * out_h * out_w * 3 * 5 * 4 * 6


def test_conv1d_flops():
    conv = nn.Conv1d(4, 6, 5, padding=2)
    p = _profile(conv, torch.randn(3, 4, 20))
    assert _row(p, "conv1d")["flops"] == 2 * 3 * 20 * 5 * 4 * 6


@pytest.mark.parametrize("a, b, expected", [((4, 8), (8, 16), 2 * 4 * 8 * 16),
                                            ((3, 4, 8), (3, 8, 16), 2 * 3 * 4 * 8 * 16)])
def test_matmul_flops(a, b, expected):
    class MatMul(nn.Module):
        def forward(self, x, y):
            return x @ y

    p = _profile(MatMul(), torch.randn(*a), torch.randn(*b))
    assert _row(p, "matmul")["flops"] == expected


def test_pointwise_ops_count_no_flops():
    p = _profile(nn.Sequential(nn.ReLU(), nn.Sigmoid()), torch.randn(4, 4))
    assert p.table["flops"].tolist() == [0, 0]
    assert p.table["bytes"].tolist() == [2 * 64, 2 * 64]


class ConvBNReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return F.relu(self.fc(y.mean((2, 3))))


def _fused(model, x, kernel=None):
    return fxforge.optimize(model, (x,), tuning=TuningPolicy(kernel=kernel, keep="fused"))


def test_fused_ops_keep_their_conv_and_linear_flops():
    model, x = ConvBNReLU().eval(), torch.randn(2, 3, 12, 12)
    conv_flops, fc_flops = 2 * 2 * 12 * 12 * 9 * 3 * 8, 2 * 2 * 8 * 5
    before = _profile(model, x)
    assert _row(before, "conv2d")["flops"] == conv_flops
    opt = _fused(model, x)
    rewritten = fxforge.profile(opt.captured, warmup=0, repeat=1)   # the custom ops themselves
    assert _row(rewritten, "fxforge.conv_pointwise")["flops"] == conv_flops
    assert _row(rewritten, "fxforge.linear_pointwise")["flops"] == fc_flops
    assert rewritten.total_flops == before.total_flops


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_lowered_onednn_kernels_keep_their_flops():
    model, x = ConvBNReLU().eval(), torch.randn(2, 3, 12, 12)
    opt = _fused(model, x, kernel="mkldnn")
    p = fxforge.profile(opt, (x,), warmup=0, repeat=1)
    assert p.what == "lowered graph"
    conv = _row(p, "fxforge.conv_pointwise")
    # oneDNN's fused op, or oneDNN's convolution then torch's relu where oneDNN's relu post-op loses NaN
    assert conv["target"].startswith(("mkldnn._convolution_pointwise", "conv_then_activation"))
    assert conv["flops"] == 2 * 2 * 12 * 12 * 9 * 3 * 8
    assert _row(p, "fxforge.linear_pointwise")["flops"] == 2 * 2 * 8 * 5


def test_conv_add_relu_formula_for_the_binary_kernel():
    x, w, other = torch.randn(1, 4, 6, 6), torch.randn(4, 4, 3, 3), torch.randn(1, 4, 6, 6)
    with flop_counter() as counter:
        torch.ops.fxforge.conv_pointwise(x, w, None, [1, 1], [1, 1], [1, 1], 1, other, "add", "relu", [],
                                         "composite")
    assert counter.get_total_flops() == 2 * 36 * 9 * 4 * 4
    assert torch.ops.fxforge.conv_pointwise in FLOP_FORMULAS


# ------------------------------------------------------------------------------------------- table


def test_every_node_has_a_verdict_against_the_ridge(_machine):
    model = nn.Sequential(nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 36, 4))
    p = _profile(model.eval(), torch.randn(2, 8, 8, 8))
    assert list(p.table.columns[:11]) == ["node", "op", "target", "module", "source", "time_ms", "flops", "bytes",
                                          "intensity", "bound", "live_bytes"]
    assert set(p.table["bound"]) <= {"compute", "memory"} and len(p.table) == 5
    for row in p.table.itertuples():
        assert row.bound == ("compute" if row.intensity >= _machine.ridge else "memory")
    assert _row(p, "conv2d")["bound"] == "compute" and _row(p, "relu")["bound"] == "memory"
    assert (p.table["time_ms"] > 0).all()
    assert p.total_ms == pytest.approx(p.table["time_ms"].sum())


def test_views_move_no_bytes():
    class Views(nn.Module):
        def forward(self, x):
            y = x.view(4, 8).transpose(0, 1)
            return y.contiguous() + 1

    p = _profile(Views(), torch.randn(32))
    bytes_by_op = dict(zip(p.table["op"], p.table["bytes"]))
    assert bytes_by_op["view"] == 0 and bytes_by_op["transpose"] == 0
    assert bytes_by_op["contiguous"] == 2 * 32 * F32 and bytes_by_op["add"] == 2 * 32 * F32


def test_op_types_are_the_same_for_every_call_form():
    class Forms(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU()

        def forward(self, x):
            x = self.act(x)
            x = F.relu(x)
            x = torch.relu(x)
            x = x.relu()
            x = x + 1
            x = torch.add(x, 1)
            return x.relu_()

    gm = fxforge.capture(Forms(), (torch.randn(3),)).graph_module
    ops = [op_type(n, gm) for n in gm.graph.nodes if n.op.startswith("call")]
    assert ops == ["relu", "relu", "relu", "relu", "add", "add", "relu"]
    exported = fxforge.capture(Forms(), (torch.randn(3),), method="export").graph_module
    assert {op_type(n, exported) for n in exported.graph.nodes if n.op == "call_function"} == {"relu", "add"}


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Inner(), Inner()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x * 2


def test_module_paths_and_sources():
    p = _profile(Outer(), torch.randn(2, 4))
    assert p.table["module"].tolist() == ["blocks.0.lin", "blocks.0", "blocks.1.lin", "blocks.1", ""]
    assert all("test_profiler.py:" in s for s in p.table["source"])
    by_module = p.by_module(depth=2)
    assert set(by_module.index) == {"blocks.0", "blocks.1", ""}
    assert by_module.loc["blocks.0", "count"] == 2


def test_groupings_sum_to_the_total():
    p = _profile(Outer(), torch.randn(2, 4))
    for grouped in (p.by_op(), p.by_module(), p.by_module(depth=1)):
        assert grouped["time_ms"].sum() == pytest.approx(p.total_ms)
        assert grouped["count"].sum() == len(p.table)
        assert grouped["flops"].sum() == p.table["flops"].sum()
        assert grouped["share"].sum() == pytest.approx(1.0)
        assert list(grouped["time_ms"]) == sorted(grouped["time_ms"], reverse=True)
    assert p.by_op().loc["linear", "count"] == 2 and p.by_op().loc["tanh", "count"] == 2


def test_live_bytes_follow_the_memory_model():
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    p = _profile(model, torch.randn(4, 16))
    expected = dict(zip(*[simulate_peak(p.graph_module).nodes, simulate_peak(p.graph_module).after]))
    assert p.table["live_bytes"].tolist() == [expected[n] for n in p.table["node"]]
    assert p.table["live_bytes"].tolist() == [4 * 64 * F32, 4 * 64 * F32, 4 * 8 * F32]
    assert p.table["measured_live_bytes"].tolist() == p.table["live_bytes"].tolist()


def test_inputs_taken_from_a_captured_model_and_errors():
    cap = fxforge.capture(nn.Linear(3, 2), (torch.randn(1, 3),))
    p = fxforge.profile(cap, warmup=0, repeat=1)
    assert p.what == "captured graph" and len(p.table) == 1
    with pytest.raises(TypeError, match="nn.Module"):
        fxforge.profile("model", (torch.randn(1),))
    with pytest.raises(ValueError, match="example_inputs"):
        fxforge.profile(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="repeat"):
        fxforge.profile(cap, repeat=0)


def test_training_mode_statistics_are_left_alone():
    bn = nn.BatchNorm1d(3).train()
    _profile(nn.Sequential(bn), torch.randn(4, 3))
    assert bn.running_mean.abs().sum() == 0 and int(bn.num_batches_tracked) == 0


# ------------------------------------------------------------------------------------------- compare


def test_compare_shows_fusion():
    model, x = ConvBNReLU().eval(), torch.randn(2, 3, 12, 12)
    before = _profile(model, x)
    if torch.backends.mkldnn.is_available():
        # What the OptimizedModule runs: the lowered graph, fused ops calling oneDNN directly.
        after = fxforge.profile(_fused(model, x, kernel="mkldnn"), (x,), warmup=0, repeat=2)
    else:  # composite kernels lower to plain ops again: look at the rewritten graph instead
        after = fxforge.profile(_fused(model, x).captured, warmup=0, repeat=2)
    table = before.compare(after)
    assert table.index[-1] == "total"
    assert table.loc["batch_norm", "count_before"] == 1 and table.loc["batch_norm", "count_after"] == 0
    assert table.loc["fxforge.conv_pointwise", "count_before"] == 0
    assert table.loc["fxforge.conv_pointwise", "count_after"] == 1
    assert table.loc["fxforge.linear_pointwise", "count_after"] == 1
    assert table.loc["conv2d", "count_after"] == 0 and table.loc["linear", "count_after"] == 0
    body = table.drop(index="total")
    assert body["time_ms_before"].sum() == pytest.approx(before.total_ms)
    assert body["time_ms_after"].sum() == pytest.approx(after.total_ms)
    assert (table["delta_ms"] == table["time_ms_after"] - table["time_ms_before"]).all()
    assert table.attrs["speedup"] == pytest.approx(before.total_ms / after.total_ms)
    assert "x" in table.attrs["summary"] and table.attrs["total_ms_before"] == pytest.approx(before.total_ms)


# ------------------------------------------------------------------------------------------- output


def test_plots_return_axes():
    from matplotlib.axes import Axes

    p = _profile(ConvBNReLU().eval(), torch.randn(1, 3, 8, 8))
    top = p.plot_top(n=3)
    assert isinstance(top, Axes) and len(top.patches) == 3
    roof = p.plot_roofline()
    assert roof.get_xscale() == "log" and roof.get_yscale() == "log"
    placed = sum(len(c.get_offsets()) for c in roof.collections)
    assert placed == len(p.table)  # one point per node
    memory = p.plot_memory()
    assert [line.get_label() for line in memory.get_lines()][:2] == ["simulated", "measured"]
    assert "measured" not in [line.get_label() for line in p.plot_memory(measured=False).get_lines()]
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    assert p.plot_top(ax=ax) is ax
    plt.close("all")


def test_graph_svg_colours_nodes_by_time():
    p = _profile(ConvBNReLU().eval(), torch.randn(1, 3, 8, 8))
    root = ET.fromstring(p.graph_svg(engine="builtin"))
    nodes = {g.get("id"): g for g in root.iter(f"{SVG}g") if "node" in g.get("class", "").split()}
    assert len(nodes) == len(p.graph_module.graph.nodes)
    colours = p.node_colors()
    slowest = p.table.sort_values("time_ms").iloc[-1]["node"]
    assert colours[slowest] == "#b10026"
    for name, colour in colours.items():
        assert nodes[f"node-{name}"].find(f"{SVG}rect").get("fill") == colour


def test_text_and_html_summaries():
    p = _profile(ConvBNReLU().eval(), torch.randn(1, 3, 8, 8))
    html = p._repr_html_()
    assert "<table" in html and "ConvBNReLU" in html and "ridge" in html
    assert str(p).startswith("ConvBNReLU: captured graph, 6 nodes")
    assert "6 nodes" in repr(p)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class WithBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x).mean((2, 3))


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Block(), Block()
        self.second.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.second(self.first(x))


def test_nodes_made_by_rewrites_keep_a_module():
    x = torch.randn(1, 3, 8, 8)
    folded = fxforge.profile(_fused(WithBlock().eval(), x).captured, warmup=0, repeat=1)
    # conv + BN folded and fused with the ReLU: the new node takes the module of the conv it replaced,
    # also where two instances of the same block share their source lines.
    assert _row(folded, "fxforge.conv_pointwise")["module"] == "block.conv"
    twice = fxforge.profile(_fused(TwoBlocks().eval(), x).captured, warmup=0, repeat=1)
    fused = twice.table[twice.table["op"] == "fxforge.conv_pointwise"]
    assert fused["module"].tolist() == ["first.conv", "second.conv"]
    linear = fxforge.profile(_fused(Outer().eval(), torch.randn(2, 4)).captured, warmup=0, repeat=1)
    fused = linear.table[linear.table["op"] == "fxforge.linear_pointwise"]
    assert fused["module"].tolist() == ["blocks.0.lin", "blocks.1.lin"]  # read from the weights they use


def test_a_node_the_flop_counter_cannot_run_still_runs(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no formula")

    monkeypatch.setitem(FLOP_FORMULAS, torch.ops.aten.addmm, broken)
    with pytest.warns(UserWarning, match="count 0 FLOPs: _0"):
        p = fxforge.profile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),), warmup=0, repeat=1)
    assert p.table["flops"].tolist() == [0, 0] and p.table["bytes"].tolist()[0] == (8 + 16 + 4 + 8) * F32


def test_attention_keeps_its_matmul_flops():
    class Attention(nn.Module):
        def forward(self, q, k, v):
            scores = torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1)
            return scores @ v

    class Fused(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, scale=0.125)

    q, k, v = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 24, 8), torch.randn(2, 3, 24, 8)
    expected = 2 * (2 * 2 * 3 * 16 * 24 * 8)  # q @ k^T and scores @ v, 2·B·H·S_q·S_kv·D each
    assert _profile(Attention(), q, k, v).total_flops == expected
    assert _profile(Fused(), q, k, v).total_flops == expected


def test_lowered_composites_get_simulated_memory():
    # Composite kernels are lowered to plain ops that carry no shape metadata: the profile borrows the values
    # of its counting run, so the simulation still sees them (and agrees with the measurement).
    model, x = ConvBNReLU().eval(), torch.randn(2, 3, 12, 12)
    p = fxforge.profile(_fused(model, x, kernel="composite"), (x,), warmup=0, repeat=1)
    assert p.what == "lowered graph"
    conv = _row(p, "conv2d")
    assert "val" not in next(n for n in p.graph_module.graph.nodes if n.name == conv["node"]).meta
    assert conv["live_bytes"] == 2 * 8 * 12 * 12 * F32  # the conv's result; its input is freed
    assert p.table["live_bytes"].tolist() == p.table["measured_live_bytes"].tolist()
