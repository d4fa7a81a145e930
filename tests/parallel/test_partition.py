"""fxforge.partition on real models (transformers GPT-2 and ResNet, small configs): where stages may begin,
what the units cost, the chosen split against the peers', the memory cap, the split spec PyTorch's
engine accepts, and the usage errors."""

from __future__ import annotations

import pytest
import torch

import fxforge
from fxforge.parallel.engine import build_pipe
from fxforge.parallel.partition import compare_policies
from fxforge.parallel.units import split_candidates, stage_units
from fxforge.runtime.roofline import Machine
from tests.training import models


@pytest.fixture(scope="module")
def gpt2():
    return models.gpt2(dropout=0.0, layers=4).eval()


# A fixed machine: the units' roofline costs, and so the splits' balance, are the same on every machine and
# whatever else runs beside the test.
MACHINE = Machine("cpu", 150.0, 25.0, "fixed")


@pytest.fixture(scope="module")
def gpt2_units(gpt2):
    return stage_units(gpt2, {"input_ids": models.ids(batch=8)}, microbatches=4, machine=MACHINE)


def test_stages_may_begin_at_each_block_and_inside_it(gpt2_units):
    names = gpt2_units.names
    assert names[0] == ""
    for layer in range(4):
        assert f"transformer.h.{layer}" in names and f"transformer.h.{layer}.mlp" in names
    assert "transformer.h" not in names          # a ModuleList is never called: no split point
    assert names[-1] == "lm_head"


def test_a_module_called_twice_is_no_split_point():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.ReLU()

        def forward(self, x):
            return self.act(self.b(self.act(self.a(x))))

    units = stage_units(Twice(), (torch.randn(4, 8),))
    assert "act" not in units.names and units.names == ["", "b"]
    assert split_candidates([["a"], ["a", "a.x"], ["b"]]) == {1: "a.x", 2: "b"}


def test_unit_costs_and_what_crosses(gpt2_units):
    units = gpt2_units
    assert (units.forward_seconds >= 0).all() and units.seconds.sum() > 0
    assert units.backward_seconds.sum() > units.forward_seconds.sum()          # backward is the larger half
    assert units.flops.sum() > 0 and units.saved_bytes.sum() > 0
    # The tied embedding is used by the first units and by lm_head: replicated to both ends.
    tied = [p for p in units.parameters if len(p.uses) > 1]
    assert [p.uses[-1] for p in tied] == [len(units) - 1]
    # The residual stream crosses every block boundary, carrying a gradient.
    residual = [v for v in units.values if v.grad and v.nbytes == 2 * 64 * 64 * 4]
    assert len(residual) >= 4


def test_microbatches_must_divide_the_batch(gpt2):
    with pytest.raises(ValueError, match="does not split into 3 equal microbatches"):
        stage_units(gpt2, {"input_ids": models.ids(batch=8)}, microbatches=3)


def test_fxforges_split_is_balanced_where_the_even_split_is_not(gpt2, gpt2_units):
    for stages in (2, 4):
        found = compare_policies(gpt2, None, stages, microbatches=4, units=gpt2_units)
        ours, even = found["fxforge"], found["even-layers"]
        assert ours.bottleneck_ratio <= min(1.10, even.bottleneck_ratio)
        assert stages == 2 or even.bottleneck_ratio > 1.10
        assert max(ours.stage_costs) <= max(even.stage_costs)
        assert ours.throughput["1F1B"] >= even.throughput["1F1B"]
        assert found["parameters"].bottleneck_ratio >= ours.bottleneck_ratio
    assert compare_policies(gpt2, None, 8, microbatches=4, units=gpt2_units, schedule="GPipe")["even-layers"] is None


def test_partition_figures_add_up(gpt2, gpt2_units):
    part = fxforge.partition(gpt2, None, 4, microbatches=4, units=gpt2_units)
    assert len(part.split_points) == 3 and len(part.stage_costs) == 4 and len(part.transfer_bytes) == 3
    assert sum(part.stage_forward_seconds) == pytest.approx(gpt2_units.forward_seconds.sum())
    assert all(c >= f + b for c, f, b in zip(part.stage_costs, part.stage_forward_seconds,
                                              part.stage_backward_seconds))
    assert all(t > 0 for t in part.transfer_bytes)
    assert list(part.split_spec) == part.split_points
    sim = part.simulate("GPipe")
    assert sim.makespan >= 4 * max(part.stage_forward_seconds[s] + part.stage_backward_seconds[s] for s in range(4))
    assert set(part.throughput) == {"1F1B", "GPipe"}
    text = str(part)
    assert "bottleneck ratio" in text and "stage 3" in text and "1F1B" in text
    assert list(part.table().columns)[:3] == ["stage", "begins_at", "units"]
    assert "<table" in part._repr_html_()


def test_a_memory_cap_is_respected_and_can_force_an_uneven_split(gpt2, gpt2_units):
    free = fxforge.partition(gpt2, None, 2, microbatches=4, units=gpt2_units)
    # A cap just under the balanced split's biggest stage: the split moves, the stages grow uneven.
    cap = int(max(free.stage_memory) * 0.97)
    capped = fxforge.partition(gpt2, None, 2, microbatches=4, units=gpt2_units, memory_per_stage=cap)
    assert max(capped.stage_memory) <= cap
    assert capped.split_points != free.split_points
    assert capped.bottleneck_ratio > free.bottleneck_ratio
    assert capped.memory_per_stage == cap
    with pytest.raises(ValueError, match=r"no split into 2 stages fits 0.1 MiB .* least any split needs is about"):
        fxforge.partition(gpt2, None, 2, microbatches=4, units=gpt2_units, memory_per_stage="0.1MiB")


def test_gpipe_holds_more_activations_than_1f1b(gpt2, gpt2_units):
    one = fxforge.partition(gpt2, None, 2, microbatches=4, units=gpt2_units)
    gpipe = fxforge.partition(gpt2, None, 2, microbatches=4, units=gpt2_units, schedule="GPipe")
    assert one.split_points == gpipe.split_points
    assert gpipe.stage_memory[1] > one.stage_memory[1]      # 4 microbatches in flight against 1


def test_torchs_engine_makes_the_stages_and_the_model_is_left_as_it_was(gpt2, gpt2_units):
    part = fxforge.partition(gpt2, None, 4, microbatches=4, units=gpt2_units)
    pipe = part.pipe()
    assert pipe.num_stages == 4
    held = [{n for n, _ in pipe.get_stage_module(s).named_parameters()} for s in range(4)]
    assert "transformer.h.0.attn.c_attn.weight" in held[0] and "lm_head.weight" in held[3]
    for name in part.split_points:
        assert "forward" not in gpt2.get_submodule(name).__dict__        # split markers removed
    with pytest.raises(ValueError, match="rank 4 has no stage"):
        part.build_stage(4, "cpu")


def test_resnet_splits_between_and_inside_blocks():
    model = models.resnet().eval()
    part = fxforge.partition(model, (models.images(batch=8),), 4)        # one microbatch per stage
    assert part.bottleneck_ratio <= 1.10
    assert build_pipe(model, part.units.microbatch, part.split_spec, 4).num_stages == 4


@pytest.mark.parametrize("kwargs,message", [
    ({"stages": 0}, "stages must be a positive int"),
    ({"stages": 2, "microbatches": 0}, "microbatches must be a positive int"),
    ({"stages": 4, "microbatches": 2}, "1F1B needs at least as many microbatches as stages"),
    ({"stages": 2, "schedule": "zb"}, "schedule 'zb'"),
    ({"stages": 2, "policy": "random"}, "policy 'random'"),
    ({"stages": 2, "memory_per_stage": "50%"}, "give bytes"),
    ({"stages": 99}, "places to split"),
])
def test_usage_errors(gpt2, gpt2_units, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fxforge.partition(gpt2, None, units=gpt2_units, **kwargs)


class InPlaceResidual(torch.nn.Module):
    """``h += r`` right after ``b``: a stage beginning at ``b`` would change the tensor it received."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Linear(512, 64))
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.a(x)
        r = self.b(x)
        h += r
        return self.c(h)


def test_a_split_point_that_fails_on_torchs_engine_is_refused_with_its_reason():
    model = InPlaceResidual()
    x = (torch.randn(8, 64),)
    # A fixed machine: on the measured one the balanced split moves with the bandwidth a loaded machine reads
    # (under 10 GB/s the stage boundary inside ``a`` wins).
    machine = Machine("cpu", peak_gflops=400.0, bandwidth_gbs=20.0, measured_at="2026-01-01T00:00:00+00:00")
    unchecked = fxforge.partition(model, x, 2, validate=False, machine=machine)
    assert unchecked.split_points == ["b"]                   # the balanced split, which torch cannot run
    part = fxforge.partition(model, x, 2, machine=machine)
    assert part.split_points in (["a.1"], ["c"])            # the next best places that run
    assert list(part.refused) == ["b"] and "in-place" in part.refused["b"]
    assert "refused to begin a stage at b" in str(part)
    assert part.pipe().num_stages == 2


def test_measured_costs_time_every_unit_on_real_data(gpt2):
    units = stage_units(gpt2, {"input_ids": models.ids(batch=4)}, microbatches=2, costs="measured")
    assert (units.forward_seconds > 0).sum() >= len(units) - 1        # the first unit may hold only a view
    assert units.backward_seconds.sum() > 0
    part = fxforge.partition(gpt2, None, 2, units=units, validate=False)
    assert len(part.split_points) == 1
    with pytest.raises(ValueError, match="costs 'guess'"):
        stage_units(gpt2, {"input_ids": models.ids(batch=4)}, costs="guess")
