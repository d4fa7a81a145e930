"""Which input dims an export keeps dynamic: the batch and the sequence dims, the dims that changed between
two calls, and the inputs to trace on so that torch.export does not specialise a dim of size 1.

:func:`batch_size` and :func:`sequence_length` read the inputs (:mod:`fxforge.core.sequence_dims`);
:func:`batch_dynamic_shapes` and :func:`sequence_dynamic_shapes` make torch.export's ``dynamic_shapes`` for
them, :func:`changed_dynamic_shapes` for the dims that changed (``torch.compile``'s automatic dynamic);
:func:`leaf_dims` reads a spec back per input tensor, :func:`image_siblings` widens a changed image dim to all
its spatial dims, and :func:`trace_inputs` / :func:`with_batch` /
:func:`resized` grow size-1 dims to trace on.

Example:
    >>> ids = torch.ones(2, 7, dtype=torch.long)
    >>> batch_size((ids,), {}), sequence_length((ids,), {})
    (2, 7)
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.core.sequence_dims import BATCH, SEQUENCE, batch_and_sequence, sequence_axes


def batch_size(args: tuple, kwargs: dict) -> int | None:
    """The batch size: the most common dim 0 among the input tensors (None without any).

    Example:
        >>> batch_size((torch.ones(4, 3), torch.ones(4)), {"mask": torch.ones(1, 9)})
        4
    """
    return batch_and_sequence(_leaves(args, kwargs))[0]


def image_siblings(shape: Any, dtype: torch.dtype, axes: set[int]) -> set[int]:
    """``axes`` with an image's other spatial dims: a floating-point input of rank >= 4 whose H or W (or D)
    changed gets all of them, since the next call that changes one of them is as likely to change the others
    (one re-plan, or one export, serves every image size instead of one per dim that changes next).

    Example:
        >>> sorted(image_siblings((2, 3, 64, 48), torch.float32, {3}))
        [2, 3]
        >>> sorted(image_siblings((2, 12, 6), torch.float32, {1})), sorted(image_siblings((2, 3, 8, 8), torch.int64, {2}))
        ([1], [2])
    """
    if dtype.is_floating_point and len(shape) >= 4 and any(axis >= 2 for axis in axes):
        return set(axes) | set(range(2, len(shape)))
    return set(axes)


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
