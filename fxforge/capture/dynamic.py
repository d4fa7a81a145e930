"""Capture with torch.export and dynamic dims.

A graph captured with static shapes holds the example's sizes; exporting it (ONNX, ``.pt2``) with a
dynamic batch needs a graph that computes them. :func:`capture_dynamic` captures with the dims dynamic:
the user's ``dynamic_shapes``, or dim 0 of every input whose dim 0 is the batch size (torch.export
specialises a size-1 dim, so a batch of 1 is traced as a batch of 2 made from the example rows);
:func:`capture_with_dims` with chosen input dims dynamic (a plan that serves many sizes);
:func:`capture_refined` with fxforge's choice of dims, taking torch.export's suggested fixes (a model with
64 positions: ``Dim("seq", max=64)``) instead of failing.

Which dims to make dynamic is :mod:`fxforge.capture.dims`' job (batch and sequence dims, the dims that
changed between two calls, the inputs to trace on); the suggested fixes are :mod:`fxforge.capture.refine`'s.
Their names stay importable from here.

Example:
    >>> cap = capture_dynamic(torch.nn.Linear(2, 3), (torch.ones(4, 2),), {})
    >>> cap.method, cap.graph_module(torch.ones(5, 2)).shape
    ('export', torch.Size([5, 3]))
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._sympy.value_ranges import ValueRanges

from fxforge.capture.dims import (  # noqa: F401 - the dims' names, importable from here as before
    batch_dynamic_shapes,
    batch_size,
    changed_dims,
    changed_dynamic_shapes,
    leaf_dims,
    resized,
    sequence_dynamic_shapes,
    sequence_length,
    trace_inputs,
    with_batch,
)
from fxforge.capture.export import export_graph_module
from fxforge.capture.hf import register_transformers_pytrees
from fxforge.capture.model import CaptureError, captured_from, check_graph
from fxforge.capture.refine import (  # noqa: F401 - importable from here as before
    export_refining,
    refined_dynamic_shapes,
    suggested_fixes,
)
from fxforge.core.captured import Captured
from fxforge.core.sequence_dims import BATCH
from fxforge.core.source import first_line, user_frame_of
from fxforge.core.verify import isolated


def capture_dynamic(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None, *,
                    reference: Any = None) -> Captured:
    """Capture ``model`` with ``torch.export`` and dynamic dims: ``dynamic_shapes``, or (None) dim 0 of
    every input whose dim 0 is the batch size.

    The graph is checked against the model on the example inputs, like :func:`fxforge.capture`'s.
    ``reference`` is the model's output on them, when already computed.

    Raises:
        CaptureError: torch.export cannot keep those dims dynamic (the message names the line that
            specialised them, where torch.export says), or the graph differs from the model.

    Example:
        >>> cap = capture_dynamic(torch.nn.Linear(2, 3), (torch.ones(1, 2),), {})
        >>> cap.graph_module(torch.ones(7, 2)).shape
        torch.Size([7, 3])
    """
    trace_args, trace_kwargs = tuple(args), dict(kwargs)
    if dynamic_shapes is None:
        batch = batch_size(args, kwargs)
        if batch == 1:  # torch.export specialises a size-1 dim: trace on a batch of 2 made from the example rows
            trace_args, trace_kwargs = with_batch(args, kwargs, 1, 2)
            batch = 2
        dynamic_shapes = batch_dynamic_shapes(model, trace_args, trace_kwargs, batch)
    name = type(model).__name__
    register_transformers_pytrees(model)  # a decoder's cache object in its output must be a pytree for export
    try:
        with torch.no_grad():
            graph_module = export_graph_module(model, trace_args, trace_kwargs, dynamic_shapes)
    except Exception as error:
        where = user_frame_of(error)
        raise CaptureError(name, {"export": "torch.export cannot keep the requested dims dynamic "
                                            f"({first_line(error)})" + (f" at {where}" if where else "")}) from error
    return _checked(model, graph_module, args, kwargs, reference)


def _checked(model: nn.Module, graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict,
             reference: Any) -> Captured:
    """The dynamic capture as a ``Captured``, once its graph answered as the model does on the example inputs
    (``reference``: the model's output there, computed now when None)."""
    if reference is None:
        with isolated(model, inputs=(args, kwargs)), torch.no_grad():
            reference = model(*args, **kwargs)
    try:
        check_graph(model, graph_module, args, kwargs, reference)
    except Exception as error:
        raise CaptureError(type(model).__name__, {"export": first_line(error)}) from error
    return captured_from(model, graph_module, "export", [], args, kwargs,
                         ["captured with torch.export and dynamic dims"], reference=reference)


def capture_with_dims(model: nn.Module, args: tuple, kwargs: dict, dims: set[tuple[int, int]]) -> Captured:
    """Capture ``model`` with ``torch.export`` and the input dims ``dims`` (``(leaf, dim)`` of the flattened
    ``(args, kwargs)``) dynamic: what a plan that serves many sizes is built from.

    Each dim is ``Dim.AUTO``: torch.export keeps it dynamic where the model allows, relates dims that must
    agree (the sequence length of the ids and of the mask), bounds them where the model does (position
    embeddings), and specialises what it must. A dim of size 1 in the inputs is captured at a stand-in size
    of 2 (:func:`stand_in`), and ``Dim.AUTO``'s ranges, which start at 2, are widened to start at 1: the plan
    is checked against eager at a size of 1 on its first call there, rather than specialised on it.

    The batch dim is the exception: dim 0 of every input whose dim 0 is the batch size
    (:func:`batch_size`), when it is among ``dims``, is one ``Dim("batch", min=1)``, so that the plan also
    serves a batch of one instead of a second capture for it. torch.export refuses that range where the
    model's code decides anything on the batch being 1 (a guard it cannot keep); the capture is then made
    again with ``Dim.AUTO`` there too.

    Raises:
        CaptureError: torch.export cannot capture the model.

    Example:
        >>> cap = capture_with_dims(torch.nn.Linear(2, 3), (torch.ones(4, 2),), {}, {(0, 0)})
        >>> cap.graph_module(torch.ones(1, 2)).shape
        torch.Size([1, 3])
        >>> [int(r.lower) for r in cap.graph_module.meta["fxforge_ranges"].values()]   # a batch of 1 served
        [1]
    """
    shapes = [tuple(t.shape) for t in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(t, torch.Tensor)]
    args, kwargs = stand_in(args, kwargs, dims)
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    auto = {(leaf, dim): torch.export.Dim.AUTO for leaf, dim in sorted(dims)
            if isinstance(leaves[leaf], torch.Tensor) and leaves[leaf].shape[dim] > 1}
    batch, refused, captured = batch_size(args, kwargs), None, None
    batch_dims = {(leaf, 0) for leaf, dim in auto if dim == 0 and batch is not None and batch > 1
                  and leaves[leaf].shape[0] == batch}
    if batch_dims:
        shared = torch.export.Dim(BATCH, min=1)
        try:
            captured = capture_dynamic(model, args, kwargs, _spec(model, args, kwargs, {**auto, **dict.fromkeys(batch_dims, shared)}))
        except CaptureError as error:
            refused = first_line(error)
    if captured is None:
        captured = capture_dynamic(model, args, kwargs, _spec(model, args, kwargs, auto))
    if refused is not None:
        captured.report.notes.append(f"a batch of one needs a plan of its own: {refused}")
    if shapes != [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]:
        captured.report.notes.append("dims of size 1 in the call were captured at a stand-in size of 2, so the plan "
                                     "does not specialise on them (it is checked against eager at 1 before it serves 1)")
    _serve_ones(captured.graph_module)
    return captured


def stand_in(args: tuple, kwargs: dict, dims: set[tuple[int, int]]) -> tuple[tuple, dict]:
    """The inputs to capture with the input dims ``dims`` dynamic on: every one of those dims of size 1 grown to
    a stand-in size of 2 (:func:`resized`; torch.export specialises a size of 1, and a batch or a length of one
    is what users' examples often have). The inputs themselves when no dim is 1.

    Example:
        >>> (x,), _ = stand_in((torch.ones(1, 5),), {}, {(0, 0), (0, 1)})
        >>> x.shape
        torch.Size([2, 5])
    """
    leaves, structure = pytree.tree_flatten((tuple(args), dict(kwargs)))
    ones = [(leaf, dim) for leaf, dim in sorted(dims) if isinstance(leaves[leaf], torch.Tensor)
            and dim < leaves[leaf].dim() and leaves[leaf].shape[dim] == 1]
    if not ones:
        return tuple(args), dict(kwargs)
    for leaf, dim in ones:
        leaves[leaf] = resized(leaves[leaf], dim, 2)
    return pytree.tree_unflatten(leaves, structure)


def _serve_ones(graph_module: torch.fx.GraphModule) -> None:
    """Let the graph's dynamic dims that torch.export ranged from 2 (``Dim.AUTO``'s default: it traces at 2 or
    more) serve a size of 1 too: a plan's first call at 1 is checked against eager before it serves it
    (:meth:`~fxforge.core.symbolic.ShapeGuard.untraced`), and a plan that differs there gets a plan of its own,
    instead of a second capture for every batch or length of one."""
    ranges = graph_module.meta.get("fxforge_ranges")
    if not ranges:
        return
    for symbol, value_range in list(ranges.items()):
        if value_range.lower == 2:
            ranges[symbol] = ValueRanges(1, value_range.upper)


def _spec(model: nn.Module, args: tuple, kwargs: dict, dims: dict[tuple[int, int], Any]) -> Any:
    """:func:`_dims_by_argument`, or a CaptureError when the inputs do not bind to the forward."""
    shapes = _dims_by_argument(model, args, kwargs, dims)
    if shapes is None:
        raise CaptureError(type(model).__name__, {"export": "the inputs do not bind to the forward's arguments"})
    return shapes


def _dims_by_argument(model: nn.Module, args: tuple, kwargs: dict, dims: dict[tuple[int, int], Any]) -> Any:
    """``dynamic_shapes`` keyed by the forward's argument names (a ``**kwargs`` parameter holds a dict of
    its own) for ``(leaf, dim) -> Dim``, the leaves counted over the flattened ``(args, kwargs)``."""
    counter = iter(range(10 ** 9))

    def spec(value: Any) -> Any:
        leaf = next(counter)
        if not isinstance(value, torch.Tensor):
            return None
        return {dim: d for (at, dim), d in dims.items() if at == leaf} or None

    positional = [pytree.tree_map(spec, value) for value in args]
    keyword = {name: pytree.tree_map(spec, value) for name, value in kwargs.items()}
    try:
        bound = inspect.signature(model.forward).bind(*positional, **keyword).arguments
    except TypeError:
        return None
    return {name: value for name, value in bound.items() if value != {} and value != ()}  # (empty **kwargs)


def capture_refined(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any, *, reference: Any = None,
                    refine: Any = True) -> tuple[Captured, Any]:
    """Capture ``model`` with ``torch.export`` and ``dynamic_shapes`` (chosen by fxforge: dims of size 1 are
    traced grown, see :func:`trace_inputs`; a constraint violation is answered with torch.export's suggested
    fixes, see :func:`export_refining`). Returns the ``Captured`` (its example inputs are ``args``,
    ``kwargs``) and the ``dynamic_shapes`` it was captured with.

    Raises:
        CaptureError: torch.export cannot keep those dims dynamic, or the graph differs from the model.

    Example:
        >>> lin = torch.nn.Linear(2, 3)
        >>> batch = torch.export.Dim("batch", min=1)
        >>> cap, spec = capture_refined(lin, (torch.ones(1, 2),), {}, {"input": {0: batch}})
        >>> cap.graph_module(torch.ones(7, 2)).shape, spec
        (torch.Size([7, 3]), {'input': {0: Dim('batch', min=1)}})
    """
    trace_args, trace_kwargs = trace_inputs(model, args, kwargs, dynamic_shapes)
    name = type(model).__name__
    try:
        with torch.no_grad():
            graph_module, dynamic_shapes = export_refining(
                lambda spec: export_graph_module(model, trace_args, trace_kwargs, spec), dynamic_shapes, refine)
    except Exception as error:
        where, fixes = user_frame_of(error), suggested_fixes(error)
        raise CaptureError(name, {"export": "torch.export cannot keep the requested dims dynamic "
                                            f"({first_line(error)})" + (f" at {where}" if where else "")
                                  + (f"; torch.export's suggested fixes: {', '.join(fixes)}" if fixes else "")}
                           ) from error
    return _checked(model, graph_module, args, kwargs, reference), dynamic_shapes
