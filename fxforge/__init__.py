"""fxforge: capture a PyTorch model as a graph, rewrite it with verified rules, run it natively or in ONNX Runtime.

Example:
    >>> import torch, fxforge
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(), torch.nn.ReLU()).eval()
    >>> cap = fxforge.capture(model, (torch.ones(2, 4),))
    >>> fxforge.rewrite(cap).report.counts["cleanup"]
    1
"""

from fxforge.api import optimize, parallelize
from fxforge.capture import CaptureError, capture
from fxforge.core.captured import Captured
from fxforge.core.report import Report
from fxforge.exporters import ExportError, OnnxRuntimeModule
from fxforge.exporters.export import export_onnx
from fxforge.exporters.pt2 import load
from fxforge.lowering.build import rewrite
from fxforge.parallel import Partition, partition
from fxforge.rewrites.passes import Pass
from fxforge.runtime.native import OptimizedModule
from fxforge.runtime.profile import Profile
from fxforge.runtime.profile.subjects import profile
from fxforge.training import TrainingMemory, training_memory

__all__ = ["CaptureError", "Captured", "ExportError", "OnnxRuntimeModule", "OptimizedModule", "Partition", "Pass", "Profile", "Report", "TrainingMemory",
           "capture", "export_onnx", "load", "optimize", "parallelize", "partition", "profile", "rewrite", "training_memory"]
