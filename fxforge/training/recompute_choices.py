"""The ways to keep each run of pieces (store, recompute its cheap units, recompute all but its boundary),
and the choice among them for a bound on the saved bytes: :class:`ChainFrontier`, every least-recompute
choice at once by dynamic programming over the chain of pieces (the tests hold it to the same choice stated
as a set-partitioning MILP, ``tests/training/milp_oracle.py``).

Example:
    >>> store = Choice((0, 0), set(), saved=100, rematerialized=0, seconds=0.0, mode="store")
    >>> recompute = Choice((0, 0), {1}, saved=10, rematerialized=0, seconds=1e-3, mode="recompute")
    >>> frontier = ChainFrontier([store, recompute], 1)
    >>> frontier.solve(200)[0], frontier.solve(50)[0], frontier.solve(5)
    (set(), {1}, None)
"""

from __future__ import annotations

import dataclasses

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


FRONTIER_GRAIN = 4096
""":class:`ChainFrontier` tells partial choices apart by their saved and rematerialized bytes rounded to
1/4096 of the largest total: of two within one grain, only the one with less recompute is kept."""


class ChainFrontier:
    """Every least-recompute way to keep the chain of ``pieces``, for any bound on saved bytes at once.

    The choices cover runs of consecutive pieces, so a way to keep the first ``k`` pieces is a path through
    positions 0..k, and the bound on it (saved bytes plus the largest run rematerialized at once) is made
    of a sum and a maximum over the path (saved bytes, the maximum rematerialized).
    A forward sweep keeps at each position the paths no other beats on all three of saved bytes,
    rematerialized bytes and seconds (the Pareto frontier; bytes within :data:`FRONTIER_GRAIN` of the
    largest total count as equal); :meth:`solve` then answers a bound by reading the last position's
    frontier. It is the MILP's answer (to that grain) in milliseconds: the bisection of
    :func:`~fxforge.training.budget_search._search` asks for a dozen bounds, and HiGHS took 0.2 s per bound
    on a 28-piece U-Net.

    Example:
        >>> store = [Choice((k, k), set(), 100, 0, 0.0, "store") for k in range(2)]
        >>> both = Choice((0, 1), {7}, 50, 120, 2e-3, "recompute")   # saves 50, rematerializes 120 at once
        >>> ChainFrontier([*store, both], 2).solve(170)
        ({7}, 'dynamic programming over 2 pieces, 3 choices (2 least-recompute plans)')
        >>> ChainFrontier([*store, both], 2).solve(169) is None
        True
    """

    def __init__(self, choices: list[Choice], pieces: int):
        self.choices = choices
        self.pieces = pieces
        largest = max(sum(c.saved for c in choices if c.mode == "store"),
                      max((c.saved + c.rematerialized for c in choices), default=0), 1)
        grain = max(1, largest // FRONTIER_GRAIN)
        starting: list[list[int]] = [[] for _ in range(pieces + 1)]
        for index, choice in enumerate(choices):
            starting[choice.pieces[0]].append(index)
        # A label: (saved, rematerialized, seconds, choice index, previous label); position 0 has the empty path.
        frontier: list[list[tuple]] = [[] for _ in range(pieces + 1)]
        frontier[0] = [(0, 0, 0.0, -1, None)]
        incoming: list[list[tuple]] = [[] for _ in range(pieces + 1)]
        for position in range(pieces):
            labels = frontier[position]
            for index in starting[position]:
                choice = choices[index]
                end = choice.pieces[1] + 1
                for label in labels:
                    incoming[end].append((label[0] + choice.saved, max(label[1], choice.rematerialized),
                                          label[2] + choice.seconds, index, label))
            frontier[position + 1] = _pareto(incoming[position + 1], grain)
            incoming[position + 1] = []
        self._final = frontier[pieces]

    def solve(self, saved_limit: float) -> tuple[set[int], str] | None:
        """The least-recompute choice whose saved bytes plus largest rematerialized run stay under
        ``saved_limit`` (``(recomputed units, note)``), or None where none does."""
        fitting = [label for label in self._final if label[0] + label[1] <= saved_limit]
        if not fitting:
            return None
        label = min(fitting, key=lambda lab: (lab[2], lab[0] + lab[1]))
        chosen: set[int] = set()
        while label is not None and label[3] >= 0:
            chosen |= self.choices[label[3]].recomputed
            label = label[4]
        return chosen, (f"dynamic programming over {self.pieces} pieces, {len(self.choices)} choices "
                        f"({len(self._final)} least-recompute plans)")


def _pareto(labels: list[tuple], grain: int) -> list[tuple]:
    """The labels no other beats on saved bytes, rematerialized bytes and seconds together (bytes compared
    in ``grain``s)."""
    labels.sort(key=lambda lab: (lab[0] // grain, lab[1] // grain, lab[2]))
    kept: list[tuple] = []
    # Sorted by saved bytes: a label is beaten only by one kept before it, with no more rematerialized bytes
    # and no more seconds. ``best`` holds, per rematerialized grain, the least seconds kept so far.
    best: dict[int, float] = {}
    for label in labels:
        remat = label[1] // grain
        if any(r <= remat and seconds <= label[2] for r, seconds in best.items()):
            continue
        kept.append(label)
        best[remat] = label[2]
    return kept
