"""``--suite onnx-forms`` (formerly ``python -m fxforge.exporters.measure``): each comparison builds both ONNX
forms, checks they agree and times them."""

from __future__ import annotations

from benchmarks import onnx_forms
from benchmarks.harness import main


def test_conv_and_residual_norm_forms_agree():
    rows = onnx_forms.measure(["conv", "residual_norm"], quick=True)
    assert [row["forms"] for row in rows] == [("standard", "FusedConv")] * 2 + [("Add", "Sum")]
    assert all(row["max_abs_diff"] < 1e-4 for row in rows)
    assert all(row["ratio"] > 0 and set(row["ms"]) == set(row["forms"]) for row in rows)


def test_attention_forms_agree():
    rows = onnx_forms.measure(["attention"], quick=True)
    assert [row["forms"] for row in rows] == [
        ("plain", "MultiHeadAttention"), ("plain", "Attention-23"), ("plain", "MultiHeadAttention"),
        ("MultiHeadAttention-unidirectional", "GroupQueryAttention")]
    assert all(row["max_abs_diff"] < 1e-4 for row in rows)


def test_the_section_prints_one_line_per_case(capsys):
    assert main(["--suite", "onnx-forms", "--quick", "--only", "linear"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("onnxruntime, CPU") and len(lines) == 2
    assert "standard" in lines[1] and "FusedGemm" in lines[1] and "standard/FusedGemm" in lines[1]
