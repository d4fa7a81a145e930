"""One row through one op: which ops compute a row of their result from one row of their inputs, and the
arguments that compute only that row (:func:`lift`), for ``cleanup``'s dead rows
(:mod:`fxforge.rewrites.dead_rows`).

Rows move through, on a dimension the op keeps row by row:

- pointwise ops (ATen's ``pointwise`` tag, activations, arithmetic, casts); a broadcast operand is sliced
  only where it spans the dimension;
- ``linear`` and ``matmul`` on any dimension but the last (``matmul``: the left operand's rows, or a batch
  dimension of both), ``layer_norm``/``rms_norm``/``softmax`` over other dimensions;
- views that keep the dimension whole: ``transpose``, ``permute``, ``unsqueeze``, ``squeeze``/``select``/``slice``
  of another dimension, ``view``/``reshape``/``flatten``/``unflatten`` where it is neither merged nor split;
- ``scaled_dot_product_attention`` on its query rows (not causal: a causal row's keys depend on where it
  sits) or on a batch/head dimension of all its operands.

Anything else is a :class:`~fxforge.rewrites.passes.Refusal` with the reason.

Example:
    >>> from fxforge.core.shapes import annotate
    >>> gm = torch.fx.symbolic_trace(lambda x: torch.relu(x)[:, 0])
    >>> _ = annotate(gm, (torch.randn(2, 5, 8),), {})
    >>> relu, read = [n for n in gm.graph.nodes if n.op == "call_function"]
    >>> source, row, keeps_dim = read_row(read)
    >>> source is relu, row
    (True, Row(dim=1, index=0))
    >>> args, kwargs = lift(relu, row, gm)
    >>> args[0].dim
    1
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from fxforge.core.nodes import fake_value, submodule
from fxforge.core.symbolic import size_expr
from fxforge.core.vocabulary import (
    CASTS,
    SDPA_PARAMETERS,
    SDPA_TARGETS,
    argument,
    calls,
    forms,
    op_name,
    sdpa_arguments,
)
from fxforge.rewrites.passes import Refusal

aten = torch.ops.aten

# Canonical ops (core.vocabulary) that compute each element from the same element of their operands.
POINTWISE = ("relu", "hardtanh", "leaky_relu", "gelu", "silu", "sigmoid", "tanh", "hardswish", "add", "sub", "mul",
             "div", "pow", "where", "masked_fill", *CASTS)


# Call forms of the ops this rule reads that core.vocabulary's OPS does not list.
SELECT = forms((aten.select.int, torch.select), ("select",))


SQUEEZE = forms((aten.squeeze.dim, aten.squeeze.dims, torch.squeeze), ("squeeze",))


UNFLATTEN = forms((aten.unflatten.int, torch.unflatten), ("unflatten",))


RMS_NORM = forms((aten.rms_norm, F.rms_norm), (), (torch.nn.RMSNorm,))


LOG_SOFTMAX = forms((F.log_softmax, torch.log_softmax, aten.log_softmax.int, aten._log_softmax.default),
                    ("log_softmax",))


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a value: index ``index`` of dimension ``dim`` (non-negative; the index is non-negative
    wherever the dimension's size is known).

    Example:
        >>> Row(1, -1).bounds()
        (-1, None)
    """

    dim: int
    index: int

    def bounds(self) -> tuple[int, int | None]:
        """``(start, end)`` of the one-row slice."""
        return self.index, (None if self.index == -1 else self.index + 1)


@dataclasses.dataclass(frozen=True)
class Sliced:
    """An operand of a lifted op that is to be read at one row of dimension ``dim``.

    Example:
        >>> x = torch.fx.Graph().placeholder("x")
        >>> Sliced(x, 1).dim
        1
    """

    value: Node
    dim: int


def _known_equal(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or symbolic) are equal for every value of the symbols, compared as the project
    compares sizes (:func:`~fxforge.core.symbolic.size_expr`: no guard added to a symbolic graph)."""
    return size_expr(a) == size_expr(b)


def _rank(node: Any) -> int | None:
    value = fake_value(node)
    return None if value is None else value.dim()


def _row_of(node: Node, dim: int, index: int) -> Row | None:
    value = fake_value(node)
    if value is None or not -value.dim() <= dim < value.dim():
        return None
    dim %= value.dim()
    size = value.shape[dim]
    if isinstance(size, int):
        if not -size <= index < size:
            return None
        index %= size
    return Row(dim, index)


def read_row(node: Node) -> tuple[Node, Row, bool] | None:
    """``(source, row, keeps_dim)`` when ``node`` reads exactly one row of ``source``: ``select``
    (``x[:, 0]``, ``x.select(1, 0)``) or a one-row ``aten.slice`` (as this rule writes them), else None.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.empty(2, 5, 8)
        >>> read_row(g.call_function(operator.getitem, (x, (slice(None), -1))))[1:]
        (Row(dim=1, index=4), False)
    """
    if node.op == "call_function" and node.target is aten.slice.Tensor:
        source, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
        if not isinstance(source, Node) or step != 1 or not isinstance(start, int):
            return None
        if end is not None and (not isinstance(end, int) or end != start + 1 or start == -1):
            return None
        if end is None and start != -1:
            return None
        row = _row_of(source, dim, start)
        return (source, row, True) if row is not None else None
    if SELECT.called_by(node):
        source, dim, index = node.args[0], argument(node, 1, "dim"), argument(node, 2, "index")
    elif node.op == "call_function" and node.target is operator.getitem:
        source, key = node.args
        keys = key if isinstance(key, tuple) else (key,)
        ints = [i for i, k in enumerate(keys) if isinstance(k, int) and not isinstance(k, bool)]
        if len(ints) != 1 or any(k != slice(None) for i, k in enumerate(keys) if i != ints[0]):
            return None
        dim, index = ints[0], keys[ints[0]]
    else:
        return None
    if not isinstance(source, Node) or not isinstance(dim, int) or not isinstance(index, int):
        return None
    row = _row_of(source, dim, index)
    return (source, row, False) if row is not None else None


def _operand(value: Any, out_rank: int, out_size: Any, dim: int) -> Any:
    """A broadcast operand of a pointwise op read at the result's row ``dim``: sliced where it spans the
    dimension, itself where it broadcasts along it (or is no tensor)."""
    tensor = fake_value(value)
    if tensor is None:
        return value if not isinstance(value, Node) else Refusal(f"no shape metadata for {value.name}")
    aligned = dim - (out_rank - tensor.dim())
    if aligned < 0 or _known_equal(tensor.shape[aligned], 1):
        return value
    if _known_equal(tensor.shape[aligned], out_size):
        return Sliced(value, aligned)
    return Refusal(f"{value.name}'s size along the dimension is not known to be 1 or the result's")


def _pointwise(node: Node, dim: int, value: torch.Tensor) -> tuple | Refusal:
    casts = calls(node, *CASTS)

    def operand(position: int | str, arg: Any) -> Any:
        if casts and position not in (0, "input", "self"):
            return arg
        return _operand(arg, value.dim(), value.shape[dim], dim)

    args = tuple(operand(i, a) for i, a in enumerate(node.args))
    kwargs = {k: operand(k, a) for k, a in node.kwargs.items()}
    refusal = next((a for a in (*args, *kwargs.values()) if isinstance(a, Refusal)), None)
    return refusal or (args, kwargs)


def _first(node: Node, dim: int) -> tuple:
    return (Sliced(node.args[0], dim), *node.args[1:]), dict(node.kwargs)


def _normalized_dims(node: Node, gm: torch.fx.GraphModule) -> int | None:
    """How many trailing dimensions a layer_norm/rms_norm normalizes."""
    if node.op == "call_module":
        shape = getattr(submodule(node, gm), "normalized_shape", None)
    else:
        shape = argument(node, 1, "normalized_shape")
    if isinstance(shape, int):
        return 1
    return len(shape) if isinstance(shape, (tuple, list, torch.Size)) else None


def _sizes(node: Node) -> tuple[str, list | Node] | None:
    """Where a view/reshape's sizes are (``"shape"``: a keyword; ``"list"``: one argument after the input;
    ``"varargs"``: the arguments after the input) and the sizes (a list, or one node computing them:
    ``x.reshape(y.shape)``); None for the forms that take another tensor's shape (``view_as``...)."""
    if node.op == "call_method":
        if node.target not in ("view", "reshape") or node.kwargs:
            return None
        rest = list(node.args[1:])
        if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size, Node)):
            return "list", rest[0] if isinstance(rest[0], Node) else list(rest[0])
        return "varargs", rest
    shape = argument(node, 1, "shape")
    where = "shape" if "shape" in node.kwargs else "list"
    if isinstance(shape, Node):
        return where, shape
    return (where, list(shape)) if isinstance(shape, (list, tuple, torch.Size)) else None


@dataclasses.dataclass(frozen=True)
class SizesWithRow:
    """The sizes a node computes (``y.shape``) with the size at ``dim`` made 1: placed as one ``getitem`` of
    the node per other dimension.

    Example:
        >>> shape = torch.fx.Graph().placeholder("shape")
        >>> SizesWithRow(shape, rank=3, dim=1).rank
        3
    """

    sizes: Node
    rank: int
    dim: int


def _kept_whole(before: tuple, after: tuple, dim: int) -> int | None:
    """The dimension of ``before`` that ``after``'s dimension ``dim`` is when a reshape neither merges nor splits
    it (the same size, with the same number of elements before it), else None."""
    prefix = math.prod(after[:dim])
    seen = 1
    for e, size in enumerate(before):
        if _known_equal(seen, prefix) and _known_equal(size, after[dim]):
            return e
        seen = seen * size
    return None


def _reshape(node: Node, dim: int, source: torch.Tensor, value: torch.Tensor) -> tuple | Refusal:
    sizes = _sizes(node)
    if sizes is None:
        return Refusal("a view whose shape is another tensor's")
    kept = _kept_whole(tuple(source.shape), tuple(value.shape), dim)
    if kept is None:
        return Refusal("the reshape merges or splits the dimension")
    where, shape = sizes
    if isinstance(shape, Node):
        new: Any = SizesWithRow(shape, value.dim(), dim)
    elif len(shape) != value.dim():
        return Refusal("the reshape's sizes do not line up with its result")
    else:
        new = [1 if i == dim and not (isinstance(size, int) and size == -1) else size for i, size in enumerate(shape)]
        if where == "list" and isinstance(node.args[1], tuple):
            new = tuple(new)
    args, kwargs = (Sliced(node.args[0], kept), *node.args[1:]), dict(node.kwargs)
    if where == "shape":
        kwargs["shape"] = new
    elif where == "list":
        args = (args[0], new, *args[2:])
    else:
        args = (args[0], *new)
    return args, kwargs


def _view_source_dim(node: Node, dim: int, source: torch.Tensor, value: torch.Tensor) -> int | Refusal | None:
    """The input dimension that a layout op's result dimension ``dim`` is (None: not a layout op)."""
    rank_in, rank_out = source.dim(), value.dim()
    if calls(node, "transpose"):
        a, b = (argument(node, 1, "dim0") % rank_in, argument(node, 2, "dim1") % rank_in)
        return b if dim == a else a if dim == b else dim
    if calls(node, "permute"):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        dims = argument(node, 1, "dims") if not dims else dims
        return list(dims)[dim] % rank_in
    if calls(node, "t"):
        return (1 - dim) if rank_in == 2 else dim
    if calls(node, "mT"):
        return {rank_in - 1: rank_in - 2, rank_in - 2: rank_in - 1}.get(dim, dim)
    if calls(node, "unsqueeze"):
        k = argument(node, 1, "dim") % rank_out
        return Refusal("the dimension is the one unsqueeze adds") if dim == k else (dim if dim < k else dim - 1)
    if SQUEEZE.called_by(node):
        squeezed = argument(node, 1, "dim")
        if squeezed is None:
            return Refusal("squeeze of every size-1 dimension would squeeze the row's too")
        squeezed = sorted(d % rank_in for d in (squeezed if isinstance(squeezed, (list, tuple)) else [squeezed])
                          if _known_equal(source.shape[d % rank_in], 1))
        kept = [d for d in range(rank_in) if d not in squeezed]
        return kept[dim]
    if SELECT.called_by(node):
        k = argument(node, 1, "dim") % rank_in
        return dim if dim < k else dim + 1
    if node.op == "call_function" and node.target is aten.slice.Tensor:
        along = argument(node, 1, "dim", 0) % rank_in
        return dim if along != dim else Refusal("a slice of several rows of the dimension")
    if calls(node, "flatten"):
        start = argument(node, 1, "start_dim", 0) % rank_in
        end = argument(node, 2, "end_dim", -1) % rank_in
        if dim < start or start == end:
            return dim if dim <= start else dim + (end - start)
        if dim > start:
            return dim + (end - start)
        return Refusal("flatten merges the dimension")
    if UNFLATTEN.called_by(node):
        k, sizes = argument(node, 1, "dim") % rank_in, argument(node, 2, "sizes")
        if dim < k:
            return dim
        if dim >= k + len(sizes):
            return dim - len(sizes) + 1
        return Refusal("unflatten splits the dimension")
    return None


def _sdpa(node: Node, dim: int, value: torch.Tensor) -> tuple | Refusal:
    args = sdpa_arguments(node)
    if args.get("is_causal"):
        return Refusal("causal attention: a query row's keys depend on its position")
    rank = value.dim()
    mask = args.get("attn_mask")
    if dim == rank - 2:
        args["query"] = Sliced(args["query"], _rank(args["query"]) - 2)
        if isinstance(mask, Node):
            args["attn_mask"] = _operand(mask, rank, value.shape[dim], dim)
    elif args.get("enable_gqa"):
        return Refusal("grouped-query attention: query and key heads differ")
    else:
        for name in ("query", "key", "value", "attn_mask"):
            if isinstance(args.get(name), Node):
                args[name] = _operand(args[name], rank, value.shape[dim], dim)
    refusal = next((a for a in args.values() if isinstance(a, Refusal)), None)
    if refusal is not None:
        return refusal
    positional = len(node.args)
    return (tuple(args[n] for n in SDPA_PARAMETERS[:positional]),
            {n: args[n] for n in SDPA_PARAMETERS[positional:] if n in node.kwargs})


def _matmul(node: Node, dim: int, value: torch.Tensor) -> tuple | Refusal:
    left, right = node.args[0], node.args[1]
    rank = value.dim()
    left_rank, right_rank = _rank(left), _rank(right)
    if left_rank is None or right_rank is None:
        return Refusal("no shape metadata for matmul's operands")
    if dim == rank - 1 or left_rank < 2 or right_rank < 2:
        return Refusal("the dimension is matmul's columns, or an operand is a vector")
    if dim == rank - 2:
        return (Sliced(left, left_rank - 2), right, *node.args[2:]), dict(node.kwargs)
    operands = [_operand(o, rank, value.shape[dim], dim) for o in (left, right)]
    refusal = next((o for o in operands if isinstance(o, Refusal)), None)
    return refusal or ((*operands, *node.args[2:]), dict(node.kwargs))


def lift(node: Node, row: Row, gm: torch.fx.GraphModule) -> tuple[tuple, dict] | Refusal:
    """``node``'s arguments for computing only ``row`` of its result, each operand to read at one row
    wrapped in :class:`Sliced`; or the :class:`Refusal` that keeps the row below ``node``. Effects (mutation,
    random numbers such as an attention's dropout, opaque modules) are the caller's to check:
    :func:`remove_dead_rows` lifts only nodes :func:`~fxforge.core.nodes.is_effectful` clears.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.empty(2, 5, 8)
        >>> y = g.call_function(torch.softmax, (x, -1)); y.meta["val"] = torch.empty(2, 5, 8)
        >>> lift(y, Row(1, 0), None)[0]
        (Sliced(value=x, dim=1), -1)
    """
    value = fake_value(node)
    if value is None or node.op not in ("call_function", "call_method", "call_module"):
        return Refusal("no shape metadata")
    dim, rank = row.dim, value.dim()
    source = fake_value(node.args[0]) if node.args else None
    name = op_name(node, gm)
    if node.op == "call_module":
        if name in POINTWISE:
            return _first(node, dim)
        if name == "linear" and dim < rank - 1:
            return _first(node, dim)
        module = submodule(node, gm)
        norms = _normalized_dims(node, gm) if name == "layer_norm" or RMS_NORM.called_by(node, gm) else None
        if norms is not None and dim < rank - norms:
            return _first(node, dim)
        return Refusal(f"{type(module).__name__} is not known to compute rows independently")
    if node.op == "call_function" and node.target in SDPA_TARGETS:
        return _sdpa(node, dim, value)
    if name == "matmul":
        return _matmul(node, dim, value)
    if name == "linear":
        return _first(node, dim) if dim < rank - 1 else Refusal("the dimension is linear's features")
    if name == "layer_norm" or RMS_NORM.called_by(node):
        norms = _normalized_dims(node, gm)
        if norms is None or dim >= rank - norms:
            return Refusal("the norm normalizes over the dimension")
        return _first(node, dim)
    if name == "softmax" or LOG_SOFTMAX.called_by(node):
        along = argument(node, 1, "dim")
        if not isinstance(along, int) or along % rank == dim:
            return Refusal("softmax along the dimension")
        return _first(node, dim)
    if name in POINTWISE or (isinstance(node.target, torch._ops.OpOverload)
                             and torch.Tag.pointwise in node.target.tags):
        return _pointwise(node, dim, value)
    if source is None:
        return Refusal(f"{node.name} is not known to compute rows independently")
    if name in ("view", "reshape"):
        return _reshape(node, dim, source, value)
    kept = _view_source_dim(node, dim, source, value)
    if isinstance(kept, Refusal):
        return kept
    if kept is None:
        return Refusal(f"{node.name} is not known to compute rows independently")
    return _first(node, kept)
