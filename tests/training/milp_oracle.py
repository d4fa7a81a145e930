"""The reference the planner's least-recompute frontier is held to: the same choice for one bound, stated as a
set-partitioning MILP over the chain of pieces and solved exactly by scipy's HiGHS (what the planner ran once
per bound of its bisection, 0.2 s each on a 28-piece U-Net, before the frontier).

Example:
    >>> store = Choice((0, 0), set(), saved=100, rematerialized=0, seconds=0.0, mode="store")
    >>> recompute = Choice((0, 0), {1}, saved=10, rematerialized=0, seconds=1e-3, mode="recompute")
    >>> solve([store, recompute], 1, 200, 1.0)[0], solve([store, recompute], 1, 50, 1.0)[0]
    (set(), {1})
"""

from __future__ import annotations

import math

import numpy as np

from fxforge.training.recompute_choices import Choice


def solve(choices: list[Choice], pieces: int, saved_limit: float, time_limit: float, gap: float = 1e-4
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
