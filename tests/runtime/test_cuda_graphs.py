"""CUDA graph replay of a plan (fxforge.runtime.cuda_graphs): the replay logic on CPU with a stand-in graph that
writes into the outputs its capture made, as a CUDA graph does; the real capture where a device is lent."""

import pytest
import torch
from torch import nn

import fxforge
from fxforge.lowering.build import build_plan
from fxforge.lowering.schedule import independent_branches
from fxforge.runtime.cuda_graphs import GraphReplay, graph_refusal, with_cuda_graph
from fxforge.runtime.interop import concurrent_module


class StandIn:
    """Replays write into the outputs the capture made; captures are counted."""

    made = 0

    def capture(self, fn):
        StandIn.made += 1
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self):
        new = self.fn()
        for static, value in zip(torch.utils._pytree.tree_leaves(self.out), torch.utils._pytree.tree_leaves(new)):
            static.copy_(value)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2)).eval()


def test_replay_copies_inputs_in_and_outputs_out():
    replay = GraphReplay(lambda x, scale=1.0: {"y": x * scale}, graph_factory=StandIn)
    first = replay(torch.ones(2), scale=2.0)["y"]
    second = replay(torch.full((2,), 5.0), scale=2.0)["y"]
    assert first.tolist() == [2.0, 2.0] and second.tolist() == [10.0, 10.0]  # the first output is not overwritten
    assert replay.captures == 1


def test_a_new_signature_or_mode_or_replaced_value_captures_again():
    pointer = [1]
    replay = GraphReplay(lambda x: x + 1, watched=lambda: (pointer[0],), graph_factory=StandIn)
    replay(torch.ones(2))
    replay(torch.ones(3))                                  # shape
    replay(torch.ones(3, dtype=torch.float64))             # dtype
    with torch.inference_mode():
        replay(torch.ones(3, dtype=torch.float64))         # mode
    pointer[0] = 2                                          # a prepacked value recomputed into new storage
    replay(torch.ones(3, dtype=torch.float64))
    assert replay.captures == 5


def test_graphs_with_effects_or_branches_on_streams_are_refused():
    assert "effects" in graph_refusal(torch.fx.symbolic_trace(lambda x: torch.nn.functional.dropout(x, 0.5, True)))
    gm = torch.fx.symbolic_trace(lambda x: torch.cat([x.sin(), x.cos()]))
    assert "side streams" in graph_refusal(concurrent_module(gm, independent_branches(gm), [[[0], [1]]]))
    assert "not a graph" in graph_refusal(lambda x: x)


def test_a_plan_replayed_answers_as_the_model_and_follows_its_weights():
    model, x = net(), torch.randn(1, 3, 8, 8)
    model(x)
    plan = build_plan(model, (x,), {})
    replayed = with_cuda_graph(plan, (x,), {}, graph_factory=StandIn, always=True)
    assert replayed is not plan and isinstance(replayed.executable, GraphReplay)
    assert plan.report.tuning[-1].rule == "cuda_graph" and plan.report.tuning[-1].choice == "graph"
    with torch.no_grad():
        torch.testing.assert_close(replayed.executable(x), model(x))
        model[4].weight.mul_(-1)  # in place: read by the next replay
        replayed.derived.refresh_if_stale()
        torch.testing.assert_close(replayed.executable(x), model(x))


def test_cpu_plans_are_left_alone():
    model, x = net(), torch.randn(1, 3, 8, 8)
    model(x)
    opt = fxforge.optimize(model, (x,))
    assert not any(t.rule == "cuda_graph" for t in opt.report.tuning)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a real graph capture")
def test_cuda_plan_replayed_as_a_graph_answers_as_eager():
    model = net().cuda()
    x = torch.randn(1, 3, 8, 8, device="cuda")
    model(x)
    opt = fxforge.optimize(model, (x,), cuda_graphs="always", inter_op=False)
    assert any(t.rule == "cuda_graph" and t.choice == "graph" for t in opt.report.tuning)
    with torch.no_grad():
        for _ in range(3):
            y = torch.randn(1, 3, 8, 8, device="cuda")
            torch.testing.assert_close(opt(y), model(y), rtol=1e-3, atol=1e-4)
        model[4].weight.mul_(-1)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-3, atol=1e-4)
        assert opt(torch.randn(2, 3, 8, 8, device="cuda")).shape == (2, 2)  # another size: captured again
