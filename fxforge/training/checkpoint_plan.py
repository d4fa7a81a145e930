"""What a budgeted training step saves and recomputes, and what it is predicted to cost: the planner's
answer (:func:`~fxforge.training.checkpointing.plan_step`).

Example:
    >>> format_bytes(512), format_bytes(3.2 * 2**10), format_bytes(1.25 * 2**30)
    ('512 B', '3.2 KiB', '1.25 GiB')
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from fxforge.core.units import format_bytes
from fxforge.training.step_graph import StepGraphs
from fxforge.training.timeline import StepSimulation


def _is_view(node: Any) -> bool:
    """Whether a node returns an alias of an input (a view, ``detach``, ``t``, a multi-output op's
    ``getitem``): no work to recompute."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


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
            run on oneDNN (:func:`~fxforge.lowering.gemm.route_matmuls`), and ``"convolutions"``; None for the
            op-by-op runner.

    Example:
        >>> from fxforge.training import plan_checkpointing
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
        >>> plan = plan_checkpointing(model.train(), (torch.randn(32, 64),), "100%", optimizer=None)
        >>> plan.budget_kind, plan.recomputed, plan.overhead
        ('fraction', [], 0.0)
        >>> str(plan).splitlines()[0]
        'budget: 100% of the activation peak -> activations <= 32.0 KiB'
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
    def over_budget_bytes(self) -> int | None:
        """How far the measured figure is above the budget (<= 0: the measured step fits); None when the plan
        was not measured (``check=False``, or not on CPU)."""
        return None if self.measured_bytes is None else self.measured_bytes - self.budget_bytes

    @property
    def fits(self) -> bool:
        """Whether the plan fits its budget: measured where it was measured, else by its simulation (the
        simulated figure the budget bounds)."""
        if self.measured_bytes is not None:
            return self.measured_bytes <= self.budget_bytes
        simulated = (self.predicted_activation_peak_bytes if self.budget_kind == "fraction"
                     else self.predicted_peak_bytes)
        return simulated <= self.budget_bytes

    def recomputed_by_module(self) -> list[tuple[str, list[str], list[str]]]:
        """The recomputed work grouped by the module that ran it, in forward order: ``(module, source lines,
        nodes)``, the module as ``named_modules()`` names it (``""`` for the model's own forward), the source
        lines ``file.py:12: code`` of the user's code that made the nodes (first seen first).

        Views and aliases (a weight's transpose, a ``detach``, a ``getitem``) are left out: recomputing them costs nothing.

        Example:
            >>> from fxforge.training import plan_checkpointing
            >>> model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(128, 128), torch.nn.Tanh())])
            >>> plan = plan_checkpointing(model.train(), (torch.randn(256, 128),), "80%", optimizer=None)
            >>> groups = plan.recomputed_by_module()
            >>> len(groups) > 0, {module for module, _, _ in groups} <= set(dict(model.named_modules()))
            (True, True)
        """
        from fxforge.core.source import node_source
        from fxforge.training.step_graph import module_of

        recomputed = set(self.recomputed)
        groups: dict[str, tuple[list[str], list[str]]] = {}
        for node in self.step.joint.graph.nodes:
            if node.name in recomputed and not _is_view(node):
                lines, nodes = groups.setdefault(module_of(node), ([], []))
                nodes.append(node.name)
                line = node_source(node)
                if line and line not in lines:
                    lines.append(line)
        return [(module, lines, nodes) for module, (lines, nodes) in groups.items()]

    @property
    def overhead(self) -> float:
        """Predicted extra step time from recomputation, as a fraction of the forward+backward time."""
        return self.recompute_seconds / self.step_seconds if self.step_seconds else 0.0

    def lines(self) -> list[str]:
        """The plan as report lines."""
        what = (f"{self.budget} of the activation peak -> activations <= {format_bytes(self.budget_bytes)}"
                if self.budget_kind == "fraction" else f"{format_bytes(self.budget_bytes)} for the whole step")
        return [
            f"budget: {what}",
            (f"activation peak: {format_bytes(self.unconstrained_activation_bytes)} -> "
             f"{format_bytes(self.predicted_activation_peak_bytes)} (simulated, backward liveness included)"),
            f"step peak: {format_bytes(self.unconstrained_peak_bytes)} -> {format_bytes(self.predicted_peak_bytes)}",
            (f"saved for backward: {len(self.saved)} values ({format_bytes(self.simulation.saved_bytes)}); "
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
        over = self.measured_bytes - self.budget_bytes
        verdict = (f"fits the budget of {format_bytes(self.budget_bytes)}" if over <= 0 else
                   f"{format_bytes(over)} OVER the budget of {format_bytes(self.budget_bytes)}")
        if self.margin_bytes > 0:
            kept = (f"; planned {format_bytes(self.margin_bytes)} under the budget, what an earlier measured plan held "
                    "beyond its simulation")
        elif self.margin_bytes < 0:
            kept = (f"; planned {format_bytes(-self.margin_bytes)} over the budget, what an earlier measured plan held "
                    "below its simulation")
        else:
            kept = ""
        return f"measured on one step: {what} {format_bytes(self.measured_bytes)}, {verdict}{kept}"

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def table(self):
        """The recomputed nodes as a pandas table (node, op, MiB freed from the saved set is not additive)."""
        import pandas as pd

        by_name = {n.name: n for n in self.step.joint.graph.nodes}
        return pd.DataFrame([{"node": name, "op": str(by_name[name].target) if name in by_name else ""}
                             for name in self.recomputed])
