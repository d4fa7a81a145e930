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
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fxforge.capture import CaptureError, capture, normalize_inputs
from fxforge.capture.dynamic import capture_dynamic
from fxforge.core.captured import Captured
from fxforge.core.gc_pause import no_collection
from fxforge.core.plan import CallConditions, Plan
from fxforge.exporters.onnx import OnnxExport, check_options, write_checked
from fxforge.exporters.ort_decorator import onnxruntime_class
from fxforge.exporters.ort_module import OnnxRuntimeModule
from fxforge.exporters.program import ExportError
from fxforge.lowering.autotune import MEASURE_ALL, TuningPolicy, autotune
from fxforge.lowering.lower import make_plan, plain_plan
from fxforge.rewrites import pipeline
from fxforge.runtime.native import OptimizedModule, optimize_class
from fxforge.runtime.plans import PlanBuilder
from fxforge.runtime.profile import Profile, profile_graph

# What export_onnx takes besides the model, the path and the inputs; the onnxruntime target passes these on.
EXPORT_OPTIONS = ("rewrites", "verify", "method", "dynamic_batch", "dynamic_shapes", "opset", "attention",
                  "external_data")


# ---------------------------------------------------------------------------------------------- native

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


def build_plan(module: nn.Module, args: tuple, kwargs: dict, conditions: CallConditions | None = None, *,
               rewrites: Any = "default", verify: bool = True, method: str = "auto",
               tuning: TuningPolicy = MEASURE_ALL) -> Plan:
    """Capture ``module`` for these inputs, rewrite it for calls made under ``conditions`` (autotune choosing
    kernels and layout), lower it.

    A plan for calls that record gradients, or run under autocast, keeps eager's ops where gradients or
    autocast need them (no folded parameters, no fused kernels) and runs its rewritten graph as it is. Plans
    are built outside inference mode, so that what they compute once (folded and prepacked weights) is an
    ordinary tensor whatever mode the first call was made in.

    Raises:
        CaptureError: the module could not be captured.

    Example:
        >>> plan = build_plan(torch.nn.ReLU(), (torch.ones(2),), {})
        >>> plan.report.method
        'fx'
    """
    conditions = conditions or CallConditions()
    with torch.inference_mode(False), no_collection():
        captured = capture(module, args, method, example_kwargs=kwargs, check=verify)
        eager_ops = conditions.gradients or bool(conditions.autocast)  # no fused ops: nothing to time or lower
        rewritten = rewrite(captured, rewrites, verify=verify, tuning=None if eager_ops else tuning,
                            conditions=conditions)
        return plain_plan(rewritten) if eager_ops else make_plan(rewritten)


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


def _build(module: nn.Module, options: dict, args: tuple, kwargs: dict, conditions: CallConditions) -> Plan:
    return build_plan(module, args, kwargs, conditions, **options)


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
                        dynamic_batch: bool = False, dynamic_shapes: Any = None) -> Captured:
    """The rewritten ``Captured`` to export: ``model`` itself when it is one, else captured and rewritten.

    The conv+activation fusion is kept without timing PyTorch kernels for it (the ONNX translation is
    the same either way, and ONNX Runtime picks its own kernels); the report notes it. With dynamic dims
    (``dynamic_batch``, ``dynamic_shapes``), a model that only ``torch.export`` captures is captured again
    with those dims dynamic, so that its graph computes shapes instead of holding the example's.

    Raises:
        ExportError: a ``Captured`` in training mode (export is for inference), or dims torch.export
            cannot keep dynamic.

    Example:
        >>> cap = captured_for_export(torch.nn.ReLU().eval(), (torch.ones(1),))
        >>> cap.method
        'fx'
    """
    if isinstance(model, Captured):
        captured = model
    else:
        if not isinstance(model, nn.Module):
            raise TypeError(f"export_onnx takes an nn.Module or a Captured, got {type(model).__name__}")
        if example_inputs is None and not example_kwargs:
            raise ValueError("export_onnx needs example_inputs for a module (a tuple, one tensor, or a dict)")
        args, kwargs = normalize_inputs(example_inputs)
        kwargs.update(example_kwargs or {})
        captured = capture(model, args, method, example_kwargs=kwargs, check=verify)
        if captured.method == "export" and (dynamic_batch or dynamic_shapes is not None):
            captured = dynamic_capture(model, args, kwargs, dynamic_shapes, reference=captured.example_outputs)
        captured = rewrite(captured, rewrites, verify=verify, tuning=None)
        if captured.report.counts.get("conv_activation"):
            captured.report.notes.append("conv_activation kept without timing PyTorch kernels: the ONNX file runs "
                                         "ONNX Runtime's own")
    if captured.training:
        raise ExportError("the graph was captured in training mode; ONNX export is for inference: capture the model "
                          "after model.eval()", stage="input")
    return captured


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
                dynamic_shapes: Any = None, *, verify: bool = True, method: str = "auto",
                attention: str = "MultiHeadAttention", external_data: bool | None = None) -> OnnxExport:
    """Capture, rewrite and export ``model`` to an ONNX file that ONNX Runtime runs like the model.

    Args:
        model: an ``nn.Module`` (exported as in eval mode, whatever its mode; its modes are put back
            afterwards), or a :class:`~fxforge.core.captured.Captured` of one in eval mode (exported as it is).
        path: the ``.onnx`` file to write (its folder must exist); replaced only by a complete, checked,
            validated file. Weights go to ``path + ".data"`` beside it with ``external_data=True``, or
            (``None``) when they pass protobuf's 2 GB limit.
        example_inputs: a tuple of positional inputs, one tensor, or a dict of keyword inputs (not needed
            with a ``Captured``).
        dynamic_batch: make dim 0 of every input whose dim 0 is the batch size dynamic (one shared
            ``torch.export.Dim("batch")``); validated on the example inputs and on another batch size.
        rewrites: ``"default"``, a list of rewrite names, or pass objects (see :func:`fxforge.rewrite`).
        opset: the ONNX opset (default 20; at least 18).
        dynamic_shapes: passed to ``torch.export.export`` as it is (keyed by the forward's argument names);
            not together with ``dynamic_batch``.
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
    """
    opset = check_options(opset, dynamic_batch, dynamic_shapes, attention)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot write {path!r}: no folder {directory!r}")
    with eval_mode(model):
        captured = captured_for_export(model, example_inputs, rewrites=rewrites, verify=verify, method=method,
                                       dynamic_batch=dynamic_batch, dynamic_shapes=dynamic_shapes)
        result, module = write_checked(captured, path, opset=opset, dynamic_batch=dynamic_batch,
                                       dynamic_shapes=dynamic_shapes, attention=attention,
                                       external_data=external_data)
    del module  # its session was only for validation
    return result


def onnxruntime_module(model: nn.Module, example_inputs: Any = None, *, path: str | os.PathLike | None = None,
                       providers: Any = None, session_options: Any = None, intra_op_num_threads: int | None = None,
                       **export_options: Any) -> OnnxRuntimeModule:
    """``model`` exported with :func:`export_onnx` and run in ONNX Runtime (the ``onnxruntime`` target).

    Without ``example_inputs`` the export happens on the first call, with that call's inputs. The file goes
    to ``path`` if given, else to a temporary folder removed with the module.

    Args:
        model: the model (exported in eval mode).
        example_inputs: a tuple of positional inputs, one tensor, a dict of keyword inputs, or None.
        path: where to keep the ONNX file.
        providers, session_options, intra_op_num_threads: for the session (see :class:`OnnxRuntimeModule`).
        export_options: ``rewrites``, ``verify``, ``method``, ``dynamic_batch``, ``dynamic_shapes``,
            ``opset``, ``attention``, ``external_data`` (see :func:`export_onnx`).

    Example:
        >>> m = onnxruntime_module(torch.nn.Tanh().eval(), intra_op_num_threads=1)
        >>> m(torch.zeros(2)).tolist(), m.intra_op_num_threads
        ([0.0, 0.0], 1)
    """
    unknown = sorted(set(export_options) - set(EXPORT_OPTIONS))
    if unknown:
        raise TypeError(f"unknown export options {', '.join(unknown)}; they are {', '.join(EXPORT_OPTIONS)}")
    export = functools.partial(_export_for_session, model, export_options)
    module = OnnxRuntimeModule.deferred(model, export, path=path, providers=providers,
                                        session_options=session_options, intra_op_num_threads=intra_op_num_threads)
    if example_inputs is not None:
        args, kwargs = normalize_inputs(example_inputs)
        module.prepare(*args, **kwargs)
    return module


def _export_for_session(model: nn.Module, options: dict, args: tuple, kwargs: dict, path: str,
                        module_options: dict) -> tuple[OnnxExport, OnnxRuntimeModule]:
    """Export ``model`` for these inputs to ``path`` and validate it in a session with ``module_options``."""
    opset = check_options(options.get("opset"), options.get("dynamic_batch", False), options.get("dynamic_shapes"),
                          options.get("attention", "MultiHeadAttention"))
    with eval_mode(model):
        captured = captured_for_export(model, args, example_kwargs=kwargs, **{
            k: options[k] for k in ("rewrites", "verify", "method", "dynamic_batch", "dynamic_shapes") if k in options})
        return write_checked(captured, path, opset=opset, dynamic_batch=options.get("dynamic_batch", False),
                             dynamic_shapes=options.get("dynamic_shapes"),
                             attention=options.get("attention", "MultiHeadAttention"),
                             external_data=options.get("external_data"), module_options=module_options)


# ---------------------------------------------------------------------------------------------- targets

def optimized(model: Any, example_inputs: Any = None, *, target: str = "native", rewrites: Any = "default",
              verify: bool = True, method: str = "auto", **target_options: Any) -> Any:
    """What :func:`fxforge.optimize` returns for an ``nn.Module`` instance or class (options checked there).

    - native, an instance: an :class:`~fxforge.runtime.native.OptimizedModule`, prepared now when
      ``example_inputs`` are given; a class: a subclass whose instances optimize themselves on first call;
    - onnxruntime, an instance: an :class:`~fxforge.exporters.ort_module.OnnxRuntimeModule`; a class: a
      subclass whose instances export themselves on their first call in eval mode.

    Example:
        >>> opt = optimized(torch.nn.ReLU(), (torch.ones(2),))
        >>> type(opt).__name__, opt.report.method
        ('OptimizedModule', 'fx')
    """
    options = {"rewrites": rewrites, "verify": verify, "method": method}
    is_class = isinstance(model, type) and issubclass(model, nn.Module)
    if not is_class and not isinstance(model, nn.Module):
        raise TypeError(f"fxforge.optimize takes an nn.Module instance or class, got {type(model).__name__}")
    if target == "onnxruntime":
        if is_class:
            return onnxruntime_class(model, functools.partial(onnxruntime_module, **options, **target_options))
        return onnxruntime_module(model, example_inputs, **options, **target_options)
    if is_class:
        return optimize_class(model, functools.partial(plan_builder, **options, **target_options))
    module = OptimizedModule(model, plan_builder(model, **options, **target_options))
    if example_inputs is not None:
        args, kwargs = normalize_inputs(example_inputs)
        module.prepare(*args, **kwargs)
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
