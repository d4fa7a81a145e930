"""Timing in blocks: what a caller of one runtime sees, not the cost of switching between runtimes."""

import time

from fxforge.lowering.timing import time_in_blocks, time_interleaved


def switching_calls(cost_s=0.005):
    """Two calls that cost ``cost_s`` only when the other one ran last (as ORT after PyTorch's spinning threads)."""
    last = []

    def call(name):
        if last and last[-1] != name:
            time.sleep(cost_s)
        last.append(name)

    return {"a": lambda: call("a"), "b": lambda: call("b")}


def test_blocks_do_not_time_the_switch_but_alternating_calls_do():
    samples = {}
    blocks = time_in_blocks(switching_calls(), rounds=3, reps=3, samples=samples)
    assert max(blocks.values()) < 2.0 and all(len(s) == 9 for s in samples.values())
    alternating = time_interleaved(switching_calls(), 0.05)
    assert min(alternating.values()) > 4.0
    counted = time_in_blocks(switching_calls(), rounds=3, reps=3, discard_first=False, samples=samples)
    assert all(max(s) > 4.0 for s in samples.values()) and max(counted.values()) < 2.0  # one switch per block


def test_rounds_follow_the_budget_within_their_bounds():
    samples = {}
    time_in_blocks({"slow": lambda: time.sleep(0.01)}, reps=1, budget_s=0.0, min_rounds=2, samples=samples)
    assert len(samples["slow"]) == 2
    time_in_blocks({"fast": lambda: None}, reps=1, budget_s=10.0, max_rounds=4, samples=samples)
    assert len(samples["fast"]) == 4
