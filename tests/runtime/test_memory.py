"""The memory model: simulated peaks against hand-computed ones and against measured ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from examples.models import EXAMPLES
from examples.models.branchy import BRANCHY
from fxforge.core.memory import GraphMemory, simulate_peak
from fxforge.runtime.memory import StorageTracker, measure_peak

F32 = 4


def _capture(module: nn.Module, *inputs: torch.Tensor, method: str = "fx") -> torch.fx.GraphModule:
    return fxforge.capture(module, inputs, method=method).graph_module


def _during(timeline) -> dict[str, int]:
    return dict(zip(timeline.nodes, timeline.during))


def _after(timeline) -> dict[str, int]:
    return dict(zip(timeline.nodes, timeline.after))


class Views(nn.Module):
    def forward(self, x):                 # 256 floats: 1 KiB, an input (not counted)
        a = x * 2                         # 1 KiB
        v = a.view(16, 16).t()            # views of a: nothing new, but a lives as long as v
        b = v + 1                         # 1 KiB
        return b.sum()


def test_views_allocate_nothing_and_keep_their_base_alive():
    x = torch.randn(256)
    gm = _capture(Views(), x)
    t = simulate_peak(gm)
    during, after = _during(t), _after(t)
    assert [t.allocated[t.nodes.index(n)] for n in ("view", "t")] == [0, 0]
    assert during["add"] == 2 * 1024           # a (through v) and b
    assert after["add"] == 1024                # a freed after v's last use
    assert during["sum_1"] == 1024 + F32
    assert (t.peak_bytes, t.peak_node, t.output_bytes) == (2048, "add", F32)
    assert measure_peak(gm, x).peak_bytes == t.peak_bytes


class Copies(nn.Module):
    def forward(self, x):
        a = x * 2                         # 1 KiB
        same = a.contiguous()             # already contiguous: a itself
        copy = a.view(16, 16).t().reshape(-1)   # not viewable: reshape copies, 1 KiB
        return same + copy


def test_ops_that_may_copy_count_what_they_did():
    x = torch.randn(256)
    gm = _capture(Copies(), x)
    t = simulate_peak(gm)
    allocated = dict(zip(t.nodes, t.allocated))
    assert allocated["contiguous"] == 0
    assert allocated["reshape"] == 1024
    assert t.peak_bytes == 3 * 1024 == measure_peak(gm, x).peak_bytes


class InPlace(nn.Module):
    def forward(self, x):
        a = x * 2                         # 1 KiB
        a.relu_()                         # in place: nothing new
        a.add_(1)                         # in place (a traced `a += 1` becomes an out-of-place add)
        b = a * 3                         # 1 KiB
        return b


def test_inplace_ops_allocate_nothing():
    x = torch.randn(256)
    gm = _capture(InPlace(), x)
    t = simulate_peak(gm)
    allocated = dict(zip(t.nodes, t.allocated))
    assert allocated["relu_"] == 0 and allocated["add_"] == 0
    assert t.peak_bytes == 2048 and t.output_bytes == 1024
    assert measure_peak(gm, x).peak_bytes == 2048


class MultiOutput(nn.Module):
    def forward(self, x):                 # 8 floats
        a = x * 2                         # 32 bytes
        p0, p1 = torch.split(a, 4)        # views of a
        values, indices = torch.sort(a)   # two new storages: 32 bytes of floats, 64 of int64
        c = p0 * 2                        # 16
        d = p1 * 3                        # 16
        return c + d + values[:4] + indices[:4]


def test_multi_output_ops():
    x = torch.randn(8)
    gm = _capture(MultiOutput(), x)
    t = simulate_peak(gm)
    allocated = dict(zip(t.nodes, t.allocated))
    assert allocated["split"] == 0 and allocated["getitem"] == 0
    assert allocated["sort"] == 32 + 64
    during = _during(t)
    assert during["mul_2"] == 32 + 96 + 16 + 16   # a (split views alive), sort's two results, c, d
    assert t.peak_bytes == measure_peak(gm, x).peak_bytes


class Outputs(nn.Module):
    def forward(self, x):
        a = x * 2                         # 1 KiB, returned
        b = a * 3                         # 1 KiB, freed after the sum
        _ = b * 5                         # unused: freed right after it runs
        return a, b.sum()


def test_outputs_live_to_the_end_and_unused_values_die_at_once():
    x = torch.randn(256)
    gm = _capture(Outputs(), x)
    t = simulate_peak(gm)
    during, after = _during(t), _after(t)
    assert during["mul_2"] == 3 * 1024 and after["mul_2"] == 2 * 1024
    assert after["sum_1"] == 1024 + F32 == t.output_bytes
    assert t.peak_bytes == 3 * 1024 == measure_peak(gm, x).peak_bytes


@pytest.mark.parametrize("method", ["fx", "export"])
def test_parameters_and_inputs_are_not_activations(method):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU()).eval()
    x = torch.randn(4, 16)
    gm = _capture(model, x, method=method)
    t = simulate_peak(gm)
    assert t.peak_bytes == 2 * 4 * 32 * F32     # the linear's result and the relu's, nothing of the weights
    assert measure_peak(gm, x).peak_bytes == t.peak_bytes


class Scratch(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = nn.MaxPool2d(2)
        self.norm = nn.GroupNorm(2, 4)

    def forward(self, x):                             # 1x4x16x16: 4 KiB
        a = x * 2                                     # 4 KiB
        p = self.pool(a)                              # 1 KiB, and 2 KiB of int64 indices for an instant
        q = F.max_pool2d(a, 2, return_indices=True)   # indices returned: no scratch
        n = self.norm(q[0])                           # 1 KiB, mean and rstd: 2 x 2 floats
        m = F.layer_norm(p, (8,))                     # 1 KiB, mean and rstd: 32 floats each
        return n + m


def test_scratch_of_pooling_and_norms():
    x = torch.randn(1, 4, 16, 16)
    gm = _capture(Scratch(), x)
    t = simulate_peak(gm)
    scratch = dict(zip(t.nodes, t.scratch))
    assert scratch["pool"] == 2048 and scratch["max_pool2d_with_indices"] == 0
    assert scratch["norm"] == 2 * 2 * F32 and scratch["layer_norm"] == 2 * 32 * F32
    assert _during(t)["pool"] == 4096 + 1024 + 2048
    assert t.peak_bytes == measure_peak(gm, x).peak_bytes


def test_custom_order_and_invalid_orders():
    x = torch.randn(256)
    gm = _capture(Outputs(), x)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function" or n.op == "call_method"]
    assert names == ["mul", "mul_1", "mul_2", "sum_1"]
    later_dead = simulate_peak(gm, ["mul", "mul_1", "sum_1", "mul_2"])
    assert later_dead.peak_bytes == 3 * 1024 + F32     # the sum is alive too by then
    with pytest.raises(ValueError, match="before its input"):
        simulate_peak(gm, ["mul_1", "mul", "mul_2", "sum_1"])
    with pytest.raises(ValueError, match="leaves out"):
        simulate_peak(gm, ["mul", "mul_1"])
    with pytest.raises(ValueError, match="not a node"):
        simulate_peak(gm, ["mul", "nope"])


def test_rows_for_a_dataframe():
    gm = _capture(Views(), torch.randn(256))
    rows = simulate_peak(gm).rows()
    assert rows[0] == {"node": "x", "allocated": 0, "during": 0, "after": 0}
    assert max(r["during"] for r in rows) == 2048


def test_nodes_without_metadata_fall_back_to_op_semantics():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.mul, (x, 2))
    v = g.call_method("view", (a, -1))
    b = g.call_function(torch.add, (v, 1))
    g.output(b)
    gm = torch.fx.GraphModule(nn.Module(), g)
    x.meta["val"] = torch.empty(4)
    mem = GraphMemory(gm)
    assert mem.unknown == ["mul", "view", "add"]
    assert mem.refs[mem.index[v]] == mem.refs[mem.index[a]]     # a view: a's storage
    assert simulate_peak(gm).peak_bytes == 0                      # sizes unknown: counted as 0


def test_tracker_counts_only_storages_created_inside():
    weight = torch.randn(64, 64)
    with StorageTracker() as tracker:
        y = weight.t()                    # a view of a tensor from before: nothing
        z = y @ weight                    # 16 KiB
        del y
        w = z.relu()                      # 16 KiB more
        del z
    assert (tracker.allocations, tracker.peak, tracker.live) == (2, 2 * 16384, 16384)
    assert w.shape == (64, 64)


TEST_GRAPHS = {**BRANCHY, "inception": EXAMPLES["inception"]}


@pytest.mark.parametrize("name", ["randwire_n16", "wide_inception", "darts_cells", "unet", "densenet",
                                  "transformer_encoder", "resnet_cnn", "inception"])
def test_simulation_within_5_percent_of_measurement(name):
    model, inputs = TEST_GRAPHS[name]()
    gm = fxforge.capture(model, inputs).graph_module
    simulated = simulate_peak(gm).peak_bytes
    measured = measure_peak(gm, *inputs)
    assert measured.device == "cpu" and measured.allocator_peak_bytes is None
    assert abs(simulated - measured.peak_bytes) <= 0.05 * measured.peak_bytes, (simulated, measured)


def test_simulation_matches_an_exported_graph():
    model, inputs = BRANCHY["resnet_cnn"]()
    gm = fxforge.capture(model, inputs, method="export").graph_module
    simulated = simulate_peak(gm).peak_bytes
    measured = measure_peak(gm, *inputs).peak_bytes
    assert abs(simulated - measured) <= 0.05 * measured, (simulated, measured)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_peak():
    x = torch.randn(256 * 1024, device="cuda")          # 1 MiB blocks: no rounding
    gm = _capture(Outputs(), x)
    simulated = simulate_peak(gm).peak_bytes
    measured = measure_peak(gm, x)
    assert measured.device == "cuda"
    assert measured.tracked_peak_bytes == simulated
    assert measured.allocator_peak_bytes == simulated == measured.peak_bytes
