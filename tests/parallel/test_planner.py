"""fxforge.parallelize: every mesh priced, the fastest that fits chosen, refusals with the figure
(fxforge/parallel/planner.py, plan.py, device_memory.py, step_costs.py). One process: no run here
(test_mesh_run.py runs plans)."""

from __future__ import annotations

import pytest
import torch

import fxforge
from fxforge.core.links import Link
from fxforge.parallel.collectives import total_bytes
from fxforge.parallel.planner import local_model, shard_dims
from tests.parallel.mesh_models import residual_mlp

LINK = Link("test link", alpha_s=50e-6, bandwidth_gbs=1.0, source="a round figure for the tests")


@pytest.fixture(scope="module")
def plan():
    return fxforge.parallelize(residual_mlp(), (torch.randn(8, 64),), devices=2, link=LINK)


def test_every_mesh_is_priced_and_the_fastest_that_fits_is_chosen(plan):
    table = plan.candidates
    assert set(table.strategy) == {"dp2", "fsdp2", "tp2", "pp2"}
    assert list(table.columns[:3]) == ["strategy", "step_s", "compute_s"]
    assert {"memory_per_device", "comm_bytes", "fits", "reason"} <= set(table.columns)
    assert table.step_s.iloc[0] == table.step_s.min() and plan.chosen.name == table.strategy.iloc[0]
    assert sum(plan.strategy.values()) - len(plan.strategy) + 1 == 2 and set(plan.strategy) == {"pp", "dp", "fsdp", "tp"}
    assert plan.chosen.name in plan.why and "fastest predicted step that fits" in plan.why
    assert all(abs(c.step_s - c.compute_s - c.comm_s) < 1e-12 for c in [plan.chosen])
    assert plan.chosen.comm_bytes == total_bytes(plan.collectives)
    text = str(plan)
    assert "candidates:" in text and "test link" in text


def test_the_figures_follow_the_mesh(plan):
    rows = plan.candidates.set_index("strategy")
    # data parallel keeps every weight, gradient and AdamW state; fully sharded keeps half of each
    assert rows.loc["fsdp2", "memory_per_device"] < rows.loc["dp2", "memory_per_device"]
    # DDP all-reduces every gradient once: 4 bytes per parameter
    params = sum(p.numel() for p in residual_mlp().parameters())
    assert rows.loc["dp2", "comm_bytes"] == 4 * params
    # FSDP2 gathers the parameters twice (forward; backward for the blocks) and reduce-scatters the gradients
    assert rows.loc["fsdp2", "comm_bytes"] > 2 * 4 * params
    # tensor parallel moves activations, not weights: far fewer bytes here
    assert rows.loc["tp2", "comm_bytes"] < rows.loc["dp2", "comm_bytes"]


def test_a_mesh_over_the_memory_is_refused_with_the_figure(plan):
    model, batch = residual_mlp(), (torch.randn(8, 64),)
    need = plan.candidates.set_index("strategy").memory_per_device       # the same model, no cap
    cap = int((need["dp2"] + need["fsdp2"]) / 2)                        # fsdp fits, dp does not
    capped = fxforge.parallelize(model, batch, devices=2, memory_per_device=cap, link=LINK, pipeline=False)
    rows = capped.candidates.set_index("strategy")
    assert not rows.loc["dp2", "fits"] and "per device, over the" in rows.loc["dp2", "reason"]
    assert capped.chosen.fits and capped.chosen.memory_per_device <= cap
    with pytest.raises(ValueError, match=r"nothing fits in 1.0 KiB per device; the smallest need is"):
        fxforge.parallelize(model, batch, devices=2, memory_per_device=1024, link=LINK, pipeline=False)


def test_a_forced_mesh_and_a_batch_that_does_not_split():
    model = residual_mlp()
    plan = fxforge.parallelize(model, (torch.randn(8, 64),), mesh={"tp": 2}, link=LINK)
    assert plan.devices == 2 and plan.strategy == {"pp": 1, "dp": 1, "fsdp": 1, "tp": 2}
    assert list(plan.candidates.strategy) == ["tp2"]
    assert plan.tp_plan["layers.0.up"] == "colwise" and plan.tp_plan["layers.0.down"] == "rowwise"
    odd = fxforge.parallelize(model, (torch.randn(3, 64),), devices=2, link=LINK, pipeline=False)
    assert set(odd.candidates.strategy) == {"tp2"}
    assert any("3 rows does not split over 2 replicas" in note for note in odd.notes)


def test_shard_dims_and_the_local_model_keep_ties():
    from transformers.pytorch_utils import Conv1D

    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(10, 4)
    model.c = Conv1D(8, 4)                        # weight [in=4, out=8]
    model.r = Conv1D(4, 8)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.emb.weight
    dims = shard_dims(model, {"emb": "vocab", "c": "colwise", "r": "rowwise", "head": "vocab"})
    assert dims == {"emb.weight": 0, "c.weight": 1, "c.bias": 0, "r.weight": 0, "r.bias": None, "head.weight": 0}
    local = local_model(model, dims, 2)
    assert local.head.weight is local.emb.weight and tuple(local.emb.weight.shape) == (5, 4)
    assert tuple(local.c.weight.shape) == (4, 4) and tuple(local.r.weight.shape) == (4, 4)
    assert local.emb.weight.is_meta and not model.emb.weight.is_meta


def test_planning_leaves_the_model_as_it_was():
    """Every rank and pipeline stage is built and stepped on copies (their optimizers step on what fake
    collectives produced): the user's weights are untouched."""
    model = residual_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fxforge.parallelize(model, (torch.randn(8, 64),), devices=2, link=LINK)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_pipeline_stage_holds_its_optimizer_state():
    model, batch = residual_mlp(), (torch.randn(8, 64),)
    with_adam = fxforge.parallelize(model, batch, mesh={"pp": 2}, link=LINK)
    without = fxforge.parallelize(model, batch, mesh={"pp": 2}, link=LINK, optimizer=None)
    part = with_adam.chosen.partition
    params = [sum(p.numel() * p.element_size() for p in part.pipe().get_stage_module(s).parameters())
              for s in range(2)]
    # AdamW keeps two moments of every weight of the stage (and a step count per parameter)
    assert with_adam.chosen.memory_per_device - without.chosen.memory_per_device >= 2 * min(params)


def test_each_blocking_collective_pays_the_links_in_step_wait(monkeypatch):
    # The same plan on a link that says each collective waits 1 ms plus 10 % of the compute before it: a mesh
    # pays exactly that on top of its collectives.
    import dataclasses

    monkeypatch.setattr("fxforge.parallel.twins.Twins.__enter__", lambda self: self)
    waiting = dataclasses.replace(LINK, sync_s=1e-3, sync_fraction=0.1)
    model, batch = residual_mlp(), (torch.randn(8, 64),)
    plan = fxforge.parallelize(model, batch, devices=2, link=waiting, pipeline=False, mesh={"fsdp": 2})
    c = plan.chosen
    bare = sum(LINK.seconds(x.kind, x.nbytes, x.ranks) for x in c.collectives)
    assert c.comm_s == pytest.approx(bare + len(c.collectives) * 1e-3 + 0.1 * c.compute_s)
    assert len(c.collectives) > 0
