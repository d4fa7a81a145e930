"""fxforge.runtime.allocator: the CPU allocator's records of a block, its peaks and marks."""

from __future__ import annotations

import pytest
import torch

from fxforge.runtime.allocator import AllocatorRecords


def test_phases_split_the_block_at_its_marks():
    with AllocatorRecords() as records:
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(3000, dtype=torch.uint8)
        del b
        records.mark("first")
        c = torch.empty(500, dtype=torch.uint8)
        records.mark("second")
        del a, c
    phases = records.phases(["first", "second"])
    assert (phases["first"].peak_bytes, phases["first"].held_bytes) == (4000, 1000)
    assert (phases["second"].peak_bytes, phases["second"].held_bytes) == (1500, 1500)
    assert records.peak_bytes() == 4000 and records.held_bytes() == 0


def test_a_kernels_own_copy_is_seen_where_a_dispatch_mode_sees_none():
    from fxforge.runtime.memory import StorageTracker

    gradient = torch.ones(()).expand(256, 1000)     # a sum's gradient: strides (0, 0)
    weight = torch.randn(1000, 64)
    with AllocatorRecords() as records:
        torch.mm(gradient, weight)
    with StorageTracker() as tracker:
        torch.mm(gradient, weight)
    result, copy = 256 * 64 * 4, 256 * 1000 * 4
    assert tracker.peak == result
    assert records.peak_bytes() == result + copy


def test_an_error_inside_the_block_propagates():
    with pytest.raises(ValueError, match="inside"), AllocatorRecords():
        raise ValueError("inside")


def test_inside_another_profiler_session_it_refuses_rather_than_end_that_one():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as outer:
        with pytest.raises(RuntimeError, match="already recording"), AllocatorRecords():
            pass
        torch.ones(8).add(1)
    assert any(e.name == "aten::add" for e in outer.events())
