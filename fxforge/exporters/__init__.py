"""Export to ONNX and run in ONNX Runtime: :func:`export_onnx` and :class:`OnnxRuntimeModule`.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "relu.onnx")
    >>> fxforge.export_onnx(torch.nn.ReLU(), path, (torch.ones(2),)).validation
    {'example inputs': 0.0}
"""

from fxforge.exporters.onnx import ExportError, OnnxExport, export_onnx
from fxforge.exporters.ort_module import InputShapeError, IOSpec, OnnxRuntimeModule

__all__ = ["ExportError", "IOSpec", "InputShapeError", "OnnxExport", "OnnxRuntimeModule", "export_onnx"]
