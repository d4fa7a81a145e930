"""Masks built from index ranges, read for every size: the causal proof where sizes are symbolic.

In a graph specialised to one input signature, a mask computed from sizes is a constant
(:class:`~fxforge.rewrites.attention.constants.Constants` computes it and compares it with ``tril``). In a
shape-generic graph its sizes are symbols, so no value can be computed; but a mask built from ``arange``
(transformers' ``kv_idx <= q_idx``, ``arange(S)[:, None] >= arange(S)``) can be read as a formula over
index positions and proven causal for every size.

An integer tensor built from ``arange`` reads as an ``Index`` (a formula over index positions), a boolean
one as a ``Keep`` (a conjunction of conditions on formulas), an additive mask ``where(keep, 0, -inf)`` as an
``Additive`` of its keep; :mod:`fxforge.rewrites.attention.index_formulas` says what they mean and proves
what they keep. Views that only add, drop or broadcast size-1 dims, full slices and casts keep the formula;
anything else reads as None (not proven). Ops are recognised by their names in :mod:`fxforge.core.vocabulary`,
in any call form.

Example:
    >>> from fxforge.core.shapes import annotate
    >>> def mask(q):
    ...     i = torch.arange(q.size(-2))
    ...     return i[None, :] <= i[:, None]   # key index <= query index: causal
    >>> gm = torch.fx.symbolic_trace(mask)
    >>> _ = annotate(gm, (torch.ones(4, 4),), {})
    >>> keep = read_mask(gm.graph.output_node().args[0])
    >>> keep.conditions
    ((Index(rank=2, terms=((-2, -1), (-1, 1)), offset=0), 'le'),)
    >>> is_causal(keep)
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import fake_value
from fxforge.core.vocabulary import COMPARISONS, COPIES, calls
from fxforge.rewrites.attention.index_formulas import (
    LARGE_NEGATIVE,
    Additive,
    Index,
    Keep,
    always_true,
    hides,
    holds_everywhere,
    is_causal,
    negated,
    python_number,
    terms_of,
)

# The formulas' names, read here by the other attention modules too.
__all__ = ["LARGE_NEGATIVE", "Additive", "Index", "Keep", "causal_for_every_size", "hides", "holds_everywhere",
           "is_causal", "negated", "python_number", "read", "read_mask"]

aten = torch.ops.aten
_SLICE_END = 2 ** 62


def _number(value: Any) -> Any:
    """An int, or a size expression of a symbolic int (node or value); None for anything else."""
    if isinstance(value, Node):
        value = value.meta.get("val")
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return None


def _is_zeros(value: Any) -> bool:
    if python_number(value) == 0.0:
        return True
    return calls(value, "zeros")


def _shape(node: Node) -> tuple | None:
    value = fake_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _same_size(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or symbolic ints) are equal for every value of the symbols."""
    return _number(a) is not None and _number(a) == _number(b)


def read(node: Any, seen: dict | None = None) -> Index | Keep | Additive | None:
    """``node`` as an :class:`Index`, :class:`Keep` or :class:`Additive`, or None when it is not built from
    index ranges by the ops this module reads."""
    seen = {} if seen is None else seen
    if not isinstance(node, Node):
        return None
    if node not in seen:
        seen[node] = None  # (a cycle reads as None)
        seen[node] = _read(node, seen)
    return seen[node]


def _rank(node: Node) -> int | None:
    shape = _shape(node)
    return None if shape is None else len(shape)


def _read(node: Node, seen: dict) -> Index | Keep | Additive | None:
    if node.op not in ("call_function", "call_method"):
        return None
    target, args = node.target, node.args
    if calls(node, "arange"):
        return _arange(node)
    if calls(node, "ones"):
        value = fake_value(node)  # a boolean tensor of ones: true everywhere
        return Keep(value.ndim, ()) if isinstance(value, torch.Tensor) and value.dtype == torch.bool else None
    for op in COMPARISONS:
        if calls(node, op):
            return _compare(op, read(args[0], seen), args[1], seen, node)
    if calls(node, "add", "sub") and len(args) == 2 and node.kwargs.get("alpha", 1) == 1:
        return _add(read(args[0], seen), args[1], seen, sign=-1 if calls(node, "sub") else 1)
    if calls(node, "mul") and len(args) == 2:
        left = read(args[0], seen)
        factor = _number(args[1])
        return left.times(factor) if isinstance(left, Index) and isinstance(factor, int) else None
    if calls(node, "logical_and") and len(args) == 2:
        a, b = read(args[0], seen), read(args[1], seen)
        if isinstance(a, Keep) and isinstance(b, Keep):
            return Keep(max(a.rank, b.rank), a.conditions + b.conditions)
        return None
    if calls(node, "logical_not"):
        inner = read(args[0], seen)
        return negated(inner) if isinstance(inner, Keep) else None
    if calls(node, "where") and len(args) == 3:
        keep = read(args[0], seen)
        if isinstance(keep, Keep) and _is_zeros(args[1]) and hides(args[2]):
            return Additive(keep)
        return None
    if calls(node, "masked_fill") and len(args) == 3:
        hidden = read(args[1], seen)
        keep = negated(hidden) if isinstance(hidden, Keep) else None
        return Additive(keep) if keep is not None and _is_zeros(args[0]) and hides(args[2]) else None
    if target in (aten.diff.default, torch.diff):
        return _diff(node, seen)
    if target in (aten.cumsum.default, torch.cumsum):
        return _cumsum(node, seen)
    if target is aten.index.Tensor and len(args) == 2:
        return _indexed(node, seen)
    return _moved(node, seen)


# transformers' packed-sequence detection, run when a decoder gets no attention mask: position ids that do not
# step by 1 start a new sequence (``cumsum(diff(positions, prepend=positions[:, :1] - 1) != 1)``), and a key
# is kept only within its query's sequence. With positions from ``arange`` every step is 1, so there is one
# sequence: the functions below read that as a formula, for every size.

def _diff(node: Node, seen: dict) -> Index | None:
    """``diff(x, 1, dim, prepend=p)`` of an index formula stepping by ``c`` along ``dim``, where ``p`` is the
    formula's value one step before the first position: ``c`` everywhere (a constant)."""
    args = list(node.args) + [None] * (5 - len(node.args))
    x, n, dim, prepend, append = args[:5]
    n, dim = node.kwargs.get("n", 1 if n is None else n), node.kwargs.get("dim", -1 if dim is None else dim)
    prepend, append = node.kwargs.get("prepend", prepend), node.kwargs.get("append", append)
    formula, before = read(x, seen), read(prepend, seen) if isinstance(prepend, Node) else None
    rank = _rank(node)
    if n != 1 or append is not None or not isinstance(formula, Index) or not isinstance(before, Index) or rank is None:
        return None
    d = dim - rank if dim >= 0 else dim
    terms = dict(formula.terms)
    step = terms.pop(d, 0)
    if dict(before.terms) != terms or before.offset != formula.offset - step:
        return None
    return Index(rank, (), step)


def _never(keep: Keep) -> bool:
    """Whether some condition of ``keep`` compares a constant in a way that never holds."""
    return any(not diff.terms and isinstance(diff.offset, int) and not always_true(diff, op)
               for diff, op in keep.conditions)


def _cumsum(node: Node, seen: dict) -> Index | None:
    """The running sum of a mask that never holds, or of zeros: zeros."""
    inner, rank = read(node.args[0], seen), _rank(node)
    if rank is None:
        return None
    if (isinstance(inner, Keep) and _never(inner)) or (isinstance(inner, Index) and not inner.terms
                                                        and inner.offset == 0):
        return Index(rank, (), 0)
    return None


def _indexed(node: Node, seen: dict) -> Index | Keep | None:
    """``x[i0, i1, ...]`` with an index tensor for every dim of ``x``, each a non-negative index formula: the
    formula of ``x`` at those positions (``x``'s coefficient on dim ``j`` times ``i_j``)."""
    source, indices = node.args
    inner, rank, source_rank = read(source, seen), _rank(node), _rank(source)
    if inner is None or rank is None or source_rank is None or len(indices) != source_rank:
        return None
    positions = [read(i, seen) for i in indices]
    if not all(isinstance(i, Index) and isinstance(i.offset, int) and i.offset >= 0
               and all(c >= 0 for _, c in i.terms) for i in positions):
        return None  # (negative positions would count from the end)

    def at(formula: Index) -> Index:
        terms: dict[int, int] = {}
        offset = formula.offset
        coefficient = dict(formula.terms)
        for j, position in enumerate(positions):
            c = coefficient.get(j - source_rank, 0)
            for d, k in position.terms:
                terms[d] = terms.get(d, 0) + c * k
            offset = offset + c * position.offset
        return Index(rank, terms_of(terms), offset)

    return None if isinstance(inner, Additive) else _mapped(inner, at, rank)


def _arange(node: Node) -> Index | None:
    args = list(node.args)
    if node.kwargs.get("start") is not None or node.kwargs.get("step") is not None:
        return None
    start, step = 0, 1
    if node.target in (aten.arange.start, aten.arange.start_step) or (node.target is torch.arange and len(args) >= 2):
        start = _number(args[0])
        step = _number(args[2]) if len(args) > 2 else 1
    if start is None or not isinstance(step, int) or step == 0:
        return None
    dtype = getattr(fake_value(node), "dtype", None)  # (a dtype argument may be a graph value: q.dtype)
    if dtype is None or dtype.is_floating_point:
        return None
    return Index(1, ((-1, step),), start)


def _operand(value: Any, seen: dict) -> Index | None:
    """The right operand of an add or a comparison as an :class:`Index`: one read from index ranges, or a size
    (an int or a symbolic one) as a constant of rank 0."""
    read_value = read(value, seen) if isinstance(value, Node) else None
    if isinstance(read_value, Index):
        return read_value
    number = _number(value) if read_value is None else None
    return None if number is None else Index(0, (), number)


def _compare(op: str, left: Any, right: Any, seen: dict, node: Node) -> Keep | None:
    right_index, rank = _operand(right, seen), _rank(node)
    if not isinstance(left, Index) or right_index is None or rank is None:
        return None
    return Keep(rank, ((left.plus(right_index.times(-1)), op),))


def _add(left: Any, right: Any, seen: dict, sign: int) -> Index | None:
    right_index = _operand(right, seen)
    if not isinstance(left, Index) or right_index is None:
        return None
    return left.plus(right_index.times(sign))


def _moved(node: Node, seen: dict) -> Index | Keep | Additive | None:
    """Views, slices and casts that keep every element's formula: dims of size 1 added, dropped or broadcast."""
    source = node.args[0] if node.args else None
    inner = read(source, seen)
    if inner is None or not isinstance(source, Node):
        return None
    if calls(node, *COPIES):
        return inner
    if calls(node, "to"):
        def kind(dtype: Any) -> str:  # a cast within bools or within integers keeps every value
            if dtype == torch.bool:
                return "bool"
            return "int" if dtype is not None and not (dtype.is_floating_point or dtype.is_complex) else "other"

        cast = kind(getattr(fake_value(node), "dtype", None))
        return inner if cast == kind(getattr(fake_value(source), "dtype", None)) != "other" else None
    before, after = _shape(source), _shape(node)
    if before is None or after is None:
        return None
    if calls(node, "slice", "getitem"):
        if calls(node, "slice"):
            start = node.args[2] if len(node.args) > 2 else 0
            end = node.args[3] if len(node.args) > 3 else None
            step = node.args[4] if len(node.args) > 4 else 1
            if start in (0, None) and step == 1 and end == 1:  # the first position only: its index is 0 there
                return _first_position(inner, node.args[1] - len(before) if node.args[1] >= 0 else node.args[1])
            if start not in (0, None) or step != 1 or not (end is None or (isinstance(end, int) and end >= _SLICE_END)
                                                          or _same_size(end, before[node.args[1]])):
                return None
        elif not _plain_index(node.args[1]):
            return None
    elif not calls(node, "unsqueeze", "view", "reshape", "expand"):
        return None
    return _relaid(inner, before, after)


def _first_position(value: Index | Keep | Additive, dim: int) -> Index | Keep | Additive | None:
    """``value`` sliced to its first position along ``dim`` (counted from the right): that dim's term drops."""
    def index(ix: Index) -> Index:
        return Index(ix.rank, tuple((d, c) for d, c in ix.terms if d != dim), ix.offset)

    rank = value.rank if not isinstance(value, Additive) else value.keep.rank
    return _mapped(value, index, rank)


def _mapped(value: Index | Keep | Additive, index: Any, rank: int) -> Index | Keep | Additive | None:
    """``value`` with ``index`` (an :class:`Index` -> :class:`Index` or None) applied to its formula, or to
    each condition's formula (a :class:`Keep` of ``rank``, or an :class:`Additive` of one); None when
    ``index`` gives None for one."""
    if isinstance(value, Index):
        return index(value)
    keep = value.keep if isinstance(value, Additive) else value
    conditions = []
    for diff, op in keep.conditions:
        moved = index(diff)
        if moved is None:
            return None
        conditions.append((moved, op))
    new_keep = Keep(rank, tuple(conditions))
    return Additive(new_keep) if isinstance(value, Additive) else new_keep


def _plain_index(index: Any) -> bool:
    """``x[:, None]``-style indexing: full slices, None and Ellipsis only."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in items)


def _relaid(value: Index | Keep | Additive, before: tuple, after: tuple) -> Index | Keep | Additive | None:
    """``value`` of shape ``before`` seen with shape ``after``, where the two differ only by dims of size 1."""
    def non_one(shape: tuple) -> list[int]:
        return [i for i, size in enumerate(shape) if not (isinstance(size, int) and size == 1)]

    old, new = non_one(before), non_one(after)
    if len(old) != len(new) or not all(_same_size(before[a], after[b]) for a, b in zip(old, new)):
        # broadcasting (expand) of size-1 dims keeps the formula: the leading dims of ``after`` are new
        if len(after) < len(before) or not all(
                isinstance(b, int) and b == 1 or _same_size(b, a)
                for b, a in zip(before, after[len(after) - len(before):])):
            return None
        old = list(range(len(before)))
        new = [len(after) - len(before) + i for i in old]
    where = {a - len(before): b - len(after) for a, b in zip(old, new)}  # from the right, before -> after

    def index(ix: Index) -> Index | None:
        terms = {}
        for d, c in ix.terms:
            if d not in where:
                if isinstance(before[d], int) and before[d] == 1:
                    continue  # an index over a dim of size 1 is always 0
                return None
            terms[where[d]] = c
        return Index(len(after), terms_of(terms), ix.offset)

    return _mapped(value, index, len(after))


def read_mask(node: Any) -> Keep | Additive | None:
    """``node`` read as a boolean mask (:class:`Keep`) or an additive one (:class:`Additive`), or None."""
    value = read(node)
    return value if isinstance(value, (Keep, Additive)) else None


def causal_for_every_size(masks: list[Any], scores: Node) -> bool:
    """Whether the masks (nodes: boolean keep-masks, or additive masks) together keep exactly the lower
    triangle of ``scores`` [.., L, S] for every size, with L and S the same size.

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> def scores_and_mask(q):
        ...     i = torch.arange(q.size(-2))
        ...     return q @ q.mT, torch.where(i[None, :] <= i[:, None], 0.0, float("-inf"))
        >>> gm = torch.fx.symbolic_trace(scores_and_mask)
        >>> _ = annotate(gm, (torch.ones(4, 4),), {})
        >>> scores, mask = gm.graph.output_node().args[0]
        >>> causal_for_every_size([mask], scores)
        True
    """
    shape = _shape(scores)
    if shape is None or len(shape) < 2 or not _same_size(shape[-1], shape[-2]):
        return False
    conditions: list = []
    for mask in masks:
        value = mask if isinstance(mask, Keep) else read_mask(mask)
        if value is None:
            return False
        conditions.extend((value.keep if isinstance(value, Additive) else value).conditions)
    return is_causal(Keep(len(shape), tuple(conditions)))
