"""The GPU precision benchmark's table (benchmarks/gpu_precision.py): its ratios against torch.compile in the same
precision, and failed contenders as rows that say why. Runs without a GPU (the measuring needs one)."""

from __future__ import annotations

from benchmarks.gpu_precision import CONTENDERS, main, markdown


def test_the_table_sets_each_fxforge_precision_against_compile_in_the_same_precision():
    row = {"model": "m", "input": "8x128", "contenders": {
        "eager": {"ms": 8.0, "prepare_s": 0.0, "rel_err": 0.0},
        "compile-bf16": {"ms": 4.0, "prepare_s": 20.0, "rel_err": 1e-2},
        "compile-fp16": {"ms": 5.0, "prepare_s": 2.0, "rel_err": 1e-3},
        "compile-int8": {"error": "RuntimeError: self.size(0) needs to be greater than 16, but got 8"},
        "fxforge-bf16": {"ms": 2.0, "prepare_s": 3.0, "rel_err": 1e-2, "top1": 1.0, "top1_expected": 0.995,
                         "notes": "precision bf16: 3 of 3 layers in bf16"},
        "fxforge-auto": {"ms": 2.0, "prepare_s": 3.0, "rel_err": 1e-2}}}
    table = markdown([row], "NVIDIA H200", "torch 2.11")
    assert "| m (8x128) | fxforge-bf16 | 2.000 | 4.00x | 2.00x | 3.0 | 1.0e-02 | 100.0% (99.5%) |" in table
    assert "| m (8x128) | fxforge-auto | 2.000 | 4.00x | 2.00x |" in table  # (against the faster of bf16 and fp16)
    assert "| m (8x128) | compile-int8 | failed: RuntimeError: self.size(0)" in table
    assert "- m fxforge-bf16: precision bf16: 3 of 3 layers in bf16" in table
    assert set(CONTENDERS) >= {"compile-bf16", "compile-fp16", "fxforge-bf16", "fxforge-fp16", "fxforge-int8"}


def test_without_a_gpu_it_says_so(tmp_path, capsys):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["--out", str(tmp_path)]) == 1
    assert "no CUDA device" in capsys.readouterr().err
