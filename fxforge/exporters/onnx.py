"""``export_onnx``: a model, captured and rewritten by fxforge, written as a checked and validated ONNX file.

The steps, each of which either succeeds or leaves nothing behind:

1. capture and rewrite (:func:`fxforge.capture`, :func:`fxforge.rewrite`), unless given a ``Captured``;
   the fused ops' PyTorch kernels are not timed (ONNX Runtime runs its own);
2. ``torch.export`` of the rewritten graph (dims made dynamic here: ``dynamic_batch``, ``dynamic_shapes``);
3. ``torch.onnx.export`` with fxforge's translations of its fused ops and of attention
   (:mod:`fxforge.exporters.translations`), into a temporary folder next to the target;
4. ``onnx.checker.check_model(full_check=True)``;
5. the file run in ONNX Runtime on the example inputs (and on another batch size when the batch is
   dynamic) and compared with the PyTorch model;
6. only then, renamed to the target path (external-data files first, the ``.onnx`` last).

An op that cannot be translated raises :class:`ExportError` naming the op and the user's source line.

Example:
    >>> import os, tempfile, torch, fxforge
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    >>> path = os.path.join(tempfile.mkdtemp(), "m.onnx")
    >>> result = fxforge.export_onnx(model, path, (torch.randn(2, 3, 16, 16),), dynamic_batch=True)
    >>> os.path.exists(path), result.translations
    (True, ['fxforge::conv_pointwise -> Conv + relu: 1'])
    >>> sorted(result.validation)
    ['batch 3', 'example inputs']
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import io
import logging
import os
import shutil
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.capture import capture, normalize_inputs
from fxforge.capture.source import first_line, node_source, user_frame_of
from fxforge.captured import Captured
from fxforge.exporters.ort_module import IOSpec, OnnxRuntimeModule, default_providers
from fxforge.exporters.residual_norm import RESIDUAL_NORM, separate_residual_adds
from fxforge.exporters.translations import DEFAULT_OPSET, MIN_OPSET, Translations
from fxforge.rewrites.autotune import forced
from fxforge.rewrites.graph_utils import attribute_tensor, copy_graph_module
from fxforge.rewrites.pipeline import rewrite
from fxforge.rewrites.report import Report
from fxforge.verify import compare_outputs, isolated

# ORT and PyTorch sum in different orders; through a deep model float32 rounding differs by a few 1e-5
# of the output's scale. Ten times the rewrite pipeline's tolerance (still far below a wrong op's O(1)).
VALIDATION_TOLERANCE_SCALE = 10.0

_NOISY_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
                  "torch._subclasses", "onnxscript", "onnx_ir")


class ExportError(RuntimeError):
    """The model could not be exported to ONNX; nothing was written.

    Attributes:
        stage: where it failed: ``"torch.export"``, ``"translation"``, ``"checker"``, ``"validation"``,
            ``"input"`` (the arguments).
        op: the op that could not be translated, where one is to blame (``"fxtest::mystery"``).
        source: the user's source line of that op, where known (``"model.py:12: return f(x)"``).

    Example:
        >>> str(ExportError("no ONNX translation for aten::foo", op="aten::foo", source="m.py:3: y = foo(x)"))
        'no ONNX translation for aten::foo'
    """

    def __init__(self, message: str, *, stage: str = "export", op: str | None = None, source: str | None = None):
        super().__init__(message)
        self.stage, self.op, self.source = stage, op, source


@dataclasses.dataclass
class OnnxExport:
    """What :func:`export_onnx` wrote, and how it was checked.

    Attributes:
        path: the ONNX file.
        opset: its default-domain opset.
        report: what the rewrites did, plus the export's notes (translations, validation).
        captured: the rewritten graph that was exported.
        io: how the model's inputs and outputs map to the ONNX graph's (for
            :class:`~fxforge.exporters.ort_module.OnnxRuntimeModule`).
        dynamic: the dims made dynamic, ``{onnx input name: {axis: name}}``.
        translations: one line per fxforge translation used (and per attention left to torch.onnx's).
        validation: the largest absolute difference from PyTorch, per input set validated on.

    Example:
        >>> r = OnnxExport("m.onnx", 20, Report(method="fx"), None, None, {}, [], {"example inputs": 0.0})
        >>> str(r).splitlines()[0]
        'm.onnx: opset 20, static shapes'
    """

    path: str
    opset: int
    report: Report
    captured: Captured | None
    io: IOSpec | None
    dynamic: dict[str, dict[int, str]]
    translations: list[str]
    validation: dict[str, float]

    def __str__(self) -> str:
        shapes = "dynamic " + ", ".join(f"{k}{v}" for k, v in self.dynamic.items()) if self.dynamic else "static shapes"
        lines = [f"{self.path}: opset {self.opset}, {shapes}"]
        lines += [f"  {t}" for t in self.translations]
        lines += [f"  validated in ONNX Runtime on {k}: max abs error {v:.3g}" for k, v in self.validation.items()]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- quiet

@contextlib.contextmanager
def quiet(log: io.StringIO | None = None) -> Iterator[io.StringIO]:
    """Keep torch.export's and torch.onnx's progress lines, logger warnings and Python warnings off the
    console; what they print lands in ``log`` (returned), for error messages.

    Example:
        >>> with quiet() as log:
        ...     print("[torch.onnx] step...")
        >>> log.getvalue()
        '[torch.onnx] step...\\n'
    """
    log = log if log is not None else io.StringIO()
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            warnings.simplefilter("ignore")
            yield log
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# ---------------------------------------------------------------------------------------------- public

def export_onnx(model: nn.Module | Captured, path: str | os.PathLike, example_inputs: Any = None,
                dynamic_batch: bool = False, rewrites: Any = "default", opset: int | None = None,
                dynamic_shapes: Any = None, *, verify: bool = True, method: str = "auto",
                attention: str = "MultiHeadAttention", external_data: bool | None = None) -> OnnxExport:
    """Capture, rewrite and export ``model`` to an ONNX file that ONNX Runtime runs like the model.

    Args:
        model: an ``nn.Module`` (exported as in eval mode, whatever its mode; its modes are put back
            afterwards), or a :class:`~fxforge.captured.Captured` of one in eval mode (exported as it is).
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
        An :class:`OnnxExport`: the path, the report, the translations used and the validation errors.

    Raises:
        ExportError: an op with no ONNX translation (naming it and the user's source line), a failed
            ``torch.export``, checker or validation; nothing is left on disk.
        fxforge.CaptureError: the model could not be captured.
        ValueError, TypeError, FileNotFoundError: bad arguments (checked before anything runs).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "lin.onnx")
        >>> r = fxforge.export_onnx(torch.nn.Linear(4, 2).eval(), path, (torch.ones(3, 4),))
        >>> r.opset, list(r.validation)
        (20, ['example inputs'])
    """
    opset = check_options(opset, dynamic_batch, dynamic_shapes, attention)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot write {path!r}: no folder {directory!r}")
    with eval_mode(model):
        captured = prepare(model, example_inputs, rewrites=rewrites, verify=verify, method=method,
                           dynamic_batch=dynamic_batch, dynamic_shapes=dynamic_shapes)
        result, module = write_checked(captured, path, opset=opset, dynamic_batch=dynamic_batch,
                                       dynamic_shapes=dynamic_shapes, attention=attention,
                                       external_data=external_data)
    del module  # its session was only for validation
    return result


def check_options(opset: int | None, dynamic_batch: bool, dynamic_shapes: Any, attention: str) -> int:
    """Validate the export options before any work; returns the opset to use.

    Example:
        >>> check_options(None, False, None, "plain")
        20
    """
    from torch.onnx import _constants

    opset = DEFAULT_OPSET if opset is None else int(opset)
    if not MIN_OPSET <= opset <= _constants.ONNX_MAX_OPSET:
        raise ValueError(f"opset {opset} is outside what torch.onnx exports ({MIN_OPSET}..{_constants.ONNX_MAX_OPSET})")
    if dynamic_batch and dynamic_shapes is not None:
        raise ValueError("give dynamic_batch=True or dynamic_shapes=..., not both (dynamic_shapes can name the batch dim)")
    if attention not in ("MultiHeadAttention", "plain"):
        raise ValueError(f"attention={attention!r}: choose 'MultiHeadAttention' or 'plain'")
    return opset


def prepare(model: nn.Module | Captured, example_inputs: Any, *, example_kwargs: dict | None = None,
            rewrites: Any = "default", verify: bool = True, method: str = "auto", dynamic_batch: bool = False,
            dynamic_shapes: Any = None) -> Captured:
    """The rewritten ``Captured`` to export: ``model`` itself when it is one, else captured and rewritten.

    The conv+activation fusion is kept without timing PyTorch kernels for it (the ONNX translation is
    the same either way, and ONNX Runtime picks its own kernels); the report notes it. With dynamic dims
    (``dynamic_batch``, ``dynamic_shapes``), a model that only ``torch.export`` captures is captured again
    with those dims dynamic, so that its graph computes shapes instead of holding the example's.

    Raises:
        ExportError: a ``Captured`` in training mode (ONNX export is for inference).

    Example:
        >>> cap = prepare(torch.nn.ReLU().eval(), (torch.ones(1),))
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
            # torch.export captured it with static shapes; capture again with the dims dynamic.
            captured = capture_dynamic(model, args, kwargs, dynamic_shapes, reference=captured.example_outputs)
        with forced(kernel="composite", layout="as captured", keep="fused"):
            captured = rewrite(captured, rewrites, verify=verify)
        if captured.report.counts.get("conv_activation"):
            captured.report.notes.append("conv_activation kept without timing PyTorch kernels: the ONNX file runs "
                                         "ONNX Runtime's own")
    if captured.training:
        raise ExportError("the graph was captured in training mode; ONNX export is for inference: capture the model "
                          "after model.eval()", stage="input")
    return captured


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


def capture_dynamic(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None, *,
                    reference: Any = None) -> Captured:
    """Capture ``model`` with ``torch.export`` and dynamic dims: ``dynamic_shapes``, or (None) dim 0 of
    every input whose dim 0 is the batch size (traced on a batch of 2 built from the example rows when
    the example's batch is 1, which torch.export would fix).

    The graph is checked against the model on the example inputs, like :func:`fxforge.capture`'s. (It
    uses capture's helpers; a ``dynamic_shapes`` argument of :func:`fxforge.capture` would replace it.)

    Raises:
        ExportError: torch.export cannot keep those dims dynamic (the message names the line that
            specialised them, where torch.export says).

    Example:
        >>> cap = capture_dynamic(torch.nn.Linear(2, 3), (torch.ones(4, 2),), {})
        >>> cap.method, cap.graph_module(torch.ones(5, 2)).shape
        ('export', torch.Size([5, 3]))
    """
    from fxforge.capture import _check, _finish
    from fxforge.capture import export as capture_export

    trace_args, trace_kwargs = tuple(args), dict(kwargs)
    if dynamic_shapes is None:
        batch = batch_size(args, kwargs)
        if batch == 1:  # torch.export specialises a size-1 dim: trace on a batch of 2 made from the example rows
            trace_args, trace_kwargs = with_batch(args, kwargs, 1, 2)
            batch = 2
        dynamic_shapes = batch_dynamic_shapes(model, trace_args, trace_kwargs, batch)
    log = io.StringIO()
    try:
        with quiet(log), torch.no_grad():
            program = torch.export.export(model, trace_args, trace_kwargs, dynamic_shapes=dynamic_shapes,
                                          strict=False)
    except Exception as error:
        raise _dynamic_error(error) from error
    unlifted = capture_export._unlift(program)
    graph_module = torch.fx.GraphModule(unlifted, unlifted.graph, type(model).__name__)
    capture_export._drop_guards(graph_module)
    capture_export._assert_constants(graph_module, args, kwargs)
    capture_export._share_state(graph_module, model)
    if reference is None:
        with isolated(model), torch.no_grad():
            reference = model(*args, **kwargs)
    _check(model, graph_module, args, kwargs, reference)
    return _finish(model, graph_module, "export", [], args, kwargs,
                   ["captured with torch.export and dynamic dims for the ONNX export"], reference=reference)


def _dynamic_error(error: BaseException) -> ExportError:
    where = user_frame_of(error)
    return ExportError(f"torch.export cannot keep the requested dims dynamic ({first_line(error)})"
                       + (f" at {where}" if where else ""), stage="torch.export", source=where)


def write_checked(captured: Captured, path: str, *, opset: int = DEFAULT_OPSET, dynamic_batch: bool = False,
                  dynamic_shapes: Any = None, attention: str = "MultiHeadAttention",
                  external_data: bool | None = None,
                  module_options: dict | None = None) -> tuple[OnnxExport, OnnxRuntimeModule]:
    """Export ``captured`` to ``path``, check and validate it, and rename it into place.

    Returns the result and the :class:`OnnxRuntimeModule` that validated it (its session is open on the
    file now at ``path``; ``module_options`` go to its constructor). On any failure nothing is left:
    neither ``path`` (an existing file there is kept as it was) nor a temporary file.
    """
    directory, name = os.path.split(os.path.abspath(path))
    scratch = tempfile.mkdtemp(prefix=".fxforge-onnx-", dir=directory)
    try:
        scratch_path = os.path.join(scratch, name)
        exported = _export(captured, scratch_path, opset, dynamic_batch, dynamic_shapes, attention, external_data,
                           cpu=runs_on_cpu((module_options or {}).get("providers")))
        check_file(scratch_path)
        module = OnnxRuntimeModule(scratch_path, exported["io"], **(module_options or {}))
        validation = validate(module, captured, exported["other_batch"])
        report = captured.report.copy()
        report.notes.extend(f"onnx: {line}" for line in exported["translations"].summary())
        report.notes.extend(f"onnx: validated in ONNX Runtime on {k}: max abs error {v:.3g}" for k, v in validation.items())
        _move_into_place(scratch, directory, name)
        module.path = os.path.join(directory, name)
        module.report = report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = OnnxExport(module.path, opset, report, captured, exported["io"], exported["dynamic"],
                        exported["translations"].summary(), validation)
    return result, module


# ---------------------------------------------------------------------------------------------- steps

def export_program(captured: Captured, dynamic_batch: bool = False, dynamic_shapes: Any = None
                   ) -> tuple[torch.export.ExportedProgram, Any, tuple | None, Any]:
    """``torch.export`` of a captured (rewritten) graph, the step before writing ONNX or a ``.pt2`` file.

    Returns the program, the model's output structure (see :func:`exportable`), the other batch's
    ``(label, args, kwargs)`` to validate on when the batch is dynamic (else None), and the dynamic shapes
    used. With ``dynamic_batch`` the leading dim of every batched input is dynamic; a batch of 1 is traced
    as a batch of 2 made from the example rows, since torch.export specialises a size-1 dim.

    Raises:
        ExportError: no input has a batch dim, or torch.export failed (with the user's line where known).

    Example:
        >>> import fxforge
        >>> cap = fxforge.capture(torch.nn.Linear(3, 2), (torch.ones(1, 3),))
        >>> program, _, other, _ = export_program(cap, dynamic_batch=True)
        >>> other[0], program.module()(torch.ones(5, 3)).shape
        ('batch 2', torch.Size([5, 2]))
    """
    gm, out_structure = exportable(captured.graph_module)
    args, kwargs = tuple(captured.example_args), dict(captured.example_kwargs)
    other_batch = None
    if dynamic_batch:
        batch = batch_size(args, kwargs)
        if batch is None:
            raise ExportError("dynamic_batch=True, but no input tensor has a dim 0", stage="input")
        if batch == 1:
            args, kwargs = with_batch(args, kwargs, batch, 2)
        other = batch + 1
        other_batch = (f"batch {other}", *with_batch(captured.example_args, captured.example_kwargs, batch, other))
        dynamic_shapes = batch_dynamic_shapes(gm, args, kwargs, 2 if batch == 1 else batch)
    try:
        with quiet(), torch.no_grad():
            program = torch.export.export(gm, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as error:
        where = user_frame_of(error)
        what = "with a dynamic batch dim " if dynamic_batch else ""
        hint = ("; the graph holds the example's batch size somewhere (TORCH_LOGS=+dynamic shows where)"
                if dynamic_batch and "Constraints violated" in str(error) else "")
        raise ExportError(f"torch.export could not export the rewritten graph {what}({first_line(error)})"
                          + (f" at {where}" if where else "") + hint, stage="torch.export", source=where) from error
    return program, out_structure, other_batch, dynamic_shapes


def runs_on_cpu(providers: Any = None) -> bool:
    """Whether the first of ``providers`` (default: :func:`default_providers`, those the export is validated
    with) is ONNX Runtime's CPU provider: the residual-add form (:mod:`fxforge.exporters.residual_norm`)
    is chosen for it.

    Example:
        >>> runs_on_cpu(["CPUExecutionProvider"]), runs_on_cpu([("CUDAExecutionProvider", {"device_id": 0})])
        (True, False)
    """
    first = (list(providers) if providers else default_providers())[0]
    return (first[0] if isinstance(first, (tuple, list)) else first) == "CPUExecutionProvider"


def _export(captured: Captured, path: str, opset: int, dynamic_batch: bool, dynamic_shapes: Any,
            attention: str, external_data: bool | None = None, *, cpu: bool = True) -> dict[str, Any]:
    """torch.export then torch.onnx.export of the captured graph into ``path``; for the CPU provider
    (``cpu``), residual adds before a LayerNormalization are written as ``Sum``."""
    program, out_structure, other_batch, dynamic_shapes = export_program(captured, dynamic_batch, dynamic_shapes)
    log = io.StringIO()
    translations = Translations(opset=opset, attention=attention)
    try:
        with quiet(log):
            onnx_program = torch.onnx.export(program, (), dynamo=True, opset_version=opset, optimize=True,
                                             custom_translation_table=translations.table())
    except Exception as error:
        raise translation_error(error, type(captured.module).__name__, log.getvalue()) from error
    if cpu:
        rewritten, refused = separate_residual_adds(onnx_program.model.graph)
        if rewritten:
            translations.used[RESIDUAL_NORM] = rewritten
        translations.notes.extend(f"residual Add kept before LayerNormalization: {reason}" for reason in refused)
    if dynamic_shapes is not None:  # name the dims as the spec does ("batch"), where torch.onnx can
        with contextlib.suppress(Exception), quiet(log):
            onnx_program._rename_dynamic_axes(dynamic_shapes)
    try:
        with quiet(log):
            onnx_program.save(path, external_data=external_data)
    except Exception as error:
        raise ExportError(f"writing the ONNX file failed: {first_line(error)}", stage="save") from error
    graph = onnx_program.model.graph
    input_names = [value.name for value in graph.inputs]
    try:
        io_spec = IOSpec.from_exported_program(program, input_names, len(graph.outputs), out_structure=out_structure)
    except ValueError as error:
        raise ExportError(f"the ONNX graph's inputs/outputs do not line up with the model's: {error}",
                          stage="translation") from error
    dynamic = {value.name: {axis: str(dim) for axis, dim in enumerate(value.shape or [])
                            if not isinstance(dim, int)} for value in graph.inputs}
    return {"io": io_spec, "translations": translations, "other_batch": other_batch,
            "dynamic": {k: v for k, v in dynamic.items() if v}}


_CONTIGUOUS = (torch.ops.aten.contiguous.default, torch.Tensor.contiguous)


def _plain_containers(value: Any) -> Any:
    """fx's immutable lists and dicts (in a graph's output) as the lists and dicts the model returned."""
    if isinstance(value, torch.fx.immutable_collections.immutable_dict):
        return {k: _plain_containers(v) for k, v in value.items()}
    if isinstance(value, torch.fx.immutable_collections.immutable_list):
        return [_plain_containers(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain_containers(v) for v in value)
    return value


def exportable(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, tuple | None]:
    """``gm`` made fit for ``torch.export`` and ``torch.onnx``, and the output structure it had, as
    ``(pytree spec, per leaf ("tensor", index) or ("constant", value))``, or None if it returns as before.

    What is changed, on a copy:

    - a graph that ``torch.export`` produced rebuilds its outputs from a pytree spec at its end;
      rebuilding a transformers cache object runs the cache's code (``torch.tensor([])``, ``torch.cat``)
      inside the trace, so the copy returns the flat tensor outputs instead;
    - outputs that are Python values (``None``, numbers) cannot be ONNX outputs: the copy returns only
      its tensors, and the values go into the returned structure;
    - ``aten.lift_fresh_copy`` (and ``detach_``) of constant tensors: exported again, torch lifts those
      constants a second time and its decompositions fail ("Constant tensor lifted_tensor_4 is not in the
      constants dictionary"); a fresh copy of a constant that nothing writes to is the constant;
    - for the same reason, tensor attributes that are neither parameters nor buffers become
      non-persistent buffers;
    - ``contiguous()`` becomes a ``clone`` in that memory format: whether ``contiguous()`` copies depends
      on the strides of its input, and torch.onnx's decompositions see other strides for the output of
      ``scaled_dot_product_attention`` than ``torch.export`` did, so a ``view`` after a ``contiguous()``
      that was a no-op in one trace fails in the other. A clone is contiguous in both (and free in ONNX).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> exportable(gm) == (gm, None)
        True
    """
    lift, detach_ = torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.detach_.default

    def read_only(node: torch.fx.Node) -> bool:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            return False
        return not schema.is_mutable or (node.target is detach_ and all(read_only(u) for u in node.users))

    contiguous = [n for n in gm.graph.nodes if (n.op == "call_function" and n.target in _CONTIGUOUS)
                  or (n.op == "call_method" and n.target == "contiguous")]
    registered = {name for name, _ in gm.named_parameters()} | {name for name, _ in gm.named_buffers()}
    constants = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target not in registered
                 and isinstance(attribute_tensor(gm, n.target), torch.Tensor)}
    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    out_spec = info.out_spec if info is not None else None
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, spec = pytree.tree_flatten(_plain_containers(output.args[0]))
    if out_spec is None and any(not isinstance(leaf, torch.fx.Node) for leaf in leaves):
        out_spec = spec
    lifts = any(n.op == "call_function" and n.target is lift for n in gm.graph.nodes)
    if not constants and not lifts and out_spec is None and not contiguous:
        return gm, None
    copy = copy_graph_module(gm)
    for node in list(copy.graph.nodes):
        if (node.op == "call_function" and node.target in _CONTIGUOUS) or (
                node.op == "call_method" and node.target == "contiguous"):
            fmt = node.kwargs.get("memory_format", node.args[1] if len(node.args) > 1 else torch.contiguous_format)
            with copy.graph.inserting_before(node):
                clone = copy.graph.call_function(torch.ops.aten.clone.default, (node.args[0],), {"memory_format": fmt})
            clone.meta.update(node.meta)
            node.replace_all_uses_with(clone)
            copy.graph.erase_node(node)
    structure = None
    if out_spec is not None:
        if info is not None:
            copy.graph._codegen = torch.fx.graph._PyTreeCodeGen(
                torch.fx.graph._PyTreeInfo(info.orig_args, info.in_spec, None))
        new_output = next(n for n in copy.graph.nodes if n.op == "output")
        kinds, tensors = [], []
        for leaf in pytree.tree_leaves(_plain_containers(new_output.args[0])):
            if isinstance(leaf, torch.fx.Node):
                kinds.append(("tensor", len(tensors)))
                tensors.append(leaf)
            else:
                kinds.append(("constant", leaf))
        new_output.args = (tuple(tensors),)
        structure = (out_spec, tuple(kinds))
    for i, node in enumerate(n for n in copy.graph.nodes if n.op == "get_attr" and n.target in constants):
        name = f"_fxforge_constant_{i}"
        copy.register_buffer(name, attribute_tensor(copy, node.target), persistent=False)
        node.target = name
    for node in list(copy.graph.nodes):
        if node.op == "call_function" and node.target is lift and all(read_only(u) for u in node.users):
            for user in [u for u in node.users if u.target is detach_]:  # detach_ of a constant: a no-op
                user.replace_all_uses_with(node)
                copy.graph.erase_node(user)
            node.replace_all_uses_with(node.args[0])
            copy.graph.erase_node(node)
    copy.graph.lint()
    copy.recompile()
    return copy, structure


def check_file(path: str) -> None:
    """``onnx.checker.check_model(path, full_check=True)``, raising :class:`ExportError`.

    Example:
        >>> try:
        ...     check_file("/nonexistent.onnx")
        ... except ExportError as error:
        ...     print(error.stage)
        checker
    """
    import onnx

    try:
        onnx.checker.check_model(path, full_check=True)
    except Exception as error:
        raise ExportError(f"the ONNX file fails onnx.checker: {first_line(error)}", stage="checker") from error


def validate(module: Callable[..., Any], captured: Captured, other_batch: tuple | None, *,
             name: str = "ONNX Runtime") -> dict[str, float]:
    """Run an exported model (``module``, called like the model) and the PyTorch model on the example
    inputs (and another batch) and compare. ``name`` says what ran the exported model, in errors.

    Returns the largest absolute difference per input set.

    Raises:
        ExportError: outputs differ beyond tolerance, or the exported model failed to run.
    """
    cases = [("example inputs", captured.example_args, captured.example_kwargs, captured.example_outputs)]
    if other_batch is not None:
        cases.append((*other_batch, None))
    errors = {}
    for label, args, kwargs, reference in cases:
        if reference is None:
            with isolated(captured.module), torch.no_grad():
                reference = captured.module(*args, **kwargs)
        try:
            with torch.no_grad():
                actual = module(*args, **kwargs)
        except Exception as error:
            raise ExportError(f"{name} failed to run the exported model on the {label}: {first_line(error)}",
                              stage="validation") from error
        result = compare_outputs(reference, actual, rtol_scale=VALIDATION_TOLERANCE_SCALE)
        if not result.ok:
            raise ExportError(f"{name}'s outputs differ from PyTorch's on the {label}: {result.reason}",
                              stage="validation")
        errors[label] = result.max_abs_err
    return errors


def _move_into_place(scratch: str, directory: str, name: str) -> None:
    """Rename the scratch folder's files into ``directory``: external data first, the model last."""
    others = sorted(f for f in os.listdir(scratch) if f != name)
    moved = []
    try:
        for file in [*others, name]:
            os.replace(os.path.join(scratch, file), os.path.join(directory, file))
            moved.append(file)
    except BaseException:
        for file in moved:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, file))
        raise


# ---------------------------------------------------------------------------------------------- errors

def _fx_node_in(error: BaseException) -> torch.fx.Node | None:
    """The fx node torch.onnx was translating when ``error`` (or an exception it chains) was raised."""
    found, seen = None, set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame, _ in traceback.walk_tb(current.__traceback__):
            node = frame.f_locals.get("node")
            if isinstance(node, torch.fx.Node) and node.op == "call_function":
                found = node
        current = current.__cause__ or current.__context__
    return found


def _op_name(target: Any) -> str:
    name = getattr(target, "name", None)
    if callable(name):
        with contextlib.suppress(Exception):
            return name()  # "fxtest::mystery" for an OpOverload
    return getattr(target, "__qualname__", None) or str(target)


def _root_cause(error: BaseException) -> BaseException:
    seen = set()
    while (error.__cause__ or error.__context__) is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return error


def translation_error(error: BaseException, model_name: str, log: str = "") -> ExportError:
    """An :class:`ExportError` for a failed ``torch.onnx.export``: the op, its source line, the cause.

    Example:
        >>> str(translation_error(RuntimeError("boom"), "Net"))
        'cannot export Net to ONNX: RuntimeError: boom'
    """
    node = _fx_node_in(error)
    cause = _root_cause(error)
    if node is None:
        tail = "; ".join(line for line in log.strip().splitlines()[-2:] if line.strip())
        return ExportError(f"cannot export {model_name} to ONNX: {first_line(cause)}" + (f" ({tail})" if tail else ""),
                           stage="translation")
    op = _op_name(node.target)
    where = node_source(node)
    chain = [error]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    missing = any(type(e).__name__ == "DispatchError" for e in chain)
    what = f"no ONNX translation for {op}" if missing else f"translating {op} failed ({first_line(cause)})"
    return ExportError(f"cannot export {model_name} to ONNX: {what}" + (f" at {where}" if where else ""),
                       stage="translation", op=op, source=where)


# ---------------------------------------------------------------------------------------------- batch dims

def batch_size(args: tuple, kwargs: dict) -> int | None:
    """The batch size: the most common dim 0 among the input tensors (None without any).

    Example:
        >>> batch_size((torch.ones(4, 3), torch.ones(4)), {"mask": torch.ones(1, 9)})
        4
    """
    sizes = [t.shape[0] for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    return collections.Counter(sizes).most_common(1)[0][0] if sizes else None


def with_batch(args: tuple, kwargs: dict, batch: int, new: int) -> tuple[tuple, dict]:
    """The inputs with batch size ``new``, built from the example rows (in reverse order, repeated), so
    token ids, masks and image statistics stay those of real inputs.

    Example:
        >>> (x,), _ = with_batch((torch.tensor([[1], [2]]),), {}, 2, 3)
        >>> x.flatten().tolist()
        [2, 1, 2]
    """
    index = torch.tensor([(batch - 1 - i) % batch for i in range(new)])

    def grow(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            return t.index_select(0, index.to(t.device)).contiguous()
        return t

    return pytree.tree_map(grow, (tuple(args), dict(kwargs)))


def batch_dynamic_shapes(gm: nn.Module, args: tuple, kwargs: dict, batch: int) -> dict[str, Any]:
    """``dynamic_shapes`` for ``torch.export``: dim 0 of every input whose dim 0 is ``batch`` is one
    shared ``Dim("batch")``; everything else static. Keyed by the graph's argument names.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
        >>> batch_dynamic_shapes(gm, (torch.ones(3, 2),), {}, 3)
        {'input': {0: Dim('batch', min=1)}}
    """
    dim = torch.export.Dim("batch", min=1)
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)

    def spec(t: Any) -> Any:
        return {0: dim} if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch else None

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}
