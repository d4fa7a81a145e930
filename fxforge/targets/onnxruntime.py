"""The ``onnxruntime`` target: the model exported to a checked ONNX file (:func:`fxforge.export_onnx`) and run
in an ONNX Runtime session (:class:`~fxforge.exporters.ort_module.OnnxRuntimeModule`).

It runs a snapshot of the weights taken at export, in eval mode, without gradients or hooks; other sizes
are served by exporting once more with the dims that changed dynamic (``dynamic=None``), by one export
with the batch and sequence dims dynamic (``dynamic=True``), or not (``dynamic=False``). It writes the
``.onnx`` file it runs.

Example:
    >>> ort = ONNXRUNTIME.build(torch.nn.Tanh().eval(), (torch.zeros(2),), {})
    >>> ort(torch.zeros(2)).tolist(), ONNXRUNTIME.contract.artifact
    ([0.0, 0.0], '.onnx')
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from typing import Any

from torch import nn

from fxforge.capture import normalize_inputs
from fxforge.core.source import first_line
from fxforge.core.target_cache import device_of
from fxforge.exporters.export import EXPORT_OPTIONS, export_for_session
from fxforge.exporters.onnx import OnnxExport, check_options
from fxforge.exporters.onnx_precision import check_precision
from fxforge.exporters.ort_decorator import onnxruntime_class
from fxforge.exporters.ort_module import OnnxRuntimeModule, ort_refusal
from fxforge.runtime.race import Entrant, Narrows
from fxforge.runtime.throughput import serve_throughput
from fxforge.runtime.throughput_search import SEARCH_BUDGET_S
from fxforge.targets.base import COMMON_OPTIONS, Contract, Target, model_kind, prepared

# The session's options, besides the export's.
SESSION_OPTIONS = ("path", "providers", "session_options", "intra_op_num_threads")


class OnnxRuntimeTarget(Target):
    """ONNX Runtime runs the exported file (see the module docstring)."""

    name = "onnxruntime"
    summary = "the model exported to ONNX and run by ONNX Runtime"
    contract = Contract(dynamic="other sizes: exported again with the dims that changed dynamic (dynamic=None)",
                        live_weights=False, hooks=False, gradients=False, training=False, artifact=".onnx",
                        devices="CPU, and CUDA where onnxruntime-gpu sees a GPU")
    options = (tuple(o for o in EXPORT_OPTIONS if o not in COMMON_OPTIONS) + SESSION_OPTIONS
               + ("objective", "throughput_budget_s"))
    precisions = ("int8",)

    def build(self, model: Any, example_inputs: Any, options: dict[str, Any]) -> nn.Module | type:
        options = dict(options)
        objective = options.pop("objective", "latency")
        budget_s = options.pop("throughput_budget_s", SEARCH_BUDGET_S)
        if model_kind(model) == "class":
            return onnxruntime_class(model, functools.partial(onnxruntime_module, **options))
        module = onnxruntime_module(model, example_inputs, **options)
        if objective == "throughput":  # each stream's calls on a session of its own thread count
            module.follow_threads = True
            return serve_throughput(module, example_inputs, budget_s=budget_s)
        return module

    def graph(self, built: nn.Module) -> Any:
        return built.onnx_export.captured if built.onnx_export is not None else None

    def write(self, built: nn.Module, path: str, *, dynamic_batch: bool = False) -> OnnxExport:
        """A copy of the file the session runs (and its ``.data``), renamed into place when whole; returns the
        export's record (validation, translations)."""
        if built.onnx_export is None or built.path is None:
            raise ValueError("nothing to write: the module has not exported the model yet")
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"cannot write {path!r}: no folder {directory!r}")
        if os.path.abspath(built.path) != os.path.abspath(path):
            _copy_whole(built.path, path)
        return built.onnx_export

    def entrant(self, model: nn.Module, args: tuple, kwargs: dict, options: dict[str, Any],
                shared: dict[str, Any]) -> Entrant:
        def build() -> nn.Module:  # exported with the dims eager serves at other sizes dynamic
            served = shared.get("served")
            if served is None:
                return prepared(onnxruntime_module(model, None, **options), args, kwargs)
            try:
                return prepared(onnxruntime_module(model, None, **options, serve=(served.args, served.kwargs)),
                                args, kwargs)
            except Exception as error:
                raise Narrows(f"not raced: it cannot serve the sizes eager serves: exporting it with {served.text} "
                              f"dynamic failed: {first_line(error)}") from error

        return Entrant(self.name, build, refusal=ort_refusal(device_of(args, kwargs, model)), fixed_sizes=True,
                       what="export to ONNX")


def _copy_whole(source: str, path: str) -> None:
    """``source`` (and ``source.data``, its external weights) copied to ``path``: to temporary names beside it,
    then renamed, the ``.onnx`` last; nothing is left on a failure."""
    directory = os.path.dirname(os.path.abspath(path))
    pairs = [(source + ".data", path + ".data")] if os.path.exists(source + ".data") else []
    pairs.append((source, path))
    temporary = []
    try:
        for src, dst in pairs:
            handle, scratch = tempfile.mkstemp(prefix=".fxforge-", dir=directory)
            os.close(handle)
            temporary.append(scratch)
            shutil.copyfile(src, scratch)
        for scratch, (_, dst) in zip(temporary, pairs):
            os.replace(scratch, dst)
    finally:
        for scratch in temporary:
            with contextlib.suppress(OSError):
                os.remove(scratch)


def onnxruntime_module(model: nn.Module, example_inputs: Any = None, *, path: str | os.PathLike | None = None,
                       providers: Any = None, session_options: Any = None, intra_op_num_threads: int | None = None,
                       dynamic: bool | None = None, serve: Any = None, **export_options: Any) -> OnnxRuntimeModule:
    """``model`` exported with :func:`export_onnx` and run in ONNX Runtime (the ``onnxruntime`` target).

    Without ``example_inputs`` the export happens on the first call, with that call's inputs. The file goes
    to ``path`` if given, else to a temporary folder removed with the module.

    Args:
        model: the model (exported in eval mode).
        example_inputs: a tuple of positional inputs, one tensor, a dict of keyword inputs, or None.
        path: where to keep the ONNX file.
        providers, session_options, intra_op_num_threads: for the session (see :class:`OnnxRuntimeModule`).
        dynamic: True: one export with the batch and sequence dims dynamic (:func:`export_onnx`'s
            ``dynamic=True``), whose session serves every batch size and length. None (as
            ``torch.compile``): the first export is static; the first call that differs from it only in
            sizes exports the model once more, with the dims that changed and the batch and sequence dims
            dynamic, and that session (the old one freed) serves every later size. False: one static
            export (other sizes raise :class:`~fxforge.exporters.ort_module.InputShapeError`). With
            ``dynamic_batch`` or ``dynamic_shapes``, None exports once, with those dims.
            ``module.exports`` counts the exports made.
        serve: other inputs ``(args, kwargs)`` the first export must serve too (the ``auto`` target's inputs
            of new sizes eager serves): the dims where their sizes differ from the example's are exported
            dynamic (with the batch and sequence dims), as ``dynamic=None`` does on a call of new sizes.
        export_options: ``rewrites``, ``verify``, ``method``, ``dynamic_batch``, ``dynamic_shapes``,
            ``opset``, ``attention``, ``external_data``, ``precision``, ``tolerance``, ``calibration`` (see
            :func:`export_onnx`; int8: the file quantized by ONNX Runtime where it keeps the tolerance and runs
            faster).

    Raises:
        TypeError, ValueError: unknown or conflicting options.

    Example:
        >>> m = onnxruntime_module(torch.nn.Tanh().eval(), intra_op_num_threads=1)
        >>> m(torch.zeros(2)).tolist(), m.intra_op_num_threads
        ([0.0, 0.0], 1)
        >>> m(torch.zeros(3)).tolist(), m(torch.zeros(5)).shape, m.exports   # a size changed: exported again
        ([0.0, 0.0, 0.0], torch.Size([5]), 2)
    """
    unknown = sorted(set(export_options) - set(EXPORT_OPTIONS))
    if unknown:
        raise TypeError(f"unknown export options {', '.join(unknown)}; they are {', '.join(EXPORT_OPTIONS)}")
    if dynamic not in (None, True, False):
        raise TypeError(f"dynamic takes None, True or False, got {dynamic!r}")
    check_options(export_options.get("opset"), export_options.get("dynamic_batch", False),
                  export_options.get("dynamic_shapes"), export_options.get("attention", "MultiHeadAttention"),
                  bool(dynamic))
    check_precision(export_options.get("precision", "float32"), export_options.get("external_data"),
                    export_options.get("tolerance"), example_inputs)
    explicit = bool(export_options.get("dynamic_batch")) or export_options.get("dynamic_shapes") is not None
    export = functools.partial(export_for_session, model, {**export_options, "dynamic": bool(dynamic)})
    module = OnnxRuntimeModule.deferred(model, export, path=path, providers=providers,
                                        session_options=session_options, intra_op_num_threads=intra_op_num_threads,
                                        dynamic=bool(dynamic) if dynamic is not None or explicit else None,
                                        serve=serve)
    if example_inputs is not None:
        args, kwargs = normalize_inputs(example_inputs)
        module.prepare(*args, **kwargs)
    return module


ONNXRUNTIME = OnnxRuntimeTarget()
