"""Steps timed beside the other ranks' twins (fxforge/parallel/twins.py) and what the planner does with them:
each replica count's own slice of the batch is timed (not the whole batch divided), and a model another process
cannot load is timed alone with a note that says so."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import fxforge
from fxforge.core.links import Link
from fxforge.parallel import planner as planner_module
from fxforge.parallel.twins import Twins, TwinsUnavailable
from tests.parallel.mesh_models import residual_mlp

LINK = Link("test link", alpha_s=50e-6, bandwidth_gbs=1.0, source="a round figure for the tests")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads a process's CPU time from /proc")
def test_the_twins_compute_inside_the_block_and_are_gone_after_it():
    model, x = residual_mlp(), torch.randn(8, 64)
    with Twins(model, (x,), {}, threads=1, count=2) as twins:
        procs = list(twins._procs)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        before = [_cpu_seconds(p.pid) for p in procs]
        time.sleep(0.5)
        assert all(_cpu_seconds(p.pid) > b for p, b in zip(procs, before))  # each is running the step
    assert all(p.poll() is not None for p in procs)


def test_a_model_another_process_cannot_load_is_refused_with_the_reason():
    class Local(torch.nn.Module):                     # defined in a function: no process can import it
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.layer(x)

    with pytest.raises(TwinsUnavailable, match="cannot be saved for another process"), \
            Twins(Local(), (torch.randn(2, 4),), {}, threads=1, count=1):
        pass


def test_each_replica_count_is_priced_from_its_own_slice_timed_beside_the_twins(monkeypatch):
    timed, beside = [], []

    class Recording(Twins):
        def __enter__(self):
            beside.append((self.count, self.args[0].shape[0]))
            return self                               # no processes: the figures below are fake

    def fake_time_step(model, args, kwargs, loss_fn, optimizer_factory, *, threads, repeats=5):
        rows = args[0].shape[0]
        timed.append(rows)
        return 1e-3 * (2 + rows), 1e-4               # a fixed cost per step: half the rows is not half the time

    monkeypatch.setattr("fxforge.parallel.twins.Twins", Recording)
    monkeypatch.setattr(planner_module, "time_step", fake_time_step)
    plan = fxforge.parallelize(residual_mlp(), (torch.randn(8, 64),), devices=2, link=LINK, pipeline=False)
    assert beside == [(1, 4)]                          # one twin (the other rank) on a replica's slice
    assert sorted(timed) == [4, 4, 8, 8]              # the whole batch; the DDP, FSDP2 and TP ranks (as built, the
                                                      # model's own 2-replica slice is not timed)
    rows = plan.candidates.set_index("strategy")
    assert rows.loc["dp2", "compute_s"] == pytest.approx(6e-3 + 1e-4)       # the 4-row step as timed, not 10/2
    assert not any("timed alone" in note for note in plan.notes)


def test_the_planner_times_alone_with_a_note_when_the_twins_cannot_run(monkeypatch):
    def unavailable(self):
        raise TwinsUnavailable("the model cannot be saved for another process (a test says so)")

    monkeypatch.setattr("fxforge.parallel.twins.Twins.__enter__", unavailable)
    plan = fxforge.parallelize(residual_mlp(), (torch.randn(8, 64),), devices=2, link=LINK, pipeline=False)
    assert any(note.startswith("steps timed alone, not beside the other ranks' twins") and "a test says so" in note
               for note in plan.notes)
    assert plan.chosen.compute_s > 0


def test_every_candidate_but_pipelines_is_priced_from_rank_zeros_step_as_built(monkeypatch):
    from torch.distributed.tensor import DTensor

    seen = []

    def fake_time_step(model, args, kwargs, loss_fn, optimizer_factory, *, threads, repeats=5):
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        fully = type(model).__name__.startswith("FSDP")
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        seen.append((sharded, fully, ddp, args[0].shape[0]))
        built = 9e-3 if fully else 7e-3 if sharded else 5e-3 if ddp else 1e-3 * (2 + args[0].shape[0])
        return built, 1e-4

    monkeypatch.setattr("fxforge.parallel.twins.Twins.__enter__", lambda self: self)
    monkeypatch.setattr(planner_module, "time_step", fake_time_step)
    model = residual_mlp()
    plan = fxforge.parallelize(model, (torch.randn(8, 64),), devices=2, link=LINK, pipeline=False)
    assert (True, False, False, 8) in seen             # the TP plan built under a fake group of 2, whole batch
    assert (True, True, False, 4) in seen              # FSDP2 over 2 ranks, a replica's half of the batch
    assert (False, False, True, 4) in seen             # DDP over 2 ranks, half the batch
    rows = plan.candidates.set_index("strategy")
    assert rows.loc["tp2", "compute_s"] == pytest.approx(7e-3 + 1e-4)
    assert rows.loc["fsdp2", "compute_s"] == pytest.approx(9e-3 + 1e-4)   # not the model's 6e-3 on 4 rows
    assert rows.loc["dp2", "compute_s"] == pytest.approx(5e-3 + 1e-4)
    assert not torch.distributed.is_initialized()      # the fake group is gone
    assert not any(isinstance(p, DTensor) for p in model.parameters())   # built on copies
