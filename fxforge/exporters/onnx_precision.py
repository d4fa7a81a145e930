"""Int8 ONNX files: the float32 file fxforge exported and validated, quantized by ONNX Runtime's quantizer, kept
only where it keeps the tolerance and runs faster in ONNX Runtime.

Up to three forms are tried, in this order:

1. **QDQ, static, fused** (``quantize_static``, ``QuantFormat.QDQ``; for files with a ReLU, a Clip or a pool):
   weights int8 per output channel, activations uint8 with ranges calibrated on the calibration calls (the example
   and four random draws of its statistics, or the user's ``calibration`` calls). ``QuantizeLinear``/
   ``DequantizeLinear`` pairs around each convolution and matrix product, which ONNX Runtime fuses into its int8
   kernels (and other runtimes read), and around the ReLUs, Clips and pools too: the quantizer folds a ReLU or a
   Clip into the range of its producer's output (a uint8 range from 0 is the ReLU), and ONNX Runtime then runs a
   chain conv -> ReLU -> (residual Add) -> pool -> conv in int8 end to end. Left out, each ReLU is a float island
   that ONNX Runtime requantizes around (a ``DequantizeLinear``/``QuantizeLinear`` pair a layer: ResNet-50 ran
   about 6-10% slower so, behind ONNX Runtime's quantizer with its default operators).
2. **QDQ, static**: the same with the convolutions and matrix products only; tried only where the fused form
   breaks the tolerance or does not apply (it is the fused form with requantizations added back: not the faster).
3. **Dynamic** (``quantize_dynamic``, for files without convolutions): int8 weights per channel, activations
   quantized at run time (``DynamicQuantizeLinear`` + ``MatMulInteger``), as ONNX Runtime recommends for
   transformers.

No Add, Mul, normalization or gather is quantized for its own sake: in int8 it saves little and rounds a residual
stream (ONNX Runtime's quantizer with all its operators puts a small ViT 0.24-0.38 off in relative error). Each form
is run in ONNX Runtime on the calibration calls and two fresh draws and compared with the float32 file's outputs
(:func:`~fxforge.core.accuracy.agreement`); those that keep the tolerance are timed against the float32 file
(interleaved), and the fastest replaces it only where it is faster. Otherwise the float32 file stays; the forms
refused and why are in the report's notes either way.

Example:
    >>> import os, tempfile
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    >>> path = os.path.join(tempfile.mkdtemp(), "mlp.onnx")
    >>> result = fxforge.export_onnx(model.eval(), path, (torch.randn(4, 16, 256),), precision="int8")
    >>> note = [n for n in result.report.notes if n.startswith("precision int8")][0]
    >>> forms = ("int8 (static QDQ fused)", "int8 (static QDQ)", "int8 (dynamic)", "float32")
    >>> result.precision in forms, note.startswith("precision int8: ")
    (True, True)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from fxforge.core.accuracy import Tolerance, agreement
from fxforge.core.verify import random_like
from fxforge.lowering.timing import DECISIVE, time_interleaved

PRECISIONS = ("float32", "int8")
CALIBRATION_DRAWS = 4  # random calls besides the example that static int8 calibrates on
CHECK_DRAWS = 2  # and fresh ones the int8 file is checked on besides those
# What is quantized: the matrix products and convolutions (an Add or a Mul in int8 saves little and rounds a
# residual stream) ...
LAYERS = ["Conv", "MatMul", "Gemm"]
# ... and in the fused form the activations and pools ONNX Runtime runs in int8 between them (a ReLU or a Clip is
# folded into its producer's output range; a pool reads and writes int8), so no float island splits a conv chain.
CHAINED = ["Relu", "Clip", "MaxPool", "AveragePool", "GlobalAveragePool"]
FUSED, STATIC, DYNAMIC = "static QDQ fused", "static QDQ", "dynamic"
TIMING_BUDGET_S = 1.0


def check_precision(precision: str, external_data: bool | None, tolerance: Any = None, example: Any = None) -> None:
    """Refuse, before anything runs, a precision ONNX files are not written in.

    Raises:
        ValueError: not float32 or int8; int8 with the weights in a separate file or keyword example inputs; a
            tolerance :class:`~fxforge.core.accuracy.Tolerance` does not take.

    Example:
        >>> check_precision("bf16", None)
        Traceback (most recent call last):
        ...
        ValueError: precision='bf16': ONNX files are written in float32 or int8 (ONNX Runtime's CPU kernels have no bfloat16 matrix products)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: ONNX files are written in float32 or int8 (ONNX Runtime's CPU "
                         "kernels have no bfloat16 matrix products)")
    if precision == "int8" and external_data:
        raise ValueError("precision='int8' writes the weights into the .onnx file: leave external_data out")
    if precision == "int8" and isinstance(example, dict):
        raise ValueError("precision='int8' calibrates on positional example inputs: pass a tuple")
    Tolerance.of(tolerance)


class _Reader:
    """ONNX Runtime's calibration data reader over the calls' feeds."""

    def __init__(self, feeds: list[dict[str, Any]]):
        self.feeds = iter(feeds)

    def get_next(self) -> dict[str, Any] | None:
        return next(self.feeds, None)


def _feeds(io: Any, call: tuple) -> dict[str, Any]:
    from fxforge.exporters.ort_calls import as_exported

    args, kwargs = as_exported(io, None, call, {})
    return {name: tensor.detach().cpu().numpy() for name, tensor in io.feeds(args, kwargs)}


def _quantized(path: str, form: str, io: Any, calibration: Sequence[tuple]) -> str:
    """``path`` quantized in ``form`` into a new file beside it; returns its path."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    out, source = f"{path}.{form.replace(' ', '_')}.tmp.onnx", f"{path}.source.tmp.onnx"
    # torch.onnx records the weights' shapes as value_info too; the quantizer transposes some weights (a Gemm's
    # per-channel axis) and its shape inference then refuses the stale entries: the quantizer gets the file
    # without them.
    model = onnx.load(path)
    weights = {tensor.name for tensor in model.graph.initializer}
    kept = [info for info in model.graph.value_info if info.name not in weights]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    onnx.save(model, source)
    hush = _Hush()  # (its advice to pre-process goes to the root logger: fxforge says what it did instead)
    logging.getLogger().addFilter(hush)
    try:
        if form in (FUSED, STATIC):
            reader = type("Reader", (_Reader, CalibrationDataReader), {})([_feeds(io, c) for c in calibration])
            quantize_static(source, out, reader, quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            op_types_to_quantize=LAYERS + CHAINED if form == FUSED else LAYERS)
        else:
            quantize_dynamic(source, out, per_channel=True, weight_type=QuantType.QInt8, op_types_to_quantize=LAYERS)
    finally:
        logging.getLogger().removeFilter(hush)
        os.remove(source)
    return out


class _Hush(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing" not in record.getMessage() and "pre-process" not in record.getMessage()


def _op_types(path: str) -> set[str]:
    import onnx

    return {node.op_type for node in onnx.load(path, load_external_data=False).graph.node}


def _forms(op_types: set[str]) -> list[str]:
    """The forms tried on a file of these operators, in order (:data:`STATIC` only where :data:`FUSED` is refused).

    Example:
        >>> _forms({"Conv", "Relu", "Add"}), _forms({"MatMul", "Gelu"})
        (['static QDQ fused', 'static QDQ'], ['static QDQ', 'dynamic'])
    """
    return ([FUSED] if op_types & set(CHAINED) else []) + [STATIC] + ([] if "Conv" in op_types else [DYNAMIC])


def quantize_file(result: Any, example: tuple, tolerance: Any, calibration: Sequence[tuple] | None = None) -> bool:
    """Replace the float32 file of ``result`` (an :class:`~fxforge.exporters.onnx.OnnxExport`) by its int8 form
    where one keeps ``tolerance`` and runs faster (see the module docstring); the outcome goes to
    ``result.report.notes`` either way. Returns whether the file was replaced."""
    from fxforge.exporters.ort_module import OnnxRuntimeModule

    tolerance = Tolerance.of(tolerance)
    calls = list(calibration) if calibration else \
        [example] + [random_like(example, seed) for seed in range(1, CALIBRATION_DRAWS + 1)]
    checks = calls + [random_like(example, CALIBRATION_DRAWS + 1 + n) for n in range(CHECK_DRAWS)]
    plain = OnnxRuntimeModule(result.path, result.io)
    with torch.no_grad():
        reference = [plain(*call) for call in checks]
    refusals, kept, files = [], {}, {}
    try:
        for form in _forms(_op_types(result.path)):
            if form == STATIC and FUSED in kept:
                continue  # (the fused form without its fusions: slower, not worth its quantization and checks)
            files[form] = _quantized(result.path, form, result.io, calls)
            module = OnnxRuntimeModule(files[form], result.io)
            found = agreement(reference, [module(*call) for call in checks], tolerance.metric)
            refusal = tolerance.refusal(found)
            if refusal is None:
                kept[form] = (module, found)
            else:
                refusals.append(f"{form}: {refusal}")
        if kept:
            runs = {"float32": plain, **{form: module for form, (module, _) in kept.items()}}
            timings = time_interleaved({name: (lambda run=run: run(*example)) for name, run in runs.items()},
                                       TIMING_BUDGET_S, decisive=DECISIVE)
            best = min(kept, key=timings.__getitem__)
            against = f"{timings[best]:.3g} ms against float32's {timings['float32']:.3g} ms in ONNX Runtime"
            others = "".join(f"; {form}: {timings[form]:.3g} ms" for form in kept if form != best)
            if timings[best] < timings["float32"] * (1 - DECISIVE):
                os.replace(files[best], result.path)
                result.report.notes.append(
                    f"precision int8: {best} (weights per channel); outputs against the float32 file on "
                    f"{len(checks)} calls: {kept[best][1].describe()} (tolerance: {tolerance.describe()}); "
                    f"{against}{others}" + "".join(f"; refused: {refusal}" for refusal in refusals))
                result.precision = f"int8 ({best})"
                return True
            refusals.append(f"{best}: not faster ({against}){others}")
    finally:
        for path in files.values():
            if os.path.exists(path):
                os.remove(path)
    result.report.notes.append(f"precision int8: float32 kept: {'; '.join(refusals)}")
    return False
