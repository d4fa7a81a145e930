"""The meshes a training step may spread over (fxforge/parallel/strategy.py)."""

from __future__ import annotations

import pytest

from fxforge.parallel.strategy import AXES, devices_of, full, meshes, name


def test_every_mesh_spans_exactly_the_devices_once():
    for devices in (1, 2, 4, 6, 8, 12):
        found = meshes(devices, tp_degrees=range(1, devices + 1))
        assert all(devices_of(m) == devices for m in found)
        keys = [tuple(m[a] for a in AXES) for m in found]
        assert len(keys) == len(set(keys))
        # every factorisation into four ordered factors appears
        count = sum(1 for pp in range(1, devices + 1) for dp in range(1, devices + 1) for fsdp in range(1, devices + 1)
                    if devices % (pp * dp * fsdp) == 0)
        assert len(found) == count


def test_tensor_degrees_and_pipelines_are_limited_by_the_model():
    found = meshes(8, tp_degrees=(2,), pipeline=True, max_stages=2)
    assert {m["tp"] for m in found} == {1, 2}
    assert max(m["pp"] for m in found) == 2
    assert all(m["pp"] == 1 for m in meshes(8, pipeline=False))
    assert name(meshes(1)[0]) == "single"


def test_full_refuses_what_is_not_a_mesh():
    assert full({"fsdp": 4}) == {"pp": 1, "dp": 1, "fsdp": 4, "tp": 1}
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        full({"ep": 2})
    with pytest.raises(ValueError, match="positive integer"):
        full({"tp": 0})
    with pytest.raises(ValueError, match="at least 1"):
        meshes(0)
