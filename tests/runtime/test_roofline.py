"""The machine's roofline: measured once, cached per device in $FXFORGE_CACHE_DIR/machine.json."""

from __future__ import annotations

import json
import time

import pytest
import torch

from fxforge.runtime import roofline
from fxforge.runtime.roofline import Machine, cache_path, measure_machine


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """A fresh cache directory with the disk cache on, and measurements replaced by counted fakes."""
    monkeypatch.setenv("FXFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FXFORGE_MACHINE_CACHE", "1")
    monkeypatch.setattr(roofline, "_KNOWN", {})
    calls = {"peak": 0, "bandwidth": 0}

    def peak(device, **kwargs):
        calls["peak"] += 1
        return 100.0

    def bandwidth(device, **kwargs):
        calls["bandwidth"] += 1
        return 20.0

    monkeypatch.setattr(roofline, "measure_peak_gflops", peak)
    monkeypatch.setattr(roofline, "measure_bandwidth_gbs", bandwidth)
    return calls


def test_ridge_and_verdicts():
    m = Machine("cpu", 120.0, 30.0, "now")
    assert m.ridge == 4.0
    assert m.bound(3.99) == "memory" and m.bound(4.0) == "compute" and m.bound(0.0) == "memory"
    assert m.attainable_gflops(1.0) == 30.0 and m.attainable_gflops(100.0) == 120.0


def test_second_call_reads_the_cache(counted, tmp_path):
    first = measure_machine("cpu")
    assert counted == {"peak": 1, "bandwidth": 1}
    assert (first.peak_gflops, first.bandwidth_gbs, first.ridge) == (100.0, 20.0, 5.0)
    assert measure_machine("cpu") == first
    assert counted == {"peak": 1, "bandwidth": 1}
    # A new process (nothing in memory) reads the file instead of measuring.
    roofline._KNOWN.clear()
    again = measure_machine("cpu")
    assert counted == {"peak": 1, "bandwidth": 1}
    assert again == first
    stored = json.loads((tmp_path / "machine.json").read_text())
    assert len(stored) == 1
    [(key, entry)] = stored.items()
    assert torch.__version__ in key and entry["peak_gflops"] == 100.0 and entry["bandwidth_gbs"] == 20.0


def test_refresh_measures_again(counted):
    measure_machine("cpu")
    measure_machine("cpu", refresh=True)
    assert counted["peak"] == 2


def test_cache_off(counted, monkeypatch, tmp_path):
    monkeypatch.setenv("FXFORGE_MACHINE_CACHE", "0")
    measure_machine("cpu")
    measure_machine("cpu")
    assert counted["peak"] == 1  # remembered in memory
    assert not (tmp_path / "machine.json").exists()
    measure_machine("cpu", cache=False)
    assert counted["peak"] == 2


def test_other_dtype_is_another_entry(counted):
    measure_machine("cpu")
    measure_machine("cpu", dtype=torch.float64)
    assert counted["peak"] == 2


def test_cache_dir_is_respected(monkeypatch, tmp_path):
    monkeypatch.setenv("FXFORGE_CACHE_DIR", str(tmp_path / "x"))
    assert cache_path() == tmp_path / "x" / "machine.json"
    monkeypatch.delenv("FXFORGE_CACHE_DIR")
    assert cache_path().parent.name == "fxforge"


def test_unreadable_cache_file_is_measured_over(counted, tmp_path):
    (tmp_path / "machine.json").write_text("{not json")
    measure_machine("cpu")
    assert counted["peak"] == 1
    assert json.loads((tmp_path / "machine.json").read_text())


def test_real_measurement_is_quick_and_sane(monkeypatch):
    monkeypatch.setattr(roofline, "_KNOWN", {})
    start = time.perf_counter()
    m = measure_machine("cpu", cache=False)
    elapsed = time.perf_counter() - start
    assert m.peak_gflops > 0.1 and m.bandwidth_gbs > 0.1
    assert elapsed < 5.0  # about 0.3 s on an idle two-core machine


def test_a_machine_measured_inside_a_fake_mode_is_measured_on_real_tensors(monkeypatch):
    """A trace with fake tensors that asks for costs measures the machine (the first time in a process): the
    products must run for real, not as fake ops that take no time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(roofline, "_KNOWN", {})
    seen = []
    real = roofline.measure_peak_gflops

    def peak(device, **kwargs):
        seen.append(type(torch.ones(1)))
        return real(device, size=128, repeats=1)

    monkeypatch.setattr(roofline, "measure_peak_gflops", peak)
    with FakeTensorMode():
        machine = measure_machine("cpu", cache=False)
    assert seen == [torch.Tensor] and machine.peak_gflops > 0
