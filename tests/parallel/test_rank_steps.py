"""Rank 0's step as the mesh builds it, timed under a fake process group (fxforge/parallel/rank_steps.py): every
layout the planner offers but pipelines at 4 devices builds and steps here, on copies."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fxforge.parallel.launch import square_mean_loss
from fxforge.parallel.planner import tp_degrees
from fxforge.parallel.rank_steps import built, built_peaks, built_steps, stage_steps
from fxforge.parallel.strategy import meshes
from tests.parallel.mesh_models import residual_mlp


def test_every_sharded_layout_at_four_devices_builds_and_steps_on_a_copy():
    from torch.distributed.tensor import DTensor

    model, x = residual_mlp(), torch.randn(8, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plans = tp_degrees(model, (x,), 4)
    options = meshes(4, tp_degrees=plans, pipeline=True, max_stages=3)
    seen = {}

    def timer(local, args, kwargs, loss_fn, optimizer_factory, *, threads):
        local(*args, **kwargs).pow(2).mean().backward()          # one real step of the built rank
        seen[len(seen)] = (args[0].shape[0], sum(isinstance(p, DTensor) for p in local.parameters()))
        return 2e-3, 1e-4

    times = built_steps(model, options, plans, (x,), {}, square_mean_loss, torch.optim.AdamW, threads=1, timer=timer)
    assert {"dp4", "fsdp4", "dp2 x fsdp2", "fsdp2 x tp2", "dp2 x tp2"} <= set(times)
    assert not any(name.startswith("pp") for name in times)             # pipelines are timed by their stages
    sharded = [params for _, params in seen.values()]
    assert sum(p == 0 for p in sharded) == 1                            # DDP alone keeps plain parameters
    assert min(rows for rows, _ in seen.values()) == 2                    # dp4, fsdp4: a quarter of the batch
    assert not dist.is_initialized()
    assert all(torch.equal(before[k], v) and not isinstance(v, DTensor) for k, v in model.state_dict().items())


def test_which_meshes_are_built():
    assert [built(m) for m in ({"dp": 4}, {"pp": 2}, {"fsdp": 2}, {"tp": 2}, {"pp": 2, "tp": 2}, {})] == \
        [True, False, True, True, False, False]


class IndexCarrier(torch.nn.Module):
    """Two blocks with token ids passed from the first to the second, as a model that re-embeds positions."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.first = torch.nn.Linear(16, 16)
        self.second = torch.nn.Linear(16, 16)
        self.again = torch.nn.Embedding(50, 16)

    def forward(self, ids):
        h = self.first(self.embed(ids))
        return self.second(h) + self.again(ids)


def test_each_pipeline_stage_steps_as_built_or_says_why_it_cannot():
    import fxforge

    model, x = residual_mlp(), torch.randn(8, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    part = fxforge.partition(model, (x,), 2)
    steps = stage_steps(part, (x,), {}, square_mean_loss, torch.optim.AdamW, threads=1)
    assert len(steps) == 2 and all(s.forward_backward > 0 and s.optimizer > 0 for s in steps)
    # each stage holds at least its weights, their gradients and AdamW's two moments
    for index, s in enumerate(steps):
        weights = sum(p.numel() * 4 for p in part.pipe().get_stage_module(index).parameters())
        assert s.peak_bytes >= 4 * weights
    assert not dist.is_initialized()
    # the stages stepped their optimizers on copies: the model's weights are its own
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ids = torch.randint(0, 50, (8, 6))
    carrier = fxforge.partition(IndexCarrier(), (ids,), 2)          # every split sends the ids on
    why = stage_steps(carrier, (ids,), {}, square_mean_loss, None, threads=1)
    assert isinstance(why, str) and why.startswith("stage 1 receives") and "torch.int64" in why


def test_a_pipeline_is_priced_from_its_stages_as_built(monkeypatch):
    import fxforge
    from fxforge.core.links import Link
    from fxforge.parallel import rank_steps

    monkeypatch.setattr("fxforge.parallel.twins.Twins.__enter__", lambda self: self)
    monkeypatch.setattr(rank_steps, "stage_steps", lambda part, *a, **k: [rank_steps.StageStep(0.2, 0.01, 7 << 20),
                                                                           rank_steps.StageStep(0.1, 0.03, 5 << 20)])
    link = Link("test link", alpha_s=50e-6, bandwidth_gbs=1.0, source="a round figure for the tests")
    plan = fxforge.parallelize(residual_mlp(), (torch.randn(8, 64),), devices=2, link=link, mesh={"pp": 2})
    part = plan.chosen.partition
    # stage 0 twice stage 1's work: the makespan is at least stage 0's whole step, and the optimizers run after
    assert 0.2 + 0.03 <= plan.chosen.compute_s < 0.2 + 0.1 + 0.03
    assert part.stages == 2 and not any("nodes' times" in note for note in plan.notes)
    assert plan.chosen.memory_per_device == 7 << 20          # the larger stage's peak as built
    # each send holds two stages: on a link with in-step waits, each stage pays them for its share of the sends,
    # over the busiest stage's compute
    import dataclasses
    import math

    waiting = dataclasses.replace(link, sync_s=1e-3, sync_fraction=0.1)
    slow = fxforge.parallelize(residual_mlp(), (torch.randn(8, 64),), devices=2, link=waiting, mesh={"pp": 2})
    sends = slow.chosen.collectives
    bare = sum(link.seconds("send", c.nbytes, 2) for c in sends)
    assert slow.chosen.comm_s == pytest.approx(bare + math.ceil(2 * len(sends) / 2) * 1e-3 + 0.1 * 0.2)


def test_tensor_parallel_and_fully_sharded_ranks_are_held_to_their_peaks_as_built(monkeypatch):
    import fxforge
    from fxforge.core.links import Link
    from fxforge.parallel import rank_steps

    model, x = residual_mlp(), torch.randn(8, 64)
    plans = tp_degrees(model, (x,), 2)
    peaks = built_peaks(model, {"tp": 2}, plans[2], (x,), {}, square_mean_loss)
    assert 0 < peaks["forward"] < peaks["backward"] and not dist.is_initialized() and "optimizer" not in peaks
    # with an optimizer, its step's peak too: the gradients and its temporaries, its state made before (kept)
    with_step = built_peaks(model, {"tp": 2}, plans[2], (x,), {}, square_mean_loss, torch.optim.AdamW)
    local_weights = sum(p.numel() * 4 for p in model.parameters()) // 2
    assert local_weights // 2 < with_step["optimizer"] < 4 * local_weights
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    monkeypatch.setattr("fxforge.parallel.twins.Twins.__enter__", lambda self: self)
    monkeypatch.setattr(rank_steps, "built_peaks",
                        lambda *a, **k: {"forward": 3 << 20, "backward": 5 << 20, "optimizer": 7 << 20})
    link = Link("test link", alpha_s=50e-6, bandwidth_gbs=1.0, source="a round figure for the tests")
    plan = fxforge.parallelize(model, (x,), devices=2, link=link, pipeline=False)
    tp2 = next(c for c in plan.options if c.name == "tp2")
    dp2 = next(c for c in plan.options if c.name == "dp2")
    parts = tp2.memory
    assert parts["activations"] == 3 << 20
    assert parts["peak"] == parts["weights"] + parts["buffers"] + parts["optimizer_state"] + (7 << 20)
    assert dp2.memory["activations"] != 3 << 20                  # DDP keeps the training-memory model
    # a fully sharded rank too: its measured peaks hold the gathered blocks, which are not added again
    fsdp2 = next(c for c in plan.options if c.name == "fsdp2")
    parts = fsdp2.memory
    assert parts["gathered"] > 0
    assert parts["peak"] == parts["weights"] + parts["buffers"] + parts["optimizer_state"] + (7 << 20)
