"""The ways to keep each run of pieces (store, recompute its cheap units, recompute all but its boundary),
and the exact choice among them for a bound on the saved bytes: a set-partitioning MILP solved by scipy's
HiGHS.

Example:
    >>> store = Choice((0, 0), set(), saved=100, rematerialized=0, seconds=0.0, mode="store")
    >>> recompute = Choice((0, 0), {1}, saved=10, rematerialized=0, seconds=1e-3, mode="recompute")
    >>> _solve([store, recompute], 1, 200, 1.0)[0], _solve([store, recompute], 1, 50, 1.0)[0]
    (set(), {1})
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fxforge.training.recompute_units import Unit, _cheap

MAX_SPAN = 24
"""The most pieces of the forward one recomputed segment may span (bounds the MILP's size)."""


@dataclasses.dataclass
class Choice:
    """One way to keep a run of pieces: ``recomputed`` units, ``saved`` bytes, bytes the backward
    ``rematerialized`` at once, ``seconds`` of recompute; ``pieces`` the run ``[first, last]``; ``mode``
    ``"store"``, ``"cheap"``, ``"recompute"`` or ``"offered"``.

    Example:
        >>> Choice((0, 2), {1, 2}, saved=1024, rematerialized=512, seconds=1e-4, mode="recompute").pieces
        (0, 2)
    """

    pieces: tuple[int, int]
    recomputed: set[int]
    saved: int
    rematerialized: int
    seconds: float
    mode: str


def _choice(units: list[Unit], pieces: tuple[int, int], inside: list[int], boundary: int, chosen: set[int],
            mode: str) -> Choice:
    """Keeping the pieces ``pieces`` (units ``inside``, ``boundary`` at the end) by recomputing ``chosen``: it
    saves what the backward uses and what a recomputed unit needs, and the boundary (the next piece may be
    recomputed from it); it rematerializes in the backward what it does not save of what the backward uses."""
    saved = sum(units[i].nbytes for i in inside if i not in chosen and (
        units[i].needed_by_backward or i == boundary or any(i in units[j].producers for j in chosen)))
    stored = sum(units[i].nbytes for i in inside if units[i].needed_by_backward)
    return Choice(pieces, set(chosen), saved, max(0, stored - saved) if chosen else 0,
                  sum(units[i].seconds for i in chosen), mode)


def _choices(units: list[Unit], pieces: list[tuple[list[int], int]]) -> list[Choice]:
    """Per piece: store it, or recompute its cheap units; per run of up to :data:`MAX_SPAN` pieces:
    recompute everything in it but the boundary at its end."""
    choices: list[Choice] = []
    for k, (inside, boundary) in enumerate(pieces):
        choices.append(_choice(units, (k, k), inside, boundary, set(), "store"))
        cheap = {i for i in inside if units[i].recomputable and i != boundary and _cheap(units[i])}
        if cheap:
            choices.append(_choice(units, (k, k), inside, boundary, cheap, "cheap"))
    for first in range(len(pieces)):
        inside: list[int] = []
        for last in range(first, min(len(pieces), first + MAX_SPAN)):
            inside = inside + pieces[last][0]
            boundary = pieces[last][1]
            chosen = {i for i in inside if units[i].recomputable and i != boundary}
            if chosen:
                choices.append(_choice(units, (first, last), inside, boundary, chosen, "recompute"))
    return choices


def _offered_choices(units: list[Unit], pieces: list[tuple[list[int], int]], offered: list[set[int]]
                     ) -> list[Choice]:
    """Per piece, the part of each offered recomputation (another partitioner's) that falls in it, as one more
    way to keep that piece (duplicates left out)."""
    choices, seen = [], set()
    for chosen_all in offered:
        for k, (inside, boundary) in enumerate(pieces):
            chosen = frozenset(i for i in inside if i in chosen_all)
            if chosen and (k, chosen) not in seen:
                seen.add((k, chosen))
                choices.append(_choice(units, (k, k), inside, boundary, set(chosen), "offered"))
    return choices


def _solve(choices: list[Choice], pieces: int, saved_limit: float, time_limit: float, gap: float = 1e-4
           ) -> tuple[set[int], str] | None:
    """The choices covering every piece once with the least recompute time whose saved bytes, plus the
    largest run the backward rematerializes at once, stay under ``saved_limit`` (a set-partitioning MILP
    over the chain of pieces, exact for that model to the relative ``gap``)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    m = len(choices)
    if m == 0:
        return set(), "milp (nothing to choose)"
    cost = np.array([c.seconds for c in choices] + [0.0])
    rows, cols, vals, lower, upper = [], [], [], [], []
    for col, choice in enumerate(choices):  # every piece covered by exactly one choice
        for k in range(choice.pieces[0], choice.pieces[1] + 1):
            rows.append(k)
            cols.append(col)
            vals.append(1.0)
    lower += [1.0] * pieces
    upper += [1.0] * pieces
    row = pieces
    for col, choice in enumerate(choices):  # z >= what each chosen run rematerializes
        if choice.rematerialized:
            rows += [row, row]
            cols += [col, m]
            vals += [float(choice.rematerialized), -1.0]
            lower.append(-math.inf)
            upper.append(0.0)
            row += 1
    for col, choice in enumerate(choices):  # saved bytes + z <= limit
        rows.append(row)
        cols.append(col)
        vals.append(float(choice.saved))
    rows.append(row)
    cols.append(m)
    vals.append(1.0)
    lower.append(-math.inf)
    upper.append(max(0.0, saved_limit))
    row += 1
    matrix = coo_matrix((vals, (rows, cols)), shape=(row, m + 1))
    result = milp(cost, constraints=LinearConstraint(matrix, lower, upper),
                  integrality=np.array([1] * m + [0]), bounds=Bounds(np.zeros(m + 1), np.array([1.0] * m + [math.inf])),
                  options={"time_limit": time_limit, "mip_rel_gap": gap})
    if result.x is None:
        return None
    chosen: set[int] = set()
    for col, choice in enumerate(choices):
        if result.x[col] > 0.5:
            chosen |= choice.recomputed
    status = "optimal" if result.status == 0 else "time limit: best found"
    return chosen, f"milp (HiGHS, {status}) over {pieces} pieces, {m} choices"
