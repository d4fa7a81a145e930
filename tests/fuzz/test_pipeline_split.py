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

from fxforge.parallel.split import StageTables, best_split, brute_force_split, in_flight


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


@given(in_features=st.integers(1, 48), out_features=st.integers(1, 700), blocks=st.integers(1, 12),
       bias=st.booleans(), lead=st.lists(st.integers(1, 3), max_size=2), tied=st.booleans(), seed=st.integers(0, 99))
def test_column_blocks_equal_the_layer_on_random_shapes(in_features, out_features, blocks, bias, lead, tied, seed):
    """A Linear layer computed in column blocks (the pipeline's rewrite of a layer heavier than a stage) gives
    its outputs and gradients, on its own parameters, tied or not."""
    import torch

    from fxforge.parallel.restructure import with_column_blocks

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(out_features, in_features),
                                torch.nn.Linear(in_features, out_features, bias=bias))
    if tied:                                          # the output layer shares the embedding's weight
        model[1].weight = model[0].weight
    blocked = with_column_blocks(model, {"1": blocks})
    x = torch.randint(0, out_features, (*lead, 5))
    results = []
    for m in (model, blocked):
        model.zero_grad(set_to_none=True)
        out = m(x)
        (out * torch.linspace(-1, 1, out_features)).sum().backward()
        results.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
    for got, expected in zip(results[1], results[0]):  # BLAS may sum a block's products in another order
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # (seen: 2e-5); a wrong block is O(1) off
