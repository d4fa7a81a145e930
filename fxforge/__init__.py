"""fxforge: capture a PyTorch model as a graph, rewrite it with verified rules, run it natively or in ONNX Runtime.

Example:
    >>> import torch, fxforge
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(), torch.nn.ReLU()).eval()
    >>> cap = fxforge.capture(model, (torch.ones(2, 4),))
    >>> fxforge.rewrite(cap).report.counts["cleanup"]
    1
"""

import importlib
from typing import Any

# ``fxforge.capture`` is both a subpackage and its function: importing the subpackage (as any of fxforge's
# modules may) would put the module where the function is, so the function is bound here, first.
from fxforge.capture import CaptureError, capture
from fxforge.lint import (  # a subpackage and its function too (bound here, before any import of it)
    Findings,
    lint,
)

# Each public name and the module that holds it. They are imported on first use (PEP 562): a process that
# needs one part of fxforge (a distributed worker, ``fxforge --help``) does not pay for importing all of it.
_HOMES = {
    "optimize": "fxforge.api", "parallelize": "fxforge.api",
    "CaptureError": "fxforge.capture", "capture": "fxforge.capture",  # bound above
    "Findings": "fxforge.lint", "lint": "fxforge.lint",  # bound above
    "Captured": "fxforge.core.captured", "Report": "fxforge.core.report",
    "ExportError": "fxforge.exporters", "OnnxRuntimeModule": "fxforge.exporters",
    "export_onnx": "fxforge.exporters.export", "load": "fxforge.exporters.pt2",
    "rewrite": "fxforge.lowering.build",
    "Partition": "fxforge.parallel.partition", "partition": "fxforge.parallel.partition",
    "Pass": "fxforge.rewrites.passes", "OptimizedModule": "fxforge.runtime.native",
    "Profile": "fxforge.runtime.profile", "profile": "fxforge.runtime.profile.subjects",
    "TrainingMemory": "fxforge.training", "training_memory": "fxforge.training",
}

__all__ = ["CaptureError", "Captured", "ExportError", "Findings", "OnnxRuntimeModule", "OptimizedModule", "Partition",
           "Pass", "Profile", "Report", "TrainingMemory", "capture", "export_onnx", "lint", "load", "optimize",
           "parallelize", "partition", "profile", "rewrite", "training_memory"]
assert set(__all__) == set(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'fxforge' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
