"""``--suite throughput``: its models are the architectures named (parameter counts of torchvision's), their
activations stay normal floats, and the block reads its rows (ratios against eager, the 1.3x verdict)."""

from __future__ import annotations

import torch

from benchmarks import throughput
from benchmarks.sections import SECTIONS
from benchmarks.throughput_models import efficientnet_b0, mobilenet_v3_small


def test_the_section_is_registered():
    assert SECTIONS["throughput"] is throughput.SECTION


def test_models_are_the_architectures_named_with_working_scales():
    mobile, _ = mobilenet_v3_small()
    assert sum(p.numel() for p in mobile.parameters()) == 2_542_856  # torchvision's mobilenet_v3_small
    efficient, (y,) = efficientnet_b0()
    assert sum(p.numel() for p in efficient.parameters()) == 5_288_548  # torchvision's efficientnet_b0
    with torch.no_grad():
        logits = efficient(y)[0]
    assert logits.abs().max() > 1e-3  # no subnormal activations (which the CPU runs far slower)


def test_markdown_reads_ratios_and_the_target():
    row = {"model": "m", "samples_per_s": {"eager": 10.0, "fxforge latency": 12.0, "fxforge throughput": 18.0},
           "errors": {"eager": 0.0, "fxforge latency": 1e-6, "fxforge throughput": 2e-6},
           "choice": "2 x 1 threads, batch 4", "choose_s": 3.0, "configurations": 6, "batching": "", "notes": [],
           "load": [0.5, 1.25], "rows": [{"streams": 2, "threads": 1, "batch": 4, "samples_per_s": 18.0, "p50_ms": 200.0, "p90_ms": 210.0,
                     "p99_ms": 220.0, "utilization": 0.95, "chosen": True}]}
    slow = {**row, "model": "n", "samples_per_s": {**row["samples_per_s"], "fxforge throughput": 13.0}}
    block = throughput.markdown([row, slow], "python -m benchmarks --suite throughput", (1.0, 1.5))
    assert "| m | 10.0 | 1.20 | 1.80 | 2 x 1 threads, batch 4 (of 6, chosen in 3 s) | 2.0e-06 | 0.5 -> 1.2 |" in block
    assert "m: throughput mode 1.50x fxforge's latency configuration (target 1.3x: met)" in block
    assert "n: throughput mode 1.08x fxforge's latency configuration (target 1.3x: **not met**)" in block
    assert "load average 1.00 before, 1.50 after" in block
    with_ort = {**row, "samples_per_s": {**row["samples_per_s"], "fxforge ORT throughput": 25.0},
                "errors": {**row["errors"], "fxforge ORT throughput": 3e-6}, "ort_choice": "1 x 2 threads, batch 8"}
    block_ort = throughput.markdown([with_ort], "python -m benchmarks --suite throughput", (1.0, 1.5))
    assert "| m | 10.0 | 1.20 | 1.80 | 2.50 |" in block_ort
    assert 'with target="onnxruntime" 2.50x eager (1 x 2 threads, batch 8)' in block_ort
    assert "| **2 x 1** (chosen) | 4 | 18.0 | 200.0 | 210.0 | 220.0 | 95% |" in block
