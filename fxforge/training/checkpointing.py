"""Checkpointing under a memory budget: which activations to keep and which to recompute, least recompute first.

A training step saves activations in the forward for the backward; recomputing some of them in the backward
instead lowers the step's peak at the price of compute. :func:`plan_checkpointing` chooses, on the step's
joint graph (:mod:`fxforge.training.step_graph`), the forward nodes to recompute:

1. **Units.** Each forward node (with the ``getitem`` nodes of a multi-output op) is a unit with the bytes
   of its outputs and the estimated time to compute it again (:mod:`fxforge.training.costs`). Random ops
   (dropout) are never recomputed: on CPU they would draw other numbers. The step's own outputs are alive
   anyway.
2. **An exact choice for a bound on the saved bytes** (a MILP solved by scipy's HiGHS): binary ``r[u]``
   (recompute) and ``s[u]`` (save) per unit; a unit the backward uses is saved or recomputed; a unit a
   recomputed unit needs is saved or recomputed too; the saved bytes stay under the bound; the recompute
   time is minimal. When HiGHS stops at its time limit its best solution is used (the report gives the
   gap); when it finds none, a bounded greedy order (least seconds per byte first) is searched instead;
   when no bound and no pattern fits, a descent on the simulation itself adds one or two pieces'
   recomputation at a time from the closest choice (:func:`_descend`). Another partitioner's choices may be
   offered (``candidates=``; for ``target="inductor"``, Inductor's min cut at several budgets,
   :mod:`fxforge.training.inductor_partitions`): each is simulated whole, and each piece's part of each is
   one more choice for that piece in the MILP; the cheapest that fits wins.
3. **The whole step simulated** (:mod:`fxforge.training.timeline`, backward liveness included: each saved
   value freed after its last use, recomputed values alive only around their use, gradients growing): the
   bound on saved bytes is only a proxy, so it is lowered by the simulated excess until the simulated peak
   fits the budget, then raised again while the peak still fits, to recompute as little as possible.
   Then, from the plan found, recomputation is given back group by group, most seconds first, while the
   simulated step still fits (:func:`_relax`). The plan returned always fits by simulation, so as the
   budget falls the predicted peak falls with it.

Torch's default partitioner then splits the joint graph with the chosen units tagged ``MUST_RECOMPUTE``,
placing each recomputation right before its first use in the backward.

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

import dataclasses
import functools
import math
import operator
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fxforge.core.memory import tensor_leaves
from fxforge.core.symbolic import hint
from fxforge.runtime.roofline import Machine, measure_machine
from fxforge.training.costs import graph_seconds, node_seconds
from fxforge.training.step_graph import StepGraphs, is_forward, is_random
from fxforge.training.timeline import StepSimulation, simulate_step

MILP_TIME_LIMIT_S = 10.0
MAX_ROUNDS = 12
OFFERED_MILP_TIME_LIMIT_S = 4.0
OFFERED_SEARCH_SECONDS = 30.0
"""With offered choices (``candidates=``), each MILP stops after 4 s and no round starts after 30 s."""

_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1, "": 1}


def parse_budget(budget: Any) -> tuple[str, float]:
    """``("fraction", f)`` for ``"60%"`` (or a float in (0, 1]), ``("bytes", n)`` for an int or ``"2GiB"``.

    Raises:
        ValueError: anything else, a fraction outside (0, 100 %], or a size that is not positive.

    Example:
        >>> parse_budget("60%"), parse_budget("1.5GiB"), parse_budget(1000)
        (('fraction', 0.6), ('bytes', 1610612736.0), ('bytes', 1000.0))
    """
    if isinstance(budget, float) and 0 < budget <= 1:
        return "fraction", float(budget)
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
        return "bytes", float(budget)
    if isinstance(budget, str):
        text = budget.strip().lower().replace(" ", "")
        if text.endswith("%"):
            try:
                value = float(text[:-1]) / 100
            except ValueError:
                value = -1.0
            if 0 < value <= 1:
                return "fraction", value
            raise ValueError(f"memory_budget {budget!r}: a percentage must be in (0, 100]")
        match = re.fullmatch(r"([0-9.]+)([kmg]i?b|b)?", text)
        if match:
            value = float(match.group(1)) * _UNITS[match.group(2) or ""]
            if value > 0:
                return "bytes", value
    raise ValueError(f"memory_budget {budget!r}: give bytes (an int, '2GiB') or a percentage ('60%')")


@dataclasses.dataclass
class Unit:
    """A forward node (with its ``getitem`` nodes): what saving it costs and what recomputing it costs."""

    name: str
    nodes: list[str]
    nbytes: int
    seconds: float
    recomputable: bool
    needed_by_backward: bool
    producers: list[int] = dataclasses.field(default_factory=list)


def _units(step: StepGraphs, machine: Machine, fused: bool = False) -> list[Unit]:
    joint = step.joint
    primal_keys = set()
    for node in joint.graph.find_nodes(op="placeholder"):
        for leaf in tensor_leaves(node.meta.get("val")):
            primal_keys.add(leaf.untyped_storage()._cdata)
    (out,) = joint.graph.find_nodes(op="output")
    flat_outputs = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    step_outputs = {n for n in flat_outputs[:step.num_fwd_outputs] if isinstance(n, torch.fx.Node)}
    units: list[Unit] = []
    index: dict[torch.fx.Node, int] = {}
    for node in joint.graph.nodes:
        if node.op != "call_function" or not is_forward(node):
            continue
        if node.target is operator.getitem and node.args[0] in index:
            unit = units[index[node.args[0]]]
            unit.nodes.append(node.name)
            index[node] = index[node.args[0]]
            unit.nbytes += _bytes(node, primal_keys)
            unit.needed_by_backward |= any(not is_forward(u) for u in node.users if u.op != "output")
            if node in step_outputs:
                unit.recomputable = False
            continue
        value = node.meta.get("val")
        multi = isinstance(value, (tuple, list))
        tensors = tensor_leaves(value)
        unit = Unit(node.name, [node.name], 0 if multi else _bytes(node, primal_keys),
                    node_seconds(node, machine, fused=fused),
                    bool(tensors) and not is_random(node) and node not in step_outputs
                    and not node.is_impure(impure_random=False),
                    any(not is_forward(u) for u in node.users if u.op != "output"))
        unit.producers = sorted({index[i] for i in node.all_input_nodes if i in index})
        index[node] = len(units)
        units.append(unit)
    return units


def _bytes(node: torch.fx.Node, primal_keys: set[int]) -> int:
    """Bytes of the storages ``node`` allocates: not a parameter's or an input's, not one of its inputs'."""
    total, seen = 0, set()
    for source in node.all_input_nodes:
        for leaf in tensor_leaves(source.meta.get("val")):
            seen.add(leaf.untyped_storage()._cdata)
    for leaf in tensor_leaves(node.meta.get("val")):
        storage = leaf.untyped_storage()
        if storage._cdata in primal_keys or storage._cdata in seen:
            continue
        seen.add(storage._cdata)
        total += hint(storage.nbytes())
    return total


EXPENSIVE_SECONDS_PER_BYTE = 2e-10
"""A unit whose recompute costs more than this per byte it frees (matrix products, convolutions, attention:
about 10x a copy) is kept in a segment's ``"cheap"`` mode; pointwise ops and views are recomputed."""


def _cheap(unit: Unit) -> bool:
    return unit.seconds <= EXPENSIVE_SECONDS_PER_BYTE * max(unit.nbytes, 1) or unit.nbytes == 0


MAX_SPAN = 24
"""The most pieces of the forward one recomputed segment may span (bounds the MILP's size)."""


@dataclasses.dataclass
class Choice:
    """One way to keep a run of pieces: ``recomputed`` units, ``saved`` bytes, bytes the backward
    ``rematerialized`` at once, ``seconds`` of recompute; ``pieces`` the run ``[first, last]``."""

    pieces: tuple[int, int]
    recomputed: set[int]
    saved: int
    rematerialized: int
    seconds: float
    mode: str


def _pieces(units: list[Unit]) -> list[tuple[list[int], int]]:
    """The forward cut into pieces where one value carries everything on: ``(units, boundary unit)``.

    Views of parameters (a transposed weight) and values used across more than half of the forward (a
    causal mask, rotary tables) are free to cross a cut: they cost nothing, or are global. A position is a
    cut when one other value crosses it; consecutive cuts crossed by the same value are one (the last).
    """
    n = len(units)
    free = [False] * n
    last_use = list(range(n))
    for i, unit in enumerate(units):
        free[i] = unit.nbytes == 0 and all(free[p] for p in unit.producers)
        for p in unit.producers:
            last_use[p] = max(last_use[p], i)
    starts: dict[int, list[int]] = {}
    for i in range(n):
        if not free[i] and last_use[i] > i and last_use[i] - i <= n // 2:
            starts.setdefault(i + 1, []).append(i)
    alive: set[int] = set()
    cuts: list[tuple[int, int]] = []
    for i in range(1, n):
        alive.update(starts.get(i, ()))
        alive = {v for v in alive if last_use[v] >= i}
        if len(alive) == 1:
            value = next(iter(alive))
            if cuts and cuts[-1][1] == value:
                cuts[-1] = (i, value)
            else:
                cuts.append((i, value))
    pieces, previous = [], 0
    for position, boundary in [*cuts, (n, n - 1)]:
        if position > previous:
            pieces.append((list(range(previous, position)), boundary))
            previous = position
    return pieces


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


def _solve(choices: list[Choice], pieces: int, saved_limit: float, time_limit: float
           ) -> tuple[set[int], str] | None:
    """The choices covering every piece once with the least recompute time whose saved bytes, plus the
    largest run the backward rematerializes at once, stay under ``saved_limit`` (a set-partitioning MILP
    over the chain of pieces, exact for that model)."""
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
                  options={"time_limit": time_limit, "mip_rel_gap": 1e-4})
    if result.x is None:
        return None
    chosen: set[int] = set()
    for col, choice in enumerate(choices):
        if result.x[col] > 0.5:
            chosen |= choice.recomputed
    status = "optimal" if result.status == 0 else "time limit: best found"
    return chosen, f"milp (HiGHS, {status}) over {pieces} pieces, {m} choices"


@dataclasses.dataclass
class CheckpointPlan:
    """What a budgeted step saves and recomputes, and what it is predicted to cost.

    Attributes:
        budget: the budget as given; ``budget_kind``: ``"fraction"`` or ``"bytes"``.
        budget_bytes: the bytes it allows: for a fraction, of the activation peak; for bytes, of the step.
        unconstrained_activation_bytes: the activation peak without checkpointing.
        predicted_activation_peak_bytes: the plan's simulated activation peak.
        unconstrained_peak_bytes, predicted_peak_bytes: the whole step's peak without and with the plan
            (weights, buffers, inputs, optimizer state, gradients, activations; the optimizer step included).
        saved: forward nodes whose values the backward keeps; ``recomputed``: forward nodes it recomputes.
        recompute_seconds, step_seconds: estimated recompute time and the unconstrained forward+backward.
        overhead: ``recompute_seconds / step_seconds``.
        solver: how the choice was made; ``rounds``: ``(bound on saved bytes, simulated figure, fits)`` (for a
            pattern the stride in place of the bound, for a step of the descent the units recomputed).
        step: the chosen partition; ``simulation``: its replay.
        loss_bytes: what the caller's loss was sized at (None when no loss was given).
        backward_reordered: whether the memory scheduler reordered the backward (a lower simulated peak).
        margin_bytes: kept back from the budget, for what a measured step held beyond its simulation (negative:
            added to it, for what a measured step held below its simulation).
        measured_bytes: the figure the budget bounds (the activation peak for a fraction, the forward and
            backward's step peak for bytes), measured on one real step of the plan; None when not measured.
        layout_optimization: for ``target="inductor"``, whether Inductor compiled the graphs with its layout
            optimization (convolutions in channels-last); None for the op-by-op runner.
        compile_record: for ``target="inductor"``, what the compilers chose, counted as AOTAutograd compiles
            each graph (the backward at the step's first backward): ``"onednn_matmuls"``, the matrix products
            run on oneDNN (:func:`~fxforge.lowering.gemm.route_matmuls`); None for the op-by-op runner.
    """

    budget: Any
    budget_kind: str
    budget_bytes: int
    unconstrained_activation_bytes: int
    predicted_activation_peak_bytes: int
    unconstrained_peak_bytes: int
    predicted_peak_bytes: int
    saved: list[str]
    recomputed: list[str]
    recompute_seconds: float
    step_seconds: float
    solver: str
    rounds: list[tuple[int, int, bool]]
    step: StepGraphs
    simulation: StepSimulation
    persistent_bytes: int = 0
    optimizer_peak_bytes: int = 0
    plan_seconds: float = 0.0
    loss_bytes: int | None = None
    backward_reordered: bool = False
    margin_bytes: int = 0
    measured_bytes: int | None = None
    layout_optimization: bool | None = None
    compile_record: dict[str, int] | None = None

    @property
    def overhead(self) -> float:
        """Predicted extra step time from recomputation, as a fraction of the forward+backward time."""
        return self.recompute_seconds / self.step_seconds if self.step_seconds else 0.0

    def lines(self) -> list[str]:
        """The plan as report lines."""
        what = (f"{self.budget} of the activation peak -> activations <= {_size(self.budget_bytes)}"
                if self.budget_kind == "fraction" else f"{_size(self.budget_bytes)} for the whole step")
        return [
            f"budget: {what}",
            (f"activation peak: {_size(self.unconstrained_activation_bytes)} -> "
             f"{_size(self.predicted_activation_peak_bytes)} (simulated, backward liveness included)"),
            f"step peak: {_size(self.unconstrained_peak_bytes)} -> {_size(self.predicted_peak_bytes)}",
            (f"saved for backward: {len(self.saved)} values ({_size(self.simulation.saved_bytes)}); "
             f"recomputed: {len(self.recomputed)} nodes"),
            (f"predicted overhead: {self.overhead:.1%} of forward+backward ({self.recompute_seconds * 1e3:.2f} ms "
             f"of {self.step_seconds * 1e3:.2f} ms, roofline estimate)"),
            f"solver: {self.solver}; {len(self.rounds)} rounds of simulation; planned in {self.plan_seconds:.2f} s",
            ("backward: reordered by the memory scheduler (a lower simulated peak)" if self.backward_reordered
             else "backward: in autograd's order (the memory scheduler found no lower peak)"),
            *([] if self.layout_optimization is None else [
                "compiled by Inductor, layout optimization " + ("on (checked on a measured step)"
                                                                if self.layout_optimization else "off")]),
            *([] if self.compile_record is None else [
                ("matrix products on oneDNN (measured faster than BLAS here): "
                 f"{self.compile_record.get('onednn_matmuls', 0)}")]),
            *([] if self.measured_bytes is None else [self._measured_line()]),
        ]

    def _measured_line(self) -> str:
        what = "activation peak" if self.budget_kind == "fraction" else "step peak"
        verdict = "fits" if self.measured_bytes <= self.budget_bytes else "OVER the budget"
        if self.margin_bytes > 0:
            kept = (f"; planned {_size(self.margin_bytes)} under the budget, what an earlier measured plan held "
                    "beyond its simulation")
        elif self.margin_bytes < 0:
            kept = (f"; planned {_size(-self.margin_bytes)} over the budget, what an earlier measured plan held "
                    "below its simulation")
        else:
            kept = ""
        return f"measured on one step: {what} {_size(self.measured_bytes)}, {verdict}{kept}"

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def table(self):
        """The recomputed nodes as a pandas table (node, op, MiB freed from the saved set is not additive)."""
        import pandas as pd

        by_name = {n.name: n for n in self.step.joint.graph.nodes}
        return pd.DataFrame([{"node": name, "op": str(by_name[name].target) if name in by_name else ""}
                             for name in self.recomputed])


def _size(nbytes: float) -> str:
    """Bytes in the unit that reads best: ``512 B``, ``3.2 KiB``, ``12.5 MiB``, ``1.25 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(nbytes)} B"


class BudgetError(ValueError):
    """The budget cannot be met by checkpointing (the message says what the least reachable is)."""


def plan_step(step: StepGraphs, budget: Any, *, persistent_bytes: int = 0, optimizer_step_bytes: int = 0,
              loss_bytes: int | None = None, machine: Machine | None = None,
              time_limit: float = MILP_TIME_LIMIT_S, fused: bool = False,
              candidates: Callable[[StepGraphs], dict[str, set[str]]] | None = None,
              margin_bytes: int = 0, reference_activation_bytes: int | None = None) -> CheckpointPlan:
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
            (:func:`~fxforge.training.costs.node_seconds`), so the plan prefers it to recomputing a
            matrix product or a convolution.
        candidates: called with ``step`` when the step does not fit unconstrained: recomputations another
            partitioner chose (a label -> forward node names; Inductor's min cut at several budgets,
            :func:`~fxforge.training.inductor_partitions.mincut_candidates`): each is simulated and
            costed like the planner's own choices (the cheapest that fits wins, its label the solver), and
            each piece's part of each is one more choice for that piece in the MILP.
        margin_bytes: kept back from the budget: the plan fits ``budget - margin_bytes`` (a measured step held
            that much more than its simulation; :class:`~fxforge.training.module.CheckpointedModule`'s check);
            negative where a measured step held less than its simulation.
        reference_activation_bytes: the unconstrained activation peak a fraction budget is a fraction of, and
            the plan's ``unconstrained_activation_bytes``; default this step's own. A step traced with
            Inductor's decompositions holds more than the model's step does unconstrained (a layer norm's
            decomposition saves its intermediates), so its own peak would make "60 %" allow more than 60 % of
            what the model holds: the module passes the peak of the model's own step here.

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
                              f"{_size(optimizer_phase)} (weights, state, gradients, its temporaries)")

        def excess(sim: StepSimulation) -> int:
            return whole(sim) - target

    units = _units(step, machine, fused)
    pieces = _pieces(units)
    choices = own = _choices(units, pieces)
    trials = _Trials(step, units, excess, target, simulate)
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
            # The offered choices make the MILP harder to prove infeasible at a low bound, and its answers can
            # lead the bisection to no fit where its own choices alone find one (ResNet-50 at 40 %): a
            # bounded search with them, then the plain one if they found nothing.
            best = _cheapest(_offered(trials, offered),
                             _search(trials, pieces, choices, saved_total, OFFERED_MILP_TIME_LIMIT_S,
                                     OFFERED_SEARCH_SECONDS))
        if best is None:
            best = _search(trials, pieces, own, saved_total, time_limit)
        if best is None:
            best = _greedy(trials, pieces)
        if best is None:
            best = _descend(trials, choices)
        if best is not None:
            best = _relax(trials, pieces, best)
    rounds = trials.rounds
    if best is None:
        least = min((figure for _, figure, _ in rounds), default=target + excess(base))
        what = "an activation peak" if kind == "fraction" else "a step peak"
        kept = f", {_size(margin_bytes)} of it kept back for what a measured step held beyond the plan" \
            if margin_bytes > 0 else ""
        free = unconstrained if kind == "fraction" else whole(base)
        raise BudgetError(f"memory_budget {budget!r} ({_size(limit)}{kept}) is below what recomputation reached: "
                          f"{what} of {_size(least)} at best (unconstrained {_size(free)})")
    _, _, chosen_step, sim, solver = best
    recompute_seconds = sum(node_seconds(n, machine, fused=fused) for n in chosen_step.backward.graph.nodes
                            if n.name in chosen_step.recomputed)
    return CheckpointPlan(budget, kind, limit, unconstrained, sim.activation_peak_bytes,
                          whole(base), whole(sim), [n.name for n in chosen_step.saved_nodes()],
                          sorted(chosen_step.recomputed), recompute_seconds, step_seconds, solver, rounds,
                          chosen_step, sim, persistent_bytes, optimizer_phase, time.perf_counter() - started,
                          loss_bytes, margin_bytes=margin_bytes)


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
    rounds: list[tuple[int, int, bool]] = dataclasses.field(default_factory=list)
    closest: dict[str, Any] = dataclasses.field(default_factory=dict)

    def run(self, chosen: set[int], mark: float | None = None) -> tuple[int, StepGraphs, StepSimulation]:
        """``(excess, partition, simulation)`` of recomputing ``chosen``; a round is recorded when ``mark``
        is given."""
        candidate = self.step.repartition(_names(self.units, chosen))
        sim = self.simulate(candidate)
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


def _search(trials: _Trials, pieces, choices: list[Choice], saved_total: float, time_limit: float,
            seconds: float = math.inf) -> tuple | None:
    """Bisect the bound on saved bytes: the largest whose MILP choice fits the budget by simulation.

    Storing everything does not fit (else no search). A bound whose choice fits is a lower end (try saving
    more); one that does not, an upper end (lowered by the simulated excess first, then halfway); a bound
    the MILP cannot meet at all raises the floor. No round starts after ``seconds``.
    """
    high, low, floor = saved_total, None, -1.0
    bound = max(0.0, saved_total - trials.excess(trials.simulate(trials.step)))
    best = None
    started = time.perf_counter()
    for _ in range(MAX_ROUNDS):
        if time.perf_counter() - started > seconds:
            break
        solved = _solve(choices, len(pieces), bound, time_limit) if bound > floor else None
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


def _greedy(trials: _Trials, pieces: list[tuple[list[int], int]]) -> tuple | None:
    """Fixed patterns, when the MILP's choices do not fit: keep one boundary every ``stride`` pieces (at each
    offset) and recompute the rest, as checkpointing every block does when a block is ``stride`` pieces;
    the cheapest pattern that fits by simulation."""
    best = None
    for stride in (2, 3, 4, 6, 8, 1):
        for offset in range(stride):
            chosen = {i for k, (inside, boundary) in enumerate(pieces) for i in inside
                      if trials.units[i].recomputable and not (i == boundary and k % stride == offset)}
            over, candidate, sim = trials.run(chosen, stride)
            if over <= 0:
                best = _cheapest(best, (trials.seconds(chosen), chosen, candidate, sim,
                                        f"pattern (a boundary kept every {stride} pieces)"))
    return best


DESCENT_ROUNDS = 8
"""The most steps :func:`_descend` takes."""

DESCENT_MARGIN = 0.05
""":func:`_descend` starts only from a choice this close to fitting (its excess a fraction of the budget): a
budget far out of reach is refused without it."""

DESCENT_SECONDS = 30.0
""":func:`_descend` stops after the step that passes this many seconds."""


def _descend(trials: _Trials, choices: list[Choice]) -> tuple | None:
    """When neither the MILP's bound nor a pattern fits: a descent on the simulation itself, from the choice
    that came nearest. Each step adds the recomputation that lowers the simulated excess most, among one
    piece's cheap units, one piece, or two consecutive pieces; it stops when the step fits or no addition
    lowers the excess. It starts only within :data:`DESCENT_MARGIN` of the budget and stops after
    :data:`DESCENT_ROUNDS` steps or :data:`DESCENT_SECONDS`.

    The MILP bounds saved bytes plus the largest run the backward rematerializes at once, a proxy that can
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


def _device(step: StepGraphs) -> str:
    for node in step.forward.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return str(value.device)
    return "cpu"
