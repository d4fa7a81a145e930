"""Searching for the least recompute that fits a budget by simulation: bisecting the bound on saved bytes
that the chain's least-recompute frontier meets (:func:`_search`), another partitioner's offers (:func:`_offered`), fixed patterns (:func:`_greedy`), a
descent on the simulation itself (:func:`_descend`), and giving back what the simulation shows is not
needed (:func:`_relax`). Each search returns ``(recompute seconds, units, partition, simulation, solver)``
or None; :func:`~fxforge.training.checkpointing.plan_step` chooses among them.

Example:
    >>> _cheapest(None, (2.0, {1}, None, None, "b"), (1.0, {0}, None, None, "a"))[4]
    'a'
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from fxforge.training.recompute_choices import ChainFrontier, Choice
from fxforge.training.recompute_units import Unit, _cheap
from fxforge.training.step_graph import StepGraphs
from fxforge.training.timeline import StepSimulation

MAX_ROUNDS = 12


def _names(units: list[Unit], chosen: set[int]) -> set[str]:
    return {name for i in chosen for name in units[i].nodes}


@dataclasses.dataclass
class _Trials:
    """One step against one budget: simulates a choice of recomputed units, records it as a round
    ``(mark, simulated figure, fits)``, and keeps the choice that came closest to fitting."""

    step: StepGraphs
    units: list[Unit]
    excess: Callable[[StepSimulation], int]
    limit: int
    simulate: Callable[[StepGraphs], StepSimulation]
    done: dict[frozenset[str], tuple[StepGraphs, StepSimulation]] = dataclasses.field(default_factory=dict)
    rounds: list[tuple[int, int, bool]] = dataclasses.field(default_factory=list)
    closest: dict[str, Any] = dataclasses.field(default_factory=dict)

    def run(self, chosen: set[int], mark: float | None = None) -> tuple[int, StepGraphs, StepSimulation]:
        """``(excess, partition, simulation)`` of recomputing ``chosen``; a round is recorded when ``mark``
        is given. A choice tried before (the same recomputed nodes) is not partitioned and simulated again:
        each trial is a whole partition of the joint graph, seconds on a large model."""
        names = frozenset(_names(self.units, chosen))
        if names not in self.done:
            candidate = self.step.repartition(names)
            self.done[names] = (candidate, self.simulate(candidate))
        candidate, sim = self.done[names]
        over = self.excess(sim)
        if mark is not None:
            self.rounds.append((int(mark), int(self.limit + over), over <= 0))
        if "over" not in self.closest or over < self.closest["over"]:
            self.closest.update(over=over, chosen=set(chosen))
        return over, candidate, sim

    def seconds(self, chosen: set[int]) -> float:
        return sum(self.units[i].seconds for i in chosen)


def _cheapest(*found: tuple | None) -> tuple | None:
    """The cheapest of the fitting choices found (``None`` where a search found none)."""
    return min((f for f in found if f is not None), key=lambda f: f[0], default=None)


def _search(trials: _Trials, pieces, choices: list[Choice], saved_total: float,
            seconds: float = math.inf) -> tuple | None:
    """Bisect the bound on saved bytes: the largest whose least-recompute choice (:class:`ChainFrontier`,
    built once for every bound) fits the budget by simulation.

    Storing everything does not fit (else no search). A bound whose choice fits is a lower end (try saving
    more); one that does not, an upper end (lowered by the simulated excess first, then halfway); a bound
    no choice meets raises the floor. No round starts after ``seconds``.
    """
    frontier = ChainFrontier(choices, len(pieces))
    high, low, floor = saved_total, None, -1.0
    bound = max(0.0, saved_total - trials.excess(trials.simulate(trials.step)))
    best = None
    started = time.perf_counter()
    for _ in range(MAX_ROUNDS):
        if time.perf_counter() - started > seconds:
            break
        solved = frontier.solve(bound) if bound > floor else None
        if solved is None:
            floor = max(floor, bound)
            if low is not None and high - floor < 0.01 * max(saved_total, 1):
                break
            bound = (max(floor, low or floor) + high) / 2
            continue
        chosen, note = solved
        over, candidate, sim = trials.run(chosen, bound)
        if over <= 0:
            best = _cheapest(best, (trials.seconds(chosen), chosen, candidate, sim, note))
            low = bound if low is None else max(low, bound)
            if high - low < 0.01 * max(saved_total, 1):
                break
            bound = (low + high) / 2
        else:
            high = min(high, bound)
            if low is not None:
                if high - low < 0.01 * max(saved_total, 1):
                    break
                bound = (low + high) / 2
            else:
                bound = max(0.0, min(bound - over, bound - 0.05 * saved_total))
                if bound <= floor:
                    bound = (floor + high) / 2 if floor >= 0 else 0.0
                if high <= 0:
                    break
    return best


def _offered(trials: _Trials, offered: dict[str, set[int]]) -> tuple | None:
    """The cheapest offered recomputation (another partitioner's) that fits by simulation."""
    best = None
    for label, chosen in offered.items():
        over, candidate, sim = trials.run(chosen, len(chosen))
        if over <= 0:
            best = _cheapest(best, (trials.seconds(chosen), chosen, candidate, sim, label))
    return best


GREEDY_SECONDS = 30.0
""":func:`_greedy` tries no pattern after this many seconds."""

GREEDY_PATIENCE = 8
""":func:`_greedy` stops after this many patterns in a row that came no closer to the budget than the closest
pattern before them: on an LSTM every pattern missed by the same 28 %, and on a GPT whose budget a measured
step had lowered, all 21 missed, the first (a boundary kept every piece) by the least. On ResNet-50 at 40 %
the closest pattern (which sets the least reachable budget, 46 %) was the tenth, after four in a row that
came no closer: 4 stopped before it (49 %)."""


def _greedy(trials: _Trials, pieces: list[tuple[list[int], int]]) -> tuple | None:
    """Fixed patterns, when the bisection's choices do not fit: keep one boundary every ``stride`` pieces (at each
    offset) and recompute the rest, as checkpointing every block does when a block is ``stride`` pieces;
    the cheapest pattern that fits by simulation. Patterns are tried cheapest first (least recompute seconds),
    so the first that fits is the answer and the dearer ones are not simulated; none starts after
    :data:`GREEDY_SECONDS`, nor after :data:`GREEDY_PATIENCE` in a row that came no closer."""
    patterns = []
    for stride in (2, 3, 4, 6, 8, 1):
        for offset in range(stride):
            chosen = frozenset(i for k, (inside, boundary) in enumerate(pieces) for i in inside
                               if trials.units[i].recomputable and not (i == boundary and k % stride == offset))
            patterns.append((trials.seconds(chosen), stride, chosen))
    seen = set()
    started, closest, misses = time.perf_counter(), math.inf, 0
    for seconds, stride, chosen in sorted(patterns, key=lambda p: (p[0], p[1])):
        if chosen in seen:
            continue
        if time.perf_counter() - started > GREEDY_SECONDS or misses >= GREEDY_PATIENCE:
            break
        seen.add(chosen)
        over, candidate, sim = trials.run(set(chosen), stride)
        if over <= 0:
            return (seconds, set(chosen), candidate, sim, f"pattern (a boundary kept every {stride} pieces)")
        misses = 0 if over < closest else misses + 1
        closest = min(closest, over)
    return None


DESCENT_ROUNDS = 8
"""The most steps :func:`_descend` takes."""


DESCENT_MARGIN = 0.05
""":func:`_descend` starts only from a choice this close to fitting (its excess a fraction of the budget): a
budget far out of reach is refused without it."""


DESCENT_SECONDS = 30.0
""":func:`_descend` stops after the step that passes this many seconds."""


def _descend(trials: _Trials, choices: list[Choice]) -> tuple | None:
    """When neither the bisection's bound nor a pattern fits: a descent on the simulation itself, from the choice
    that came nearest. Each step adds the recomputation that lowers the simulated excess most, among one
    piece's cheap units, one piece, or two consecutive pieces; it stops when the step fits or no addition
    lowers the excess. It starts only within :data:`DESCENT_MARGIN` of the budget and stops after
    :data:`DESCENT_ROUNDS` steps or :data:`DESCENT_SECONDS`.

    The search bounds saved bytes plus the largest run the backward rematerializes at once, a proxy that can
    stall just above a budget whose peak is reached before any rematerialization (at a language model's
    head, every saved value is still alive): there, saving one value less is what fits, and only the
    simulation sees it.
    """
    closest = trials.closest
    if "chosen" not in closest or closest["over"] > DESCENT_MARGIN * trials.limit:
        return None
    local = [c for c in choices if c.mode != "store" and c.pieces[1] - c.pieces[0] <= 1]
    chosen, current = closest["chosen"], closest["over"]
    started = time.perf_counter()
    for _ in range(DESCENT_ROUNDS):
        if time.perf_counter() - started > DESCENT_SECONDS:
            return None
        best = None
        for choice in local:
            if not choice.recomputed <= chosen:
                trial = chosen | choice.recomputed
                over, candidate, sim = trials.run(trial)
                if best is None or over < best[0]:
                    best = (over, trial, candidate, sim)
        if best is None or best[0] >= current:
            return None
        current, chosen = best[0], best[1]
        trials.rounds.append((len(chosen), int(trials.limit + current), current <= 0))
        if current <= 0:
            return (trials.seconds(chosen), chosen, best[2], best[3],
                    f"descent on the simulation ({len(trials.rounds)} rounds)")
    return None


RELAX_SECONDS = 15.0
""":func:`_relax` stops after the trial that passes this many seconds."""


def _relax(trials: _Trials, pieces: list[tuple[list[int], int]], best: tuple) -> tuple:
    """Give back recomputation the simulation shows is not needed: from the plan found, drop one group of
    recomputed units at a time, most seconds first (each expensive unit, a matrix product or a convolution,
    on its own; each piece's cheap units together), and keep each drop whose step still fits. The searches
    fit a proxy (a bound on saved bytes, a partitioner's estimate); the budget is the simulated peak, which
    often has room left. Stops after :data:`RELAX_SECONDS`.
    """
    _, chosen, candidate, sim, solver = best
    groups = []
    for inside, _ in pieces:
        part = chosen & set(inside)
        expensive = {i for i in part if not _cheap(trials.units[i])}
        groups += [{i} for i in expensive]
        if part - expensive:
            groups.append(part - expensive)
    groups.sort(key=trials.seconds, reverse=True)
    started, dropped = time.perf_counter(), 0
    for group in groups:
        if time.perf_counter() - started > RELAX_SECONDS or not trials.seconds(group):
            break
        trial = chosen - group
        over, trial_step, trial_sim = trials.run(trial)
        if over <= 0:
            chosen, candidate, sim, dropped = trial, trial_step, trial_sim, dropped + len(group)
    if not dropped:
        return best
    trials.rounds.append((len(chosen), int(trials.limit + trials.excess(sim)), True))
    return (trials.seconds(chosen), chosen, candidate, sim,
            f"{solver}; then {dropped} recomputed nodes given back where the simulated step still fits")
