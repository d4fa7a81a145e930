"""Exported forms of a rewritten graph, and running them.

- :mod:`~fxforge.exporters.program`: ``torch.export`` programs of rewritten graphs; validation against PyTorch;
- :mod:`~fxforge.exporters.onnx`: a checked, validated ONNX file (with :mod:`~fxforge.exporters.translations`
  of fxforge's ops, and the rules on the ONNX graph: one list, :mod:`~fxforge.exporters.onnx_rules`, run by
  :mod:`~fxforge.exporters.onnx_engine`, each rule's module asking :mod:`~fxforge.exporters.onnx_ir`);
- :mod:`~fxforge.exporters.pt2`: a ``.pt2`` artifact and :func:`~fxforge.exporters.pt2.load`;
- :mod:`~fxforge.exporters.ort_module`: :class:`OnnxRuntimeModule`, the ONNX Runtime runner;
- :mod:`~fxforge.exporters.ort_decorator`: decorated classes that run in ONNX Runtime.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "relu.onnx")
    >>> fxforge.export_onnx(torch.nn.ReLU(), path, (torch.ones(2),)).validation
    {'example inputs': 0.0}
"""

from fxforge.exporters.onnx import OnnxExport
from fxforge.exporters.ort_module import InputShapeError, IOSpec, OnnxRuntimeModule
from fxforge.exporters.program import ExportError

__all__ = ["ExportError", "IOSpec", "InputShapeError", "OnnxExport", "OnnxRuntimeModule"]
