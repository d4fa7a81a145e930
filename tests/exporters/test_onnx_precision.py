"""Int8 ONNX files (``export_onnx(precision="int8")``, ``target="onnxruntime", precision="int8"``): ONNX
Runtime's quantizer on the validated float32 file, kept where it keeps the tolerance and runs faster."""

from __future__ import annotations

import os

import onnx
import pytest
import torch
from torch import nn

import fxforge
from fxforge.core.accuracy import agreement
from fxforge.exporters import onnx_precision
from fxforge.exporters.ort_module import OnnxRuntimeModule


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 10))
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 16, 16))
    return model.eval()


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):  # [batch, tokens, 64]
        return x + self.down(torch.relu(self.up(x)))


def _ops(path: str) -> set[str]:
    return {node.op_type for node in onnx.load(path).graph.node}


@pytest.fixture
def int8_is_faster(monkeypatch):
    monkeypatch.setattr(onnx_precision, "time_interleaved",
                        lambda calls, *a, **k: {name: (1.0 if name == "float32" else 0.5) for name in calls})


@pytest.mark.parametrize("model, shape, form, ops", [
    (_cnn, (8, 3, 16, 16), "static QDQ", {"QuantizeLinear", "DequantizeLinear"}),
    # a residual stream of raw inputs: fresh draws leave static ranges, so the dynamic form is the one kept
    (Tokens, (2, 16, 64), "dynamic", {"DynamicQuantizeLinear", "MatMulInteger"}),
])
def test_an_int8_file_answers_within_the_tolerance(tmp_path, int8_is_faster, model, shape, form, ops):
    torch.manual_seed(0)
    model = model().eval()
    path = str(tmp_path / "m.onnx")
    result = fxforge.export_onnx(model, path, (torch.randn(shape),), precision="int8", tolerance=0.05)
    note = next(n for n in result.report.notes if n.startswith("precision int8"))
    assert note.startswith(f"precision int8: {form} (weights per channel)"), note
    assert ops <= _ops(path) and result.precision == f"int8 ({form})"
    assert f"precision: int8 ({form})" in str(result)
    assert os.listdir(tmp_path) == ["m.onnx"]  # (no file of the attempts left beside it)
    session = OnnxRuntimeModule(path, result.io)
    with torch.no_grad():
        fresh = torch.randn(shape)
        found = agreement([model(fresh)], [session(fresh)])
    assert 0 < found.relative_error <= 0.1, found


def test_both_forms_that_keep_the_tolerance_are_timed_and_the_fastest_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_precision, "time_interleaved",
                        lambda calls, *a, **k: {"float32": 1.0, "static QDQ": 0.6, "dynamic": 0.4})
    path = str(tmp_path / "t.onnx")
    result = fxforge.export_onnx(Tokens().eval(), path, (torch.randn(2, 16, 64),), precision="int8",
                                 tolerance={"relative_error": 1.0, "cosine": 0.0, "top1": None})
    note = next(n for n in result.report.notes if n.startswith("precision int8"))
    assert note.startswith("precision int8: dynamic") and note.endswith("; static QDQ: 0.6 ms"), note


def test_transformer_files_fall_back_to_dynamic_quantization_where_static_breaks_the_tolerance(tmp_path,
                                                                                                 int8_is_faster,
                                                                                                 monkeypatch):
    calls = []
    real = onnx_precision._quantized

    def static_breaks(path, form, io, calibration):
        calls.append(form)
        return real(path, form, io, [tuple(t * 50 for t in c) for c in calibration] if form == "static QDQ"
                    else calibration)  # (ranges 50x too wide: static rounds everything away)

    monkeypatch.setattr(onnx_precision, "_quantized", static_breaks)
    path = str(tmp_path / "t.onnx")
    result = fxforge.export_onnx(Tokens().eval(), path, (torch.randn(2, 16, 64),), precision="int8")
    assert calls == ["static QDQ", "dynamic"]
    note = next(n for n in result.report.notes if n.startswith("precision int8"))
    assert note.startswith("precision int8: dynamic"), note
    assert "DynamicQuantizeLinear" in _ops(path)


def test_a_file_that_breaks_the_tolerance_or_is_not_faster_stays_float32(tmp_path, monkeypatch):
    path = str(tmp_path / "c.onnx")
    result = fxforge.export_onnx(_cnn(), path, (torch.randn(8, 3, 16, 16),), precision="int8", tolerance=1e-6)
    note = next(n for n in result.report.notes if n.startswith("precision int8"))
    assert note.startswith("precision int8: float32 kept: static QDQ: relative error"), note
    assert "QuantizeLinear" not in _ops(path) and result.precision == "float32"
    monkeypatch.setattr(onnx_precision, "time_interleaved",
                        lambda calls, *a, **k: {name: 1.0 for name in calls})
    result = fxforge.export_onnx(_cnn(), path, (torch.randn(8, 3, 16, 16),), precision="int8")
    note = next(n for n in result.report.notes if n.startswith("precision int8"))
    assert "static QDQ: not faster (1 ms against float32's 1 ms" in note, note
    assert "QuantizeLinear" not in _ops(path) and os.listdir(tmp_path) == ["c.onnx"]


def test_the_onnxruntime_target_serves_int8_and_quantizes_each_export(int8_is_faster):
    model = _cnn()
    opt = fxforge.optimize(model, (torch.randn(8, 3, 16, 16),), target="onnxruntime", precision="int8",
                           tolerance=0.1)
    with torch.no_grad():
        for shape in [(8, 3, 16, 16), (16, 3, 16, 16)]:  # (a new batch size: exported again, quantized again)
            fresh = torch.randn(shape)
            assert 0 < agreement([model(fresh)], [opt(fresh)]).relative_error <= 0.1
    assert opt.exports == 2 and opt.onnx_export.precision == "int8 (static QDQ)"


def test_bad_precision_options_are_refused_before_anything_is_written(tmp_path):
    path = str(tmp_path / "x.onnx")
    model, x = _cnn(), torch.randn(2, 3, 16, 16)
    with pytest.raises(ValueError, match="ONNX files are written in float32 or int8"):
        fxforge.export_onnx(model, path, (x,), precision="bf16")
    with pytest.raises(ValueError, match="leave external_data out"):
        fxforge.export_onnx(model, path, (x,), precision="int8", external_data=True)
    with pytest.raises(ValueError, match="positional example inputs"):
        fxforge.export_onnx(model, path, {"input": x}, precision="int8")
    with pytest.raises(ValueError, match="tolerance=-1"):
        fxforge.optimize(model, (x,), target="onnxruntime", precision="int8", tolerance=-1)
    assert os.listdir(tmp_path) == []
