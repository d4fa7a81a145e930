"""``memory_reorder``: put the nodes in the topological order with the lowest simulated peak memory.

The code torch.fx generates frees every value after its last use, so on a branchy graph (randomly wired
networks, Inception blocks, NAS cells) the order of the nodes decides how much is alive at once. This
pass chooses the order with the memory model of :mod:`fxforge.core.memory` (views and in-place ops
allocate nothing, inputs and parameters are not counted, outputs live to the end, a few ops' scratch
counts while they run). Select it as ``fxforge.rewrite(cap, [..., MEMORY_REORDER])``, or
:func:`memory_reorder_pass` for another search budget.

How:

1. **Which orders are allowed.** Data dependencies, plus: an op that mutates a tensor (in place, or
   through ``out=``) keeps its place relative to every other node touching that storage (through any
   view, and module calls owning a mutated parameter); ops with effects fxforge cannot
   confine to a storage (random numbers, opaque modules, modules in training mode, assertions) keep their
   relative order, and also keep it with the nodes touching their inputs; grad-mode and autocast switches
   are barriers nothing crosses.
2. **Segments.** A node that every other node is an ancestor or a descendant of passes through every
   valid order at the same place; the graph is cut there and each segment between two cuts is scheduled
   on its own (the set of nodes done, and therefore the memory alive, at a cut is the same whatever the
   order before it).
3. **Heuristics** give an upper bound: the capture order, least-peak-first greedy, list scheduling by
   bytes freed, and a depth-first order that computes the input with the largest footprint first.
4. **Exact search**: best-first over sets of scheduled nodes (the memory alive depends only on the set,
   not on the order it was reached in, so each set is one state), ordered by a lower bound of every
   completion: the peak so far, what must be alive when each remaining node runs whatever the order, and
   what is alive now plus the smallest next step. A node that frees at least what it allocates without
   raising the bound is scheduled at once (that never hurts); states that cannot beat the heuristics'
   peak are dropped. When the search ends within its budget (counted in states, so the result does not
   depend on the machine's load) the result is proven optimal; otherwise the best heuristic is used, with
   the lower bound the search reached.

The chosen order is never worse than the capture order (checked on the whole graph before the graph is
changed). The report has one ``schedule`` line per segment with a choice (method, simulated peak before
and after, proven or not) and one for the graph.

The package, one question per module:

- :mod:`~fxforge.rewrites.memory_reorder.problem`: which orders are allowed (:func:`effect_kind`, the
  dependency graph with the edges effects add) and the memory each node's step takes;
- :mod:`~fxforge.rewrites.memory_reorder.segment`: scheduling one segment (its peak, the heuristics, the
  lower bound and the exact search with its budget);
- :mod:`~fxforge.rewrites.memory_reorder.planning`: the whole graph, usable on its own outside the pass
  (:func:`plan` a GraphModule into a :class:`Schedule`, :func:`apply_order`, :func:`reorder_for_memory`);
- :mod:`~fxforge.rewrites.memory_reorder.rewrite_pass`: the pass (:func:`run_memory_reorder`,
  :func:`memory_reorder_pass`, :data:`MEMORY_REORDER`) and what it records in the report.

Example:
    >>> from fxforge.rewrites.passes import PassContext
    >>> class Branches(torch.nn.Module):
    ...     def forward(self, x):                # x: 1024 floats, 4 KiB (an input: not counted)
    ...         wide = x.repeat(4)               # 16 KiB, needed at the end
    ...         temp = x.repeat(8)               # 32 KiB, only to compute ...
    ...         small = temp.sum()               # ... a scalar
    ...         return wide * small
    >>> gm = fxforge.capture(Branches(), (torch.ones(1024),)).graph_module
    >>> ctx = PassContext("memory_reorder", training=False, method="fx")
    >>> run_memory_reorder(gm, ctx)
    >>> [n.name for n in gm.graph.nodes]
    ['x', 'repeat_1', 'sum_1', 'repeat', 'mul', 'output']
    >>> ctx.matches[0].what
    'segment 0 reordered (size-ordered DFS, proven optimal): simulated peak 0.0469 -> 0.0313 MiB'
"""

from fxforge.rewrites.memory_reorder.planning import (
    MAX_STATES,
    TIME_BUDGET_S,
    Schedule,
    SegmentSchedule,
    apply_order,
    plan,
    reorder_for_memory,
)
from fxforge.rewrites.memory_reorder.problem import effect_kind
from fxforge.rewrites.memory_reorder.rewrite_pass import (
    MEMORY_REORDER,
    memory_reorder_pass,
    run_memory_reorder,
)

__all__ = [
    "MAX_STATES",
    "MEMORY_REORDER",
    "TIME_BUDGET_S",
    "Schedule",
    "SegmentSchedule",
    "apply_order",
    "effect_kind",
    "memory_reorder_pass",
    "plan",
    "reorder_for_memory",
    "run_memory_reorder",
]
