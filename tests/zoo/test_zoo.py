"""torchvision and timm models with random weights, through fxforge as a new user would try them: no fallback,
no rollback, float32-level errors on fresh inputs, ONNX export after the rewrites wherever plain export works
(and ONNX Runtime agreeing with eager, outputs in the model's own structure), a conv+BatchNorm fold in every
model with BatchNorm.

Runs with ``make zoo`` (its own environment: see ``benchmarks/zoo.py``); skipped where torchvision or timm is
missing."""

from __future__ import annotations

import pytest

pytest.importorskip("torchvision", reason="the zoo runs in its own environment: make zoo")
pytest.importorskip("timm", reason="the zoo runs in its own environment: make zoo")

from benchmarks.zoo import ZOO, run_model


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model(name, tmp_path):
    row = run_model(name, str(tmp_path))
    assert row.problems() == [], row
    assert row.plain_export == "ok", row.plain_export  # every zoo model exports plainly today
