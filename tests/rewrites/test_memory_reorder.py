"""memory_reorder: optimal where the search finishes (checked against brute force), never worse than the
capture order, effects kept in order, outputs unchanged, fast on 2 000 nodes."""

from __future__ import annotations

import operator
import random
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from examples.models.branchy import BRANCHY, synthetic_2000
from fxforge.core.memory import GraphMemory, simulate_peak
from fxforge.core.shapes import annotate
from fxforge.rewrites.memory_reorder import (
    MEMORY_REORDER,
    apply_order,
    effect_kind,
    plan,
    planning,
    reorder_for_memory,
    run_memory_reorder,
)
from fxforge.rewrites.memory_reorder.problem import _Problem
from fxforge.rewrites.passes import PassContext
from fxforge.runtime.memory import measure_peak

# --------------------------------------------------------------------------------------------------
# small random graphs and brute force


def random_graph(seed: int, max_nodes: int = 9, inplace: bool = False) -> torch.fx.GraphModule:
    """Up to ``max_nodes`` ops on 1-D tensors of different lengths: copies, concatenations, repeats,
    slices and views, ``split`` (multi-output + getitem), reductions, max pooling (scratch memory: its
    indices); with ``inplace``, also ``mul_``."""
    rng = random.Random(seed)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    values: list[tuple[torch.fx.Node, int]] = [(x, 8)]
    count = 0
    kinds = ["scale", "cat", "repeat", "slice", "view", "split", "sum", "pool"] + (["inplace"] * 2 if inplace else [])
    while count < max_nodes:
        kind = rng.choice(kinds)
        # Prefer recent values, so the graphs have some depth as well as width.
        a, length = values[-1 - min(int(rng.expovariate(0.5)), len(values) - 1)]
        if kind == "scale":
            node, new = g.call_function(torch.mul, (a, float(count + 2))), length
        elif kind == "cat":
            b, other = rng.choice(values)
            node, new = g.call_function(torch.cat, ([a, b],)), length + other
        elif kind == "repeat":
            r = rng.choice([2, 3, 4])
            node, new = g.call_method("repeat", (a, r)), length * r
        elif kind == "slice":
            new = max(1, length // 2)
            node = g.call_function(operator.getitem, (a, slice(0, new)))
        elif kind == "view":
            node, new = g.call_method("view", (a, -1)), length
        elif kind == "split":
            if count + 2 > max_nodes:
                continue
            parts = g.call_function(torch.split, (a, max(1, length // 2)))
            node, new = g.call_function(operator.getitem, (parts, 0)), max(1, length // 2)
            count += 1
        elif kind == "sum":
            node, new = g.call_method("sum", (a, 0, True)), 1
        elif kind == "pool":
            if count + 3 > max_nodes or length < 2:
                continue
            pooled = g.call_function(F.max_pool2d, (g.call_method("view", (a, 1, 1, -1)), (1, 2)))
            node, new = g.call_method("view", (pooled, -1)), length // 2
            count += 2
        else:
            if a is x:
                continue
            node, new = g.call_method("mul_", (a, 0.5)), length
        values.append((node, new))
        count += 1
    sinks = [n for n, _ in values[1:] if not n.users]
    g.output(tuple(sinks))
    gm = torch.fx.GraphModule(nn.Module(), g)
    annotate(gm, (torch.randn(8),), {})
    return gm


def brute_force_peak(gm: torch.fx.GraphModule, preds: list[list[int]]) -> tuple[int, int]:
    """(lowest peak, number of orders) over every order of the non-root nodes allowed by ``preds``,
    evaluated with the memory model directly (no bound, no pruning)."""
    mem = GraphMemory(gm)
    sched = [i for i, n in enumerate(mem.nodes) if n.op not in ("placeholder", "get_attr")]
    n = len(sched)
    alloc = [sum(mem.sizes[s] for s in mem.allocs[i] if mem.activation[s]) for i in sched]
    scratch = [mem.scratch[i] for i in sched]
    touches = [[s for s in mem.touches[i] if mem.activation[s]] for i in sched]
    remaining = mem.consumers()
    best, orders = [float("inf")], [0]
    done = [False] * n

    def extend(placed: int, live: int, peak: int) -> None:
        if placed == n:
            orders[0] += 1
            best[0] = min(best[0], peak)
            return
        for k in range(n):
            if done[k] or not all(done[p] for p in preds[k]):
                continue
            done[k] = True
            step = live + alloc[k]
            freed = 0
            for s in touches[k]:
                remaining[s] -= 1
                if remaining[s] == 0 and s not in mem.pinned:
                    freed += mem.sizes[s]
            extend(placed + 1, step - freed, max(peak, step + scratch[k]))
            for s in touches[k]:
                remaining[s] += 1
            done[k] = False

    extend(0, 0, 0)
    return int(best[0]), orders[0]


@pytest.mark.parametrize("heuristics", [True, False], ids=["with-heuristics", "capture-order-bound"])
@pytest.mark.parametrize("seed", range(40))
def test_exact_search_is_optimal_against_brute_force(seed, heuristics, monkeypatch):
    if not heuristics:  # the search alone has to find the optimum, from the capture order's bound
        monkeypatch.setattr(planning, "_HEURISTICS", {"capture order": planning._HEURISTICS["capture order"]})
    gm = random_graph(seed, inplace=seed % 4 == 3)
    problem = _Problem(gm, GraphMemory(gm))
    best, orders = brute_force_peak(gm, problem.preds)
    schedule = plan(gm, time_budget_s=10.0)
    assert schedule.proven_optimal
    assert schedule.peak_after == best, (schedule.peak_after, best, orders)
    assert schedule.lower_bound <= best
    assert schedule.peak_before == simulate_peak(gm).peak_bytes
    assert simulate_peak(gm, schedule.order).peak_bytes == best


def test_some_random_graphs_gain():
    gains = [plan(random_graph(seed)).gain for seed in range(40)]
    assert sum(g > 1 for g in gains) >= 5 and min(gains) >= 1.0


@pytest.mark.parametrize("seed", range(6))
def test_reordered_random_graphs_compute_the_same(seed):
    gm = random_graph(100 + seed, max_nodes=12, inplace=True)
    x = torch.randn(8)
    expected = gm(x.clone())
    schedule = reorder_for_memory(gm)
    got = gm(x.clone())
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert simulate_peak(gm).peak_bytes == schedule.peak_after <= schedule.peak_before


# --------------------------------------------------------------------------------------------------
# heuristics and budgets


def test_out_of_budget_is_the_best_heuristic_and_never_worse_than_capture():
    model, inputs = BRANCHY["randwire_n32"]()
    gm = fxforge.capture(model, inputs).graph_module
    before = simulate_peak(gm).peak_bytes
    schedule = plan(gm, max_states=1)
    (segment,) = schedule.segments
    assert not segment.proven_optimal and "stopped after 1 states" in segment.note
    assert segment.peak_after == min(segment.heuristics.values()) <= segment.peak_before
    assert segment.lower_bound < segment.peak_after
    assert schedule.peak_after <= before
    exact = plan(gm, max_states=1_000_000, time_budget_s=60.0)
    assert exact.proven_optimal and exact.peak_after <= schedule.peak_after
    again = plan(gm, max_states=1_000_000, time_budget_s=60.0)    # budgets in states: the same order
    assert [n.name for n in again.order] == [n.name for n in exact.order]


@pytest.mark.parametrize("name", ["transformer_encoder", "resnet_cnn", "unet", "densenet"])
def test_chains_keep_their_order(name):
    model, inputs = BRANCHY[name]()
    cap = fxforge.capture(model, inputs)
    ctx = PassContext("memory_reorder", training=False, method=cap.method)
    code = cap.graph_module.code
    run_memory_reorder(cap.graph_module, ctx)
    assert ctx.matches == [] and cap.graph_module.code == code
    assert ctx.tuning[-1].choice == "capture order kept"
    assert "proven optimal" in ctx.tuning[-1].note


# --------------------------------------------------------------------------------------------------
# effects


def _positions(gm: torch.fx.GraphModule) -> dict[str, int]:
    return {n.name: i for i, n in enumerate(gm.graph.nodes)}


class MutatedBranch(nn.Module):
    def forward(self, x):                  # x: 1024 floats
        a = x * 2
        wide = a.repeat(4)                 # reads a before the mutation: must stay before it
        a.add_(1)
        temp = a.repeat(8)                 # a large temporary the optimal order would like first
        return wide * temp.sum()


def test_mutation_keeps_its_readers_on_their_side():
    x = torch.randn(1024)
    model = MutatedBranch()
    gm = fxforge.capture(model, (x,)).graph_module
    schedule = reorder_for_memory(gm)
    pos = _positions(gm)
    assert pos["repeat"] < pos["add_"] < pos["repeat_1"]
    assert torch.equal(gm(x), model(x))
    assert schedule.proven_optimal


class Randoms(nn.Module):
    def forward(self, x):
        big = torch.rand(8192)             # drawn first: its values depend on the RNG order
        small = torch.rand(16) + x.sum()
        return big.sum() * small


def test_random_ops_keep_their_relative_order():
    x = torch.randn(16)
    gm = fxforge.capture(Randoms(), (x,)).graph_module
    kinds = {n.name: effect_kind(n, gm) for n in gm.graph.nodes}
    assert kinds["rand"] == kinds["rand_1"] == "global"
    torch.manual_seed(0)
    expected = gm(x)
    reorder_for_memory(gm)
    pos = _positions(gm)
    assert pos["rand"] < pos["rand_1"]
    torch.manual_seed(0)
    assert torch.equal(gm(x), expected)


def test_nothing_crosses_a_grad_mode_switch():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    early = g.call_method("repeat", (x, 8))                    # big, used at the end
    off = g.call_function(torch._C._set_grad_enabled, (False,))
    inside = g.call_function(torch.mul, (x, 2))
    g.call_function(torch._C._set_grad_enabled, (True,))
    late = g.call_method("sum", (early,))
    g.output((inside, late))
    gm = torch.fx.GraphModule(nn.Module(), g)
    annotate(gm, (torch.randn(64),), {})
    assert effect_kind(off, gm) == "barrier"
    schedule = plan(gm)
    order = [n.name for n in schedule.order]
    assert order.index("_set_grad_enabled") < order.index("mul") < order.index("_set_grad_enabled_1")
    assert order.index("repeat") < order.index("_set_grad_enabled")
    assert schedule.segments == []                              # the switches cut the graph


class Opaque(nn.Module):
    """Not a torch.nn module: fxforge cannot see what it does."""

    def forward(self, x):
        return x * 2


def test_opaque_modules_keep_their_order_and_their_inputs_readers():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.mul, (x, 3))
    first = g.call_module("first", (a,))
    reader = g.call_method("repeat", (a, 8))
    second = g.call_module("second", (x,))
    g.output((first, g.call_method("sum", (reader,)), second))
    root = nn.Module()
    root.first, root.second = Opaque(), Opaque()
    gm = torch.fx.GraphModule(root, g)
    annotate(gm, (torch.randn(64),), {})
    problem = _Problem(gm, GraphMemory(gm))
    index = {n.name: k for k, n in enumerate(problem.nodes)}
    assert index["first"] in problem.preds[index["second"]]       # global order
    assert index["first"] in problem.preds[index["repeat"]]       # it might have written a


def test_out_arguments_and_module_effects():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    c = g.call_function(torch.zeros, (64,))
    before = g.call_method("repeat", (c, 8))                    # reads c before it is written
    write = g.call_function(torch.add, (x, 1.0), {"out": c})
    big = g.call_method("repeat", (x, 16))
    g.output((before, c, g.call_method("sum", (big,))))
    gm = torch.fx.GraphModule(nn.Module(), g)
    annotate(gm, (torch.randn(64),), {})
    assert effect_kind(write, gm) == "mutation"
    order = [n.name for n in plan(gm).order]
    assert order.index("repeat") < order.index("add")

    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
    kinds = {}
    for training in (False, True):
        gm = fxforge.capture(model.train(training), (torch.randn(2, 3, 4, 4),)).graph_module
        kinds[training] = [effect_kind(n, gm) for n in gm.graph.nodes if n.op == "call_module"]
    assert kinds[False] == [None, None, "mutation"]       # an in-place ReLU: ordered by its storage only
    # In training mode every module call counts as effectful (BatchNorm updates its running statistics;
    # graph_utils.is_effectful does not tell modules apart there): they keep their order.
    assert kinds[True] == ["global", "global", "global"]


def test_nodes_without_metadata_are_refused():
    gm = torch.fx.symbolic_trace(MutatedBranch())
    ctx = PassContext("memory_reorder", training=False, method="fx")
    run_memory_reorder(gm, ctx)
    assert ctx.matches == [] and "no shape metadata" in ctx.near_misses[0].reason


def test_apply_order_rejects_invalid_orders():
    gm = fxforge.capture(MutatedBranch(), (torch.randn(16),)).graph_module
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    with pytest.raises(ValueError, match="before its input"):
        apply_order(gm, list(reversed(nodes)))
    with pytest.raises(ValueError, match="every node"):
        apply_order(gm, nodes[:-1])


# --------------------------------------------------------------------------------------------------
# through the pipeline


def test_pipeline_reorders_verifies_and_reports():
    model, inputs = BRANCHY["randwire_n16"]()
    cap = fxforge.capture(model, inputs)
    before_sim = simulate_peak(cap.graph_module).peak_bytes
    before_measured = measure_peak(cap.graph_module, *inputs).peak_bytes
    new = fxforge.rewrite(cap, [MEMORY_REORDER])
    report = new.report
    assert report.counts == {"memory_reorder": 1} and report.rolled_back == []
    assert any(v.startswith("memory_reorder") for v in report.verified)
    with torch.no_grad():
        assert torch.equal(new.graph_module(*inputs), model(*inputs))
    after_sim = simulate_peak(new.graph_module).peak_bytes
    after_measured = measure_peak(new.graph_module, *inputs).peak_bytes
    assert after_sim < before_sim
    simulated_ratio, measured_ratio = before_sim / after_sim, before_measured / after_measured
    assert abs(measured_ratio / simulated_ratio - 1) <= 0.05
    text = str(report)
    assert "memory_reorder schedule segment 0" in text and "proven optimal" in text
    assert "memory_reorder schedule graph: reordered (capture order 1.2 MiB, reordered 1 MiB)" in text
    assert "MiB" in report._repr_html_()


def test_2000_node_graph_is_scheduled_in_under_2_seconds():
    model, inputs = synthetic_2000()
    gm = fxforge.capture(model, inputs).graph_module
    assert len(gm.graph.nodes) >= 2000
    before = simulate_peak(gm).peak_bytes
    started = time.perf_counter()
    schedule = reorder_for_memory(gm)
    seconds = time.perf_counter() - started
    assert seconds < 2.0, seconds
    assert simulate_peak(gm).peak_bytes == schedule.peak_after <= before
    assert len(schedule.segments) > 20
