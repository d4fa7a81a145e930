"""Running statistics and their counters (``fxforge.core.statistics``): BatchNorm's kernels update the statistics
without bumping their versions, so a derived value is watched by the counter that moves with them."""

from __future__ import annotations

import gc

import torch
from torch import nn

from fxforge.core.derived import SourceStates
from fxforge.core.statistics import counter_of, note_statistics, with_counters


def test_the_kernels_really_update_the_statistics_behind_their_versions():
    """(Else this module watches a counter for nothing.)"""
    bn = nn.BatchNorm2d(3).train()
    versions = (bn.running_mean._version, bn.running_var._version, bn.num_batches_tracked._version)
    with torch.no_grad():
        bn(torch.randn(2, 3, 4, 4) + 5)
    assert (bn.running_mean._version, bn.running_var._version) == versions[:2]
    assert bn.num_batches_tracked._version > versions[2] and bn.running_mean.abs().sum() > 0


def test_every_normalization_layer_that_tracks_statistics_is_noted():
    model = nn.Sequential(nn.BatchNorm1d(2), nn.InstanceNorm2d(2, track_running_stats=True),
                          nn.BatchNorm2d(2, track_running_stats=False), nn.SyncBatchNorm(2), nn.Linear(2, 2))
    note_statistics(model)
    for layer in (model[0], model[1], model[3]):
        assert counter_of(layer.running_mean) is layer.num_batches_tracked
        assert counter_of(layer.running_var) is layer.num_batches_tracked
    assert model[2].running_mean is None and counter_of(model[4].weight) is None
    assert with_counters([model[0].weight, model[0].running_var, model[0].running_mean]) == \
        [model[0].weight, model[0].running_var, model[0].running_mean, model[0].num_batches_tracked]


def test_a_training_call_is_seen_by_the_states_of_the_statistics():
    bn = nn.BatchNorm1d(2)
    note_statistics(bn)
    states = SourceStates([bn.running_mean, bn.running_var])
    with torch.no_grad():
        bn.train()(torch.randn(8, 2))
    assert states.changed() and not states.changed()


def test_a_statistic_that_is_gone_is_forgotten():
    bn = nn.BatchNorm1d(2)
    note_statistics(bn)
    stale_id = id(bn.running_mean)
    bn.running_mean = torch.zeros(2)  # the old tensor dies; a new one (maybe at the same address) is not noted
    gc.collect()
    assert counter_of(bn.running_mean) is None or id(bn.running_mean) != stale_id
    note_statistics(bn)
    assert counter_of(bn.running_mean) is bn.num_batches_tracked
