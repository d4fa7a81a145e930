"""What an index-range mask means: formulas over index positions, and the proofs read from them.

:mod:`fxforge.rewrites.attention.index_masks` reads a mask built from ``arange`` as one of these values; here
is what they are and what can be proven of them for every size:

- an :class:`Index` is an integer tensor whose element at position ``p`` is ``offset + sum(coefficient[d] *
  p[d])``, dims counted from the right (-1 is the last), which is what broadcasting aligns;
- a :class:`Keep` is a boolean tensor: the conjunction of conditions ``diff <op> 0`` on such formulas;
- an :class:`Additive` is an additive mask ``where(keep, 0, -inf)`` of its keep (a value at or below
  :data:`LARGE_NEGATIVE` hides a key as ``-inf`` does: :func:`hides`).

Example:
    >>> key_minus_query = Index(2, ((-2, -1), (-1, 1)))        # key index - query index
    >>> causal = Keep(2, ((key_minus_query, "le"),))
    >>> is_causal(causal), negated(causal).conditions[0][1], holds_everywhere(causal)
    (True, 'gt', False)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# A fill or additive value at or below this hides a key (see :mod:`fxforge.rewrites.attention`).
LARGE_NEGATIVE = -1e4

_NEGATED = {"le": "gt", "lt": "ge", "ge": "lt", "gt": "le", "eq": "ne", "ne": "eq"}


@dataclasses.dataclass(frozen=True)
class Index:
    """An integer tensor of rank ``rank`` whose element at position ``p`` is
    ``offset + sum(c * p[d] for d, c in terms)`` (``d`` counted from the right).

    Example:
        >>> query, key = Index(2, ((-2, 1),)), Index(2, ((-1, 1),))      # arange(S)[:, None], arange(S)
        >>> key.plus(query.times(-1))
        Index(rank=2, terms=((-2, -1), (-1, 1)), offset=0)
    """

    rank: int
    terms: tuple[tuple[int, int], ...]
    offset: Any = 0

    def plus(self, other: Index) -> Index:
        """The elementwise sum of two formulas (broadcast to the larger rank)."""
        terms = dict(self.terms)
        for d, c in other.terms:
            terms[d] = terms.get(d, 0) + c
        return Index(max(self.rank, other.rank), terms_of(terms), self.offset + other.offset)

    def times(self, factor: int) -> Index:
        """The formula multiplied by an integer."""
        return Index(self.rank, terms_of({d: c * factor for d, c in self.terms}), self.offset * factor)


@dataclasses.dataclass(frozen=True)
class Keep:
    """A boolean tensor of rank ``rank``: True where every condition ``(diff, op)`` holds (``diff op 0``).

    Example:
        >>> Keep(2, ((Index(2, ((-2, -1), (-1, 1))), "le"),)).conditions[0][1]     # key - query <= 0
        'le'
    """

    rank: int
    conditions: tuple[tuple[Index, str], ...]


@dataclasses.dataclass(frozen=True)
class Additive:
    """An additive mask: 0 where ``keep`` holds, a value that hides the key elsewhere.

    Example:
        >>> Additive(Keep(1, ())).keep.conditions       # hides nothing: 0 everywhere
        ()
    """

    keep: Keep


def terms_of(terms: dict[int, int]) -> tuple[tuple[int, int], ...]:
    """A formula's terms from ``{dim: coefficient}``: sorted by dim, zero coefficients dropped.

    Example:
        >>> terms_of({-1: 1, -2: 0, -3: 2})
        ((-3, 2), (-1, 1))
    """
    return tuple(sorted((d, c) for d, c in terms.items() if c != 0))


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


def always_true(diff: Index, op: str) -> bool:
    """Whether the condition ``diff <op> 0`` holds everywhere because ``diff`` is a constant that meets it.

    Example:
        >>> always_true(Index(0, (), 0), "le"), always_true(Index(0, (), 1), "le")
        (True, False)
        >>> always_true(Index(1, ((-1, 1),)), "ge")     # holds, but not as a constant
        False
    """
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
        if always_true(diff, op):
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
    conditions = [(d, op) for d, op in keep.conditions if not always_true(d, op)]
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
