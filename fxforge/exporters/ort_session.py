"""ONNX Runtime sessions as fxforge opens them: the execution providers (CUDA where torch and ONNX Runtime
both have it), why ONNX Runtime cannot serve a device, and the session options (threads, no spinning).

Example:
    >>> session_options(2).inter_op_num_threads, default_providers()[-1]
    (1, 'CPUExecutionProvider')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def default_providers() -> list[str]:
    """CUDA when torch sees a GPU and ONNX Runtime has the CUDA provider, else CPU (listed explicitly,
    so a GPU build of ONNX Runtime on a CPU-only machine does not try, and complain about, CUDA).

    Example:
        >>> default_providers()[-1]
        'CPUExecutionProvider'
    """
    import onnxruntime as ort

    if torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def ort_refusal(device: torch.device) -> str | None:
    """Why ONNX Runtime cannot run a model on ``device`` on its own hardware here, or None.

    A model on a GPU needs ONNX Runtime's CUDA provider (the ``onnxruntime-gpu`` package); without it the
    session would run on the CPU, which is no contender for the GPU's targets.

    Example:
        >>> ort_refusal(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda":
        return None
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        return None
    return ("not raced: this onnxruntime has no CUDAExecutionProvider (the onnxruntime-gpu package), so it "
            "would run the CUDA model on the CPU")


def session_options(intra_op_num_threads: int | None = None, *, spinning: bool = False) -> Any:
    """ONNX Runtime ``SessionOptions`` as fxforge uses them.

    ``intra_op_num_threads`` defaults to torch's thread count (so both use the same cores); one
    inter-op thread; worker threads do not spin waiting for work (``session.intra_op.allow_spinning =
    "0"``: a spinning pool competes with the rest of the process for the cores between runs); warnings
    from ONNX Runtime's logger are off (errors still raise).

    Example:
        >>> session_options(3).intra_op_num_threads
        3
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = int(intra_op_num_threads or torch.get_num_threads())
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    flag = "1" if spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", flag)
    options.add_session_config_entry("session.inter_op.allow_spinning", flag)
    return options


def _provider_options(providers: Sequence[Any]) -> list[Any]:
    """Put the current torch CUDA device on a bare ``"CUDAExecutionProvider"``."""
    result = []
    for provider in providers:
        if provider == "CUDAExecutionProvider" and torch.cuda.is_available():
            provider = ("CUDAExecutionProvider", {"device_id": torch.cuda.current_device()})
        result.append(provider)
    return result
