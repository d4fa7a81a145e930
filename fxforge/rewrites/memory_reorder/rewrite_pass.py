"""The ``memory_reorder`` rewrite pass: plan the order, apply it, and say in the report what was done.

What the pass records in ``ctx``: a refusal (near miss) when a node lacks shape metadata; one match per
reordered segment (its method, whether proven optimal, its simulated peak before and after); one
``schedule`` tuning line per segment with more than one valid order and one for the whole graph (peaks
in MiB).

Example:
    >>> MEMORY_REORDER.name, MEMORY_REORDER.keeps_meta
    ('memory_reorder', True)
"""

from __future__ import annotations

import torch

from fxforge.rewrites.memory_reorder.planning import MAX_STATES, TIME_BUDGET_S, apply_order, plan
from fxforge.rewrites.passes import Pass, PassContext, Refusal


def _mib(nbytes: int) -> float:
    return nbytes / 2**20


def run_memory_reorder(gm: torch.fx.GraphModule, ctx: PassContext, *, time_budget_s: float = TIME_BUDGET_S,
                       max_states: int = MAX_STATES) -> None:
    """The ``memory_reorder`` pass: reorder ``gm`` (see the module docstring) and report per segment.

    A graph with a node lacking shape metadata is left alone (refused at that node).

    Example:
        >>> from fxforge.rewrites.passes import PassContext
        >>> gm = fxforge.capture(torch.nn.ReLU(), (torch.ones(4),)).graph_module
        >>> ctx = PassContext("memory_reorder", training=False, method="fx")
        >>> run_memory_reorder(gm, ctx); ctx.matches, ctx.tuning[0].choice
        ([], 'capture order kept')
    """
    missing = [n for n in gm.graph.nodes if n.op not in ("output", "placeholder", "get_attr") and "val" not in n.meta]
    if missing:
        ctx.refused(missing[0], Refusal("no shape metadata: the memory of the graph cannot be simulated"))
        return
    schedule = plan(gm, time_budget_s=time_budget_s, max_states=max_states)
    if schedule.peak_after > schedule.peak_before:  # cannot happen; never make it worse if it does
        ctx.tuned("graph", "capture order kept", {"capture order": _mib(schedule.peak_before)},
                  "the planned order was worse", unit="MiB", kind="schedule")
        return
    names = {node.name: node for node in gm.graph.nodes}
    if schedule.changed:
        for segment in schedule.segments:
            if segment.method == "capture order":
                continue
            moved = [a for a, b in zip(segment.nodes, segment.capture_nodes) if a != b]
            proven = ", proven optimal" if segment.proven_optimal else ""
            ctx.matched(f"segment {segment.index} reordered ({segment.method}{proven}): simulated peak "
                        f"{_mib(segment.peak_before):.3g} -> {_mib(segment.peak_after):.3g} MiB",
                        [names[name] for name in moved[:6]])
        apply_order(gm, schedule.order)
    for segment in schedule.segments:
        proven = "proven optimal" if segment.proven_optimal else (
            f"not proven ({segment.note}); lower bound {_mib(segment.lower_bound):.3g} MiB")
        searched = f"; {segment.states} states searched" if segment.states else ""
        span = f"{segment.capture_nodes[0]}..{segment.capture_nodes[-1]}, {len(segment.nodes)} nodes"
        ctx.tuned(f"segment {segment.index} ({span})", segment.method,
                  {"capture order": _mib(segment.peak_before), "reordered": _mib(segment.peak_after)},
                  proven + searched, unit="MiB", kind="schedule")
    proven = "proven optimal" if schedule.proven_optimal else f"lower bound {_mib(schedule.lower_bound):.3g} MiB"
    ctx.tuned("graph", "reordered" if schedule.changed else "capture order kept",
              {"capture order": _mib(schedule.peak_before), "reordered": _mib(schedule.peak_after)},
              f"{proven}; {len(schedule.segments)} segments, {schedule.cuts} fixed nodes; "
              f"planned in {schedule.seconds * 1000:.0f} ms", unit="MiB", kind="schedule")


def memory_reorder_pass(time_budget_s: float = TIME_BUDGET_S, max_states: int = MAX_STATES) -> Pass:
    """The ``memory_reorder`` pass with its own search budget (the built-in one uses the defaults).

    Example:
        >>> memory_reorder_pass(max_states=1_000_000, time_budget_s=60.0).name
        'memory_reorder'
    """

    def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        run_memory_reorder(gm, ctx, time_budget_s=time_budget_s, max_states=max_states)

    return Pass("memory_reorder", run, "reorder nodes for the lowest simulated peak memory (exact where feasible)",
                keeps_meta=True)


MEMORY_REORDER = memory_reorder_pass()
