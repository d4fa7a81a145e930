"""Capture an ``nn.Module`` as a ``torch.fx`` graph: symbolic tracing, or torch.export.

- :mod:`~fxforge.capture.model`: :func:`capture` tries the methods in turn and checks the graph;
- :mod:`~fxforge.capture.fx_trace`: symbolic tracing, with submodules that break it kept as opaque leaves;
- :mod:`~fxforge.capture.export`: torch.export turned back into a callable graph;
- :mod:`~fxforge.capture.dynamic`: torch.export with dynamic dims (the batch dim, or the user's spec);
- :mod:`~fxforge.capture.dims`: which input dims an export keeps dynamic (batch, sequence, those that changed);
- :mod:`~fxforge.capture.refine`: torch.export's suggested fixes taken instead of failing;
- :mod:`~fxforge.capture.hf`: transformers' cache objects as pytrees.

Example:
    >>> import torch
    >>> from fxforge.capture import capture
    >>> cap = capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.ones(2, 4),))
    >>> cap.method
    'fx'
"""

from fxforge.capture.fx_trace import OpaqueModule
from fxforge.capture.model import CaptureError, capture, normalize_inputs

__all__ = ["CaptureError", "OpaqueModule", "capture", "normalize_inputs"]
