"""Writing a rewritten graph as a checked and validated ONNX file.

:func:`write_checked` takes a ``Captured`` (captured and rewritten: :func:`fxforge.export_onnx` does that
first) through these steps, each of which either succeeds or leaves nothing behind:

1. ``torch.export`` of the rewritten graph (dims made dynamic here: ``dynamic_batch``, ``dynamic_shapes``,
   which :func:`fxforge.export_onnx` also builds for ``dynamic=True``: the batch and sequence dims;
   :func:`fxforge.exporters.program.export_program`);
2. ``torch.onnx.export`` with fxforge's translations of its fused ops and of attention
   (:mod:`fxforge.exporters.translations`), into a temporary folder next to the target; then the rules on
   its ONNX graph, :data:`~fxforge.exporters.onnx_rules.ONNX_RULES` (in the report as ``onnx <rule>``);
3. ``onnx.checker.check_model(full_check=True)``;
4. the file run in ONNX Runtime on the example inputs and compared with the PyTorch model; a file with
   dynamic dims also on two other sizes of every dynamic dim (one larger, one smaller where the dim's range
   allows; :func:`fxforge.exporters.program.validation_inputs`), so three sizes in all;
5. only then, renamed to the target path (external-data files first, the ``.onnx`` last).

An op that cannot be translated raises :class:`~fxforge.exporters.program.ExportError` naming the op and
the user's source line.

Example:
    >>> import os, tempfile, torch, fxforge
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    >>> path = os.path.join(tempfile.mkdtemp(), "m.onnx")
    >>> result = fxforge.export_onnx(model, path, (torch.randn(2, 3, 16, 16),), dynamic_batch=True)
    >>> os.path.exists(path), result.translations
    (True, ['fxforge::conv_pointwise -> Conv + relu: 1'])
    >>> sorted(result.validation)
    ['batch 1', 'batch 3', 'example inputs']
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import tempfile
import traceback
from typing import Any

import torch

from fxforge.core.captured import Captured
from fxforge.core.report import Report
from fxforge.core.source import first_line, node_source
from fxforge.core.tracing import tracing
from fxforge.core.verify import isolated
from fxforge.exporters.onnx_engine import run_onnx_rules
from fxforge.exporters.onnx_rules import ONNX_RULES
from fxforge.exporters.ort_module import IOSpec, OnnxRuntimeModule, default_providers
from fxforge.exporters.program import (
    ExportError,
    export_program,
    exportable,
    quiet,
    validate,
    validation_inputs,
)
from fxforge.exporters.torch_onnx import export_to_onnx
from fxforge.exporters.torchscript_export import requested_axes, resized_inputs, torchscript_export
from fxforge.exporters.translations import DEFAULT_OPSET, MIN_OPSET, Translations


@dataclasses.dataclass
class OnnxExport:
    """What :func:`fxforge.export_onnx` wrote, and how it was checked.

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
        left_out: why a rewrite was left out of this export (with it the export failed; also in the report's
            notes), or None.
        judged: per input set validated on, the reference that judged ONNX Runtime's outputs: ``"float32
            eager"``, or float64 eager with the distances where float32 eager is itself that far from the
            exact result (see :func:`~fxforge.exporters.program.validate`).
        fallback: why the file was written by torch.onnx's TorchScript exporter (its dynamo exporter failed
            on the model; also in the report's notes), or None.
        precision: ``"float32"``, or the int8 form the file was quantized to (``precision="int8"``; the
            validation above is of the float32 file it was made from, the int8 file's agreement with it is in
            the report's notes).

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
    left_out: str | None = None
    judged: dict[str, str] = dataclasses.field(default_factory=dict)
    fallback: str | None = None
    precision: str = "float32"

    def __str__(self) -> str:
        shapes = "dynamic " + ", ".join(f"{k}{v}" for k, v in self.dynamic.items()) if self.dynamic else "static shapes"
        lines = [f"{self.path}: opset {self.opset}, {shapes}"]
        lines += [f"  {t}" for t in self.translations]
        lines += [f"  validated in ONNX Runtime on {k}: max abs error {v:.3g}"
                  + (f", judged by {self.judged[k]}" if self.judged.get(k, "float32 eager") != "float32 eager" else "")
                  for k, v in self.validation.items()]
        lines += [f"  {self.fallback}"] if self.fallback else []
        lines += [f"  precision: {self.precision} (validated against the float32 file)"] \
            if self.precision != "float32" else []
        return "\n".join(lines)


def check_options(opset: int | None, dynamic_batch: bool, dynamic_shapes: Any, attention: str,
                  dynamic: bool = False) -> int:
    """Validate the export options before any work; returns the opset to use.

    Raises:
        ValueError: an opset torch.onnx does not export, dims asked for in two ways (``dynamic``,
            ``dynamic_batch``, ``dynamic_shapes``: one of them), an unknown ``attention``.

    Example:
        >>> check_options(None, False, None, "plain")
        20
        >>> check_options(None, True, None, "plain", dynamic=True)
        Traceback (most recent call last):
        ...
        ValueError: give one of dynamic=True, dynamic_batch=True, dynamic_shapes=...: dynamic=True makes the batch and sequence dims dynamic, dynamic_batch=True the batch dim, dynamic_shapes the dims it names
    """
    from torch.onnx import _constants

    opset = DEFAULT_OPSET if opset is None else int(opset)
    if not MIN_OPSET <= opset <= _constants.ONNX_MAX_OPSET:
        raise ValueError(f"opset {opset} is outside what torch.onnx exports ({MIN_OPSET}..{_constants.ONNX_MAX_OPSET})")
    if dynamic not in (True, False):
        raise TypeError(f"dynamic takes True or False, got {dynamic!r}")
    if dynamic and (dynamic_batch or dynamic_shapes is not None):
        raise ValueError("give one of dynamic=True, dynamic_batch=True, dynamic_shapes=...: dynamic=True makes the "
                         "batch and sequence dims dynamic, dynamic_batch=True the batch dim, dynamic_shapes the dims "
                         "it names")
    if dynamic_batch and dynamic_shapes is not None:
        raise ValueError("give dynamic_batch=True or dynamic_shapes=..., not both (dynamic_shapes can name the batch dim)")
    if attention not in ("MultiHeadAttention", "plain"):
        raise ValueError(f"attention={attention!r}: choose 'MultiHeadAttention' or 'plain'")
    return opset


def write_checked(captured: Captured, path: str, *, opset: int = DEFAULT_OPSET, dynamic_batch: bool = False,
                  dynamic_shapes: Any = None, attention: str = "MultiHeadAttention",
                  external_data: bool | None = None, module_options: dict | None = None,
                  refine: Any = False) -> tuple[OnnxExport, OnnxRuntimeModule]:
    """Export ``captured`` to ``path``, check and validate it, and rename it into place.

    A file with dynamic dims is validated on the example inputs and on two other sizes of every dynamic
    dim. ``refine`` (True, or the names of the dims that must stay dynamic) lets torch.export's suggested
    fixes narrow ``dynamic_shapes`` fxforge chose (see :func:`fxforge.exporters.program.export_program`).

    Returns the result and the :class:`OnnxRuntimeModule` that validated it (its session is open on the
    file now at ``path``; ``module_options`` go to its constructor). On any failure nothing is left:
    neither ``path`` (an existing file there is kept as it was) nor a temporary file.
    """
    directory, name = os.path.split(os.path.abspath(path))
    scratch = tempfile.mkdtemp(prefix=".fxforge-onnx-", dir=directory)
    try:
        scratch_path = os.path.join(scratch, name)
        exported = _export(captured, scratch_path, opset, dynamic_batch, dynamic_shapes, attention, external_data,
                           cpu=runs_on_cpu((module_options or {}).get("providers")), refine=refine)
        check_file(scratch_path)
        module = OnnxRuntimeModule(scratch_path, exported["io"], **(module_options or {}))
        judged: dict[str, str] = {}
        validation = validate(module, captured, exported["other_sizes"], judged=judged)
        report = captured.report.copy()
        report.matches.extend(exported["matches"])
        report.near_misses.extend(exported["near_misses"])
        report.notes.extend(f"onnx: {line}" for line in exported["translations"].summary())
        report.notes.extend(f"onnx: {exported['fallback']}" for _ in [1] if exported["fallback"])
        report.notes.extend(f"onnx: validated in ONNX Runtime on {k}: max abs error {v:.3g}, judged by {judged[k]}"
                            for k, v in validation.items())
        _move_into_place(scratch, directory, name)
        module.path = os.path.join(directory, name)
        module.report = report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = OnnxExport(module.path, opset, report, captured, exported["io"], exported["dynamic"],
                        exported["translations"].summary(), validation, judged=judged,
                        fallback=exported["fallback"])
    return result, module


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
            attention: str, external_data: bool | None = None, *, cpu: bool = True,
            refine: Any = False) -> dict[str, Any]:
    """torch.export then torch.onnx.export of the captured graph into ``path``, then the rules of
    :data:`~fxforge.exporters.onnx_rules.ONNX_RULES` on its ONNX graph (those for the CPU provider only where
    ``cpu``). Returns what :func:`write_checked` needs: the io spec, the translations used, the dims made
    dynamic, the rules' applications and refusals (``"matches"``, ``"near_misses"``) and the inputs of other
    sizes to validate a file with dynamic dims on (``"other_sizes"``)."""
    translations = Translations(opset=opset, attention=attention, cpu=cpu)
    try:
        program, out_structure, _, dynamic_shapes = export_program(captured, dynamic_batch, dynamic_shapes,
                                                                   refine=refine)
    except ExportError as error:
        if dynamic_shapes is None or "Constraints violated" not in str(error):
            raise
        return _specialised_fallback(captured, path, opset, external_data, translations, error, dynamic_shapes)
    log = io.StringIO()
    try:
        with tracing(), quiet(log):
            onnx_program = export_to_onnx(program, opset, translations.table())
    except Exception as error:
        failure = translation_error(error, type(captured.module).__name__, log.getvalue())
        if raised_in_fxforge(error):  # fxforge's own translation failed: a bug to fix, not to export around
            raise failure from error
        try:
            return _torchscript_fallback(program, captured, out_structure, path, opset, external_data,
                                         translations, failure, dynamic_shapes)
        except ExportError as second:
            raise ExportError(f"{failure}; {second}", stage=failure.stage, op=failure.op,
                              source=failure.source) from error
    matches, near_misses = run_onnx_rules(onnx_program.model, ONNX_RULES, cpu=cpu)
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
    other_sizes = validation_inputs(program, captured, lambda index, axis: dynamic.get(
        input_names[index], {}).get(axis) if index < len(input_names) else None)
    return {"io": io_spec, "translations": translations, "other_sizes": other_sizes, "fallback": None,
            "dynamic": {k: v for k, v in dynamic.items() if v}, "matches": matches, "near_misses": near_misses}


def _specialised_fallback(captured: Captured, path: str, opset: int, external_data: bool | None,
                          translations: Translations, failure: ExportError, dynamic_shapes: Any) -> dict[str, Any]:
    """What :func:`_export` returns where torch.export specialised dims ``dynamic_shapes`` asks to be dynamic
    (an LSTM's length: its kernel's shape checks guard the size): the graph exported with its example's sizes,
    then written by the TorchScript exporter with those dims dynamic, which it keeps where the graph computes
    with them (ONNX's LSTM takes any length), and validated at other sizes of each (the file is refused where a
    size stayed fixed inside). Raises :class:`ExportError` (``failure`` and why) where that fails too."""
    program, out_structure, _, _ = export_program(captured)
    module, _ = exportable(captured.graph_module)
    args, kwargs = tuple(captured.example_args), dict(captured.example_kwargs)
    axes = requested_axes(module, args, kwargs, dynamic_shapes)
    if not axes:
        raise failure
    reason = (f"torch.export kept dims fixed that were asked dynamic ({first_line(failure)}); exported with the "
              "TorchScript exporter (torch.onnx.export(dynamo=False); no fxforge ONNX translations or rules) with "
              "them dynamic, validated at other sizes of each")
    try:
        exported = _torchscript_fallback(program, captured, out_structure, path, opset, external_data, translations,
                                         failure, axes=axes, reason=reason)
    except ExportError as second:
        raise ExportError(f"{failure}; {second}", stage=failure.stage, op=failure.op, source=failure.source) from second
    exported["other_sizes"] = resized_inputs(args, kwargs, axes)
    for label, other_args, other_kwargs in exported["other_sizes"]:
        try:  # the model itself (a graph module's failure would print its generated code on stderr)
            with isolated(captured.module, inputs=(other_args, other_kwargs)), torch.no_grad():
                captured.module(*other_args, **other_kwargs)
        except Exception as error:  # the model's own failure, said as the reason
            raise ExportError(f"{failure}; the model itself fails at {label}: {first_line(error)}",
                              stage=failure.stage, op=failure.op, source=failure.source) from error
    return exported


def _torchscript_fallback(program: torch.export.ExportedProgram, captured: Captured, out_structure: Any, path: str,
                          opset: int, external_data: bool | None, translations: Translations,
                          failure: ExportError, dynamic_shapes: Any = None, *,
                          axes: dict[int, dict[int, str]] | None = None, reason: str | None = None) -> dict[str, Any]:
    """What :func:`_export` returns, for ``program`` written by torch.onnx's TorchScript exporter after its
    dynamo exporter failed (``failure``): no fxforge translations or ONNX rules (those work on the dynamo
    exporter's graph); validated as any other file. Raises :class:`ExportError` where it fails too."""
    import onnx

    args, kwargs = program.example_inputs or (tuple(captured.example_args), dict(captured.example_kwargs))
    module, _ = exportable(captured.graph_module)  # the graph export_program exported
    input_names = torchscript_export(program, module, args, kwargs, path, opset, dynamic_shapes, axes=axes)
    model = onnx.load(path)
    if external_data:
        onnx.save_model(model, path, save_as_external_data=True, location=os.path.basename(path) + ".data")
    try:
        io_spec = IOSpec.from_exported_program(program, input_names, len(model.graph.output),
                                               out_structure=out_structure)
    except ValueError as error:
        raise ExportError(f"the TorchScript exporter's inputs/outputs do not line up with the model's: {error}",
                          stage="translation") from error
    dynamic = {value.name: {axis: dim.dim_param for axis, dim in enumerate(value.type.tensor_type.shape.dim)
                            if dim.dim_param} for value in model.graph.input}
    other_sizes = validation_inputs(program, captured, lambda index, axis: dynamic.get(
        input_names[index], {}).get(axis) if index < len(input_names) else None)
    reason = reason or (f"torch.onnx dynamo exporter failed: {failure}; exported with the TorchScript exporter "
                        "(torch.onnx.export(dynamo=False); no fxforge ONNX translations or rules)")
    unused = Translations(opset=translations.opset, attention=translations.attention, cpu=translations.cpu)
    return {"io": io_spec, "translations": unused, "other_sizes": other_sizes, "fallback": reason,
            "dynamic": {k: v for k, v in dynamic.items() if v}, "matches": [], "near_misses": []}


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


def raised_in_fxforge(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s root cause is fxforge's own code (one of its translations),
    not torch.onnx's or onnxscript's.

    Example:
        >>> try:
        ...     check_file("/nonexistent.onnx")
        ... except ExportError as error:
        ...     raised_in_fxforge(error)
        False
    """
    frames = list(traceback.walk_tb(_root_cause(error).__traceback__))
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return bool(frames) and os.path.abspath(frames[-1][0].f_code.co_filename).startswith(package + os.sep)


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


