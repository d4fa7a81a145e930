"""Checkpointing under a memory budget: which activations to keep and which to recompute, least recompute first.

A training step saves activations in the forward for the backward; recomputing some of them in the backward
instead lowers the step's peak at the price of compute. :func:`plan_checkpointing` chooses, on the step's
joint graph (:mod:`fxforge.training.step_graph`), the forward nodes to recompute:

1. **Units.** Each forward node (with the ``getitem`` nodes of a multi-output op) is a unit with the bytes
   of its outputs and the estimated time to compute it again (:mod:`fxforge.core.costs`). Random ops
   (dropout) are never recomputed: on CPU they would draw other numbers. The step's own outputs are alive
   anyway.
2. **The least recompute for a bound on the saved bytes.** The forward is a chain of pieces; each run of
   pieces is kept one of a few ways (stored, its cheap units recomputed, all but its boundary recomputed),
   each with its saved bytes, the bytes the backward rematerializes at once and its recompute seconds. One
   sweep over the chain (:class:`~fxforge.training.recompute_choices.ChainFrontier`, dynamic programming)
   keeps every way to keep the whole chain that no other beats on saved bytes, rematerialized bytes and
   seconds together, so the least-recompute choice under any bound (saved plus the largest rematerialized
   run) is read off it; the tests hold it to the same choice stated as a MILP (scipy's HiGHS,
   ``tests/training/milp_oracle.py``). When no bound's choice fits, fixed patterns (a boundary
   kept every few pieces) are tried; when none fits either, a descent on the simulation itself adds one or
   two pieces' recomputation at a time from the closest choice (:func:`~fxforge.training.budget_search._descend`).
   Another partitioner's choices may be offered (``candidates=``; for ``target="inductor"``, Inductor's
   min cut at several budgets, :mod:`fxforge.training.inductor_partitions`): each is simulated whole, and
   each piece's part of each is one more way to keep that piece; the cheapest that fits wins.
3. **The whole step simulated** (:mod:`fxforge.training.timeline`, backward liveness included: each saved
   value freed after its last use, recomputed values alive only around their use, gradients growing): the
   bound on saved bytes is only a proxy, so it is lowered by the simulated excess until the simulated peak
   fits the budget, then raised again while the peak still fits, to recompute as little as possible.
   Then, from the plan found, recomputation is given back group by group, most seconds first, while the
   simulated step still fits (:func:`~fxforge.training.budget_search._relax`). The plan returned always
   fits by simulation, so as the budget falls the predicted peak falls with it.

Torch's default partitioner then splits the joint graph with the chosen units tagged ``MUST_RECOMPUTE``,
placing each recomputation right before its first use in the backward.

The jobs live in their own modules: the units and pieces in :mod:`fxforge.training.recompute_units`, the
choices and the least-recompute frontier in :mod:`fxforge.training.recompute_choices`, the searches against the simulation in
:mod:`fxforge.training.budget_search`, the answer in :mod:`fxforge.training.checkpoint_plan`; this module
reads the budget (:func:`parse_budget`) and plans a step (:func:`plan_step`).

Budgets: ``"60%"`` is 60 % of the unconstrained *activation peak* (the most bytes the forward and backward
hold at once beyond weights, optimizer state, inputs and parameter gradients); an ``int`` is a cap in bytes
on the whole step's peak (weights, gradients, optimizer state and activations together).

Example:
    >>> layers = [m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())]
    >>> model = torch.nn.Sequential(*layers).train()
    >>> from fxforge.training import plan_checkpointing
    >>> plan = plan_checkpointing(model, (torch.randn(512, 256),), "80%", optimizer=None)
    >>> plan.predicted_activation_peak_bytes <= plan.budget_bytes, len(plan.recomputed) > 0
    (True, True)
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from fxforge.core.costs import Machine, graph_seconds, node_seconds
from fxforge.core.units import format_bytes, parse_budget
from fxforge.runtime.roofline import measure_machine
from fxforge.training.budget_search import (
    _cheapest,
    _descend,
    _greedy,
    _offered,
    _relax,
    _search,
    _Trials,
)
from fxforge.training.checkpoint_plan import CheckpointPlan
from fxforge.training.recompute_choices import (  # noqa: F401 - Choice: importable from here as before
    Choice,
    _choices,
    _offered_choices,
)
from fxforge.training.recompute_units import _pieces, _units
from fxforge.training.step_graph import StepGraphs
from fxforge.training.timeline import StepSimulation, simulate_step

SEARCH_SECONDS = 30.0
"""No round of the bisection starts after 30 s: each round is a whole partition of the step."""
OFFERED_SEARCH_SECONDS = 30.0
"""With offered choices (``candidates=``), no round starts after 30 s."""

class BudgetError(ValueError):
    """The budget cannot be met by checkpointing; the message says the least reachable.

    Attributes:
        least_bytes: the least the figure the budget bounds reached (the activation peak for a fraction, the
            step's peak for bytes), everything that can be recomputed recomputed among the tries; None where
            not known.
        least_budget: the least budget that is reachable, in the budget's own kind: ``"77%"`` (rounded up to
            a whole percent) or bytes; None where not known.
        unconstrained_bytes: the same figure without checkpointing.

    Example:
        >>> error = BudgetError("too low", least_bytes=770, unconstrained_bytes=1000, kind="fraction")
        >>> issubclass(BudgetError, ValueError), error.least_budget
        (True, '77%')
    """

    def __init__(self, message: str, *, least_bytes: int | None = None, unconstrained_bytes: int | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.least_bytes = least_bytes
        self.unconstrained_bytes = unconstrained_bytes
        self.least_budget: str | int | None = None
        if least_bytes is not None and kind == "fraction" and unconstrained_bytes:
            percent = math.ceil(100 * least_bytes / unconstrained_bytes - 1e-9)
            self.least_budget = f"{min(percent, 100)}%"
        elif least_bytes is not None and kind == "bytes":
            self.least_budget = int(least_bytes)


def plan_step(step: StepGraphs, budget: Any, *, persistent_bytes: int = 0, optimizer_step_bytes: int = 0,
              loss_bytes: int | None = None, machine: Machine | None = None,
              fused: bool = False,
              candidates: Callable[[StepGraphs], dict[str, set[str]]] | None = None,
              margin_bytes: int = 0, reference_activation_bytes: int | None = None,
              tried: dict | None = None) -> CheckpointPlan:
    """Choose the recomputation of ``step`` that fits ``budget`` (see the module docstring).

    Args:
        step: the traced step (its current partition is taken as the unconstrained one).
        budget: ``"60%"``, a float fraction, bytes, or ``"2GiB"``.
        persistent_bytes: weights, buffers, inputs and optimizer state (for a budget in bytes).
        optimizer_step_bytes: what the optimizer step allocates beyond the gradients.
        loss_bytes: what the caller's loss allocates between the forward and the backward (its peak), or
            None when it is not known: then the outputs are taken as held by the caller to the end of the
            step (the optimizer's too), as a caller keeping ``out = model(x)`` does.
        fused: the graphs will be compiled by Inductor, which computes a recomputed elementwise op inside
            the kernel that uses it: such recomputation is costed at writing its output once
            (:func:`~fxforge.core.costs.node_seconds`), so the plan prefers it to recomputing a
            matrix product or a convolution.
        candidates: called with ``step`` when the step does not fit unconstrained: recomputations another
            partitioner chose (a label -> forward node names; Inductor's min cut at several budgets,
            :func:`~fxforge.training.inductor_partitions.mincut_candidates`): each is simulated and
            costed like the planner's own choices (the cheapest that fits wins, its label the solver), and
            each piece's part of each is one more way to keep that piece.
        margin_bytes: kept back from the budget: the plan fits ``budget - margin_bytes`` (a measured step held
            that much more than its simulation; :class:`~fxforge.training.module.CheckpointedModule`'s check);
            negative where a measured step held less than its simulation.
        reference_activation_bytes: the unconstrained activation peak a fraction budget is a fraction of, and
            the plan's ``unconstrained_activation_bytes``; default this step's own. A step traced with
            Inductor's decompositions holds more than the model's step does unconstrained (a layer norm's
            decomposition saves its intermediates), so its own peak would make "60 %" allow more than 60 % of
            what the model holds: the module passes the peak of the model's own step here.
        tried: partitions already simulated for a trace of this same step (recomputed node names -> partition
            and simulation), filled in by this plan: a plan made again (another margin) on a new trace of the
            same graph simulates only the choices the first did not.

    Raises:
        BudgetError: no recomputation fits (the least reachable is in the message).
    """
    started = time.perf_counter()
    kind, value = parse_budget(budget)
    machine = machine or measure_machine(_device(step))
    simulate = functools.partial(simulate_step, loss_bytes=loss_bytes)
    base = simulate(step)
    held = base.output_bytes if loss_bytes is None else 0
    optimizer_phase = persistent_bytes + base.gradient_bytes + held + optimizer_step_bytes

    def whole(sim: StepSimulation) -> int:
        return max(persistent_bytes + sim.peak_bytes, optimizer_phase)

    unconstrained = base.activation_peak_bytes if reference_activation_bytes is None else reference_activation_bytes
    if kind == "fraction":
        limit = int(value * unconstrained)
        target = limit - margin_bytes

        def excess(sim: StepSimulation) -> int:
            return sim.activation_peak_bytes - target
    else:
        limit = int(value)
        target = limit - margin_bytes
        if optimizer_phase > limit:
            raise BudgetError(f"memory_budget {budget!r}: the optimizer step alone needs "
                              f"{format_bytes(optimizer_phase)} (weights, state, gradients, its temporaries); "
                              f"the least reachable budget is at least {format_bytes(optimizer_phase)}",
                              least_bytes=optimizer_phase, unconstrained_bytes=whole(base), kind="bytes")

        def excess(sim: StepSimulation) -> int:
            return whole(sim) - target

    units = _units(step, machine, fused)
    pieces = _pieces(units)
    choices = own = _choices(units, pieces)
    trials = _Trials(step, units, excess, target, simulate, done={} if tried is None else tried)
    best: tuple[float, set[int], StepGraphs, StepSimulation, str] | None = None
    step_seconds = graph_seconds(step.forward, machine, fused=fused) + graph_seconds(step.backward, machine,
                                                                                     fused=fused)
    if excess(base) <= 0:
        best = (0.0, set(), step, base, "none needed (the step fits unconstrained)")
    else:
        saved_total = float(sum(c.saved for c in own if c.mode == "store"))
        offered = {label: {i for i, unit in enumerate(units) if unit.recomputable and set(unit.nodes) & names}
                   for label, names in (candidates(step) if candidates else {}).items()}
        if offered:
            choices = own + _offered_choices(units, pieces, list(offered.values()))
            # The offered choices' answers can lead the bisection to no fit where its own choices alone find
            # one (ResNet-50 at 40 %): a bounded search with them, then the plain one if they found nothing.
            best = _cheapest(_offered(trials, offered),
                             _search(trials, pieces, choices, saved_total, OFFERED_SEARCH_SECONDS))
        if best is None:
            best = _search(trials, pieces, own, saved_total, SEARCH_SECONDS)
        if best is None:
            best = _greedy(trials, pieces)
        if best is None:
            best = _descend(trials, choices)
        if best is not None:
            best = _relax(trials, pieces, best)
    rounds = trials.rounds
    if best is None:
        # The least reachable: everything that can be recomputed recomputed, and whatever a search came closer with.
        everything = {i for i, unit in enumerate(units) if unit.recomputable}
        if everything:
            trials.run(everything, len(everything))
        least = min((figure for _, figure, _ in trials.rounds), default=target + excess(base))
        what = "an activation peak" if kind == "fraction" else "a step peak"
        kept = f", {format_bytes(margin_bytes)} of it kept back for what a measured step held beyond the plan" \
            if margin_bytes > 0 else ""
        free = unconstrained if kind == "fraction" else whole(base)
        error = BudgetError("", least_bytes=least + margin_bytes, unconstrained_bytes=free, kind=kind)
        error.args = ((f"memory_budget {budget!r} ({format_bytes(limit)}{kept}) is below what recomputation reached: "
                       f"{what} of {format_bytes(least)} at best, everything recomputable recomputed (unconstrained "
                       f"{format_bytes(free)}); the least reachable budget is {_budget_text(error.least_budget)}"),)
        raise error
    _, _, chosen_step, sim, solver = best
    recompute_seconds = sum(node_seconds(n, machine, fused=fused) for n in chosen_step.backward.graph.nodes
                            if n.name in chosen_step.recomputed)
    return CheckpointPlan(budget, kind, limit, unconstrained, sim.activation_peak_bytes,
                          whole(base), whole(sim), [n.name for n in chosen_step.saved_nodes()],
                          sorted(chosen_step.recomputed), recompute_seconds, step_seconds, solver, rounds,
                          chosen_step, sim, persistent_bytes, optimizer_phase, time.perf_counter() - started,
                          loss_bytes, margin_bytes=margin_bytes)


def _budget_text(budget: str | int | None) -> str:
    return "unknown" if budget is None else budget if isinstance(budget, str) else format_bytes(budget)


def _device(step: StepGraphs) -> str:
    for node in step.forward.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return str(value.device)
    return "cpu"
