"""``capture()``: try the capture methods in turn, check the graph against the model, build the ``Captured``.

Example:
    >>> import torch
    >>> cap = capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.ones(2, 4),))
    >>> cap.method
    'fx'
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.capture.dynamo import capture_dynamo, own_graph
from fxforge.capture.export import export_graph_module
from fxforge.capture.fx_trace import TraceFailure, hidden_work, restore_output_type, trace_with_leaves
from fxforge.capture.hf import register_transformers_pytrees
from fxforge.capture.inputs import normalize_inputs
from fxforge.core.captured import Captured
from fxforge.core.nodes import count_calls
from fxforge.core.report import Report
from fxforge.core.shapes import MetaInfo, annotate, run_and_annotate
from fxforge.core.source import first_line, user_frame_of
from fxforge.core.verify import Comparison, compare_outputs, isolated
from fxforge.core.vocabulary import HOOK_DICTS, has_hooks

METHODS = ("auto", "fx", "export", "dynamo")


class CaptureError(RuntimeError):
    """No capture method could turn the module into a graph that reproduces it.

    The message names, for each method tried, what broke and the user's line where it broke; and, where
    TorchDynamo cuts the model into graphs, each break (``breaks``: found on first use, a dynamo run of the model,
    so that a caller that only needs the reasons, such as ``optimize`` handing the model to dynamo, pays nothing).

    Example:
        >>> str(CaptureError("Net", {"fx": "TraceError: x at m.py:3"}))
        'cannot capture Net: fx: TraceError: x at m.py:3'
    """

    def __init__(self, model_name: str, reasons: dict[str, str], breaks: list | None = None,
                 find_breaks: Any = None):
        self.reasons = reasons
        self._breaks = list(breaks) if breaks is not None else None
        self._find_breaks = find_breaks  # () -> breaks, where not given
        detail = "; ".join(f"{method}: {why}" for method, why in reasons.items())
        self._message = f"cannot capture {model_name}: {detail}"
        super().__init__(self._message)

    @property
    def message_without_breaks(self) -> str:
        """The message without where TorchDynamo breaks the model (which takes a dynamo run to find)."""
        return self._message

    @property
    def breaks(self) -> list:
        """Where TorchDynamo cuts the model (:class:`~fxforge.core.breaks.Break`), [] where unknown."""
        if self._breaks is None:
            find, self._find_breaks = self._find_breaks, None
            self._breaks = list(find()) if find is not None else []
        return self._breaks

    def __str__(self) -> str:
        cuts = "; ".join(map(str, self.breaks))
        return self._message + (f"; one graph cannot hold it, TorchDynamo breaks it at {cuts}" if cuts else "")


def describe_failure(error: BaseException) -> str:
    """What broke and the user's line where it broke, for a capture reason.

    Example:
        >>> describe_failure(ValueError("bad"))
        'ValueError: bad'
    """
    where = getattr(error, "source", None) if isinstance(error, TraceFailure) else user_frame_of(error)
    reason = error.reason if isinstance(error, TraceFailure) else first_line(error)
    return f"{reason} at {where}" if where else reason


def _on_meta(*outputs: Any) -> bool:
    """Whether any tensor in ``outputs`` lives on the meta device (a model planned on paper: shapes, no values)."""
    return any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in pytree.tree_leaves(outputs))


def _compare_layout(reference: Any, actual: Any) -> Comparison:
    """:func:`compare_outputs` for outputs on the meta device, which hold no values to compare: the structure,
    each tensor's shape, dtype and device, and the non-tensor leaves must agree.

    Example:
        >>> meta = torch.empty(2, 3, device="meta")
        >>> _compare_layout((meta, 1), (meta.clone(), 1)).ok, _compare_layout(meta, meta.view(3, 2)).reason
        (True, 'output: (2, 3)/torch.float32/meta vs (3, 2)/torch.float32/meta')
    """
    ref_leaves, ref_spec = pytree.tree_flatten_with_path(reference)
    act_leaves, act_spec = pytree.tree_flatten_with_path(actual)
    if ref_spec != act_spec:
        return Comparison(False, float("inf"), f"output structure differs: {ref_spec} vs {act_spec}")
    for (path, r), (_, a) in zip(ref_leaves, act_leaves):
        name = "output" + pytree.keystr(path) if path else "output"
        if isinstance(r, torch.Tensor) and isinstance(a, torch.Tensor):
            layout = [(tuple(t.shape), t.dtype, t.device.type) for t in (r, a)]
            if layout[0] != layout[1]:
                return Comparison(False, float("inf"), f"{name}: " + " vs ".join("/".join(map(str, x)) for x in layout))
        elif isinstance(r, torch.Tensor) or isinstance(a, torch.Tensor) or r != a:
            return Comparison(False, float("inf"), f"{name}: {r!r} != {a!r}")
    return Comparison(True, 0.0)


def check_graph(module: nn.Module, graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict, reference: Any,
                *, record: bool = False) -> MetaInfo | None:
    """Refuse (raise) a graph whose outputs differ from the module's ``reference`` outputs; with ``record``,
    the run also records every node's shape metadata (and the :class:`MetaInfo` saying so is returned).

    Example:
        >>> relu = torch.nn.ReLU()
        >>> check_graph(relu, torch.fx.symbolic_trace(relu), (torch.ones(1),), {}, torch.ones(1)) is None
        True
    """
    # A GraphModule that raises prints its generated code to stderr; the error itself becomes the reason.
    info = None
    with isolated(module, inputs=(args, kwargs)), torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
        if record:
            actual, info = run_and_annotate(graph_module, args, kwargs)
        else:
            actual = graph_module(*args, **kwargs)
    result = compare_outputs(reference, actual) if not _on_meta(reference, actual) else _compare_layout(reference, actual)
    if not result.ok:
        raise RuntimeError(f"captured graph differs from the module: {result.reason}")
    return info


def capture(module: nn.Module, example_inputs: Any = None, method: str = "auto", *,
            example_kwargs: dict | None = None, check: bool = True) -> Captured:
    """Capture ``module`` as a graph that reproduces it on inputs like ``example_inputs``.

    Args:
        module: the model; its current mode (train/eval) is the one captured.
        example_inputs: a tuple of positional inputs, one tensor, or a dict of keyword inputs.
        example_kwargs: keyword inputs in addition to positional ``example_inputs``.
        method: ``"fx"`` (symbolic trace; submodules in which tracing breaks are kept opaque),
            ``"export"`` (torch.export, non-strict, ATen ops) or ``"auto"`` (fx when it needs no opaque
            leaf and keeps no attention layer or wrapped library function whole (see
            :func:`~fxforge.capture.fx_trace.hidden_work`), else export, else fx as traced).
        check: run the graph once against the module on the example inputs and refuse a graph that
            differs (buffers and RNG state are restored afterwards).

    Returns:
        A :class:`~fxforge.core.captured.Captured` with shape metadata on every node.

    :func:`fxforge.capture.dynamic.capture_dynamic` captures with torch.export and dynamic dims instead.

    Raises:
        CaptureError: no method captured the module; names the line that broke each method.
        ValueError: an unknown ``method``.

    Example:
        >>> cap = capture(torch.nn.Linear(3, 1), (torch.ones(2, 3),), method="export")
        >>> cap.method, tuple(cap.graph_module(torch.ones(2, 3)).shape)
        ('export', (2, 1))
    """
    if method not in METHODS:
        raise ValueError(f"unknown capture method {method!r}; choose one of {', '.join(METHODS)}")
    args, kwargs = normalize_inputs(example_inputs)
    kwargs.update(example_kwargs or {})
    name = type(module).__name__
    if method == "dynamo":
        return capture_dynamo(module, args, example_kwargs=kwargs)
    register_transformers_pytrees(module)  # cache objects in outputs must be pytrees (export, comparison)
    reference = None
    if check:
        try:
            with isolated(module, inputs=(args, kwargs)), torch.no_grad():
                reference = module.forward(*args, **kwargs)  # the graph is the forward's: the root's hooks
                # run around it (an optimized module's call runs them)
        except Exception as error:
            raise CaptureError(name, {"eager": f"the module raised on the example inputs: {describe_failure(error)}"}) from error

    reasons: dict[str, str] = {}
    traced, traced_meta = None, None
    if method in ("auto", "fx"):
        try:
            traced = own_graph(module) or trace_with_leaves(module, args, kwargs)
            if isinstance(reference, dict) and type(reference) is not dict:
                # Tracing records a returned ModelOutput as a plain dict; give the graph the model's type.
                restore_output_type(traced.graph_module, type(reference))
            if check:
                traced_meta = check_graph(module, traced.graph_module, args, kwargs, reference, record=True)
        except Exception as error:  # noqa: BLE001
            reasons["fx"] = describe_failure(error)
            traced = None
        hidden = hidden_work(traced.graph_module) if traced is not None and method == "auto" else []
        if traced is not None and (method == "fx" or not (traced.opaque or hidden)):
            return captured_from(module, traced.graph_module, "fx", traced.opaque, args, kwargs, info=traced_meta,
                           reference=reference)
        if traced is not None:
            reasons["fx"] = ("needs opaque leaves: " + "; ".join(str(o) for o in traced.opaque) if traced.opaque else
                             "it keeps whole what the rewrites cannot see into: " + "; ".join(hidden))
    if method in ("auto", "export"):
        try:
            exported = export_graph_module(module, args, kwargs)
            if check:
                check_graph(module, exported, args, kwargs, reference)
        except Exception as error:  # noqa: BLE001
            reasons["export"] = describe_failure(error)
        else:
            notes = [f"symbolic trace not used: {reasons['fx']}"] if "fx" in reasons else []
            return captured_from(module, exported, "export", [], args, kwargs, notes, reference=reference)
    if traced is not None:
        kept = "opaque leaves" if traced.opaque else "what it keeps whole"
        notes = [f"torch.export failed ({reasons['export']}); kept the trace with {kept}"]
        return captured_from(module, traced.graph_module, "fx", traced.opaque, args, kwargs, notes, info=traced_meta,
                       reference=reference)
    raise CaptureError(name, reasons, find_breaks=functools.partial(breaks_of, module, args, kwargs))


def _unhooked(module: nn.Module) -> nn.Module:
    """``module``, or where it has hooks a copy of its modules without them that shares its tensors: dynamo's run
    must not fire the user's hooks, and a hook wrapped to stay quiet would break dynamo's graph."""
    if not any(map(has_hooks, module.modules())):
        return module
    copy_ = copy.deepcopy(module, memo={id(t): t for t in [*module.parameters(), *module.buffers()]})
    for inner in copy_.modules():
        for table in HOOK_DICTS:
            if isinstance(getattr(inner, table, None), dict):
                getattr(inner, table).clear()
    return copy_


def breaks_of(module: nn.Module, args: tuple, kwargs: dict) -> list:
    """Where TorchDynamo cuts ``module`` on these inputs (its state left as it was), for an error that says why
    one graph cannot hold it; [] where dynamo fails on it too.

    Example:
        >>> breaks_of(torch.nn.ReLU(), (torch.ones(1),), {})
        []
    """
    try:
        with isolated(module, inputs=(args, kwargs)):
            return capture_dynamo(_unhooked(module), args, example_kwargs=kwargs).breaks
    except Exception:  # noqa: BLE001 - the error being built says what broke; dynamo failing adds nothing
        return []


def captured_from(module: nn.Module, graph_module: torch.fx.GraphModule, method: str, opaque: list,
                  args: tuple, kwargs: dict, notes: list[str] | None = None, info: MetaInfo | None = None,
                  reference: Any = None) -> Captured:
    """The ``Captured`` of a checked graph: shape metadata on every node (unless ``info`` says a run
    recorded it), a report with ``notes``, the module's mode and its ``reference`` outputs.

    Example:
        >>> relu = torch.nn.ReLU()
        >>> captured_from(relu, torch.fx.symbolic_trace(relu), "fx", [], (torch.ones(1),), {}).report.nodes_before
        1
    """
    info = info or annotate(graph_module, args, kwargs)
    nodes = count_calls(graph_module.graph)
    report = Report(method=method, opaque=list(opaque), meta_source=info.source, nodes_before=nodes, nodes_after=nodes)
    report.notes.extend(notes or [])
    if info.reason:
        report.notes.append(f"shape metadata from a real run: fake propagation failed ({info.reason})")
    return Captured(graph_module, method, list(opaque), args, kwargs, module, module.training, report,
                    example_outputs=reference)
