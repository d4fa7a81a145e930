"""Exporting a model to a checked ONNX file: capture (with dynamic dims where asked), rewrite without timing
PyTorch's kernels, write, check and validate (:func:`export_onnx`, ``fxforge.export_onnx``).

The ``onnxruntime`` target (:mod:`fxforge.targets.onnxruntime`) runs what :func:`export_for_session` writes;
the ``.pt2`` artifact and the CLI take their rewritten graph from :func:`captured_for_export`.

Example:
    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "tanh.onnx")
    >>> export_onnx(torch.nn.Tanh().eval(), path, (torch.ones(2),)).path == path
    True
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from fxforge.capture import CaptureError, capture, normalize_inputs
from fxforge.capture.dynamic import (
    batch_size,
    capture_dynamic,
    capture_refined,
    changed_dynamic_shapes,
    sequence_dynamic_shapes,
    sequence_length,
)
from fxforge.core.captured import Captured
from fxforge.core.plan import CallConditions
from fxforge.core.source import first_line
from fxforge.exporters.onnx import OnnxExport, check_options, write_checked
from fxforge.exporters.onnx_precision import check_precision, quantize_file
from fxforge.exporters.ort_module import OnnxRuntimeModule
from fxforge.exporters.program import ExportError
from fxforge.rewrites import pipeline
from fxforge.rewrites.registry import resolve

# The calls an exported graph serves: no gradients, no autocast; guards the ONNX translation may drop as ops.
EXPORT_CONDITIONS = CallConditions(guards_as_ops=True)
# What export_onnx takes besides the model, the path and the inputs; the onnxruntime target passes these on.
EXPORT_OPTIONS = ("rewrites", "verify", "method", "dynamic", "dynamic_batch", "dynamic_shapes", "opset", "attention",
                  "external_data", "precision", "tolerance", "calibration")


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """Run the block with ``model`` (an ``nn.Module``) in eval mode, then put its modes back as they were.

    Example:
        >>> m = torch.nn.Dropout().train()
        >>> with eval_mode(m):
        ...     m.training
        False
        >>> m.training
        True
    """
    if not isinstance(model, nn.Module):
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def captured_for_export(model: nn.Module | Captured, example_inputs: Any, *, example_kwargs: dict | None = None,
                        rewrites: Any = "default", verify: bool = True, method: str = "auto",
                        dynamic_batch: bool = False, dynamic_shapes: Any = None, dynamic: bool = False) -> Captured:
    """The rewritten ``Captured`` to export: ``model`` itself when it is one, else captured and rewritten.

    The conv+activation fusion is kept without timing PyTorch kernels for it (the ONNX translation is
    the same either way, and ONNX Runtime picks its own kernels); the report notes it. With dynamic dims
    (``dynamic=True``: the batch and sequence dims, ``dynamic_batch``, ``dynamic_shapes``), a model that only
    ``torch.export`` captures is captured again with those dims dynamic, so that its graph computes shapes
    instead of holding the example's.

    Raises:
        ExportError: a ``Captured`` in training mode (export is for inference), or dims torch.export
            cannot keep dynamic.

    Example:
        >>> cap = captured_for_export(torch.nn.ReLU().eval(), (torch.ones(1),))
        >>> cap.method
        'fx'
    """
    return _for_export(model, example_inputs, example_kwargs=example_kwargs, rewrites=rewrites, verify=verify,
                       method=method, dynamic_batch=dynamic_batch, dynamic_shapes=dynamic_shapes, dynamic=dynamic)[0]


def _for_export(model: nn.Module | Captured, example_inputs: Any, *, example_kwargs: dict | None = None,
                rewrites: Any = "default", verify: bool = True, method: str = "auto", dynamic_batch: bool = False,
                dynamic_shapes: Any = None, dynamic: bool = False,
                before: tuple | None = None) -> tuple[Captured, Any, Any, Captured | None]:
    """:func:`captured_for_export`, with the ``dynamic_shapes`` to export it with and how they may be refined
    (see :func:`fxforge.capture.dynamic.export_refining`): the user's as given, or those fxforge chose for
    ``dynamic=True`` (batch and sequence dims) or, with ``before`` (the inputs of an earlier export that
    do not fit these), for the dims that changed (:func:`fxforge.capture.dynamic.changed_dynamic_shapes`);
    and the capture before the rewrites (None for a ``Captured``, which is exported as it is)."""
    refine: Any = False
    unrewritten = None
    if isinstance(model, Captured):
        captured = model
        if dynamic or before is not None:
            dynamic_shapes, refine = _chosen_dims(captured.graph_module, captured.example_args,
                                                  captured.example_kwargs, before)
    else:
        if not isinstance(model, nn.Module):
            raise TypeError(f"export_onnx takes an nn.Module or a Captured, got {type(model).__name__}")
        if example_inputs is None and not example_kwargs:
            raise ValueError("export_onnx needs example_inputs for a module (a tuple, one tensor, or a dict)")
        args, kwargs = normalize_inputs(example_inputs)
        kwargs.update(example_kwargs or {})
        captured = capture(model, args, method, example_kwargs=kwargs, check=verify)
        if dynamic or before is not None:
            dynamic_shapes, refine = _chosen_dims(model, args, kwargs, before)
        if captured.method == "export" and refine is not False:
            try:
                captured, dynamic_shapes = capture_refined(model, args, kwargs, dynamic_shapes,
                                                           reference=captured.example_outputs, refine=refine)
            except CaptureError as error:
                raise ExportError(error.reasons.get("export", str(error)), stage="torch.export") from error
        elif captured.method == "export" and (dynamic_batch or dynamic_shapes is not None):
            captured = dynamic_capture(model, args, kwargs, dynamic_shapes, reference=captured.example_outputs)
        unrewritten = captured
        captured = _rewritten_for_export(unrewritten, rewrites, verify)
    if captured.training:
        raise ExportError("the graph was captured in training mode; ONNX export is for inference: capture the model "
                          "after model.eval()", stage="input")
    return captured, dynamic_shapes, refine, unrewritten


def _rewritten_for_export(captured: Captured, rewrites: Any, verify: bool) -> Captured:
    """The rewrites for an ONNX file: no tuner (ONNX Runtime picks its own kernels), and attention's NaN-row guard
    written as one op (``fxforge::nan_rows``) that the translation leaves out where ORT's kernel gives NaN there
    itself, instead of a graph of guards that a later pass would pattern-match away."""
    captured = pipeline.rewrite(captured, rewrites, verify, conditions=EXPORT_CONDITIONS)
    if captured.report.counts.get("conv_activation"):
        captured.report.notes.append("conv_activation kept without timing PyTorch kernels: the ONNX file runs "
                                     "ONNX Runtime's own")
    return captured


def write_exportable(write: Any, captured: Captured, unrewritten: Captured | None, rewrites: Any,
                      verify: bool) -> Any:
    """``write(captured)`` (a ``write_checked`` with its options bound); where that export fails after rewrites
    and the graph without them exports, the rewrites never make the model unexportable: the export is made
    again from ``unrewritten`` leaving out one applied rewrite at a time (the first that exports is kept),
    else with none; the export's ``left_out`` (and a note in its report) says which was left out and why (its
    ``captured`` is the graph exported). ``unrewritten`` None (a graph given as it is): the failure is raised.

    Example:
        >>> import os, tempfile
        >>> from fxforge.exporters.onnx import write_checked
        >>> cap = captured_for_export(torch.nn.Tanh().eval(), (torch.ones(2),))
        >>> path = os.path.join(tempfile.mkdtemp(), "t.onnx")
        >>> write = functools.partial(write_checked, path=path)
        >>> result, module = write_exportable(write, cap, None, "default", True)
        >>> result.path == path
        True
    """
    try:
        return write(captured)
    except ExportError as error:
        applied = [name for name in captured.report.counts if name != "cleanup"]
        if unrewritten is None or not applied:
            raise
        failure = error
    for left_out in [*applied, None]:  # one applied rewrite at a time, then every rewrite
        kept = [p for p in resolve(rewrites) if p.name != left_out] if left_out is not None else []
        candidate = _rewritten_for_export(unrewritten, kept, verify) if kept else unrewritten
        try:
            written = write(candidate)
        except ExportError:
            continue
        result = written[0]
        result.left_out = (f"{left_out or 'every rewrite'} left out of the ONNX export: with it, the export "
                           f"failed ({first_line(failure)})")
        result.report.notes.append(result.left_out)
        return written
    raise failure


def _chosen_dims(forward: nn.Module, args: tuple, kwargs: dict, before: tuple | None) -> tuple[Any, Any]:
    """``(dynamic_shapes, refine)`` fxforge chooses: the batch and sequence dims (``dynamic=True``; every dim
    must stay dynamic), or the dims that changed since ``before`` (only those must)."""
    if before is not None:
        found = changed_dynamic_shapes(forward, before, (args, kwargs))
        if found is None:
            raise ExportError("the inputs differ from those of the earlier export in more than their sizes",
                              stage="input")
        return found
    batch = batch_size(args, kwargs)
    if batch is None:
        raise ExportError("dynamic=True, but no input tensor has a dim 0", stage="input")
    return sequence_dynamic_shapes(forward, args, kwargs, batch, sequence_length(args, kwargs)), True


def dynamic_capture(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None, *,
                    reference: Any = None) -> Captured:
    """:func:`fxforge.capture.dynamic.capture_dynamic`, its failure an :class:`ExportError` (stage
    ``torch.export``): the dims an export asked for cannot stay dynamic.

    Example:
        >>> dynamic_capture(torch.nn.Linear(2, 3), (torch.ones(4, 2),), {}).graph_module(torch.ones(5, 2)).shape
        torch.Size([5, 3])
    """
    try:
        return capture_dynamic(model, args, kwargs, dynamic_shapes, reference=reference)
    except CaptureError as error:
        raise ExportError(error.reasons.get("export", str(error)), stage="torch.export") from error


def export_onnx(model: nn.Module | Captured, path: str | os.PathLike, example_inputs: Any = None,
                dynamic_batch: bool = False, rewrites: Any = "default", opset: int | None = None,
                dynamic_shapes: Any = None, *, dynamic: bool = False, verify: bool = True, method: str = "auto",
                attention: str = "MultiHeadAttention", external_data: bool | None = None, precision: str = "float32",
                tolerance: Any = None, calibration: Sequence[tuple] | None = None) -> OnnxExport:
    """Capture, rewrite and export ``model`` to an ONNX file that ONNX Runtime runs like the model.

    A file with dynamic dims (``dynamic``, ``dynamic_batch``, ``dynamic_shapes``) is validated in ONNX
    Runtime against the model at three sizes: the example inputs, and two other sizes of every dynamic dim
    (one larger, one smaller where the dim's range allows; ``result.validation`` lists them).

    Args:
        model: an ``nn.Module`` (exported as in eval mode, whatever its mode; its modes are put back
            afterwards), or a :class:`~fxforge.core.captured.Captured` of one in eval mode (exported as it is).
        path: the ``.onnx`` file to write (its folder must exist); replaced only by a complete, checked,
            validated file. Weights go to ``path + ".data"`` beside it with ``external_data=True``, or
            (``None``) when they pass protobuf's 2 GB limit.
        example_inputs: a tuple of positional inputs, one tensor, or a dict of keyword inputs (not needed
            with a ``Captured``).
        dynamic_batch: make dim 0 of every input whose dim 0 is the batch size dynamic (one shared
            ``torch.export.Dim("batch")``).
        rewrites: ``"default"``, a list of rewrite names, or pass objects (see :func:`fxforge.rewrite`).
        opset: the ONNX opset (default 20; at least 18).
        dynamic_shapes: passed to ``torch.export.export`` as it is (keyed by the forward's argument names;
            a dim it makes dynamic that is 1 in the example is traced grown to 2); not together with
            ``dynamic_batch``.
        dynamic: make the batch and the sequence dims dynamic, for one file that serves every batch size and
            sequence length: dim 0 as ``dynamic_batch`` does, and dim 1 of every input of rank >= 2 whose
            dim 1 is the sequence length (token ids, attention masks, position ids, ``[batch, seq, hidden]``
            floats; the length is read from integer inputs first) as one shared ``Dim("seq")``; an image
            ``[batch, channels, height, width]`` gets only the batch dim (see
            :func:`fxforge.capture.dynamic.sequence_dynamic_shapes`). A batch or sequence of 1 in the example
            is traced grown to 2 (its row or position repeated). Where torch.export finds the model limits a
            dim (64 positions: ``Dim("seq", max=64)``), its suggested range is taken; a model that needs one
            of those dims at one size is refused (ExportError). Fused attention stays fused
            (``MultiHeadAttention``; ``GroupQueryAttention`` computes its lengths from the inputs' shapes).
            Not together with ``dynamic_batch`` or ``dynamic_shapes``.
        verify: verify each rewrite numerically (see :func:`fxforge.rewrite`).
        method: capture method, ``"auto"``, ``"fx"`` or ``"export"``.
        attention: ``"MultiHeadAttention"`` (attention -> ONNX Runtime's attention kernels where they carry
            the call: ``com.microsoft.GroupQueryAttention`` for causal self-attention, else
            ``com.microsoft.MultiHeadAttention``, run without its mask when the mask masks nothing; see
            :mod:`fxforge.exporters.translations`) or ``"plain"`` (torch.onnx's MatMul/Softmax graph).
        external_data: weights in a separate ``.data`` file (True), in the ``.onnx`` (False), or only
            when they must be (None).
        precision: ``"float32"``, or ``"int8"``: the validated float32 file quantized by ONNX Runtime's
            quantizer (QDQ with calibrated activations, or dynamic for files without convolutions), kept where
            it keeps ``tolerance`` against the float32 file and runs faster in ONNX Runtime; else the float32
            file, the reason in the report's notes (see :mod:`fxforge.exporters.onnx_precision`).
        tolerance: what int8 must keep: a relative error, a dict or a :class:`~fxforge.core.accuracy.Tolerance`
            (default 0.05, cosine 0.999, top-1 99 % for class scores).
        calibration: the calls (tuples of positional inputs) static int8 calibrates on; default: the example
            inputs and four random draws of their statistics.

    Returns:
        An :class:`~fxforge.exporters.onnx.OnnxExport`: the path, the report, the translations used and
        the validation errors.

    Raises:
        ExportError: an op with no ONNX translation (naming it and the user's source line), a failed
            ``torch.export``, checker or validation; nothing is left on disk.
        fxforge.CaptureError: the model could not be captured.
        ValueError, TypeError, FileNotFoundError: bad arguments (checked before anything runs).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "lin.onnx")
        >>> r = export_onnx(torch.nn.Linear(4, 2).eval(), path, (torch.ones(3, 4),))
        >>> r.opset, list(r.validation)
        (20, ['example inputs'])
        >>> ids = torch.randint(0, 10, (2, 6))
        >>> r = export_onnx(torch.nn.Embedding(10, 4).eval(), path, (ids,), dynamic=True)
        >>> r.dynamic, list(r.validation)
        ({'input': {0: 'batch', 1: 'seq'}}, ['example inputs', 'batch 3, seq 7', 'batch 1, seq 3'])
    """
    opset = check_options(opset, dynamic_batch, dynamic_shapes, attention, dynamic)
    check_precision(precision, external_data, tolerance, example_inputs)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot write {path!r}: no folder {directory!r}")
    options = {"rewrites": rewrites, "verify": verify, "method": method, "dynamic": dynamic,
               "dynamic_batch": dynamic_batch, "dynamic_shapes": dynamic_shapes, "opset": opset,
               "attention": attention, "external_data": external_data, "precision": precision, "tolerance": tolerance,
               "calibration": calibration}
    result, module = export_for_session(model, options, example_inputs, {}, path, {})
    del module  # its session was only for validation
    return result


def export_for_session(model: nn.Module, options: dict, args: tuple, kwargs: dict, path: str,
                        module_options: dict, before: tuple | None = None) -> tuple[OnnxExport, OnnxRuntimeModule]:
    """Export ``model`` (an ``nn.Module``, or a ``Captured`` exported as it is) for these inputs to ``path``
    and validate it in a session with ``module_options``; with ``before`` (the inputs of the export this one
    replaces), the dims that changed since are dynamic. What :func:`export_onnx` and
    :class:`~fxforge.exporters.ort_module.OnnxRuntimeModule` (to (re-)export) call; ``options``: those of
    :data:`EXPORT_OPTIONS`; ``args`` may be any form of example inputs (a tuple, one tensor, a dict).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "t.onnx")
        >>> result, module = export_for_session(torch.nn.Tanh(), {}, (torch.zeros(2),), {}, path, {})
        >>> module(torch.zeros(2)).tolist()
        [0.0, 0.0]
    """
    dynamic = bool(options.get("dynamic", False))
    opset = check_options(options.get("opset"), options.get("dynamic_batch", False), options.get("dynamic_shapes"),
                          options.get("attention", "MultiHeadAttention"), dynamic)
    with eval_mode(model):
        captured, dims, refine, unrewritten = _for_export(
            model, args, example_kwargs=kwargs, dynamic=dynamic, before=before,
            **{k: options[k] for k in ("rewrites", "verify", "method", "dynamic_batch", "dynamic_shapes") if k in options})
        write = functools.partial(write_checked, path=path, opset=opset,
                                  dynamic_batch=options.get("dynamic_batch", False), dynamic_shapes=dims,
                                  attention=options.get("attention", "MultiHeadAttention"),
                                  external_data=options.get("external_data"), module_options=module_options,
                                  refine=refine)
        result, module = write_exportable(write, captured, unrewritten, options.get("rewrites", "default"),
                                          options.get("verify", True))
    if options.get("precision", "float32") == "int8":
        example = args if isinstance(args, tuple) else (args,) if args is not None else tuple(model.example_args)
        if quantize_file(result, example, options.get("tolerance"), options.get("calibration")):
            module.session_options = module.session_options  # (a new session, on the int8 file)
    return result, module
