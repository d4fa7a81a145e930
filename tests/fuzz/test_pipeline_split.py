"""The fuzz suite for the pipeline split (issue 23): on random chains of units, with random compute, memory,
bytes crossing, link speed, stage count, microbatches, schedule and cap, the DP's slowest stage equals brute
force's, every stage fits the cap, and where brute force finds nothing the DP refuses.

``make test`` runs the ``short`` profile; ``make fuzz`` runs ``long`` (``FXFORGE_FUZZ=long``).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxforge.pipeline.split import StageTables, best_split, brute_force_split, in_flight


@st.composite
def chains(draw):
    units = draw(st.integers(2, 9))
    floats = st.floats(0.0, 5.0, allow_nan=False)
    seconds = draw(st.lists(st.floats(0.01, 5.0), min_size=units, max_size=units))
    memory = draw(st.lists(floats, min_size=units, max_size=units))
    sent = draw(st.lists(floats, min_size=units, max_size=units))
    stages = draw(st.integers(1, units))
    return seconds, memory, sent, stages


@given(chain=chains(), link=st.sampled_from([0.5, 1.0, 1e9]), microbatches=st.integers(1, 8),
       schedule=st.sampled_from(["1F1B", "GPipe"]), cap_scale=st.one_of(st.none(), st.floats(0.2, 3.0)))
def test_the_dp_is_exact_and_respects_the_cap(chain, link, microbatches, schedule, cap_scale):
    seconds, memory, sent, stages = chain
    tables = StageTables.of_costs(seconds, memory, sent, link_gbs=link / 1e9)
    cap = None if cap_scale is None else cap_scale * sum(memory) / stages + 1e-9
    found = brute_force_split(tables, stages, memory_per_stage=cap, microbatches=microbatches, schedule=schedule)
    if found is None:
        with pytest.raises(ValueError, match="fits"):
            best_split(tables, stages, memory_per_stage=cap, microbatches=microbatches, schedule=schedule)
        return
    cuts = best_split(tables, stages, memory_per_stage=cap, microbatches=microbatches, schedule=schedule)
    edges = [0, *cuts, len(seconds)]
    assert all(a < b for a, b in itertools.pairwise(edges))
    assert max(tables.seconds(a, b) for a, b in itertools.pairwise(edges)) == pytest.approx(found[0])
    if cap is not None:
        for s, (a, b) in enumerate(itertools.pairwise(edges)):
            assert tables.memory_table(in_flight(schedule, s, stages, microbatches))[a, b] <= cap
