"""Masks built from index ranges, read for every size: the causal proof where sizes are symbolic.

In a graph specialised to one input signature, a mask computed from sizes is a constant
(:class:`~fxforge.rewrites.attention.constants.Constants` computes it and compares it with ``tril``). In a
shape-generic graph its sizes are symbols, so no value can be computed; but a mask built from ``arange``
(transformers' ``kv_idx <= q_idx``, ``arange(S)[:, None] >= arange(S)``) can be read as a formula over
index positions and proven causal for every size.

An integer tensor built from ``arange`` is an :class:`Index`: its element at position ``p`` is
``offset + sum(coefficient[d] * p[d])``, dims counted from the right (-1 is the last), which is what
broadcasting aligns. A boolean tensor is a :class:`Keep`: the conjunction of conditions ``diff <op> 0`` on
such formulas. An additive mask ``where(keep, 0, -inf)`` is an :class:`Additive` of its keep. Views that
only add, drop or broadcast size-1 dims, full slices and casts keep the formula; anything else reads as
None (not proven).

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

import dataclasses
import math
import operator
from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import fake_value
from fxforge.core.vocabulary import calls

aten = torch.ops.aten
# A fill or additive value at or below this hides a key (see :mod:`fxforge.rewrites.attention`).
LARGE_NEGATIVE = -1e4

_COMPARISONS = {
    "le": (operator.le, torch.le, aten.le.Tensor, aten.le.Scalar),
    "lt": (operator.lt, torch.lt, aten.lt.Tensor, aten.lt.Scalar),
    "ge": (operator.ge, torch.ge, aten.ge.Tensor, aten.ge.Scalar),
    "gt": (operator.gt, torch.gt, aten.gt.Tensor, aten.gt.Scalar),
    "eq": (operator.eq, torch.eq, aten.eq.Tensor, aten.eq.Scalar),
    "ne": (operator.ne, torch.ne, aten.ne.Tensor, aten.ne.Scalar),
}
_METHOD_COMPARISONS = {"le": "le", "lt": "lt", "ge": "ge", "gt": "gt", "eq": "eq", "ne": "ne", "__le__": "le",
                       "__lt__": "lt", "__ge__": "ge", "__gt__": "gt", "__eq__": "eq", "__ne__": "ne"}
_NEGATED = {"le": "gt", "lt": "ge", "ge": "lt", "gt": "le", "eq": "ne", "ne": "eq"}
_ARANGE = (torch.arange, aten.arange.default, aten.arange.start, aten.arange.start_step)
_NOT = (torch.logical_not, torch.bitwise_not, operator.invert, aten.logical_not.default,
        aten.bitwise_not.default)
_ZEROS = (torch.zeros, aten.zeros.default, torch.zeros_like, aten.zeros_like.default, aten.new_zeros.default)
_ONES = (torch.ones, aten.ones.default, torch.ones_like, aten.ones_like.default, aten.new_ones.default)
_SAME_VALUES = (aten.lift_fresh_copy.default, aten.detach.default, aten.alias.default, torch.Tensor.detach)
_SLICE_END = 2 ** 62


@dataclasses.dataclass(frozen=True)
class Index:
    """An integer tensor of rank ``rank`` whose element at position ``p`` is
    ``offset + sum(c * p[d] for d, c in terms)`` (``d`` counted from the right)."""

    rank: int
    terms: tuple[tuple[int, int], ...]
    offset: Any = 0

    def plus(self, other: Index) -> Index:
        terms = dict(self.terms)
        for d, c in other.terms:
            terms[d] = terms.get(d, 0) + c
        return Index(max(self.rank, other.rank), _terms(terms), self.offset + other.offset)

    def times(self, factor: int) -> Index:
        return Index(self.rank, _terms({d: c * factor for d, c in self.terms}), self.offset * factor)


@dataclasses.dataclass(frozen=True)
class Keep:
    """A boolean tensor of rank ``rank``: True where every condition ``(diff, op)`` holds (``diff op 0``)."""

    rank: int
    conditions: tuple[tuple[Index, str], ...]


@dataclasses.dataclass(frozen=True)
class Additive:
    """An additive mask: 0 where ``keep`` holds, a value that hides the key elsewhere."""

    keep: Keep


def _terms(terms: dict[int, int]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted((d, c) for d, c in terms.items() if c != 0))


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


def python_number(value: Any) -> float | None:
    """A Python int or float as a float; None for anything else (graph values, bools).

    Example:
        >>> python_number(2), python_number(True), python_number("2")
        (2.0, None, None)
    """
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def hides(value: Any) -> bool:
    """Whether ``value``, a Python number, hides a key as a fill or an additive mask: ``-inf`` or at most
    :data:`LARGE_NEGATIVE`.

    Example:
        >>> hides(float("-inf")), hides(-1e9), hides(-5.0), hides(float("nan"))
        (True, True, False, False)
    """
    number = python_number(value)
    return number is not None and (number == -math.inf or number <= LARGE_NEGATIVE)


def _is_zeros(value: Any) -> bool:
    if python_number(value) == 0.0:
        return True
    return isinstance(value, Node) and (value.target in _ZEROS or (
        value.op == "call_method" and value.target in ("new_zeros", "zero_")))


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
    if target in _ARANGE:
        return _arange(node)
    if target in _ONES or (node.op == "call_method" and target == "new_ones"):
        value = fake_value(node)  # a boolean tensor of ones: true everywhere
        return Keep(value.ndim, ()) if isinstance(value, torch.Tensor) and value.dtype == torch.bool else None
    if node.op == "call_method" and target in _METHOD_COMPARISONS:
        return _compare(_METHOD_COMPARISONS[target], read(args[0], seen), args[1], seen, node)
    for op, targets in _COMPARISONS.items():
        if target in targets:
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
    if target in _NOT or (node.op == "call_method" and target in ("logical_not", "bitwise_not", "__invert__")):
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
    return any(not diff.terms and isinstance(diff.offset, int) and not _always_true(diff, op)
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
        return Index(rank, _terms(terms), offset)

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
    if node.target in _SAME_VALUES or calls(node, "contiguous", "clone", "identity") or (
            node.op == "call_method" and node.target in ("detach", "contiguous", "clone")):
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
    if (node.target in (aten.slice.Tensor,) or (node.op == "call_method" and node.target == "__getitem__")
            or node.target is operator.getitem):
        if node.target is aten.slice.Tensor:
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
        return Index(len(after), _terms(terms), ix.offset)

    return _mapped(value, index, len(after))


def negated(keep: Keep) -> Keep | None:
    """Where ``keep`` does not hold: one condition negated (a conjunction's negation is no conjunction: None).

    Example:
        >>> negated(Keep(1, ((Index(1, ((-1, 1),)), "le"),))).conditions[0][1]
        'gt'
    """
    if len(keep.conditions) != 1:
        return None
    (diff, op), = keep.conditions
    return Keep(keep.rank, ((diff, _NEGATED[op]),))


def read_mask(node: Any) -> Keep | Additive | None:
    """``node`` read as a boolean mask (:class:`Keep`) or an additive one (:class:`Additive`), or None."""
    value = read(node)
    return value if isinstance(value, (Keep, Additive)) else None


def _always_true(diff: Index, op: str) -> bool:
    if diff.terms or not isinstance(diff.offset, int):
        return False
    return {"le": diff.offset <= 0, "lt": diff.offset < 0, "ge": diff.offset >= 0, "gt": diff.offset > 0,
            "eq": diff.offset == 0, "ne": diff.offset != 0}[op]


def holds_everywhere(keep: Keep) -> bool:
    """Whether ``keep`` is True at every position for every size: each condition compares with 0 an index
    formula that positions (never negative) cannot bring to the other side, such as transformers'
    ``q_idx >= 0`` that spreads a padding mask over the queries.

    Example:
        >>> query = Index(2, ((-2, 1),))
        >>> holds_everywhere(Keep(2, ((query, "ge"),))), holds_everywhere(Keep(2, ((query, "gt"),)))
        (True, False)
    """
    for diff, op in keep.conditions:
        if _always_true(diff, op):
            continue
        if op in ("le", "lt"):
            diff, op = diff.times(-1), {"le": "ge", "lt": "gt"}[op]
        if op not in ("ge", "gt") or not isinstance(diff.offset, int) or any(c < 0 for _, c in diff.terms):
            return False
        if diff.offset < (0 if op == "ge" else 1):  # sum of c * p >= 0: offset >= 0 (> 0 for a strict >)
            return False
    return True


def is_causal(keep: Keep) -> bool:
    """Whether ``keep`` holds exactly where the key index is at most the query index (dims -1 and -2), for
    every size: one condition equivalent to ``key - query <= 0`` (others always true).

    Example:
        >>> key_minus_query = Index(2, ((-2, -1), (-1, 1)))
        >>> is_causal(Keep(2, ((key_minus_query, "le"),))), is_causal(Keep(2, ((key_minus_query, "lt"),)))
        (True, False)
    """
    conditions = [(d, op) for d, op in keep.conditions if not _always_true(d, op)]
    if len(conditions) != 1:
        return False
    (diff, op), = conditions
    if op in ("ge", "gt"):
        diff, op = diff.times(-1), {"ge": "le", "gt": "lt"}[op]
    if op not in ("le", "lt"):
        return False
    terms = dict(diff.terms)
    if set(terms) != {-1, -2} or terms[-1] <= 0 or terms[-1] != -terms[-2] or not isinstance(diff.offset, int):
        return False
    # k * (key - query) + c <= 0 (or < 0): key - query <= 0 exactly when 0 <= -c / k < 1 (c - 1 for <)
    bound = -diff.offset if op == "le" else -diff.offset - 1
    return 0 <= bound < terms[-1]


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
