"""The pipeline simulator (fxforge/parallel/simulate.py) against step times worked out by hand."""

from __future__ import annotations

import pytest

from fxforge.parallel.simulate import schedule_order, simulate_pipeline


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (3, 3)])
def test_balanced_stages_take_the_textbook_time(schedule, stages, microbatches):
    # (m + k - 1) forwards and (m + k - 1) backwards on the critical path.
    sim = simulate_pipeline([1.0] * stages, [2.0] * stages, microbatches=microbatches, schedule=schedule)
    assert sim.makespan == pytest.approx((microbatches + stages - 1) * 3.0)
    assert sim.bubble == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_the_slowest_stage_sets_the_pace():
    fast = simulate_pipeline([1.0, 1.0], [1.0, 1.0], microbatches=16)
    slow = simulate_pipeline([1.0, 2.0], [1.0, 2.0], microbatches=16)
    assert slow.makespan > fast.makespan
    assert slow.makespan >= 16 * 4.0        # stage 1 alone is busy 16 x 4 s


def test_sending_delays_the_next_stage():
    sim = simulate_pipeline([1.0, 1.0], [1.0, 1.0], microbatches=1, send_forward=[0.5, 0.0],
                            send_backward=[0.0, 0.25])
    assert sim.makespan == pytest.approx(1 + 0.5 + 1 + 1 + 0.25 + 1)
    assert sim.throughput == pytest.approx(1 / sim.makespan)


def test_orders_are_torchs():
    assert schedule_order("GPipe", 0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert schedule_order("1F1B", 1, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert schedule_order("1F1B", 0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(ValueError, match="1F1B or GPipe"):
        schedule_order("interleaved", 0, 2, 2)
