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
from fxforge.verify import compare_outputs


def _interleaved_medians(fns, inputs, reps: int = 30) -> list[float]:
    """Median milliseconds of each function, warmed up and timed in alternation."""
    times: list[list[float]] = [[] for _ in fns]
    with torch.inference_mode():
        for fn in fns:
            for _ in range(3):
                fn(*inputs)
        for _ in range(reps):
            for i, fn in enumerate(fns):
                start = time.perf_counter()
                fn(*inputs)
                times[i].append((time.perf_counter() - start) * 1e3)
    return [sorted(t)[len(t) // 2] for t in times]


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
    eager_ms, fx_ms = _interleaved_medians([model, optimized], inputs)
    print(f"\nmax abs error vs eager: {check.max_abs_err:.3g} ({'ok' if check.ok else check.reason})")
    print(f"latency, median of 30 interleaved: eager / fxforge = {eager_ms / fx_ms:.2f}x")


if __name__ == "__main__":
    main(*sys.argv[1:2])
