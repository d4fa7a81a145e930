"""Capture with torch.export and dynamic dims, and the batch-dim helpers that go with it.

A graph captured with static shapes holds the example's sizes; exporting it (ONNX, ``.pt2``) with a
dynamic batch needs a graph that computes them. :func:`capture_dynamic` captures with the dims dynamic:
the user's ``dynamic_shapes``, or dim 0 of every input whose dim 0 is the batch size (torch.export
specialises a size-1 dim, so a batch of 1 is traced as a batch of 2 made from the example rows).

For exports that serve every batch size and sequence length (``export_onnx(..., dynamic=True)``, the
``onnxruntime`` target), :func:`sequence_dynamic_shapes` chooses the batch and sequence dims,
:func:`changed_dynamic_shapes` the dims that changed between two calls, :func:`trace_inputs` grows the
size-1 dims to trace on, and :func:`capture_refined` / :func:`export_refining` take torch.export's suggested
fixes (a model with 64 positions: ``Dim("seq", max=64)``) instead of failing.

Example:
    >>> cap = capture_dynamic(torch.nn.Linear(2, 3), (torch.ones(4, 2),), {})
    >>> cap.method, cap.graph_module(torch.ones(5, 2)).shape
    ('export', torch.Size([5, 3]))
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.capture.export import export_graph_module
from fxforge.capture.hf import register_transformers_pytrees
from fxforge.capture.model import CaptureError, captured_from, check_graph
from fxforge.core.captured import Captured
from fxforge.core.sequence_dims import BATCH, SEQUENCE, batch_and_sequence, sequence_axes
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
    embeddings), and specialises what it must. Sizes 0 and 1 stay specialised by ``Dim.AUTO`` (its range
    starts at 2), so a dim of size 1 in the example stays static.

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
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    auto = {(leaf, dim): torch.export.Dim.AUTO for leaf, dim in sorted(dims)
            if isinstance(leaves[leaf], torch.Tensor) and leaves[leaf].shape[dim] > 1}
    batch, refused = batch_size(args, kwargs), None
    batch_dims = {(leaf, 0) for leaf, dim in auto if dim == 0 and batch is not None and batch > 1
                  and leaves[leaf].shape[0] == batch}
    if batch_dims:
        shared = torch.export.Dim(BATCH, min=1)
        try:
            return capture_dynamic(model, args, kwargs, _spec(model, args, kwargs, {**auto, **dict.fromkeys(batch_dims, shared)}))
        except CaptureError as error:
            refused = first_line(error)
    captured = capture_dynamic(model, args, kwargs, _spec(model, args, kwargs, auto))
    if refused is not None:
        captured.report.notes.append(f"a batch of one needs a plan of its own: {refused}")
    return captured


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


def batch_size(args: tuple, kwargs: dict) -> int | None:
    """The batch size: the most common dim 0 among the input tensors (None without any).

    Example:
        >>> batch_size((torch.ones(4, 3), torch.ones(4)), {"mask": torch.ones(1, 9)})
        4
    """
    return batch_and_sequence(_leaves(args, kwargs))[0]


def _leaves(args: tuple, kwargs: dict) -> list[tuple[tuple[int, ...], torch.dtype] | None]:
    """``(shape, dtype)`` of every input tensor (None for other inputs), as :mod:`fxforge.core.sequence_dims`
    reads them."""
    return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None
            for t in pytree.tree_leaves((args, kwargs))]


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


# ---------------------------------------------------------------------------------------------- export dims

def sequence_length(args: tuple, kwargs: dict) -> int | None:
    """The sequence length: the most common dim 1 among the integer and bool input tensors of rank >= 2
    (token ids, attention masks, position ids), else among the float inputs of rank 3 (``[batch, seq,
    hidden]``); None without any.

    Example:
        >>> ids = torch.ones(2, 7, dtype=torch.long)
        >>> sequence_length((ids,), {"mask": torch.ones(2, 7, dtype=torch.bool)})
        7
        >>> sequence_length((torch.ones(2, 3, 8, 8),), {}) is None
        True
    """
    return batch_and_sequence(_leaves(args, kwargs))[1]


def _batch_and_sequence_axes(value: Any, batch: int | None, seq: int | None) -> dict[int, str]:
    """:func:`~fxforge.core.sequence_dims.sequence_axes` of one input ({} for anything but a tensor)."""
    return sequence_axes(tuple(value.shape), value.dtype, batch, seq) if isinstance(value, torch.Tensor) else {}


def sequence_dynamic_shapes(gm: nn.Module, args: tuple, kwargs: dict, batch: int | None,
                            seq: int | None) -> dict[str, Any]:
    """``dynamic_shapes`` for ``torch.export`` with the batch and the sequence dims dynamic: dim 0 of every
    input whose dim 0 is ``batch`` is one shared ``Dim("batch")``, as in :func:`batch_dynamic_shapes`; dim 1
    of every input of rank >= 2 whose dim 1 is ``seq`` is one shared ``Dim("seq")`` (token ids, masks and
    position ids, ``[batch, seq, hidden]`` floats; not a float input of rank 4 or more, whose dim 1 is its
    channels). Everything else is static. Keyed by the forward's argument names.

    With a batch or a sequence of 1, every input with a dim of size 1 there counts; trace on inputs from
    :func:`trace_inputs` (torch.export specialises size-1 dims).

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda ids, mask, pixels: ids)
        >>> ids, mask, pixels = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5), torch.ones(2, 3, 5, 5)
        >>> spec = sequence_dynamic_shapes(gm, (ids, mask, pixels), {}, 2, 5)
        >>> spec["ids"], spec["pixels"]
        ({0: Dim('batch', min=1), 1: Dim('seq', min=1)}, {0: Dim('batch', min=1)})
    """
    dims = {BATCH: torch.export.Dim(BATCH, min=1), SEQUENCE: torch.export.Dim(SEQUENCE, min=1)}
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)

    def spec(value: Any) -> Any:
        return {axis: dims[name] for axis, name in _batch_and_sequence_axes(value, batch, seq).items()} or None

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def changed_dims(before: tuple[tuple, dict], after: tuple[tuple, dict]) -> set[tuple[int, int]] | None:
    """``(leaf, dim)`` of the flattened ``(args, kwargs)`` whose sizes differ between two calls, or None when
    the calls differ in more than sizes (structure, dtypes, ranks, Python values).

    Example:
        >>> changed_dims(((torch.ones(2, 3),), {}), ((torch.ones(2, 5),), {}))
        {(0, 1)}
        >>> changed_dims(((torch.ones(2, 3),), {}), ((torch.ones(2, 3, 1),), {})) is None
        True
    """
    old, old_spec = pytree.tree_flatten((tuple(before[0]), dict(before[1])))
    new, new_spec = pytree.tree_flatten((tuple(after[0]), dict(after[1])))
    if old_spec != new_spec:
        return None
    dims = set()
    for leaf, (a, b) in enumerate(zip(old, new)):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return None
        if not isinstance(a, torch.Tensor):
            try:
                same = bool(a == b) or a is b
            except Exception:  # noqa: BLE001 - values that do not compare
                same = a is b
            if not same:
                return None
        elif a.dtype != b.dtype or a.dim() != b.dim():
            return None
        else:
            dims.update((leaf, axis) for axis, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n)
    return dims


def changed_dynamic_shapes(model: nn.Module, before: tuple[tuple, dict],
                           after: tuple[tuple, dict]) -> tuple[dict[str, Any], set[str]] | None:
    """``dynamic_shapes`` to export ``model`` again on the inputs ``after`` when an export for ``before`` does
    not take them (``torch.compile``'s automatic dynamic): every dim that changed is dynamic, and so are the
    batch and the sequence dims (as :func:`sequence_dynamic_shapes` chooses them), so that one more export
    serves the sizes that vary. Another dim that changed gets a ``Dim`` of its own (``d<leaf>_<dim>``).

    Returns the spec and the names of the dims that must stay dynamic (those of the dims that changed; the
    others may be specialised if the model needs it, see :func:`refined_dynamic_shapes`), or None when the
    calls differ in more than sizes, or not at all.

    Example:
        >>> lin = torch.nn.Linear(4, 2)
        >>> spec, required = changed_dynamic_shapes(lin, ((torch.ones(2, 4),), {}), ((torch.ones(3, 4),), {}))
        >>> spec, required
        ({'input': {0: Dim('batch', min=1)}}, {'batch'})
    """
    changed = changed_dims(before, after)
    if not changed:
        return None
    args, kwargs = tuple(after[0]), dict(after[1])
    batch, seq = batch_size(args, kwargs), sequence_length(args, kwargs)
    shared = {BATCH: torch.export.Dim(BATCH, min=1), SEQUENCE: torch.export.Dim(SEQUENCE, min=1)}
    leaves = pytree.tree_leaves((args, kwargs))
    per_leaf: dict[int, dict[int, Any]] = {}
    required = set()
    for leaf, value in enumerate(leaves):
        axes = {axis: shared[name] for axis, name in _batch_and_sequence_axes(value, batch, seq).items()}
        for at, axis in sorted(changed):
            if at == leaf:
                axes.setdefault(axis, torch.export.Dim(f"d{leaf}_{axis}", min=1))
                required.add(axes[axis].__name__)
        per_leaf[leaf] = axes
    return _spec_by_argument(model, args, kwargs, per_leaf), required


def _spec_by_argument(model: nn.Module, args: tuple, kwargs: dict, per_leaf: dict[int, dict[int, Any]]) -> Any:
    """``dynamic_shapes`` keyed by the forward's argument names, from ``{leaf: {axis: Dim}}`` (leaves counted
    over the flattened ``(args, kwargs)``)."""
    counter = iter(range(10 ** 9))

    def spec(value: Any) -> Any:
        leaf = next(counter)
        return per_leaf.get(leaf) or None if isinstance(value, torch.Tensor) else None

    positional = [pytree.tree_map(spec, value) for value in args]
    keyword = {name: pytree.tree_map(spec, value) for name, value in kwargs.items()}
    return dict(inspect.signature(model.forward).bind(*positional, **keyword).arguments)


def _axes_of(spec: Any) -> dict[int, Any]:
    """One tensor's spec (``{axis: Dim}``, or a Dim or None per axis) as ``{axis: Dim}``."""
    if isinstance(spec, dict):
        items = spec.items()
    elif isinstance(spec, (list, tuple)):
        items = enumerate(spec)
    else:
        return {}
    return {int(axis): dim for axis, dim in items if dim is not None and not isinstance(dim, int)}


def leaf_dims(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> dict[int, dict[int, Any]]:
    """``{leaf: {axis: Dim}}`` for the tensors of the flattened ``(args, kwargs)``: where ``dynamic_shapes``
    (keyed by the forward's argument names, or positional) puts a dynamic dim.

    Example:
        >>> lin = torch.nn.Linear(4, 2)
        >>> leaf_dims(lin, (torch.ones(3, 4),), {}, {"input": {0: torch.export.Dim("rows", min=1)}})
        {0: {0: Dim('rows', min=1)}}
    """
    if dynamic_shapes is None:
        return {}
    counter = iter(range(10 ** 9))
    positional = [pytree.tree_map(lambda _: next(counter), value) for value in args]
    keyword = {name: pytree.tree_map(lambda _: next(counter), value) for name, value in kwargs.items()}
    try:
        bound = inspect.signature(model.forward).bind(*positional, **keyword).arguments
    except TypeError:
        return {}
    found: dict[int, dict[int, Any]] = {}
    for position, (name, indices) in enumerate(bound.items()):
        if isinstance(dynamic_shapes, dict):
            spec = dynamic_shapes.get(name)
        else:
            spec = dynamic_shapes[position] if position < len(dynamic_shapes) else None
        if spec is None:
            continue
        leaves, structure = pytree.tree_flatten(indices)
        try:
            specs = structure.flatten_up_to(spec)
        except Exception:  # noqa: BLE001, S112 - a spec torch.export will reject with its own message
            continue
        for leaf, leaf_spec in zip(leaves, specs):
            axes = _axes_of(leaf_spec)
            if axes:
                found[leaf] = axes
    return found


def resized(tensor: torch.Tensor, axis: int, new: int) -> torch.Tensor:
    """``tensor`` with ``new`` entries along ``axis``, made from its own: the example rows in reverse order,
    repeated, along dim 0 (as :func:`with_batch`), the positions repeated from the first along another dim.

    Example:
        >>> resized(torch.tensor([[1, 2, 3]]), 1, 5).tolist()
        [[1, 2, 3, 1, 2]]
    """
    size = tensor.shape[axis]
    order = [(size - 1 - i) % size for i in range(new)] if axis == 0 else [i % size for i in range(new)]
    return tensor.index_select(axis, torch.tensor(order, device=tensor.device)).contiguous()


def trace_inputs(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> tuple[tuple, dict]:
    """The inputs to trace ``model`` on with ``dynamic_shapes``: torch.export specialises a dim of size 1, so
    every named ``Dim`` that is 1 wherever it appears is grown to 2 there (with :func:`resized`: a batch of
    one becomes two copies of its row, a sequence of one two copies of its position).

    Example:
        >>> seq = torch.export.Dim("seq")
        >>> (x,), _ = trace_inputs(torch.nn.Linear(4, 2), (torch.ones(3, 1, 4),), {}, {"input": {1: seq}})
        >>> x.shape
        torch.Size([3, 2, 4])
    """
    dims = leaf_dims(model, args, kwargs, dynamic_shapes)
    leaves, structure = pytree.tree_flatten((tuple(args), dict(kwargs)))
    sizes: dict[str, set[int]] = collections.defaultdict(set)
    for leaf, axes in dims.items():
        for axis, dim in axes.items():
            if isinstance(dim, torch.export.Dim) and not hasattr(dim, "root"):  # a named dim, not 2 * another
                sizes[dim.__name__].add(int(leaves[leaf].shape[axis]))
    grow = {name for name, seen in sizes.items() if seen == {1}}
    if not grow:
        return tuple(args), dict(kwargs)
    for leaf, axes in dims.items():
        for axis, dim in axes.items():
            if getattr(dim, "__name__", None) in grow and not hasattr(dim, "root"):
                leaves[leaf] = resized(leaves[leaf], axis, 2)
    return pytree.tree_unflatten(leaves, structure)


# ---------------------------------------------------------------------------------------------- refinement

def _dims_in(spec: Any) -> list[Any]:
    if isinstance(spec, dict):
        return [d for value in spec.values() for d in _dims_in(value)]
    if isinstance(spec, (list, tuple)):
        return [d for value in spec for d in _dims_in(value)]
    return [spec] if isinstance(spec, torch.export.Dim) else []


def _map_dims(spec: Any, fn: Any) -> Any:
    """``spec`` with every Dim ``d`` replaced by ``fn(d)``; a per-axis entry that becomes None is dropped."""
    if isinstance(spec, dict):
        mapped = {key: _map_dims(value, fn) for key, value in spec.items()}
        return {k: v for k, v in mapped.items() if v is not None or not isinstance(k, int)}
    if isinstance(spec, (list, tuple)):
        return type(spec)(_map_dims(value, fn) for value in spec)
    return fn(spec) if isinstance(spec, torch.export.Dim) else spec


def suggested_fixes(error: BaseException) -> list[str]:
    """The lines under "Suggested fixes:" in a torch.export constraint violation (``seq = Dim('seq', max=64)``,
    ``n = 8``, ``b = a``), or [].

    Example:
        >>> suggested_fixes(RuntimeError("Constraints violated (seq)!\\nSuggested fixes:\\n  seq = Dim('seq', max=64)\\n\\nmore"))
        ["seq = Dim('seq', max=64)"]
    """
    text = str(error)
    if "Suggested fixes:" not in text:
        return []
    fixes = []
    for line in text.split("Suggested fixes:", 1)[1].splitlines():
        if not line.strip():
            if fixes:
                break
            continue
        if " = " not in line:
            break
        fixes.append(line.strip())
    return fixes


def refined_dynamic_shapes(error: BaseException, dynamic_shapes: Any, required: Any = None) -> Any:
    """``dynamic_shapes`` with torch.export's suggested fixes applied, or None when it suggests none, or fixes
    a dim in ``required`` (default: every dim) to one size.

    Ranges are narrowed (``Dim("seq", max=64)`` for a model with 64 positions; the minimum of 1 is kept) and
    dims the model ties together become one (torch's
    ``torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes``); a dim that is not required
    and that the model needs at one size becomes static.

    Example:
        >>> seq = torch.export.Dim("seq", min=1)
        >>> error = RuntimeError("Suggested fixes:\\n  seq = Dim('seq', max=64)")
        >>> refined_dynamic_shapes(error, {"ids": {1: seq}})
        {'ids': {1: Dim('seq', min=1, max=64)}}
        >>> refined_dynamic_shapes(RuntimeError("Suggested fixes:\\n  seq = 8"), {"ids": {1: seq}}) is None
        True
    """
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    fixes = suggested_fixes(error)
    if not fixes:
        return None
    names = {d.__name__ for d in _dims_in(dynamic_shapes)}
    required = names if required is None else set(required)
    static = {name.strip() for name, expr in (fix.split(" = ", 1) for fix in fixes) if expr.strip().lstrip("-").isdigit()}
    if static & required:
        return None
    spec = _map_dims(dynamic_shapes, lambda d: None if d.__name__ in static else d)
    others = [fix for fix in fixes if fix.split(" = ", 1)[0].strip() not in static]
    if others:
        try:
            spec = refine_dynamic_shapes_from_suggested_fixes("Suggested fixes:\n" + "\n".join(others), spec)
        except Exception:  # noqa: BLE001 - fixes torch cannot apply: the original error stands
            return None
    minimum = {d.__name__: d.min for d in _dims_in(dynamic_shapes) if not hasattr(d, "root")}
    kept: dict[str, Any] = {}

    def keep_minimum(dim: Any) -> Any:
        if hasattr(dim, "root") or dim.__name__ not in minimum or dim.min >= minimum[dim.__name__]:
            return dim
        if dim.__name__ not in kept:
            kept[dim.__name__] = torch.export.Dim(dim.__name__, min=minimum[dim.__name__], max=dim.max)
        return kept[dim.__name__]

    return _map_dims(spec, keep_minimum)


def export_refining(export: Any, dynamic_shapes: Any, refine: Any = False, attempts: int = 4) -> tuple[Any, Any]:
    """``(export(dynamic_shapes), the dynamic_shapes used)``; with ``refine``, a constraint violation is
    answered by trying again with :func:`refined_dynamic_shapes` (``refine``: True, every dim must stay
    dynamic; or the names of those that must), up to ``attempts`` exports in all.

    Raises:
        Exception: what the last export raised.

    Example:
        >>> export_refining(lambda spec: spec, {"x": None})
        ({'x': None}, {'x': None})
    """
    for attempt in range(attempts):
        try:
            return export(dynamic_shapes), dynamic_shapes
        except Exception as error:
            refined = None
            if refine is not False and attempt + 1 < attempts:
                refined = refined_dynamic_shapes(error, dynamic_shapes, None if refine is True else refine)
            if refined is None or refined == dynamic_shapes:
                raise
            dynamic_shapes = refined
    raise AssertionError("unreachable")  # pragma: no cover


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
