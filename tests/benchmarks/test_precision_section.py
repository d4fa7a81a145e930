"""The precision benchmark's block (``benchmarks/precision.py``), rendered from rows as a run leaves them."""

from __future__ import annotations

from benchmarks.precision import CONTENDERS, MODELS, markdown


def _row(name: str) -> dict:
    ms = {"eager": 10.0, "fxforge": 8.0, "fxforge-bf16": 4.0, "autocast-bf16": 6.0, "compile-autocast-bf16": 5.0}
    contenders = {c: {"ms": ms[c], "prepare_s": 1.0, "error": 0.004 if "bf16" in c else 1e-7} for c in CONTENDERS}
    contenders["compile-autocast-bf16"] = {"failed": "BackendCompilerFailed: boom"}
    return {"model": name, "shape": [8, 512], "contenders": contenders, "layers": "2 of 2",
            "note": "precision bf16: 2 of 2 layers in bf16", "load": 1.2}


def test_the_block_has_a_line_per_contender_with_ratios_and_the_layers_reduced():
    text = markdown([_row("mlp"), {"model": "bert_small", "error": "child failed"}], "python -m benchmarks --suite precision")
    assert "| mlp (8x512) | fxforge-bf16 | 4.00 | 2.50x | 2.00x | 1.0 | 4.0e-03 | 1.2 |" in text
    assert "| mlp (8x512) | compile-autocast-bf16 | failed: BackendCompilerFailed: boom |" in text
    assert "| bert_small | failed: child failed |" in text
    assert "| mlp | 2 of 2 | precision bf16: 2 of 2 layers in bf16 |" in text
    assert set(MODELS) >= {"mlp", "bert_small"}
