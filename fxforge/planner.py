"""The orchestrator: a model and inputs in, a plan out (capture -> rewrite -> lower), for every target.

Every entry point that starts from a user's model goes through here, so the stages are wired in one place:

- :func:`build_plan` / :func:`plan_builder`: the native target's :class:`~fxforge.core.plan.Plan` (the
  rewritten graph, with kernels and layout chosen by autotune, and its lowered form), which
  :class:`~fxforge.runtime.native.OptimizedModule` runs per input signature;
- :func:`rewrite`: the rewrite stage with fxforge's autotune as its tuner (``fxforge.rewrite``);
- :func:`captured_for_export`: capture (with dynamic dims where asked) and rewrite without timing
  PyTorch kernels, for the ONNX file and the ``.pt2`` artifact; :func:`export_onnx` writes the file and
  :func:`onnxruntime_module` runs it (the ``onnxruntime`` target);
- :func:`optimized`: what ``fxforge.optimize`` returns for an instance or a class, per target;
- :func:`profile`: what a profile measures (a model's captured graph, a ``Captured``, or the graph an
  ``OptimizedModule`` really runs).

The per-call work (signature lookup, choosing the lowered or the autograd graph, eager fallback) is the
runtime's (:mod:`fxforge.runtime.plans`); this module hands it the build function, so nothing below
imports the stages above it.

Example:
    >>> import torch
    >>> plan = build_plan(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval(), (torch.ones(2, 4),), {})
    >>> plan.captured.method, plan.executable(torch.ones(2, 4)).shape
    ('fx', torch.Size([2, 4]))
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fxforge.capture import CaptureError, capture, normalize_inputs
from fxforge.capture.dynamic import (
    batch_size,
    capture_dynamic,
    capture_refined,
    capture_with_dims,
    changed_dynamic_shapes,
    sequence_dynamic_shapes,
    sequence_length,
)
from fxforge.core.captured import Captured
from fxforge.core.gc_pause import no_collection
from fxforge.core.plan import CallConditions, Plan
from fxforge.core.report import Contender, Race
from fxforge.core.source import first_line
from fxforge.core.symbolic import ShapeGuard
from fxforge.core.target_cache import choice_key, compile_rate, device_of, remember_compile_rate, target_cache
from fxforge.exporters.onnx import OnnxExport, check_options, write_checked
from fxforge.exporters.ort_decorator import onnxruntime_class
from fxforge.exporters.ort_module import OnnxRuntimeModule, ort_refusal
from fxforge.exporters.program import ExportError
from fxforge.lowering.autotune import MEASURE_ALL, TuningPolicy, autotune
from fxforge.lowering.inductor import LEFT_TO_INDUCTOR, inductor_plan
from fxforge.lowering.lower import make_plan, plain_plan
from fxforge.rewrites import pipeline
from fxforge.rewrites.registry import resolve
from fxforge.runtime.native import OptimizedModule, optimize_class
from fxforge.runtime.plans import MAX_PLANS, PlanBuilder, ShapePolicy
from fxforge.runtime.profile import Profile, profile_graph
from fxforge.runtime.race import Entrant, race, remembrable
from fxforge.training.module import CheckpointedModule

# What export_onnx takes besides the model, the path and the inputs; the onnxruntime target passes these on.
EXPORT_OPTIONS = ("rewrites", "verify", "method", "dynamic", "dynamic_batch", "dynamic_shapes", "opset", "attention",
                  "external_data")


# ---------------------------------------------------------------------------------------------- native

def checkpointed(model: Any, example_inputs: Any, memory_budget: Any, *, optimizer: Any = torch.optim.AdamW,
                 loss: Any = None, autocast: torch.dtype | None = None, target: str = "native",
                 check: bool = True) -> CheckpointedModule:
    """The model's training step fitted under ``memory_budget`` by checkpointing (see
    :mod:`fxforge.training.module`): ``optimize(model, inputs, memory_budget=...)``; ``target="inductor"``
    compiles the plan's forward and backward graphs with Inductor (:mod:`fxforge.training.compiled`).

    Raises:
        TypeError: not a model instance, no example inputs.
        ValueError: the model is in eval mode (nothing is saved for a backward), or a malformed budget.
        fxforge.training.checkpointing.BudgetError: no recomputation fits the budget.
    """
    if not isinstance(model, nn.Module):
        raise TypeError("memory_budget plans a training step: call fxforge.optimize(model, example_inputs, "
                        "memory_budget=...) on a model instance")
    if example_inputs is None:
        raise TypeError("memory_budget needs example_inputs: the plan is made for their shapes")
    if not model.training:
        raise ValueError("memory_budget plans checkpointing for training: the model is in eval mode "
                         "(call model.train() first)")
    return CheckpointedModule(model, example_inputs, memory_budget, optimizer=optimizer, loss=loss,
                              autocast=autocast, target=target, check=check)


def rewrite(captured: Captured, rewrites: Any = "default", verify: bool = True, *,
            tuning: TuningPolicy | None = MEASURE_ALL, conditions: CallConditions | None = None) -> Captured:
    """Apply rewrites to a captured graph and return a new ``Captured`` with a report.

    The rewrite stage (:func:`fxforge.rewrites.pipeline.rewrite`: passes in order, each verified, rolled
    back if it changes results) with fxforge's autotune measuring what passes cannot prove (which fused
    kernel and layout, and whether a fusion pays at all).

    Args:
        captured: from :func:`fxforge.capture`; left unchanged.
        rewrites: ``"default"``, a list of built-in names, or pass objects.
        verify: check the rewrites numerically.
        tuning: autotune's :class:`~fxforge.lowering.autotune.TuningPolicy` (choices it must not measure);
            None: nothing is timed and fused ops keep their composite kernel (what an export wants).
        conditions: the calls the graph will serve (:class:`~fxforge.core.plan.CallConditions`; default:
            calls that record no gradients, outside autocast).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout()).eval()
        >>> rewrite(capture(model, (torch.ones(1, 2),))).report.counts
        {'cleanup': 1}
    """
    tuner = functools.partial(autotune, policy=tuning) if tuning is not None else None
    return pipeline.rewrite(captured, rewrites, verify, tuner=tuner, conditions=conditions)


def build_plan(module: nn.Module, args: tuple, kwargs: dict, conditions: CallConditions | None = None,
               dynamic: Any = None, *, rewrites: Any = "default", verify: bool = True, method: str = "auto",
               tuning: TuningPolicy = MEASURE_ALL, backend: str = "native") -> Plan:
    """Capture ``module`` for these inputs, rewrite it for calls made under ``conditions`` (autotune choosing
    kernels and layout), lower it.

    A plan for calls that record gradients, or run under autocast, keeps eager's ops where gradients or
    autocast need them (no folded parameters, no fused kernels) and runs its rewritten graph as it is. Plans
    are built outside inference mode, so that what they compute once (folded and prepacked weights) is an
    ordinary tensor whatever mode the first call was made in.

    ``dynamic`` makes the plan serve many sizes: a set of input dims ``(leaf, dim)`` of the flattened
    ``(args, kwargs)`` (captured by :func:`~fxforge.capture.dynamic.capture_with_dims`), or a
    ``dynamic_shapes`` spec in torch.export's format. The graph then has symbolic sizes; the plan's
    ``shapes`` (a :class:`~fxforge.core.symbolic.ShapeGuard`) says which calls it serves, including the size
    relations rewrites assumed (listed in the report's notes).

    Raises:
        CaptureError: the module could not be captured (with those dims dynamic).

    Example:
        >>> plan = build_plan(torch.nn.ReLU(), (torch.ones(2),), {})
        >>> plan.report.method
        'fx'
    """
    conditions = conditions or CallConditions()
    with torch.inference_mode(False), no_collection():
        if dynamic is None:
            captured, guard = capture(module, args, method, example_kwargs=kwargs, check=verify), None
        else:
            if isinstance(dynamic, (set, frozenset)):
                captured = capture_with_dims(module, args, kwargs, dynamic)
            else:
                captured = capture_dynamic(module, args, kwargs, dynamic)
            guard = ShapeGuard.of(captured.graph_module, captured.graph_module.meta.get("fxforge_ranges"))
        eager_ops = conditions.gradients or bool(conditions.autocast)  # no fused ops: nothing to time or lower
        if backend == "inductor" and not eager_ops:
            kept = [p for p in resolve(rewrites) if p.name not in LEFT_TO_INDUCTOR]
            rewritten = rewrite(captured, kept, verify=verify, tuning=None, conditions=conditions)
            plan = inductor_plan(rewritten, dynamic=dynamic is not None)
        else:
            rewritten = rewrite(captured, rewrites, verify=verify, tuning=None if eager_ops else tuning,
                                conditions=conditions)
            plan = plain_plan(rewritten) if eager_ops else make_plan(rewritten)
    if guard is not None and guard.symbols:
        plan.shapes = guard
        assumed = guard.take_assumptions()
        plan.report.notes.append(f"dynamic sizes: {guard.describe()}" + (
            f"; rewrites assumed {', '.join(assumed)} (checked per input signature)" if assumed else ""))
    return plan


def plan_builder(module: nn.Module, **options: Any) -> PlanBuilder:
    """``(args, kwargs, conditions) -> Plan`` for ``module``: what an optimized module calls for a call it has
    no plan for.

    Args:
        module: the model.
        options: ``rewrites``, ``verify``, ``method``, ``tuning`` (see :func:`build_plan`).

    Example:
        >>> build = plan_builder(torch.nn.ReLU(), rewrites=[])
        >>> build((torch.ones(1),), {}, CallConditions()).report.counts
        {}
    """
    return functools.partial(_build, module, options)


def _build(module: nn.Module, options: dict, args: tuple, kwargs: dict, conditions: CallConditions,
           dynamic: Any = None) -> Plan:
    return build_plan(module, args, kwargs, conditions, dynamic, **options)


# ---------------------------------------------------------------------------------------------- exports

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
    captured = rewrite(captured, rewrites, verify=verify, tuning=None)
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
                attention: str = "MultiHeadAttention", external_data: bool | None = None) -> OnnxExport:
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
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot write {path!r}: no folder {directory!r}")
    with eval_mode(model):
        captured, dims, refine, unrewritten = _for_export(
            model, example_inputs, rewrites=rewrites, verify=verify, method=method, dynamic_batch=dynamic_batch,
            dynamic_shapes=dynamic_shapes, dynamic=dynamic)
        write = functools.partial(write_checked, path=path, opset=opset, dynamic_batch=dynamic_batch,
                                  dynamic_shapes=dims, attention=attention, external_data=external_data,
                                  refine=refine)
        result, module = write_exportable(write, captured, unrewritten, rewrites, verify)
    del module  # its session was only for validation
    return result


def onnxruntime_module(model: nn.Module, example_inputs: Any = None, *, path: str | os.PathLike | None = None,
                       providers: Any = None, session_options: Any = None, intra_op_num_threads: int | None = None,
                       dynamic: bool | None = None, **export_options: Any) -> OnnxRuntimeModule:
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
        export_options: ``rewrites``, ``verify``, ``method``, ``dynamic_batch``, ``dynamic_shapes``,
            ``opset``, ``attention``, ``external_data`` (see :func:`export_onnx`).

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
    explicit = bool(export_options.get("dynamic_batch")) or export_options.get("dynamic_shapes") is not None
    export = functools.partial(_export_for_session, model, {**export_options, "dynamic": bool(dynamic)})
    module = OnnxRuntimeModule.deferred(model, export, path=path, providers=providers,
                                        session_options=session_options, intra_op_num_threads=intra_op_num_threads,
                                        dynamic=bool(dynamic) if dynamic is not None or explicit else None)
    if example_inputs is not None:
        args, kwargs = normalize_inputs(example_inputs)
        module.prepare(*args, **kwargs)
    return module


def _export_for_session(model: nn.Module, options: dict, args: tuple, kwargs: dict, path: str,
                        module_options: dict, before: tuple | None = None) -> tuple[OnnxExport, OnnxRuntimeModule]:
    """Export ``model`` for these inputs to ``path`` and validate it in a session with ``module_options``;
    with ``before`` (the inputs of the export this one replaces), the dims that changed since are dynamic."""
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
        return write_exportable(write, captured, unrewritten, options.get("rewrites", "default"),
                                 options.get("verify", True))


# ---------------------------------------------------------------------------------------------- targets

def optimized(model: Any, example_inputs: Any = None, *, target: str = "native", rewrites: Any = "default",
              verify: bool = True, method: str = "auto", dynamic: bool | None = None, **target_options: Any) -> Any:
    """What :func:`fxforge.optimize` returns for an ``nn.Module`` instance or class (options checked there).

    - native, an instance: an :class:`~fxforge.runtime.native.OptimizedModule`, prepared now when
      ``example_inputs`` are given; a class: a subclass whose instances optimize themselves on first call;
    - onnxruntime, an instance: an :class:`~fxforge.exporters.ort_module.OnnxRuntimeModule`; a class: a
      subclass whose instances export themselves on their first call in eval mode;
    - inductor: as native (the same guards, plan cache and live weights), each plan's rewritten graph
      compiled by ``torch.compile`` instead of lowered (:mod:`fxforge.lowering.inductor`);
    - auto, an instance with example inputs: the fastest of the others, measured (:func:`auto_module`).

    Example:
        >>> opt = optimized(torch.nn.ReLU(), (torch.ones(2),))
        >>> type(opt).__name__, opt.report.method
        ('OptimizedModule', 'fx')
    """
    options = {"rewrites": rewrites, "verify": verify, "method": method}
    is_class = isinstance(model, type) and issubclass(model, nn.Module)
    if not is_class and not isinstance(model, nn.Module):
        raise TypeError(f"fxforge.optimize takes an nn.Module instance or class, got {type(model).__name__}")
    if target == "auto":
        return auto_module(model, example_inputs, **options, dynamic=dynamic, **target_options)
    if target == "onnxruntime":
        if is_class:
            return onnxruntime_class(model, functools.partial(onnxruntime_module, **options, dynamic=dynamic,
                                                              **target_options))
        return onnxruntime_module(model, example_inputs, **options, dynamic=dynamic, **target_options)
    if target == "inductor":
        options["backend"] = "inductor"
    policy = ShapePolicy(dynamic, target_options.pop("dynamic_shapes", None),
                         target_options.pop("max_plans", MAX_PLANS))
    if is_class:
        return optimize_class(model, functools.partial(plan_builder, **options, **target_options), policy)
    module = OptimizedModule(model, plan_builder(model, **options, **target_options), policy)
    if example_inputs is not None:
        args, kwargs = normalize_inputs(example_inputs)
        module.prepare(*args, **kwargs)
    return module


# ---------------------------------------------------------------------------------------------- auto

# What target="auto" races, in the order built (native first: its build tells Inductor's compile estimate).
AUTO_TARGETS = ("native", "onnxruntime", "inductor")
# Seconds the race may take by default (Inductor's compile is skipped when it would not fit).
AUTO_BUDGET_S = 300.0
# A remembered winner re-timed against eager is raced again when its speed-up over eager fell by this factor.
CONTRADICTED = 1.5


def auto_module(model: nn.Module, example_inputs: Any, *, targets: Any = AUTO_TARGETS,
                budget_s: float | None = AUTO_BUDGET_S, rewrites: Any = "default", verify: bool = True,
                method: str = "auto", dynamic: bool | None = None, max_plans: int = MAX_PLANS) -> nn.Module:
    """The fastest of ``targets`` for this model on this machine, checked against eager (``target="auto"``).

    Every target is built, run on fresh inputs and compared with eager, then timed together with eager
    (:func:`fxforge.runtime.race.race`); the fastest is returned, its report's ``race`` holding every
    contender's latency, prepare time and error, and why it won. The choice is remembered on disk
    (:mod:`fxforge.core.target_cache`): the next optimize of a model of the same structure with inputs of
    the same signature on this machine builds only the winner, re-times it against eager, and races
    everything again only when that contradicts the remembered speed-up (by :data:`CONTRADICTED`) or the
    winner no longer builds or agrees. A model in training mode does not race ``onnxruntime`` (an export is
    an inference snapshot).

    Example:
        >>> net = auto_module(torch.nn.Linear(8, 8).eval(), (torch.ones(4, 8),), targets=["native"])
        >>> net.report.race.winner
        'native'
    """
    began = time.perf_counter()
    args, kwargs = normalize_inputs(example_inputs)
    targets = tuple(targets)
    options = {"rewrites": rewrites, "verify": verify, "method": method, "dynamic": dynamic}
    names = [getattr(p, "name", repr(p)) for p in resolve(rewrites)]
    key = choice_key(model, args, kwargs, f"targets {sorted(targets)} rewrites {names} verify {verify} "
                                          f"method {method} dynamic {dynamic}")
    cache = target_cache()
    stored = cache.get(key) if cache is not None else None
    entrants = _entrants(model, args, kwargs, targets, options, max_plans)
    notes: list[str] = []
    if stored is not None and stored.get("winner") in entrants:
        winner = stored["winner"]
        built, result = race(model, args, kwargs, [entrants[winner]], budget_s=None, began=began)
        then = stored["eager_ms"] / stored["latency_ms"][winner]
        now = result.eager_ms / result.contenders[0].latency_ms if result.winner else None
        if now is not None and then / now <= CONTRADICTED:
            return _chosen(built[winner], _remembered(result, stored, then, now))
        notes.append(f"the remembered choice {winner} ({then:.2f}x eager when chosen) was raced again: "
                     + (f"it ran at {now:.2f}x eager now" if now is not None else result.contenders[0].refused))
    snapshot = model.training and "onnxruntime" in entrants  # an export of a model in training mode
    order = [t for t in AUTO_TARGETS if t in entrants and not (snapshot and t == "onnxruntime")]
    built, result = race(model, args, kwargs, [entrants[t] for t in order], budget_s=budget_s, began=began)
    if snapshot:
        result.contenders.append(Contender("onnxruntime", refused="not raced: the model is in training mode (an "
                                                                   "ONNX export is an inference snapshot)"))
    result.notes[:0] = notes
    if not result.winner:
        module = _prepared(optimized(model, target="native", rewrites=[], verify=verify, method=method,
                                     dynamic=dynamic, max_plans=max_plans), args, kwargs)
        result.winner, result.why = "native", "no target agreed with eager: native without rewrites"
        return _chosen(module, result)
    if cache is not None and remembrable(result):
        cache.put(key, {"winner": result.winner, "eager_ms": result.eager_ms, "load": result.load,
                        "latency_ms": {c.target: c.latency_ms for c in result.contenders if c.latency_ms},
                        "when": time.strftime("%Y-%m-%d %H:%M")})
        cache.save()
    return _chosen(built[result.winner], result)


def _entrants(model: nn.Module, args: tuple, kwargs: dict, targets: tuple, options: dict,
              max_plans: int) -> dict[str, Entrant]:
    """How to build each target raced, by name."""
    device = device_of(args, kwargs, model)
    nodes: list[int] = []  # the native graph's node count, once built: Inductor's compile estimate

    def native() -> nn.Module:
        return _prepared(optimized(model, target="native", max_plans=max_plans, **options), args, kwargs)

    def inductor() -> nn.Module:
        return _prepared(optimized(model, target="inductor", max_plans=max_plans, **options), args, kwargs)

    def onnx() -> nn.Module:
        return _prepared(onnxruntime_module(model, **options), args, kwargs)

    def estimate() -> float | None:
        return nodes[0] * compile_rate(device)[0] if nodes else None

    def native_built(module: nn.Module, seconds: float) -> None:
        nodes.append(module.report.nodes_after)

    def inductor_built(module: nn.Module, seconds: float) -> None:
        remember_compile_rate(device, seconds, module.report.nodes_after)

    every = {"native": Entrant("native", native, built=native_built),
             "inductor": Entrant("inductor", inductor, estimate_s=estimate, built=inductor_built),
             "onnxruntime": Entrant("onnxruntime", onnx, refusal=ort_refusal(device))}
    return {t: every[t] for t in targets}


def _prepared(module: Any, args: tuple, kwargs: dict) -> nn.Module:
    module.prepare(*args, **kwargs)
    return module


def _remembered(result: Race, stored: dict, then: float, now: float) -> Race:
    """A re-timed remembered winner's race: its new figures, the others' remembered latencies."""
    result.remembered = True
    winner = result.winner
    for target, ms in stored["latency_ms"].items():
        if target != winner:
            result.contenders.append(Contender(target, latency_ms=ms))
    result.why = (f"remembered from the race of {stored.get('when', 'an earlier run')} ({then:.2f}x eager then, "
                  f"{now:.2f}x now)")
    result.notes.append("only the winner was built; the other targets' latencies are those remembered "
                        "(FXFORGE_TARGET_CACHE=0 races every time)")
    return result


def _chosen(module: nn.Module, result: Race) -> nn.Module:
    """The winner, its report (and ``module.race``) holding the race."""
    module.race = result
    report = getattr(module, "report", None)
    if report is not None:
        report.race = result
    return module


# ---------------------------------------------------------------------------------------------- profile

def profile(model_or_captured: Any, example_inputs: Any = None, *, warmup: int = 2, repeat: int = 10,
            device: torch.device | str | None = None) -> Profile:
    """Profile a model's graph node by node: time, FLOPs, bytes, roofline verdict, memory.

    What is profiled:

    - an ``nn.Module``: captured with :func:`fxforge.capture` (no rewrites), its graph;
    - a :class:`~fxforge.Captured` (from ``fxforge.capture`` or ``fxforge.rewrite``): its graph as it is
      (fused ops are custom-op calls choosing their kernel at each call);
    - an :class:`~fxforge.OptimizedModule`: the graph it runs for these inputs when no gradient is
      recorded: its plan's lowered graph (:func:`fxforge.lowering.lower.lower`), whose fused ops are direct
      calls of their oneDNN/cuDNN kernels on prepacked weights (their ``op`` is still
      ``fxforge.conv_pointwise``; ``target`` names the kernel). (With gradients on, it runs the rewritten
      graph instead: profile ``opt.captured`` for that.)

    Nodes run under ``torch.no_grad()``; the graph's buffers (BatchNorm statistics in training mode) and the
    RNG are restored afterwards. See :mod:`fxforge.runtime.profile` for every column.

    Args:
        model_or_captured: what to profile (above).
        example_inputs: a tuple of inputs, one tensor, or a dict of keyword inputs; for a ``Captured`` or an
            ``OptimizedModule`` that has run, the inputs it was captured with by default.
        warmup: untimed runs first.
        repeat: timed runs; each node's time is its median.
        device: the device whose roofline judges the nodes (default: the inputs' or parameters' device).
            Inputs and the model are not moved.

    Returns:
        A :class:`~fxforge.runtime.profile.Profile`.

    Example:
        >>> conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        >>> p = profile(conv, (torch.randn(2, 3, 16, 16),), warmup=1, repeat=2)
        >>> int(p.table["flops"][0]) == 2 * 2 * 8 * 8 * 3 * 3 * 3 * 8
        True
    """
    if warmup < 0 or repeat < 1:
        raise ValueError(f"profile needs warmup >= 0 and repeat >= 1 (got {warmup}, {repeat})")
    graph_module, args, kwargs, what, model = _profiled(model_or_captured, example_inputs)
    name = type(model if model is not None else graph_module).__name__
    return profile_graph(graph_module, args, kwargs, what=what, name=name, model=model, warmup=warmup,
                         repeat=repeat, device=device)


def _profiled(subject: Any, example_inputs: Any) -> tuple[torch.fx.GraphModule, tuple, dict, str, nn.Module | None]:
    """``(graph, args, kwargs, what it is, the user's model)`` that :func:`profile` measures."""
    args, kwargs = normalize_inputs(example_inputs)
    if isinstance(subject, OptimizedModule):
        if example_inputs is None:
            if subject.captured is None:
                raise ValueError("profile: this OptimizedModule has not run yet; pass example_inputs")
            args, kwargs = subject.captured.example_args, subject.captured.example_kwargs
        plan = subject.plan_for(*args, **kwargs)
        if plan is None:
            raise ValueError(f"profile: {type(subject.original).__name__} runs eagerly for these inputs (fxforge "
                             "could not capture it), so there is no graph to profile")
        return plan.executable, args, kwargs, "lowered graph", subject.original
    if isinstance(subject, Captured):
        if example_inputs is None:
            args, kwargs = subject.example_args, subject.example_kwargs
        rewritten = any(getattr(subject.report, "counts", {}).values())
        return subject.graph_module, args, kwargs, "rewritten graph" if rewritten else "captured graph", subject.module
    if isinstance(subject, torch.fx.GraphModule) and example_inputs is not None:
        return subject, args, kwargs, "graph", None
    if isinstance(subject, nn.Module):
        if example_inputs is None:
            raise ValueError("profile: example_inputs are needed to capture a model")
        cap = capture(subject, example_inputs)
        return cap.graph_module, cap.example_args, cap.example_kwargs, "captured graph", subject
    raise TypeError("profile takes an nn.Module, a fxforge.Captured or an OptimizedModule, "
                    f"got {type(subject).__name__}")
