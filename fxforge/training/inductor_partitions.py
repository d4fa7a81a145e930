"""Inductor's own partitioner's choices, as candidate recomputations for a plan Inductor will compile.

Inductor splits a joint graph with ``min_cut_rematerialization_partition``: a min cut over the graph chooses,
value by value, what the forward saves and what the backward recomputes from it (it keeps a layer norm's
statistics and recomputes its normalization, it keeps a matrix product's output and recomputes the GELU after
it, as the example shows), and under ``torch._functorch.config.activation_memory_budget`` a knapsack
recomputes more. Its choice is finer than the planner's pieces (:mod:`fxforge.training.checkpointing`
chooses per run of the forward), but it does not simulate the backward's liveness: its budget bounds its
estimate of the saved bytes, not the step's peak, and the peak is not monotonic in it.

:func:`mincut_recomputations` runs that partitioner on a copy of the step's joint graph at a few budgets and
returns, for each, the forward nodes its backward recomputes. The planner takes them as candidates
(``candidates=`` in :func:`~fxforge.training.checkpointing.plan_step`): each is simulated and costed like its
own choices, and each piece's part of each joins the ways to keep that piece.

Example:
    >>> from fxforge.training.compiled import inductor_decompositions
    >>> from fxforge.training.step_graph import trace_step
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    >>> step = trace_step(model.train(), (torch.randn(32, 64),), {}, decompositions=inductor_decompositions())
    >>> sets = mincut_recomputations(step, budgets=(1.0,))
    >>> sorted({str(n.target) for n in step.joint.graph.nodes if n.name in sets[1.0]})  # GELU's
    ['aten.add.Tensor', 'aten.erf.default', 'aten.mul.Tensor']
"""

from __future__ import annotations

import copy

import torch

from fxforge.training.step_graph import StepGraphs, is_random

MINCUT_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2)
"""The ``activation_memory_budget`` values whose partitions are offered: 1.0 is Inductor's default (only what
its min cut finds free to recompute), the others its knapsack's choices at those fractions."""


def mincut_recomputations(step: StepGraphs, budgets: tuple[float, ...] = MINCUT_BUDGETS
                          ) -> dict[float, set[str]]:
    """Per budget, the forward nodes of ``step``'s joint graph that Inductor's partitioner recomputes.

    Random nodes are left out (the planner never recomputes them); a budget whose partition recomputes the
    same nodes as a larger budget's is left out too. A partition that fails is skipped: the candidates are
    offers, the planner's own choices stand without them.
    """
    from torch._functorch.partitioners import min_cut_rematerialization_partition  # imports Inductor
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    forward = {n.name for n in step.forward_nodes() if not is_random(n)}
    found: dict[float, set[str]] = {}
    for budget in budgets:
        joint = copy.deepcopy(step.joint)  # the partitioner cleans and re-tags the graph it is given
        try:
            with torch._functorch.config.patch(activation_memory_budget=budget), _use_lazy_graph_module(True):
                _, backward = min_cut_rematerialization_partition(joint, step.joint_inputs, compiler="inductor",
                                                                  **step.partition_kwargs)
        except Exception:  # noqa: BLE001, S112 - an offer that cannot be made is no error of the plan
            continue
        recomputed = {n.name for n in backward.graph.nodes if n.op == "call_function" and n.name in forward}
        if recomputed and recomputed not in found.values():
            found[budget] = recomputed
    return found


def mincut_candidates(step: StepGraphs) -> dict[str, set[str]]:
    """:func:`mincut_recomputations` labelled for a plan's report (``candidates=`` of
    :func:`~fxforge.training.checkpointing.plan_step`).

    Example:
        >>> from fxforge.training.compiled import inductor_decompositions
        >>> from fxforge.training.step_graph import trace_step
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
        >>> step = trace_step(model.train(), (torch.randn(32, 64),), {}, decompositions=inductor_decompositions())
        >>> list(mincut_candidates(step))[0]
        "Inductor's min-cut partition (activation_memory_budget 1), simulated"
    """
    return {f"Inductor's min-cut partition (activation_memory_budget {b:g}), simulated": names
            for b, names in mincut_recomputations(step).items()}
