"""ONNX Runtime's IO binding for a CUDA session: inputs bound in place on the device, outputs written straight
into torch tensors where their shapes follow from the inputs' (:func:`run_bound`), and the dtype tables between
torch, numpy and ONNX Runtime's type names.

Example:
    >>> _ORT_DTYPES["tensor(float)"], _NUMPY_DTYPES[torch.int64].__name__
    (torch.float32, 'int64')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fxforge.exporters.io_spec import InputShapeError

# ONNX element type names (as ORT reports them) -> torch dtypes.
_ORT_DTYPES = {
    "tensor(float)": torch.float32, "tensor(double)": torch.float64, "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16, "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
    "tensor(int16)": torch.int16, "tensor(int8)": torch.int8, "tensor(uint8)": torch.uint8,
    "tensor(bool)": torch.bool,
}
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                 torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
                 torch.uint8: np.uint8, torch.bool: np.bool_}


def run_bound(session: Any, output_meta: Sequence[Any], device: torch.device,
              feeds: Sequence[tuple[str, torch.Tensor]], symbols: dict[str, int],
              out_device: torch.device) -> list[torch.Tensor]:
    """Run ``session`` (on CUDA ``device``) with IO binding: inputs in place on the device, outputs into torch
    tensors where possible (``symbols``: the inputs' dim names bound to sizes), returned on ``out_device``."""
    binding = session.io_binding()
    keep = []  # tensors bound by pointer must outlive the run
    for name, tensor in feeds:
        tensor = tensor.detach()
        if tensor.device != device:
            tensor = tensor.to(device)
        tensor = tensor.contiguous()
        keep.append(tensor)
        if tensor.dtype not in _NUMPY_DTYPES:
            raise InputShapeError(f"input {name!r}: {tensor.dtype} cannot be bound to ONNX Runtime from Python")
        binding.bind_input(name, "cuda", device.index or 0, _NUMPY_DTYPES[tensor.dtype], list(tensor.shape),
                           tensor.data_ptr())
    preallocated: list[torch.Tensor | None] = []
    for meta in output_meta:
        shape = [d if isinstance(d, int) else symbols.get(d) for d in meta.shape]
        dtype = _ORT_DTYPES.get(meta.type)
        if dtype in _NUMPY_DTYPES and all(isinstance(d, int) for d in shape):
            out = torch.empty(shape, dtype=dtype, device=device)
            binding.bind_output(meta.name, "cuda", device.index or 0, _NUMPY_DTYPES[dtype], shape, out.data_ptr())
            preallocated.append(out)
        else:
            binding.bind_output(meta.name, "cuda", device.index or 0)
            preallocated.append(None)
    torch.cuda.current_stream(device).synchronize()  # inputs written by torch's stream are complete
    session.run_with_iobinding(binding)
    host = binding.copy_outputs_to_cpu() if any(out is None for out in preallocated) else None
    outputs = []
    for i, out in enumerate(preallocated):
        if out is None:  # a shape that depends on values: ONNX Runtime allocated it; copy through the host
            out = torch.from_numpy(np.asarray(host[i])).to(device)
        outputs.append(out.to(out_device))
    return outputs
