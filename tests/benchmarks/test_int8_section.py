"""The int8 benchmark's block (``benchmarks/int8.py``), rendered from rows as a run leaves them, and the wiring of
its ``pt2e-int8`` peer (torchao's PT2E + Inductor), which needs neither torchao nor a model run here."""

from __future__ import annotations

import importlib.util

import torch

from benchmarks import int8
from benchmarks.int8 import CONTENDERS, MODELS, PT2E_MISSING, markdown, summary


def _row(name: str, classifier: bool) -> dict:
    ms = {"eager": 10.0, "fxforge-fp32": 8.0, "fxforge-bf16": 5.0, "fxforge-int8": 4.0, "fxforge-auto": 4.0,
          "fxforge-ort-int8": 3.2, "fxforge-inductor-int8": 2.5, "fxforge-auto-target": 3.2, "ort-int8": 3.0, "ao-dynamic": 6.0,
          "pt2e-int8": 2.0}
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
    assert "| mlp_b8 (8x3x96x96) | fxforge-inductor-int8 | 2.50 | 4.00x | 3.20x | 1.0 | 4.0e-03 | | 0.8 |" in text
    assert "| the fastest of those three | 3.20x | 1 |" in summary([_row("m", False)])
    assert {"mlp_b8", "bert_small_b1", "resnet50_b1"} <= set(MODELS)


def test_pt2e_int8_has_its_lines_and_an_unchecked_line_in_the_summary():
    text = markdown([_row("mlp_b8", False)], "python -m benchmarks --suite int8")
    assert "| mlp_b8 (8x3x96x96) | pt2e-int8 | 2.00 | 5.00x | 4.00x | 1.0 | 4.0e-03 | | 0.8 |" in text
    assert "| pt2e-int8 (PT2E + Inductor, torchao's X86 quantizer, unchecked) | 4.00x | 1 |" in summary([_row("m", False)])
    assert "PT2E + Inductor int8 is absent" not in text and "`pt2e-int8`: PT2E + Inductor" in text


def test_without_torchao_pt2e_int8_is_not_built_and_its_line_says_why(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    model, example = torch.nn.Linear(4, 4), (torch.randn(2, 4),)
    builders, skipped = int8._peers(model, example, [example], str(tmp_path))
    assert set(builders) == {"ort-int8", "ao-dynamic"} and skipped == {"pt2e-int8": {"skipped": PT2E_MISSING}}
    assert PT2E_MISSING == "not run: torchao is not installed (pip install torchao)"

    row = _row("mlp_b8", False)
    row["contenders"].update(skipped)
    text = markdown([row], "python -m benchmarks --suite int8")
    assert f"| mlp_b8 (8x3x96x96) | pt2e-int8 | {PT2E_MISSING} | | | | | | |" in text
    assert not any(line.startswith("| pt2e-int8") for line in summary([row]))


def test_with_torchao_pt2e_int8_is_built_from_the_example_and_the_calibration_calls(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real(name, *a))
    built = []
    monkeypatch.setattr(int8, "_pt2e_int8", lambda *args: built.append(args) or "compiled")
    model, example = torch.nn.Linear(4, 4), (torch.randn(2, 4),)
    calibration = [example, (torch.randn(2, 4),)]
    builders, skipped = int8._peers(model, example, calibration, str(tmp_path))
    assert list(builders) == ["ort-int8", "ao-dynamic", "pt2e-int8"] and skipped == {}
    assert builders["pt2e-int8"]() == "compiled" and built == [(model, example, calibration)]
