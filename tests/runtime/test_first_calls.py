"""New sizes after optimize cost little (issue 48, item 2): a model optimized on one example (often of batch 1)
and then called at other batches, image sizes and lengths re-plans at most once per dim that becomes dynamic,
never specialises on a batch or a length of 1, and matches eager at every size.

The models are written here the way users write them (a small U-Net-like conv net, a GRU regressor, token
models with an LSTM or attention), so that the checks do not lean on one model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from fxforge.core.captured import Captured
from fxforge.core.plan import Plan
from fxforge.core.report import Report
from fxforge.runtime.plan_policy import ShapePolicy, dims_for, grown_dims
from fxforge.runtime.plans import PlanCache
from fxforge.runtime.signature import input_signature

sys.path.insert(0, str(Path(__file__).parents[1] / "user_models"))
from hand_written import USER_MODELS


class TinyUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.mid = nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.head = nn.Conv2d(16, 2, 1)

    def forward(self, x):
        d = self.down(x)
        m = F.relu(self.mid(F.max_pool2d(d, 2)))
        return self.head(torch.cat([self.up(m), d], dim=1))


class TokenTagger(nn.Module):
    """Token ids -> embeddings plus positions -> one attention layer -> tags."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.pos = nn.Embedding(64, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 5)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.out(self.attn(x, x, x, need_weights=False)[0])


def _same_as_eager(opt: nn.Module, model: nn.Module, *inputs: torch.Tensor) -> None:
    with torch.no_grad():
        torch.testing.assert_close(opt(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)


def _settled(model: nn.Module, x: torch.Tensor) -> nn.Module:
    model.train()
    with torch.no_grad():
        model(x)
    return model.eval()


def test_new_image_sizes_and_batches_after_a_batch_of_one_cost_no_capture():
    torch.manual_seed(0)
    model = _settled(TinyUNet(), torch.randn(4, 3, 16, 16))
    opt = fxforge.optimize(model, (torch.randn(1, 3, 16, 16),))
    assert opt.plans_built == 1
    for shape in [(2, 3, 16, 12), (1, 3, 24, 24), (3, 3, 8, 16), (1, 3, 16, 16), (2, 3, 16, 12)]:
        _same_as_eager(opt, model, torch.randn(shape))
    assert opt.plans_built == 1  # the torch.fx plan serves every size, each new one checked against eager once
    assert opt.cache.plans_reused == 3
    assert sum("served new sizes" in note for note in opt.cache.notes) == 3


def test_a_gru_on_float_sequences_serves_new_lengths_and_a_batch_of_one_without_a_re_plan():
    torch.manual_seed(0)
    case = USER_MODELS["gru"]()
    opt = fxforge.optimize(case.model, case.inputs)
    for inputs in [*case.fresh, (torch.randn(2, 3, 6),)]:
        _same_as_eager(opt, case.model, *inputs)
    assert opt.plans_built == 1


def test_a_token_model_optimized_on_a_batch_of_one_serves_batch_three_with_the_same_plan():
    torch.manual_seed(0)
    model = TokenTagger().eval()
    opt = fxforge.optimize(model, (torch.randint(0, 50, (1, 8)),))
    plan = opt.cache.last
    assert plan.shapes is not None  # batch and length dynamic from the first plan, the batch of 1 not specialised
    for shape in [(3, 8), (2, 21), (1, 5), (4, 1)]:
        _same_as_eager(opt, model, torch.randint(0, 50, shape))
        assert opt.cache.last is plan
    assert opt.plans_built == 1
    assert any("stand-in size of 2" in note for note in plan.report.notes)


def test_an_lstm_whose_length_torch_export_specialises_serves_every_new_length_without_a_re_plan():
    case = USER_MODELS["lstm"]()
    opt = fxforge.optimize(case.model, case.inputs)
    # torch.export unrolls the LSTM over the length, which the token inputs want dynamic: optimize builds a torch.fx
    # plan instead, which serves every later size once checked against eager
    assert opt.cache.last.captured.method == "fx" and opt.cache.last.shapes is None
    built = opt.plans_built
    for inputs in [*case.fresh, (torch.randint(0, 100, (3, 7)),), (torch.randint(0, 100, (1, 1)),)]:
        _same_as_eager(opt, case.model, *inputs)
    assert opt.plans_built == built
    assert opt.cache.plans_reused == 5


class Flatten(nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], -1) * 2


def test_a_graph_that_baked_its_example_sizes_is_not_reused_and_the_call_matches_eager():
    model = Flatten()
    baked = torch.fx.symbolic_trace(lambda x: x.reshape(2, -1) * 2)  # what a graph that read sizes once holds
    built = []

    def build(args, kwargs, conditions, dynamic=None):
        built.append(dynamic)
        graph = baked if len(built) == 1 else torch.fx.symbolic_trace(model)
        captured = Captured(graph, "fx", [], args, kwargs, model, False, Report(method="fx"))
        return Plan(captured, graph)

    cache = PlanCache(model, build)
    with torch.no_grad():
        cache((torch.ones(2, 6),), {})
        x = torch.randn(3, 6)
        torch.testing.assert_close(cache((x,), {}), model(x))  # the reuse check failed: eager's answer
        assert len(built) == 1 and any("differs from eager" in note for note in cache.notes)
        torch.testing.assert_close(cache((x,), {}), model(x))  # its next call gets a plan of its own
        assert len(built) > 1 and cache.last.executable is not baked
    assert cache.plans_reused == 0


def test_one_changed_spatial_dim_makes_its_sibling_and_the_batch_dynamic():
    image = input_signature((torch.ones(2, 3, 64, 48),), {}, False)
    assert grown_dims(image, {(0, 3)}) == {(0, 0), (0, 2), (0, 3)}
    first = input_signature((torch.ones(1, 3, 64, 64),), {}, False)
    assert dims_for(ShapePolicy(), image, [first], set()) == frozenset({(0, 0), (0, 2), (0, 3)})
    assert dims_for(ShapePolicy(dynamic=False), image, [first], set()) is None


@pytest.mark.parametrize("batch", [1, 3])
def test_a_shape_generic_capture_on_a_batch_of_one_is_traced_at_a_stand_in_and_serves_one(batch):
    from fxforge.capture.dynamic import capture_with_dims

    model = nn.Sequential(nn.Linear(4, 4), nn.GELU()).eval()
    captured = capture_with_dims(model, (torch.randn(batch, 5, 4),), {}, {(0, 0), (0, 1)})
    assert captured.example_args[0].shape[0] == max(batch, 2)
    assert all(int(r.lower) == 1 for r in captured.graph_module.meta["fxforge_ranges"].values())
    x = torch.randn(1, 1, 4)
    torch.testing.assert_close(captured.graph_module(x), model(x))
