"""Measuring this machine's gloo link (fxforge.runtime.link_measure): real processes, a fit that predicts what
was measured, and a cache that answers the second time without starting any (issue 52)."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

from fxforge.core.links import KINDS, Link, Timing, fit_sync
from fxforge.runtime import link_measure
from fxforge.runtime.link_measure import cache_key, measured_link


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """A fresh cache directory with the disk cache on, and nothing measured in this process."""
    monkeypatch.setenv("FXFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FXFORGE_MACHINE_CACHE", "1")
    monkeypatch.setattr(link_measure, "_KNOWN", {})
    return tmp_path / link_measure.FILE_NAME


def _refuse(*args, **kwargs):
    raise AssertionError("the cache should have answered: no process may start")


def test_real_gloo_measurement_fits_and_is_cached(fresh_cache, monkeypatch):
    measured: list[Timing] = []
    waits: list[tuple[float, float]] = []
    overlaps: list[tuple[float, float]] = []
    real_launch = link_measure._launch

    def spy(*args, **kwargs):
        timings, in_step, behind = real_launch(*args, **kwargs)
        measured.extend(timings)
        waits.extend(in_step)
        overlaps.extend(behind)
        return measured, waits, overlaps

    monkeypatch.setattr(link_measure, "_launch", spy)
    link = measured_link("gloo", 2)
    assert link.source.startswith("measured gloo 2 ranks on ") and link.name.startswith("gloo 2 ranks on ")
    assert 1e-7 < link.alpha_s < 1e-2 and 1e-3 < link.bandwidth_gbs < 1e3
    assert sorted(kind for kind, _, _ in link.by_kind) == sorted(link_measure.KINDS)
    assert {(t.kind, t.nbytes) for t in measured} == {(k, n) for k in link_measure.KINDS for n in link_measure.SIZES}
    # How well the fit matches these timings depends on the machine's load (a test run's other worker takes a
    # core): the fit itself is held on exact and noisy synthetic timings in tests/core/test_links.py.
    assert all(t.seconds > 0 for t in measured)
    # Larger tensors take longer: the fit found a bandwidth, not only a latency.
    for kind in link_measure.KINDS:
        assert link.seconds(kind, link_measure.SIZES[-1], 2) > 3 * link.seconds(kind, link_measure.SIZES[0], 2)

    # The in-step waits: one point per stretch of compute, the longer stretches measured longer, and the link's
    # figures are the fit through them (both >= 0), said in its source.
    assert len(waits) == len(link_measure.SEGMENTS_S)
    computes = [c for c, _ in waits]
    assert computes[0] < 1e-4 and computes == sorted(computes) and computes[-1] > 0.005
    alone = link.seconds("all_reduce", link_measure.STREAM_BYTES, 2)
    assert (link.sync_s, link.sync_fraction) == fit_sync([(c, t - alone) for c, t in waits])
    assert "in a step, each collective waits" in link.source
    # The overlap: one asynchronous all-reduce per size, each taking longer the larger; the link's share hidden
    # is one less what they added behind compute over their own time, said in its source.
    assert len(overlaps) == len(link_measure.OVERLAP_BYTES) and overlaps[0][0] < overlaps[1][0]
    hidden = 1 - sum(max(0.0, x) for _, x in overlaps) / sum(a for a, _ in overlaps)
    assert link.overlap == pytest.approx(min(1.0, max(0.0, hidden)))
    assert f"hides {link.overlap:.0%} of its time behind" in link.source

    # Second call: no process starts (the process starter fails if called); in this process, then from the file.
    monkeypatch.setattr(link_measure, "_launch", _refuse)
    assert measured_link("gloo", 2) == link
    link_measure._KNOWN.clear()
    link_measure.open_cache(link_measure.FILE_NAME)._data = None  # as a new process: re-read the file
    assert measured_link("gloo", 2) == link
    stored = json.loads(fresh_cache.read_text())
    assert Link.from_dict(stored[cache_key("gloo", 2)]) == link
    # refresh measures again.
    with pytest.raises(AssertionError, match="no process may start"):
        measured_link("gloo", 2, refresh=True)


def _fake_timings(backend, ranks, sizes, *args):
    truth = Link("fake", 1e-4, 1.0, "test")
    timings = [Timing(kind, n, ranks, truth.seconds(kind, n, ranks)) for kind in link_measure.KINDS for n in sizes]
    # in the streams, the all-reduce's own time, 0.3 ms more and 5 % of the compute before it
    alone = truth.seconds("all_reduce", link_measure.STREAM_BYTES, ranks)
    # behind compute, a quarter of each asynchronous all-reduce's own time shows
    behind = [(truth.seconds("all_reduce", n, ranks), 0.25 * truth.seconds("all_reduce", n, ranks))
              for n in link_measure.OVERLAP_BYTES]
    return timings, [(c, alone + 3e-4 + 0.05 * c) for c in (0.0, 0.002, 0.008, 0.032)], behind


def test_cache_is_keyed_and_survives_a_bad_entry(fresh_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(link_measure, "_launch", lambda *a: calls.append(a[:2]) or _fake_timings(*a))
    two = measured_link("gloo", 2)
    assert two.alpha_s == pytest.approx(1e-4) and two.bandwidth_gbs == pytest.approx(1.0)
    assert two.sync_s == pytest.approx(3e-4) and two.sync_fraction == pytest.approx(0.05)
    assert "0.30 ms + 5.0% of the compute" in two.source
    assert two.overlap == pytest.approx(0.75) and "hides 75% of its time behind" in two.source
    three = measured_link("gloo", 3)
    assert calls == [("gloo", 2), ("gloo", 3)] and three.name.startswith("gloo 3 ranks")
    stored = json.loads(fresh_cache.read_text())
    keys = {cache_key("gloo", 2), cache_key("gloo", 3)}
    assert set(stored) == keys and all(torch.__version__ in key and " host " in key for key in keys)
    # An entry that does not read back is measured again, and replaced.
    stored[cache_key("gloo", 2)] = {"name": "broken"}
    fresh_cache.write_text(json.dumps(stored))
    link_measure._KNOWN.clear()
    link_measure.open_cache(link_measure.FILE_NAME)._data = None
    assert measured_link("gloo", 2) == two and calls[-1] == ("gloo", 2)


def test_cache_off_keeps_the_disk_clean(fresh_cache, monkeypatch):
    monkeypatch.setenv("FXFORGE_MACHINE_CACHE", "0")
    calls = []
    monkeypatch.setattr(link_measure, "_launch", lambda *a: calls.append(a[:2]) or _fake_timings(*a))
    measured_link("gloo", 2)
    measured_link("gloo", 2, cache=False)
    assert len(calls) == 2 and not fresh_cache.exists()


def test_bad_requests_are_refused(monkeypatch):
    monkeypatch.setattr(link_measure, "_launch", _refuse)
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        measured_link("mpi", 2)
    with pytest.raises(ValueError, match="ranks >= 2, not 1"):
        measured_link("gloo", 1)
    ranks = max(2, torch.cuda.device_count() + 1)
    with pytest.raises(ValueError, match=f"NCCL between {ranks} ranks needs a GPU per rank"):
        measured_link("nccl", ranks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks how a worker's failure reads, on a machine without NCCL")
def test_a_failing_worker_is_named():
    with pytest.raises(RuntimeError, match=r"measuring the nccl link: rank \d failed: \w+(Error|Exception)"):
        link_measure._launch("nccl", 2, (4096,), 1, 1, 4096)


def test_a_taken_port_is_chosen_again(monkeypatch):
    # The first port offered is held by another listener: rank 0 cannot bind it, the workers end at once and
    # the measurement starts again on the next port.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real_free_port = link_measure.free_port
        monkeypatch.setattr(link_measure, "free_port", lambda: ports.pop(0) if ports else real_free_port())
        start = time.monotonic()
        timings, _, _ = link_measure._launch("gloo", 2, (4096,), 1, 1, 4096)
    assert not ports and time.monotonic() - start < 30
    assert [(t.kind, t.nbytes, t.ranks) for t in timings] == [(k, 4096, 2) for k in link_measure.KINDS]
    assert all(0 < t.seconds < 1 for t in timings)


def test_ports_taken_every_time_give_up(monkeypatch):
    tries = []

    def taken(*args):
        tries.append(args)
        raise link_measure._PortTaken("port 1")

    monkeypatch.setattr(link_measure, "_run_workers", taken)
    with pytest.raises(RuntimeError, match=r"measuring the gloo link: no free local port \(port 1\)"):
        link_measure._launch("gloo", 2, (4096,), 1, 1, 4096)
    assert len(tries) == link_measure.PORT_TRIES


def test_kinds_are_the_models():
    assert set(link_measure.KINDS) <= set(KINDS)
