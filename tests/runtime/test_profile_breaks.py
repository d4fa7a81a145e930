"""``fxforge.profile`` of models TorchDynamo cuts into graphs: each graph between the breaks profiled node by node,
in one table numbered by graph; models captured whole profile exactly as before."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fxforge
from fxforge.core.nodes import CALL_OPS
from fxforge.runtime.profile import GraphsProfile
from fxforge.runtime.profile.table import COLUMNS

sys.path.insert(0, str(Path(__file__).parents[1] / "user_models"))
from with_breaks import BREAK_LINES, BREAK_MODELS


def _calls(graph_module):
    return [n.name for n in graph_module.graph.nodes if n.op in CALL_OPS]


@pytest.mark.parametrize("name", ["data_branch", "masked_pool", "ragged_loop"])
def test_each_graph_between_breaks_is_profiled_node_by_node(name):
    case = BREAK_MODELS[name]()
    state = {k: v.clone() for k, v in case.model.state_dict().items()}
    p = fxforge.profile(case.model, case.inputs, warmup=0, repeat=1)
    assert isinstance(p, GraphsProfile)
    assert list(p.table.columns) == ["graph", *COLUMNS]
    found = fxforge.capture(case.model, case.inputs, method="dynamo")
    assert len(p.parts) == len(found.graphs) >= 2
    for number, (part, (_, host, _)) in enumerate(zip(p.parts, found.graphs), 1):
        rows = p.table[p.table["graph"] == number]
        assert list(rows["node"]) == list(part.table["node"]) == _calls(host)  # every computing node, in order
    assert p.total_flops == sum(part.total_flops for part in p.parts) > 0
    assert any(BREAK_LINES[name] == b.code for b in p.breaks), p.breaks
    text = p.summary()
    assert f"{len(p.parts)} graphs" in text and BREAK_LINES[name] in text
    assert all(torch.equal(v, state[k]) for k, v in case.model.state_dict().items())  # the model left as it was
    svg = p.graph_svg(engine="builtin", graph=2)
    assert svg.startswith("<svg")
    with pytest.raises(ValueError, match="numbered from 1"):
        p.graph_svg(graph=len(p.parts) + 1)


def test_an_optimized_module_running_graph_by_graph_profiles_each_graphs_plan():
    case = BREAK_MODELS["data_branch"]()
    opt = fxforge.optimize(case.model, case.inputs)
    assert opt.dynamo is not None
    p = fxforge.profile(opt, case.inputs, warmup=0, repeat=1)
    assert isinstance(p, GraphsProfile) and p.what == "lowered graphs between breaks"
    assert len(p.parts) == len(opt.report.graphs)
    for number, (_, module) in enumerate(opt.dynamo.ordered(), 1):
        captured = module.captured
        plan = module.plan_for(*captured.example_args)
        assert list(p.table[p.table["graph"] == number]["node"]) == _calls(plan.executable)


class Percentile(torch.nn.Module):
    """``float(np.percentile(...))``: torch 2.13's dynamo traces the numpy call into a value ``float()`` rejects."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return torch.clamp(h, max=float(np.percentile(h.detach().numpy(), 90)))


def test_a_model_dynamo_cannot_run_keeps_the_capture_error():
    with pytest.raises(fxforge.CaptureError):  # no graphs to profile
        fxforge.profile(Percentile().eval(), (torch.randn(4, 8),), warmup=0, repeat=1)


def test_a_whole_graph_model_profiles_as_before():
    p = fxforge.profile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.ones(2, 4),),
                        warmup=0, repeat=1)
    assert type(p).__name__ == "Profile" and list(p.table.columns) == COLUMNS
