"""Inductor's min-cut partitions offered to the planner (``target="inductor"``): what they recompute, and that a
plan takes an offer when it is the cheapest choice that fits by simulation (issue 22)."""

from __future__ import annotations

import pytest
import torch

from fxforge.core.costs import node_seconds
from fxforge.runtime.roofline import measure_machine
from fxforge.training import checkpointing, inductor_partitions
from fxforge.training.checkpointing import plan_step
from fxforge.training.compiled import inductor_decompositions
from fxforge.training.eager_graph import eager_like_graph
from fxforge.training.inductor_partitions import mincut_candidates, mincut_recomputations
from fxforge.training.step_graph import is_random, trace_step
from fxforge.training.timeline import simulate_step
from tests.training.models import gpt2, ids, images, vit

MATRIX_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _traced(model: torch.nn.Module, x: torch.Tensor):
    graph_module = eager_like_graph(model, (x,), {})
    return trace_step(graph_module, (x,), {}, loss=None, decompositions=inductor_decompositions())


@pytest.fixture(scope="module")
def gpt2_step():
    return _traced(gpt2(dropout=0.1, layers=1), ids(0))


@pytest.fixture(scope="module")
def gpt2_sets(gpt2_step):
    """Inductor's partitions of the GPT-2 step at the default budgets (a min cut each, seconds)."""
    return mincut_recomputations(gpt2_step)


def _offering(monkeypatch, sets):
    """:func:`mincut_candidates` labels ``sets`` (computed once by the test) rather than partitioning again."""
    monkeypatch.setattr(inductor_partitions, "mincut_recomputations", lambda step, budgets=None: sets)


def test_the_default_min_cut_recomputes_elementwise_ops_never_a_random_one(gpt2_step, gpt2_sets):
    sets = gpt2_sets
    by_name = {n.name: n for n in gpt2_step.joint.graph.nodes}
    forward = {n.name for n in gpt2_step.forward_nodes()}
    assert sets.get(1.0)
    for names in sets.values():
        assert names <= forward
        assert not [n for n in names if is_random(by_name[n])]
    # Inductor's default (budget 1.0) recomputes only what its min cut finds free: no matrix product.
    assert not [n for n in sets[1.0] if by_name[n].target in MATRIX_PRODUCTS]
    # No budget offers the same recomputation as another.
    assert len({frozenset(s) for s in sets.values()}) == len(sets)


def test_the_offers_are_labelled_with_their_budget(monkeypatch, gpt2_step, gpt2_sets):
    _offering(monkeypatch, gpt2_sets)
    labels = list(mincut_candidates(gpt2_step))
    assert len(labels) == len(gpt2_sets)
    assert labels[0] == "Inductor's min-cut partition (activation_memory_budget 1), simulated"
    assert all(label.startswith("Inductor's min-cut partition (activation_memory_budget ") for label in labels)


def test_an_offer_that_fits_is_taken_when_the_search_finds_nothing(monkeypatch):
    """With the MILP's search stalled, a budget that one of the offers meets by simulation is met by it (and
    the plan says which); the budget is set at the lowest simulated activation peak among the offers."""
    step = _traced(vit(layers=1), images(0, batch=8))
    base = simulate_step(step).activation_peak_bytes
    sets = mincut_recomputations(step)
    peaks = {budget: simulate_step(step.repartition(names)).activation_peak_bytes for budget, names in sets.items()}
    lowest = min(peaks.values())
    assert lowest < base
    _offering(monkeypatch, sets)
    monkeypatch.setattr(checkpointing, "_search", lambda *args, **kwargs: None)
    plan = plan_step(step, min(1.0, (lowest + 1) / base), fused=True, candidates=mincut_candidates)
    assert plan.solver.startswith("Inductor's min-cut partition (activation_memory_budget ")
    assert plan.predicted_activation_peak_bytes <= plan.budget_bytes


def test_recomputation_the_simulation_does_not_need_is_given_back(monkeypatch):
    """From a plan that recomputes more than the budget needs (the MILP's search stalled, the densest pattern
    found instead), the planner drops recomputation group by group while the simulated step still fits: fewer
    nodes recomputed, less predicted overhead, the budget still met."""
    found = {}
    patterns = checkpointing._greedy

    def recorded(trials, pieces):
        best = patterns(trials, pieces)
        if best is not None:
            pattern = best[2]
            found.update(nodes=len(pattern.recomputed),
                         seconds=sum(node_seconds(n, machine) for n in pattern.backward.graph.nodes
                                     if n.name in pattern.recomputed))
        return best

    monkeypatch.setattr(checkpointing, "_search", lambda *args, **kwargs: None)
    monkeypatch.setattr(checkpointing, "_greedy", recorded)
    step = _traced(gpt2(dropout=0.0), ids(0))
    machine = measure_machine("cpu")
    plan = plan_step(step, "85%", machine=machine)
    assert plan.solver.startswith("pattern (") and "given back" in plan.solver
    assert len(plan.recomputed) < found["nodes"]
    assert plan.recompute_seconds < found["seconds"]
    assert plan.predicted_activation_peak_bytes <= plan.budget_bytes
