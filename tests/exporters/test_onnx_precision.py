"""Int8 ONNX files (``export_onnx(precision="int8")``, ``target="onnxruntime", precision="int8"``): ONNX
Runtime's quantizer on the validated float32 file, kept where it keeps the tolerance and runs faster."""

from __future__ import annotations

import os
from collections import Counter

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
    (_cnn, (8, 3, 16, 16), "static QDQ fused", {"QuantizeLinear", "DequantizeLinear"}),
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
    steady = {"float32": 1.0, "static QDQ fused": 0.6, "static QDQ": 0.5, "dynamic": 0.4}
    monkeypatch.setattr(onnx_precision, "time_interleaved", lambda calls, *a, **k: {n: steady[n] for n in calls})
    path = str(tmp_path / "t.onnx")
    result = fxforge.export_onnx(Tokens().eval(), path, (torch.randn(2, 16, 64),), precision="int8",
                                 tolerance={"relative_error": 1.0, "cosine": 0.0, "top1": None})
    note = next(n for n in result.report.notes if n.startswith("precision int8"))
    # (the plain static form is not tried where the fused one keeps the tolerance)
    assert note.startswith("precision int8: dynamic") and note.endswith("; static QDQ fused: 0.6 ms"), note


def test_transformer_files_fall_back_to_dynamic_quantization_where_static_breaks_the_tolerance(tmp_path,
                                                                                                 int8_is_faster,
                                                                                                 monkeypatch):
    calls = []
    real = onnx_precision._quantized

    def static_breaks(path, form, io, calibration):
        calls.append(form)
        return real(path, form, io, [tuple(t * 50 for t in c) for c in calibration] if form.startswith("static")
                    else calibration)  # (ranges 50x too wide: static rounds everything away)

    monkeypatch.setattr(onnx_precision, "_quantized", static_breaks)
    path = str(tmp_path / "t.onnx")
    result = fxforge.export_onnx(Tokens().eval(), path, (torch.randn(2, 16, 64),), precision="int8")
    assert calls == ["static QDQ fused", "static QDQ", "dynamic"]
    note = next(n for n in result.report.notes if n.startswith("precision int8"))
    assert note.startswith("precision int8: dynamic"), note
    assert "; refused: static QDQ fused: relative error" in note and "; refused: static QDQ: relative error" in note
    assert "DynamicQuantizeLinear" in _ops(path)


def test_a_file_that_breaks_the_tolerance_or_is_not_faster_stays_float32(tmp_path, monkeypatch):
    path = str(tmp_path / "c.onnx")
    result = fxforge.export_onnx(_cnn(), path, (torch.randn(8, 3, 16, 16),), precision="int8", tolerance=1e-6)
    note = next(n for n in result.report.notes if n.startswith("precision int8"))
    assert note.startswith("precision int8: float32 kept: static QDQ fused: relative error"), note
    assert "above the tolerance 1e-06; static QDQ: relative error" in note, note  # (the fallback, refused too)
    assert "QuantizeLinear" not in _ops(path) and result.precision == "float32"
    monkeypatch.setattr(onnx_precision, "time_interleaved",
                        lambda calls, *a, **k: {name: 1.0 for name in calls})
    result = fxforge.export_onnx(_cnn(), path, (torch.randn(8, 3, 16, 16),), precision="int8")
    note = next(n for n in result.report.notes if n.startswith("precision int8"))
    assert "static QDQ fused: not faster (1 ms against float32's 1 ms" in note, note
    assert "QuantizeLinear" not in _ops(path) and os.listdir(tmp_path) == ["c.onnx"]


def test_the_onnxruntime_target_serves_int8_and_quantizes_each_export(int8_is_faster):
    model = _cnn()
    opt = fxforge.optimize(model, (torch.randn(8, 3, 16, 16),), target="onnxruntime", precision="int8",
                           tolerance=0.1)
    with torch.no_grad():
        for shape in [(8, 3, 16, 16), (16, 3, 16, 16)]:  # (a new batch size: exported again, quantized again)
            fresh = torch.randn(shape)
            assert 0 < agreement([model(fresh)], [opt(fresh)]).relative_error <= 0.1
    assert opt.exports == 2 and opt.onnx_export.precision == "int8 (static QDQ fused)"


def _runtime_ops(path: str, tmp_path) -> Counter:
    """The operators of the graph ONNX Runtime runs for ``path`` (after its own fusions)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath, options.log_severity_level = str(tmp_path / "optimized.onnx"), 3
    ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
    ops = Counter(node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node)
    os.remove(options.optimized_model_filepath)
    return ops


TOLERANCE = {"relative_error": 0.05, "top1": None}  # (an untrained classifier's top-1 turns on near ties)


def _relu6_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU6(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10)).eval()


def test_the_fused_form_keeps_a_conv_chain_in_int8_and_is_the_only_static_form_tried(tmp_path, int8_is_faster,
                                                                                      monkeypatch):
    """ReLUs and Clips folded into the convolutions' quantized outputs, pools quantized: ONNX Runtime runs the chain
    without requantizing between the layers (the plain static form leaves a float ReLU island, and a
    DequantizeLinear/QuantizeLinear pair around it, at each layer)."""
    forms, real = [], onnx_precision._quantized
    monkeypatch.setattr(onnx_precision, "_quantized", lambda path, form, *a: forms.append(form) or real(path, form, *a))
    model, x = _relu6_cnn(), torch.randn(8, 3, 16, 16)
    path = str(tmp_path / "c.onnx")
    result = fxforge.export_onnx(model, path, (x,), precision="int8", tolerance=TOLERANCE)
    assert forms == ["static QDQ fused"] and result.precision == "int8 (static QDQ fused)", result.report.notes
    assert not {"Relu", "Clip"} & _ops(path) and "QuantizeLinear" in _ops(path)
    fused = _runtime_ops(path, tmp_path)
    assert fused["QLinearConv"] == 3 and fused["QuantizeLinear"] <= 1 and not {"Relu", "Clip"} & set(fused), fused
    float32 = str(tmp_path / "f.onnx")
    plain = fxforge.export_onnx(model, float32, (x,))
    static = onnx_precision._quantized(float32, "static QDQ", plain.io, [(x,)])
    assert _runtime_ops(static, tmp_path)["QuantizeLinear"] >= 3  # (a requantization at each ReLU)
    with torch.no_grad():
        fresh = torch.randn(8, 3, 16, 16)
        assert 0 < agreement([model(fresh)], [OnnxRuntimeModule(path, result.io)(fresh)]).relative_error <= 0.05


def test_a_fused_form_that_breaks_the_tolerance_is_refused_and_the_plain_static_form_kept(tmp_path, int8_is_faster,
                                                                                           monkeypatch):
    real = onnx_precision._quantized

    def fused_breaks(path, form, io, calibration):
        return real(path, form, io, [tuple(t * 50 for t in c) for c in calibration] if form == "static QDQ fused"
                    else calibration)

    monkeypatch.setattr(onnx_precision, "_quantized", fused_breaks)
    path = str(tmp_path / "c.onnx")
    result = fxforge.export_onnx(_relu6_cnn(), path, (torch.randn(8, 3, 16, 16),), precision="int8",
                                 tolerance=TOLERANCE)
    note = next(n for n in result.report.notes if n.startswith("precision int8"))
    assert note.startswith("precision int8: static QDQ (weights per channel)"), note
    assert "; refused: static QDQ fused: relative error" in note and "above the tolerance 0.05" in note, note
    assert result.precision == "int8 (static QDQ)" and {"Relu", "Clip"} <= _ops(path)
    assert os.listdir(tmp_path) == ["c.onnx"]


def test_files_without_relus_or_pools_skip_the_fused_form():
    assert onnx_precision._forms({"Conv", "MatMul", "Gelu", "Add", "LayerNormalization"}) == ["static QDQ"]
    assert onnx_precision._forms({"MatMul", "Relu", "Add"}) == ["static QDQ fused", "static QDQ", "dynamic"]


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
