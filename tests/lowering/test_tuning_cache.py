"""Autotune's on-disk cache: measurements are reused on the same machine, reported as such, and the file is
written atomically and merged with what other processes wrote."""

import json

import pytest
import torch
from torch import nn

import fxforge
from fxforge.core.disk_cache import TuningCache
from fxforge.lowering import autotune
from fxforge.lowering.autotune import NOTE


def test_round_trip_merges_other_writers_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "autotune.json"
    mine, theirs = TuningCache(path), TuningCache(path)
    mine.put("a", {"composite": 1.0})
    theirs.put("b", {"mkldnn": 2.0})
    theirs.save()
    mine.save()
    assert json.loads(path.read_text()) == {"a": {"composite": 1.0}, "b": {"mkldnn": 2.0}}
    assert [p.name for p in tmp_path.iterdir()] == ["autotune.json"]


def test_an_unreadable_file_is_started_afresh(tmp_path):
    path = tmp_path / "autotune.json"
    path.write_text("{not json")
    cache = TuningCache(path)
    assert cache.get("a") is None
    cache.put("a", 1)
    cache.save()
    assert json.loads(path.read_text()) == {"a": 1}


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FXFORGE_AUTOTUNE_CACHE", "1")
    monkeypatch.setenv("FXFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "machine_load", lambda: 0.0)  # a quiet machine (tests set it busy themselves)
    return tmp_path / "autotune.json"


def test_a_second_optimize_reuses_the_measurements_and_says_so(cache_on, monkeypatch):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 16, 16)
    timed = []

    def fake_timing(calls, budget, **_):
        timed.append(sorted(calls))
        return {name: (1.0 if name in ("fused", "mkldnn") else 2.0) for name in calls}

    monkeypatch.setattr(autotune, "time_interleaved", fake_timing)
    first = fxforge.rewrite(fxforge.capture(model, (x,)), ["conv_activation"])
    assert timed and cache_on.exists()
    assert not any(NOTE in t.note for t in first.report.tuning)
    count = len(timed)
    second = fxforge.rewrite(fxforge.capture(model, (x,)), ["conv_activation"])
    assert len(timed) == count, "nothing timed again"
    assert second.report.counts == first.report.counts
    choices = [(t.subject, t.choice, t.timings) for t in second.report.tuning if t.subject != "layout"]
    assert choices == [(t.subject, t.choice, t.timings) for t in first.report.tuning if t.subject != "layout"]
    assert all(NOTE in t.note for t in second.report.tuning if t.subject != "layout")
    # Other shapes are other measurements.
    fxforge.rewrite(fxforge.capture(model, (torch.randn(2, 3, 16, 16),)), ["conv_activation"])
    assert len(timed) > count


def scripted_timings(graph, kernels):
    """A stand-in for autotune's timing: whole-graph timings return ``graph``, a fused op's kernels their
    entry in ``kernels`` (else the composite's); ``.graph_calls`` counts the whole-graph timings."""

    def fake(calls, budget, **_):
        if "fused" in calls:
            fake.graph_calls += 1
            return dict(graph)
        return {name: kernels.get(name, kernels["composite"]) for name in calls}

    fake.graph_calls = 0
    return fake


def rewrite_conv_relu(timings, monkeypatch):
    monkeypatch.setattr(autotune, "time_interleaved", timings)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    return fxforge.rewrite(fxforge.capture(model, (torch.ones(1, 3, 16, 16),)), ["conv_activation"])


def test_a_close_whole_graph_call_is_measured_again(cache_on, monkeypatch):
    close_call = scripted_timings({"fused": 1.0, "before": 1.01}, {"mkldnn": 1.0, "composite": 2.0})
    rewrite_conv_relu(close_call, monkeypatch)
    first = close_call.graph_calls
    rewrite_conv_relu(close_call, monkeypatch)
    assert first >= 1 and close_call.graph_calls == 2 * first  # timed again, not replayed


def _graph_entries(path):
    return {k: v for k, v in json.loads(path.read_text()).items() if "| graph " in k} if path.exists() else {}


def test_a_whole_graph_timing_far_from_its_ops_times_is_measured_again_and_not_remembered(cache_on, monkeypatch):
    """The report's case: the fused graph's ops sum to 0.2 ms, its timing says 32 ms (the machine was busy)."""
    busy_moment = scripted_timings({"fused": 32.0, "before": 1.0}, {"mkldnn": 0.2, "composite": 0.3})
    new = rewrite_conv_relu(busy_moment, monkeypatch)
    graph = [t for t in new.report.tuning if t.subject == "graph"]
    layouts = next(t for t in new.report.tuning if t.subject == "layout").timings
    assert len(layouts) == 2 and busy_moment.graph_calls == 2 * len(layouts)  # each layout's graph timed once more
    assert all("not remembered: the graphs differ by 31 ms" in t.note for t in graph), graph
    assert _graph_entries(cache_on) == {}


def test_a_consistent_timing_is_remembered_with_the_machine_load(cache_on, monkeypatch):
    rewrite_conv_relu(scripted_timings({"fused": 1.0, "before": 1.5}, {"mkldnn": 1.0, "composite": 1.5}), monkeypatch)
    entries = _graph_entries(cache_on)
    assert entries and all(v["load"] == 0.0 and v["fused"] == 1.0 for v in entries.values())


def test_timings_measured_on_a_busy_machine_are_used_but_not_remembered(cache_on, monkeypatch):
    monkeypatch.setattr(autotune, "machine_load", lambda: 3.0)
    new = rewrite_conv_relu(scripted_timings({"fused": 1.0, "before": 1.5}, {"mkldnn": 1.0, "composite": 1.5}),
                            monkeypatch)
    assert new.report.counts == {"conv_activation": 1}  # the measurement decided this optimize
    assert any("not remembered: the machine was busy (load 3.00 per core)" in t.note for t in new.report.tuning)
    assert not cache_on.exists() or json.loads(cache_on.read_text()) == {}
