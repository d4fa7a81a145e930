"""The int8 benchmark's block (``benchmarks/int8.py``), rendered from rows as a run leaves them."""

from __future__ import annotations

from benchmarks.int8 import CONTENDERS, MODELS, markdown


def _row(name: str, classifier: bool) -> dict:
    ms = {"eager": 10.0, "fxforge-fp32": 8.0, "fxforge-bf16": 5.0, "fxforge-int8": 4.0, "fxforge-auto": 4.0,
          "fxforge-ort-int8": 3.2, "fxforge-auto-target": 3.2, "ort-int8": 3.0, "ao-dynamic": 6.0}
    contenders = {c: {"ms": ms[c], "prepare_s": 1.0, "error": 0.004} for c in CONTENDERS}
    if classifier:
        for entry in contenders.values():
            entry["top1"] = 0.995
    contenders["ao-dynamic"] = {"failed": "RuntimeError: no Linear"}
    plans = {"fxforge-int8": {"kept": "int8", "layers": "3 of 4", "notes": ["precision int8: 3 of 4 layers in int8"]}}
    return {"model": name, "shape": [8, 3, 96, 96], "contenders": contenders, "plans": plans, "load": 0.8}


def test_the_block_has_a_line_per_contender_with_ratios_accuracy_and_the_plans():
    text = markdown([_row("vit_classifier_b8", True), _row("mlp_b8", False), {"model": "resnet50_b1",
                                                                               "error": "child failed"}],
                    "python -m benchmarks --suite int8")
    assert "| vit_classifier_b8 (8x3x96x96) | fxforge-int8 | 4.00 | 2.50x | 2.00x | 1.0 | 4.0e-03 | 99.5% | 0.8 |" \
        in text
    assert "| mlp_b8 (8x3x96x96) | fxforge-int8 | 4.00 | 2.50x | 2.00x | 1.0 | 4.0e-03 | | 0.8 |" in text
    assert "| mlp_b8 (8x3x96x96) | ao-dynamic | failed: RuntimeError: no Linear | | | | | |" in text
    assert "| resnet50_b1 | failed: child failed | | | | | | | |" in text
    assert "| mlp_b8 | fxforge-int8 | int8 | 3 of 4 | precision int8: 3 of 4 layers in int8 |" in text
    assert {"mlp_b8", "bert_small_b1", "resnet50_b1"} <= set(MODELS)
