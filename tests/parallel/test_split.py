"""The split search (fxforge/parallel/split.py): the DP is exact (equal to brute force), a memory cap is
respected and can force an uneven split, and the peers' splits are what their policies say."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fxforge.parallel.split import (
    StageTables,
    best_split,
    block_names,
    brute_force_split,
    even_layer_split,
    in_flight,
)


def _worst(tables: StageTables, cuts: list[int]) -> float:
    edges = [0, *cuts, tables.units]
    return max(tables.seconds(a, b) for a, b in itertools.pairwise(edges))


@pytest.mark.parametrize("seed", range(12))
def test_the_dp_equals_brute_force_on_random_chains(seed):
    rng = np.random.default_rng(seed)
    units = int(rng.integers(4, 10))
    stages = int(rng.integers(2, min(units, 5) + 1))
    tables = StageTables.of_costs(rng.uniform(0.1, 3.0, units).tolist(), rng.uniform(1, 5, units).tolist(),
                                  sent=rng.uniform(0, 2, units).tolist(), link_gbs=1e-9)
    cuts = best_split(tables, stages)
    best, _ = brute_force_split(tables, stages)
    assert len(cuts) == stages - 1 and cuts == sorted(set(cuts))
    assert _worst(tables, cuts) == pytest.approx(best)


@pytest.mark.parametrize("seed", range(8))
def test_the_dp_equals_brute_force_under_a_memory_cap(seed):
    rng = np.random.default_rng(100 + seed)
    units, stages = 8, 3
    memory = rng.uniform(1, 5, units).tolist()
    tables = StageTables.of_costs(rng.uniform(0.1, 3.0, units).tolist(), memory)
    cap = float(np.quantile(memory, 0.5)) * 3
    found = brute_force_split(tables, stages, memory_per_stage=cap)
    if found is None:
        with pytest.raises(ValueError, match="no split into 3 stages fits"):
            best_split(tables, stages, memory_per_stage=cap)
        return
    cuts = best_split(tables, stages, memory_per_stage=cap)
    assert _worst(tables, cuts) == pytest.approx(found[0])
    edges = [0, *cuts, units]
    assert all(sum(memory[a:b]) <= cap + 1e-9 for a, b in itertools.pairwise(edges))


def test_a_memory_cap_forces_an_uneven_split():
    # Equal times: the balanced split is 3 | 3; a heavy first unit does not fit with two others.
    tables = StageTables.of_costs([1.0] * 6, [10.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert best_split(tables, 2) == [3]
    assert best_split(tables, 2, memory_per_stage=11.0) == [2]
    with pytest.raises(ValueError, match="least any split needs is about"):
        best_split(tables, 2, memory_per_stage=9.0)


def test_activations_in_flight_follow_the_schedule():
    assert [in_flight("1F1B", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert in_flight("GPipe", 3, 4, 8) == 8
    with pytest.raises(ValueError, match="unknown schedule"):
        in_flight("zb", 0, 2, 2)


def test_fewer_units_than_stages_is_refused():
    with pytest.raises(ValueError, match="2 places to split"):
        best_split(StageTables.of_costs([1.0, 1.0]), 3)


def test_blocks_are_the_outermost_indexed_submodules_with_children():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2),
                                torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
                                                     for _ in range(4)]))
    names = ["", "1.0", "1.0.1", "1.1", "1.2", "1.3"]
    assert block_names(names, model) == ["1.0", "1.1", "1.2", "1.3"]
    assert even_layer_split(names, model, 2) == [4]       # blocks 1.0, 1.1 | 1.2, 1.3
    assert even_layer_split(names, model, 5) is None
