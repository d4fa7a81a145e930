"""Profile a bundled example model before and after fxforge, and show where the time went.

Run: python examples/profile_compare.py [resnet_cnn|densenet|inception|unet|transformer_encoder ...]

For each model: ``fxforge.profile`` of the model as captured and of ``fxforge.optimize(model)`` (the
lowered graph it runs), then ``compare()`` per op type, and the compute/memory verdicts against this
machine's measured roofline. The times are the nodes' own medians summed, one profile after the other: a
picture of where time goes, not an interleaved speed comparison (``python -m benchmarks`` is that).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxforge
from examples.models import EXAMPLES


def main(names: list[str]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name in names or ["resnet_cnn", "inception", "transformer_encoder"]:
            compare(name)
    finally:
        torch.set_num_threads(threads)  # a caller in this process (the tests) keeps its own count


def compare(name: str) -> None:
    """Print the example model ``name``'s profile before and after ``fxforge.optimize``, side by side."""
    model, inputs = EXAMPLES[name]()
    before = fxforge.profile(model, inputs)
    after = fxforge.profile(fxforge.optimize(model, inputs), inputs)
    machine = before.machine
    print(f"== {name}: {len(before.table)} -> {len(after.table)} nodes; roofline {machine.peak_gflops:.0f} "
          f"GFLOP/s, {machine.bandwidth_gbs:.1f} GB/s, ridge {machine.ridge:.2f} FLOP/byte")
    comparison = before.compare(after)
    print(comparison.attrs["summary"])
    print(comparison.to_string(float_format=lambda v: f"{v:.3f}"))
    print("verdicts:", before.table["bound"].value_counts().to_dict(), "->",
          after.table["bound"].value_counts().to_dict(), "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
