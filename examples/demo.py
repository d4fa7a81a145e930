"""`make demo`: optimize a bundled example model with fxforge and print what it did.

Run: python examples/demo.py [inception|resnet_cnn|densenet|unet|transformer_encoder]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxforge
from examples.models import EXAMPLES
from fxforge.cli.summary import compare_latency
from fxforge.core.verify import compare_outputs


def main(name: str = "inception") -> None:
    model, inputs = EXAMPLES[name]()
    model.eval()
    start = time.perf_counter()
    optimized = fxforge.optimize(model, inputs)
    seconds = time.perf_counter() - start
    print(f"fxforge demo: {name} ({sum(p.numel() for p in model.parameters()):,} parameters), "
          f"optimized in {seconds:.2f} s\n")
    print(optimized.report)
    with torch.inference_mode():
        check = compare_outputs(model(*inputs), optimized(*inputs))
    eager_ms, fx_ms = compare_latency(model, optimized, inputs, reps=30, warmup=3)
    print(f"\nmax abs error vs eager: {check.max_abs_err:.3g} ({'ok' if check.ok else check.reason})")
    print(f"latency, median of 30 interleaved: eager / fxforge = {eager_ms / fx_ms:.2f}x")


if __name__ == "__main__":
    main(*sys.argv[1:2])
