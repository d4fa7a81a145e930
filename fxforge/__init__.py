"""fxforge: capture a PyTorch model as a graph, rewrite it with verified rules, run it natively.

Example:
    >>> import torch, fxforge
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(), torch.nn.ReLU()).eval()
    >>> cap = fxforge.capture(model, (torch.ones(2, 4),))
    >>> fxforge.rewrite(cap).report.counts["cleanup"]
    1
"""

from fxforge.api import optimize
from fxforge.capture import CaptureError, capture
from fxforge.captured import Captured
from fxforge.exporters import ExportError, OnnxRuntimeModule, export_onnx
from fxforge.rewrites.passes import Pass
from fxforge.rewrites.pipeline import rewrite
from fxforge.rewrites.report import Report
from fxforge.runtime.artifact import load
from fxforge.runtime.native import OptimizedModule
from fxforge.runtime.profiler import Profile, profile

__all__ = ["CaptureError", "Captured", "ExportError", "OnnxRuntimeModule", "OptimizedModule", "Pass", "Profile", "Report", "capture",
           "export_onnx", "load", "optimize", "profile", "rewrite"]
