"""Budgeted checkpointing: the plan fits its budget by simulation, the MILP is exact for its model (issue 22)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from fxforge.training import BudgetError, plan_checkpointing
from fxforge.training.checkpointing import Choice, parse_budget
from fxforge.training.recompute_choices import ChainFrontier
from tests.training.milp_oracle import solve as _solve
from tests.training.models import gpt2, ids, images, resnet


def _mlp(layers: int = 8, width: int = 128) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])


@pytest.mark.parametrize("text, expected", [("60%", ("fraction", 0.6)), (0.25, ("fraction", 0.25)),
                                            (4096, ("bytes", 4096.0)), ("2 MiB", ("bytes", 2.0 * 2**20)),
                                            ("1.5GB", ("bytes", 1.5e9)), ("100%", ("fraction", 1.0))])
def test_budgets_are_read(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", ["0%", "120%", "lots", -5, 0, True, "5 parsecs"])
def test_a_malformed_budget_is_refused_with_the_value(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        parse_budget(bad)


def test_the_peak_falls_with_the_budget_and_always_fits():
    model, x = gpt2(dropout=0.0, layers=4), ids(0, seq=128)
    # By simulation, unchecked: a measured step's re-plans are test_module.py's.
    plans = [plan_checkpointing(model, (x,), f"{f}%", check=False) for f in (100, 80, 60, 45)]
    assert plans[0].recomputed == [] and plans[0].overhead == 0
    for plan in plans:
        assert plan.predicted_activation_peak_bytes <= plan.budget_bytes, str(plan)
    peaks = [p.predicted_activation_peak_bytes for p in plans]
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < 0.5 * peaks[0]
    overheads = [p.overhead for p in plans]
    assert overheads == sorted(overheads) and 0 < overheads[-1] < 0.5
    assert "dynamic programming" in plans[-1].solver
    assert all(not n.startswith("bernoulli") for p in plans for n in p.recomputed)


def test_the_descent_on_the_simulation_fits_where_the_bisection_and_the_patterns_stall(monkeypatch):
    """With the bisection and the patterns stalled (their closest choice: nothing recomputed), the descent adds
    recomputation piece by piece until the simulated step fits, when the closest choice is within
    DESCENT_MARGIN of the budget (on GPT-2 at per-block checkpointing's peak, the MILP's proxy stalls 0.1 MiB
    above it: benchmarks/RESULTS.md)."""
    from fxforge.training import checkpointing

    def stalled(trials, *args, **kwargs):
        trials.closest.update(over=trials.excess(trials.simulate(trials.step)), chosen=set())

    monkeypatch.setattr(checkpointing, "_search", stalled)
    monkeypatch.setattr(checkpointing, "_greedy", lambda *args: None)
    model, x = gpt2(dropout=0.0, layers=4), ids(0, seq=128)
    plan = plan_checkpointing(model, (x,), "97%", check=False)  # nothing recomputed is 3 % over: within the margin
    assert plan.solver.startswith("descent on the simulation")
    assert plan.recomputed and plan.predicted_activation_peak_bytes <= plan.budget_bytes
    fits = [f for _, _, f in plan.rounds]
    first = fits.index(True)  # the descent's step that fits (a round of giving back may follow it)
    assert not any(fits[:first]) and all(fits[first:]) and len(fits) - first <= 2
    # A budget far from the closest choice is refused without a descent.
    with pytest.raises(BudgetError, match="below what recomputation reached"):
        plan_checkpointing(model, (x,), "70%", check=False)


def test_a_budget_in_bytes_caps_the_whole_step():
    model, x = resnet(), images(0, batch=8)
    free = plan_checkpointing(model, (x,), "100%", check=False)
    cap = int(free.unconstrained_peak_bytes * 0.85)
    plan = plan_checkpointing(model, (x,), cap, check=False)
    assert plan.budget_kind == "bytes" and plan.predicted_peak_bytes <= cap < plan.unconstrained_peak_bytes
    assert plan.recomputed


def test_an_unreachable_budget_says_what_can_be_reached():
    with pytest.raises(BudgetError, match=r"below what recomputation reached: an activation peak of [0-9.]+ (MiB|KiB)"):
        plan_checkpointing(_mlp(), (torch.randn(256, 128),), "10%", optimizer=None)
    with pytest.raises(BudgetError, match="the optimizer step alone needs"):
        plan_checkpointing(_mlp(), (torch.randn(256, 128),), 1000)


def test_the_plan_is_printed_with_what_it_costs():
    plan = plan_checkpointing(_mlp(), (torch.randn(256, 128),), "85%", optimizer=None)
    text = str(plan)
    for phrase in ("budget: 85% of the activation peak", "activation peak:", "recomputed:", "predicted overhead:",
                   "solver: dynamic programming"):
        assert phrase in text
    assert len(plan.table()) == len(plan.recomputed)


def _brute_force(choices: list[Choice], pieces: int, limit: float) -> float | None:
    best = None
    for r in range(1, pieces + 1):
        for subset in itertools.combinations(range(len(choices)), r):
            covered = sorted(k for i in subset for k in range(choices[i].pieces[0], choices[i].pieces[1] + 1))
            if covered != list(range(pieces)):
                continue
            saved = sum(choices[i].saved for i in subset) + max(choices[i].rematerialized for i in subset)
            if saved <= limit:
                cost = sum(choices[i].seconds for i in subset)
                best = cost if best is None else min(best, cost)
    return best


def _random_chain(seed: int) -> tuple[list[Choice], int, float]:
    rng = random.Random(seed)
    pieces = rng.randint(2, 5)
    choices = []
    for first in range(pieces):
        store = rng.randint(10, 100)
        choices.append(Choice((first, first), set(), store, 0, 0.0, "store"))
        for last in range(first, pieces):
            choices.append(Choice((first, last), {100 * first + last}, rng.randint(1, 30), rng.randint(10, 200),
                                  rng.uniform(0.1, 5.0), "recompute"))
    return choices, pieces, rng.uniform(30, 250)


@pytest.mark.parametrize("seed", range(12))
def test_the_milp_is_the_brute_force_optimum_on_small_random_chains(seed):
    choices, pieces, limit = _random_chain(seed)
    expected = _brute_force(choices, pieces, limit)
    solved = _solve(choices, pieces, limit, time_limit=10)
    if expected is None:
        assert solved is None
        return
    chosen, _ = solved
    cost = sum(c.seconds for c in choices if c.recomputed and c.recomputed <= chosen)
    assert cost == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("seed", range(40))
def test_the_frontier_is_the_brute_force_optimum_on_small_random_chains(seed):
    """The dynamic programming the bisection reads is exact where bytes are whole grains (these are)."""
    choices, pieces, limit = _random_chain(seed)
    expected = _brute_force(choices, pieces, limit)
    solved = ChainFrontier(choices, pieces).solve(limit)
    if expected is None:
        assert solved is None
        return
    chosen, note = solved
    cost = sum(c.seconds for c in choices if c.recomputed and c.recomputed <= chosen)
    assert cost == pytest.approx(expected, rel=1e-9) and note.startswith("dynamic programming")


def test_the_frontier_is_the_milp_on_a_real_chain():
    """On the choices of a real step (the user-style U-Net, 28 pieces, 400+ choices), the frontier's answer for
    every bound the bisection may ask costs what HiGHS proves least (to the frontier's grain), and building it
    takes less than the MILPs of one bisection did (0.2 s each)."""
    import sys
    import time
    from pathlib import Path

    from fxforge.core.costs import Machine
    from fxforge.training.recompute_choices import _choices
    from fxforge.training.recompute_units import _pieces, _units
    from fxforge.training.step_graph import trace_step

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "user_models"))
    from hand_written import UNet

    torch.manual_seed(0)
    step = trace_step(UNet().train(), (torch.randn(1, 3, 64, 64),), {}, loss=None)
    units = _units(step, Machine("cpu", peak_gflops=100.0, bandwidth_gbs=20.0, measured_at="2026-01-01"), False)
    pieces = _pieces(units)
    choices = _choices(units, pieces)
    started = time.perf_counter()
    frontier = ChainFrontier(choices, len(pieces))
    built = time.perf_counter() - started
    total = sum(c.saved for c in choices if c.mode == "store")
    answered_bounds = 0
    for fraction in (0.9, 0.7, 0.5, 0.35, 0.2, 0.05):
        bound = fraction * total
        solved, answered = _solve(choices, len(pieces), bound, time_limit=30), frontier.solve(bound)
        assert (solved is None) == (answered is None), fraction
        if solved is None:
            continue
        (milp, _), (chosen, _) = solved, answered
        answered_bounds += 1
        spent = sum(units[i].seconds for i in chosen)
        least = sum(units[i].seconds for i in milp)
        assert spent <= least * 1.001 + 1e-12, (fraction, spent, least)
    assert len(pieces) >= 20 and len(choices) >= 300 and answered_bounds >= 4
    assert built < 2.0


def test_the_patterns_stop_when_they_come_no_closer():
    """Patterns are tried cheapest first; after GREEDY_PATIENCE in a row that come no closer than the closest
    before them, the rest are not partitioned (an unreachable budget on an LSTM: 21 patterns, each a whole
    partition, all missing by the same amount)."""
    from types import SimpleNamespace

    from fxforge.training import budget_search

    units = [SimpleNamespace(recomputable=True, seconds=1.0 + i / 100) for i in range(24)]
    pieces = [([2 * k, 2 * k + 1], 2 * k + 1) for k in range(12)]
    tried = []

    def run(chosen, mark=None):
        tried.append(frozenset(chosen))
        return (100 - len(tried) if len(tried) <= 3 else 100), None, None  # closer three times, then stalls

    trials = SimpleNamespace(units=units, run=run, seconds=lambda chosen: sum(units[i].seconds for i in chosen))
    assert budget_search._greedy(trials, pieces) is None
    assert len(tried) == 3 + budget_search.GREEDY_PATIENCE
    assert len(set(tried)) == len(tried)

    def fits_at_the_fifth(chosen, mark=None):
        tried.append(frozenset(chosen))
        return (-1 if len(tried) == 5 else 100), "step", "sim"

    tried.clear()
    trials.run = fits_at_the_fifth
    found = budget_search._greedy(trials, pieces)
    assert found is not None and found[2] == "step" and len(tried) == 5
