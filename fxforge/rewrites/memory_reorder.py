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

from __future__ import annotations

import dataclasses
import heapq
import operator
import time
from collections.abc import Callable, Generator, Sequence

import torch
from torch.fx.node import _side_effectful_functions

from fxforge.core.memory import GraphMemory
from fxforge.core.nodes import (
    is_effectful,
    is_inplace,
    is_random,
    is_torch_nn_module,
    submodule,
)
from fxforge.rewrites.passes import Pass, PassContext

_ROOTS = ("placeholder", "get_attr")

# Defaults of the pass: states the exact search may expand over all segments (0.1-0.4 s on one server
# core), and a time limit on top of that for slow machines.
MAX_STATES = 10_000
TIME_BUDGET_S = 1.0


# --------------------------------------------------------------------------------------------------
# results


@dataclasses.dataclass
class SegmentSchedule:
    """How one segment (the nodes between two cuts every order passes through) was scheduled.

    Attributes:
        index: position of the segment in the graph (0 = first).
        nodes: names of its nodes, in the chosen order.
        capture_nodes: the same names in the capture order.
        method: ``"exact search"``, ``"greedy least-peak"``, ``"list by bytes freed"``,
            ``"size-ordered DFS"`` or ``"capture order"`` (kept when nothing does better).
        peak_before, peak_after: simulated peak bytes within the segment, capture order and chosen.
        lower_bound: a proven lower bound of the segment's peak over every valid order.
        proven_optimal: ``peak_after == lower_bound``.
        states: states the exact search expanded (0 when it was not needed).
        seconds: time spent on the segment.
        heuristics: peak of each heuristic, by name.
        note: why the search stopped, when it did not finish.

    Example:
        >>> s = SegmentSchedule(0, ["a", "b"], ["a", "b"], "capture order", 10, 10, 10, True)
        >>> s.gain
        1.0
    """

    index: int
    nodes: list[str]
    capture_nodes: list[str]
    method: str
    peak_before: int
    peak_after: int
    lower_bound: int
    proven_optimal: bool
    states: int = 0
    seconds: float = 0.0
    heuristics: dict[str, int] = dataclasses.field(default_factory=dict)
    note: str = ""

    @property
    def gain(self) -> float:
        """``peak_before / peak_after`` (1.0 when nothing changed)."""
        return self.peak_before / self.peak_after if self.peak_after else 1.0


@dataclasses.dataclass
class Schedule:
    """The order chosen for a graph, and how.

    Attributes:
        order: the non-root nodes (no placeholders, ``get_attr`` or output) in the chosen order.
        segments: one :class:`SegmentSchedule` per segment with more than one valid order.
        peak_before, peak_after: simulated peak bytes of the whole graph, capture order and chosen.
        lower_bound: a proven lower bound of the graph's peak over every valid order.
        cuts: nodes every valid order passes through at a fixed place.
        seconds: time to plan (analysis and search; not applying the order).

    Example:
        >>> Schedule([], [], 100, 80, 80, 0, 0.0).proven_optimal
        True
    """

    order: list[torch.fx.Node]
    segments: list[SegmentSchedule]
    peak_before: int
    peak_after: int
    lower_bound: int
    cuts: int
    seconds: float

    @property
    def proven_optimal(self) -> bool:
        """The chosen order's peak equals the lower bound: no valid order has a lower peak."""
        return self.peak_after <= self.lower_bound

    @property
    def changed(self) -> bool:
        """Whether any segment's order differs from the capture order."""
        return any(s.method != "capture order" for s in self.segments)

    @property
    def gain(self) -> float:
        """``peak_before / peak_after``."""
        return self.peak_before / self.peak_after if self.peak_after else 1.0


# --------------------------------------------------------------------------------------------------
# which orders are allowed


def effect_kind(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    """How an effectful node constrains the order: None (no effect), ``"mutation"`` (writes a storage the
    shape metadata identifies: it keeps its place relative to the nodes touching that storage),
    ``"global"`` (randomness, opaque or training-mode modules, assertions: relative order among them kept)
    or ``"barrier"`` (grad-mode/autocast switches and the like: no node crosses it).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> a = g.call_method("relu_", (x,)); b = g.call_function(torch._assert, (True, "m")); _ = g.output(a)
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), g)
        >>> a.meta["val"] = torch.ones(1)
        >>> effect_kind(a, gm), effect_kind(b, gm)
        ('mutation', 'global')
    """
    if node.op in ("placeholder", "output"):
        return None
    if not is_effectful(node, gm):
        # ``torch.add(a, b, out=c)`` writes c without an in-place name.
        return "mutation" if isinstance(node.kwargs.get("out"), torch.fx.Node) else None
    target = node.target
    if node.op == "call_function" and target in _side_effectful_functions and target is not operator.setitem:
        name = getattr(target, "__name__", str(target))
        return "global" if ("assert" in name or "constrain" in name) else "barrier"
    if not is_inplace(node, gm) or is_random(node) or "val" not in node.meta:
        return "global"
    if node.op == "call_module":
        module = submodule(node, gm)
        if module is None or not is_torch_nn_module(module) or module.training:
            return "global"
    return "mutation"


class _Problem:
    """The scheduling problem of a graph: nodes, allowed orders, and the memory each step takes."""

    def __init__(self, gm: torch.fx.GraphModule, mem: GraphMemory):
        self.mem = mem
        self.sched = [i for i, n in enumerate(mem.nodes) if n.op not in _ROOTS]
        self.nodes = [mem.nodes[i] for i in self.sched]
        n = len(self.sched)
        self.n = n
        pos = {mi: k for k, mi in enumerate(self.sched)}
        preds: list[set[int]] = [set() for _ in range(n)]
        for k, node in enumerate(self.nodes):
            for inp in node.all_input_nodes:
                p = pos.get(mem.index.get(inp, -1))
                if p is not None:
                    preds[k].add(p)
        self._effect_edges(gm, preds)
        self.preds = [sorted(p) for p in preds]
        self.succs: list[list[int]] = [[] for _ in range(n)]
        for k, ps in enumerate(self.preds):
            for p in ps:
                self.succs[p].append(k)
        act = mem.activation
        self.alloc = [sum(mem.sizes[s] for s in mem.allocs[mi] if act[s]) for mi in self.sched]
        self.scratch = [mem.scratch[mi] for mi in self.sched]
        self.touch = [tuple(s for s in mem.touches[mi] if act[s]) for mi in self.sched]
        self.consumers: dict[int, list[int]] = {}
        for k, touched in enumerate(self.touch):
            for s in touched:
                self.consumers.setdefault(s, []).append(k)
        self.sizes = mem.sizes
        self.pinned = {s for s in mem.pinned if act[s]}

    def _effect_edges(self, gm: torch.fx.GraphModule, preds: list[set[int]]) -> None:
        mem = self.mem
        kinds = [effect_kind(node, gm) for node in self.nodes]
        if not any(kinds):
            return
        touchers: dict[int, list[int]] = {}
        for k, mi in enumerate(self.sched):
            for s in mem.touches[mi]:
                touchers.setdefault(s, []).append(k)
        # Parameters and buffers: a module call reads (and in training mode writes) its own without a
        # get_attr node in the graph, so it counts as touching the storages of the attributes under it.
        attrs = [(str(n.target), set(mem.refs[mem.index[n]])) for n in mem.nodes if n.op == "get_attr"]
        attr_storages = {s for _, refs in attrs for s in refs}
        modules = [(k, f"{node.target}.") for k, node in enumerate(self.nodes) if node.op == "call_module"]
        previous_global = None
        region: list[int] = []
        barrier = None
        for k, kind in enumerate(kinds):
            if barrier is not None and barrier != k:
                preds[k].add(barrier)
            if kind == "barrier":
                for j in region:
                    preds[k].add(j)
                region, barrier = [], k
            else:
                region.append(k)
            if kind in ("global", "barrier"):
                if previous_global is not None:
                    preds[k].add(previous_global)
                previous_global = k
            if kind is None:
                continue
            storages = set(mem.touches[self.sched[k]])
            node = self.nodes[k]
            if kind == "global" and node.op == "call_module":  # it may also write its own parameters
                for target, refs in attrs:
                    if target.startswith(f"{node.target}."):
                        storages |= refs
            related = {j for s in storages for j in touchers.get(s, ())}
            if storages & attr_storages:
                for target, refs in attrs:
                    if refs & storages:
                        related.update(j for j, prefix in modules if target.startswith(prefix))
            for j in related:
                if j < k:
                    preds[k].add(j)
                elif j > k:
                    preds[j].add(k)

    def ancestors(self) -> list[int]:
        """Bitset of each node's ancestors (capture order is topological, and so are the added edges)."""
        anc = [0] * self.n
        for k in range(self.n):
            bits = 0
            for p in self.preds[k]:
                bits |= anc[p] | (1 << p)
            anc[k] = bits
        return anc

    def descendants(self) -> list[int]:
        desc = [0] * self.n
        for k in range(self.n - 1, -1, -1):
            bits = 0
            for s in self.succs[k]:
                bits |= desc[s] | (1 << s)
            desc[k] = bits
        return desc


# --------------------------------------------------------------------------------------------------
# one segment


class _Segment:
    """A run of nodes between two cuts, with the memory state at its start; local indices 0..m-1."""

    def __init__(self, problem: _Problem, first: int, last: int, live_before: int, live_set: set[int]):
        self.problem = problem
        self.first, self.last = first, last
        self.m = m = last - first + 1
        self.base = live_before
        self.pred_mask = [0] * m
        self.preds: list[list[int]] = [[] for _ in range(m)]
        self.succs: list[list[int]] = [[] for _ in range(m)]
        for j in range(m):
            for p in problem.preds[first + j]:
                if p >= first:
                    self.pred_mask[j] |= 1 << (p - first)
                    self.preds[j].append(p - first)
                    self.succs[p - first].append(j)
        self.alloc = [problem.alloc[first + j] for j in range(m)]
        # What a step adds to the memory alive while it runs: its results and its scratch.
        self.step = [problem.alloc[first + j] + problem.scratch[first + j] for j in range(m)]
        # Storages that may be freed inside the segment: (consumer mask, size) per touching node.
        storages: dict[int, tuple[int, bool]] = {}
        for j in range(m):
            for s in problem.touch[first + j]:
                if s in storages:
                    continue
                mask, pinned = 0, s in problem.pinned
                for c in problem.consumers[s]:
                    if c > last:
                        pinned = True
                    elif c >= first:
                        mask |= 1 << (c - first)
                storages[s] = (mask, pinned)
        self.storages = storages
        self.frees: list[list[tuple[int, int]]] = [[] for _ in range(m)]
        self.frees_s: list[list[int]] = [[] for _ in range(m)]
        for j in range(m):
            for s in problem.touch[first + j]:
                mask, pinned = storages[s]
                if not pinned:
                    self.frees[j].append((mask, problem.sizes[s]))
                    self.frees_s[j].append(s)
        self.live_set = live_set

    # -- evaluation

    def peak_of(self, order: Sequence[int]) -> int:
        """Peak of the segment run in ``order`` (local indices), from its base."""
        remaining = {s: mask.bit_count() for s, (mask, pinned) in self.storages.items() if not pinned}
        live, peak = self.base, 0
        sizes = self.problem.sizes
        for j in order:
            live += self.alloc[j]
            peak = max(peak, live + self.step[j] - self.alloc[j])
            for s in self.frees_s[j]:
                remaining[s] -= 1
                if remaining[s] == 0:
                    live -= sizes[s]
        return peak

    # -- heuristics

    def list_schedule(self, key: Callable[[int, int, int], tuple]) -> list[int]:
        """Repeatedly run the ready node with the smallest ``key(j, bytes its step adds, net change)``
        (the net change: what it allocates less what it frees, given what has run)."""
        m, alloc, sizes = self.m, self.step, self.problem.sizes
        indeg = [len(p) for p in self.preds]
        remaining = {s: mask.bit_count() for s, (mask, pinned) in self.storages.items() if not pinned}
        change = [self.alloc[j] - sum(sizes[s] for s in self.frees_s[j] if remaining[s] == 1) for j in range(m)]
        done = [False] * m
        heap = [(key(j, alloc[j], change[j]), j) for j in range(m) if indeg[j] == 0]
        heapq.heapify(heap)
        order: list[int] = []
        while heap:
            k, j = heapq.heappop(heap)
            if done[j] or k != key(j, alloc[j], change[j]):
                continue  # run already, or its key changed since it was pushed (pushed again then)
            done[j] = True
            order.append(j)
            for s in self.frees_s[j]:
                remaining[s] -= 1
                if remaining[s] == 1:  # its last consumer will free it: that one's net change drops
                    rest = self.storages[s][0]
                    while rest:
                        low = rest & -rest
                        rest ^= low
                        c = low.bit_length() - 1
                        if not done[c]:
                            change[c] -= sizes[s]
                            if indeg[c] == 0:
                                heapq.heappush(heap, (key(c, alloc[c], change[c]), c))
                            break
            for v in self.succs[j]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    heapq.heappush(heap, (key(v, alloc[v], change[v]), v))
        return order

    def dfs_order(self) -> list[int]:
        """Depth-first from the sinks, computing first the input whose subgraph needs the most memory
        beyond its result (Sethi–Ullman's rule, with footprints estimated as if the graph were a tree)."""
        m = self.m
        footprint = [0] * m
        result = self.alloc
        for j in range(m):
            ordered = sorted(self.preds[j], key=lambda p: (result[p] - footprint[p], p))
            held, peak = 0, 0
            for p in ordered:
                peak = max(peak, held + footprint[p])
                held += result[p]
            footprint[j] = max(peak, held + self.step[j])
        rank = {j: (result[j] - footprint[j], j) for j in range(m)}
        order: list[int] = []
        done = [False] * m
        sinks = [j for j in range(m) if not self.succs[j]]
        for sink in sorted(sinks, key=rank.__getitem__):
            stack = [(sink, iter(sorted(self.preds[sink], key=rank.__getitem__)))]
            if done[sink]:
                continue
            while stack:
                j, inputs = stack[-1]
                for p in inputs:
                    if not done[p]:
                        stack.append((p, iter(sorted(self.preds[p], key=rank.__getitem__))))
                        break
                else:
                    stack.pop()
                    if not done[j]:
                        done[j] = True
                        order.append(j)
        return order

    # -- lower bound

    def needs(self) -> list[int]:
        """For each node, the bytes alive whenever it runs, in any order: what it allocates, and every
        storage allocated before it (by the time the segment starts, or by an ancestor) that it or a
        descendant still touches, or that outlives the segment."""
        m = self.m
        full = (1 << m) - 1
        anc = [0] * m
        for j in range(m):
            bits = 0
            for p in self.preds[j]:
                bits |= anc[p] | (1 << p)
            anc[j] = bits
        desc = [0] * m
        for j in range(m - 1, -1, -1):
            bits = 0
            for s in self.succs[j]:
                bits |= desc[s] | (1 << s)
            desc[j] = bits
        problem = self.problem
        allocated_at: dict[int, int] = {}
        for j in range(m):
            for s in problem.mem.allocs[problem.sched[self.first + j]]:
                allocated_at[s] = j
        need = [0] * m
        for s, (mask, pinned) in self.storages.items():
            size = problem.sizes[s]
            if not size:
                continue
            a = allocated_at.get(s)
            if a is None and s not in self.live_set:
                continue
            after_alloc = full if a is None else desc[a] | (1 << a)
            if pinned:
                before_use = full
            else:
                before_use = 0
                rest = mask
                while rest:
                    low = rest & -rest
                    c = low.bit_length() - 1
                    before_use |= anc[c] | low
                    rest ^= low
            live = after_alloc & before_use
            while live:
                low = live & -live
                need[low.bit_length() - 1] += size
                live ^= low
        # Storages alive at the start that no node of the segment touches stay alive throughout.
        untouched = sum(problem.sizes[s] for s in self.live_set if s not in self.storages)
        return [x + untouched + self.step[j] - self.alloc[j] for j, x in enumerate(need)]

    # -- exact search

    def search(self, upper: int, deadline: float, max_states: int) -> tuple[list[int] | None, int, int, str]:
        """Best-first search for an order with a peak below ``upper`` (see :meth:`searcher`), run once.

        Returns ``(order or None, lower bound, states expanded, note)``: an order when one below ``upper``
        exists (it is optimal); None with lower bound ``upper`` when none does (``upper`` is optimal);
        None with a smaller lower bound when the budget ran out first.
        """
        searcher = self.searcher(upper)
        next(searcher)
        order, lower, states, note, _ = searcher.send((max_states, deadline))
        return order, lower, states, note

    def searcher(self, upper: int) -> Generator[tuple, tuple[int, float], None]:
        """The search as a generator that can be resumed with more budget.

        Prime it with ``next()``, then ``send((total states allowed, deadline))``; it answers
        ``(order or None, lower bound, states expanded so far, note, finished)`` when it finishes or runs
        out of budget, and goes on from where it stopped when sent a larger budget.
        """
        m = self.m
        full = (1 << m) - 1
        pred_mask, alloc, frees, stepped = self.pred_mask, self.alloc, self.frees, self.step
        need = self.needs()
        by_need = sorted(range(m), key=lambda j: -need[j])
        needs_sorted = [need[j] for j in by_need]

        def rest_bound(done: int) -> int:
            for i, j in enumerate(by_need):
                if not (done >> j) & 1:
                    return needs_sorted[i]
            return 0

        def change(j: int, done: int) -> int:
            after = done | (1 << j)
            d = alloc[j]
            for mask, size in frees[j]:
                if mask & after == mask:
                    d -= size
            return d

        succs = self.succs

        def advance(ready: int, done: int, j: int) -> int:
            """The ready set once ``j`` (already in ``done``) has run."""
            ready &= ~(1 << j)
            for v in succs[j]:
                if pred_mask[v] & done == pred_mask[v]:
                    ready |= 1 << v
            return ready

        budget, deadline = yield ()
        start_bound = rest_bound(0)
        if start_bound >= upper:
            while True:
                yield None, upper, 0, "", True
        start_ready = sum(1 << j for j in range(m) if not pred_mask[j])
        # Heap entries: (bound, -nodes done, live, peak so far, done set, ready set)
        heap = [(start_bound, 0, self.base, 0, 0, start_ready)]
        best = {0: start_bound}
        parent: dict[int, tuple[int, tuple[int, ...]]] = {0: (-1, ())}
        closed: set[int] = set()
        states = 0
        while heap:
            if states >= budget or states & 15 == 0 and time.perf_counter() > deadline:
                # Out of budget: every order below ``upper`` passes through a state still in the heap.
                note = f"stopped after {states} states" if states >= budget else "stopped at the time limit"
                budget, deadline = yield None, min(heap[0][0], upper), states, note, False
                continue
            bound, _, live, peak, done, ready = heapq.heappop(heap)
            if done in closed or best.get(done, upper) < bound:
                continue
            closed.add(done)
            states += 1
            # Forced moves: a ready node that frees at least what it allocates, without raising the bound,
            # can go first in every completion without making it worse.
            origin, forced, moved = done, [], True
            while moved:
                moved = False
                rest = ready
                while rest:
                    low = rest & -rest
                    rest ^= low
                    j = low.bit_length() - 1
                    if live + stepped[j] > bound:
                        continue
                    d = change(j, done)
                    if d <= 0:
                        peak = max(peak, live + stepped[j])
                        live += d
                        done |= low
                        ready = advance(ready, done, j)
                        forced.append(j)
                        moved = True
            if forced:
                if done in closed:
                    continue
                closed.add(done)
                parent[done] = (origin, tuple(forced))
            if done == full:
                path = self._path(parent, done)
                while True:
                    yield path, bound, states, "", True
            rest = ready
            while rest:
                low = rest & -rest
                rest ^= low
                j = low.bit_length() - 1
                step = live + stepped[j]
                new_peak = max(peak, step)
                nxt = done | low
                if new_peak >= upper or nxt in closed:
                    continue
                new_bound = max(new_peak, rest_bound(nxt))
                if new_bound >= upper or best.get(nxt, upper) <= new_bound:
                    continue
                new_live, new_ready = live + change(j, done), advance(ready, nxt, j)
                # Whichever node runs next adds at least the smallest step to what is alive then.
                bits, smallest = new_ready, -1
                while bits:
                    low_bit = bits & -bits
                    bits ^= low_bit
                    size = stepped[low_bit.bit_length() - 1]
                    if smallest < 0 or size < smallest:
                        smallest = size
                if smallest >= 0 and new_live + smallest > new_bound:
                    new_bound = new_live + smallest
                    if new_bound >= upper or best.get(nxt, upper) <= new_bound:
                        continue
                best[nxt] = new_bound
                parent[nxt] = (done, (j,))
                heapq.heappush(heap, (new_bound, -nxt.bit_count(), new_live, new_peak, nxt, new_ready))
        while True:  # no order below ``upper``: it is optimal
            yield None, upper, states, "", True

    @staticmethod
    def _path(parent: dict[int, tuple[int, tuple[int, ...]]], done: int) -> list[int]:
        steps: list[tuple[int, ...]] = []
        while done:
            previous, nodes = parent[done]
            steps.append(nodes)
            done = previous
        return [j for nodes in reversed(steps) for j in nodes]


# --------------------------------------------------------------------------------------------------
# the whole graph

@dataclasses.dataclass
class _Found:
    """The best order known for a segment while :func:`plan` works on it."""

    seg: _Segment
    orders: dict[str, list[int]]
    peaks: dict[str, int]
    method: str
    order: list[int]
    peak: int
    lower: int
    states: int
    note: str
    seconds: float


_HEURISTICS: dict[str, Callable[[_Segment], list[int]]] = {
    "capture order": lambda seg: list(range(seg.m)),
    # The step's peak is the memory alive (the same for every ready node) plus what the node allocates.
    "greedy least-peak": lambda seg: seg.list_schedule(lambda j, alloc, change: (alloc, change, j)),
    "list by bytes freed": lambda seg: seg.list_schedule(lambda j, alloc, change: (change, alloc, j)),
    "size-ordered DFS": _Segment.dfs_order,
}


def plan(gm: torch.fx.GraphModule, *, time_budget_s: float = TIME_BUDGET_S,
         max_states: int = MAX_STATES) -> Schedule:
    """Choose the order of ``gm``'s nodes with the lowest simulated peak; the graph is not changed.

    Args:
        gm: a graph with shape metadata on every node.
        time_budget_s: a limit on the time the exact search takes over all segments, for slow machines
            (the heuristics and the analysis come on top); the budget proper is ``max_states``.
        max_states: states the exact search may expand over all segments, segments with the highest peaks
            first. Counting states rather than seconds makes the order the same on every run.

    Example:
        >>> gm = fxforge.capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
        ...                      (torch.ones(2, 4),)).graph_module
        >>> s = plan(gm)
        >>> [n.name for n in s.order], s.segments, s.proven_optimal   # a chain: one order only
        (['_0', '_1'], [], True)
    """
    started = time.perf_counter()
    mem = GraphMemory(gm)
    problem = _Problem(gm, mem)
    n = problem.n
    anc, desc = problem.ancestors(), problem.descendants()
    is_cut = [anc[k].bit_count() + desc[k].bit_count() == n - 1 for k in range(n)]
    ranges: list[tuple[int, int]] = []
    k = 0
    while k < n:
        if is_cut[k]:
            k += 1
            continue
        first = k
        while k < n and not is_cut[k]:
            k += 1
        ranges.append((first, k - 1))

    # The capture order: memory alive at each segment's start, and the peak of every step.
    remaining = {s: len(c) for s, c in problem.consumers.items()}
    live, live_set = 0, set()
    during = [0] * n
    starts: dict[int, tuple[int, set[int]]] = {}
    range_at = {first: (first, last) for first, last in ranges}
    for k in range(n):
        if k in range_at:
            starts[k] = (live, set(live_set))
        for s in problem.mem.allocs[problem.sched[k]]:
            if problem.mem.activation[s]:
                live += problem.sizes[s]
                live_set.add(s)
        during[k] = live + problem.scratch[k]
        for s in problem.touch[k]:
            remaining[s] -= 1
            if remaining[s] == 0 and s not in problem.pinned:
                live -= problem.sizes[s]
                live_set.discard(s)
    peak_before = max(during, default=0)

    # Heuristics for every segment first, then the exact search in two rounds: every segment gets an equal
    # share of half the budget (most small segments are proven there), then the segments still unproven
    # share what is left, highest peaks first, each taking at most a quarter of it. The budget is counted
    # in states, so the same graph always gets the same order; the time limit is a safety net for slow
    # machines.
    found_by_first: dict[int, _Found] = {}
    for first, last in ranges:
        seg_started = time.perf_counter()
        seg = _Segment(problem, first, last, *starts[first])
        orders = {name: make(seg) for name, make in _HEURISTICS.items()}
        peaks = {name: seg.peak_of(order) for name, order in orders.items()}
        best = min(peaks, key=lambda name: peaks[name])  # ties: the first listed, the capture order
        found_by_first[first] = _Found(seg, orders, peaks, best, orders[best], peaks[best], 0, 0, "",
                                       time.perf_counter() - seg_started)
    by_peak = sorted(ranges, key=lambda r: (-found_by_first[r[0]].peak, r[0]))
    states_left = max_states
    time_end = time.perf_counter() + time_budget_s
    first_share = max_states // 2 // max(1, len(by_peak))
    searchers: dict[int, Generator] = {}
    for round_ in (1, 2):
        todo = [r for r in by_peak if round_ == 1 or found_by_first[r[0]].lower < found_by_first[r[0]].peak]
        for i, (first, _) in enumerate(todo):
            entry = found_by_first[first]
            started_at = time.perf_counter()
            if round_ == 1:
                searchers[first] = searcher = entry.seg.searcher(entry.peak)
                next(searcher)
                budget = min(first_share, states_left)
                deadline = started_at + max(0.0, time_end - started_at) / (len(todo) - i)
            else:  # the search goes on from where the first round left it
                searcher = searchers[first]
                share = min(len(todo) - i, 4)
                budget = entry.states + states_left // share
                deadline = started_at + max(0.0, time_end - started_at) / share
            order, lower, states, note, _ = searcher.send((budget, deadline))
            states_left -= states - entry.states
            entry.states, entry.note = states, note
            entry.lower = max(entry.lower, min(lower, entry.peak))
            if order is not None:
                entry.method, entry.order, entry.peak = "exact search", order, entry.seg.peak_of(order)
                entry.lower = entry.peak
            entry.seconds += time.perf_counter() - started_at
    for searcher in searchers.values():
        searcher.close()

    chosen: dict[int, list[int]] = {}
    results: dict[int, SegmentSchedule] = {}
    for first, last in ranges:
        entry = found_by_first[first]
        capture = entry.peaks["capture order"]
        if entry.peak >= capture:
            entry.method, entry.order, entry.peak = "capture order", entry.orders["capture order"], capture
        chosen[first] = [first + j for j in entry.order]
        proven = entry.peak <= entry.lower
        results[first] = SegmentSchedule(
            index=0, nodes=[problem.nodes[first + j].name for j in entry.order],
            capture_nodes=[node.name for node in problem.nodes[first:last + 1]], method=entry.method,
            peak_before=capture, peak_after=entry.peak, lower_bound=min(entry.lower, entry.peak),
            proven_optimal=proven, states=entry.states, seconds=entry.seconds, heuristics=entry.peaks,
            note="" if proven else entry.note)

    order: list[int] = []
    k = 0
    while k < n:
        if k in chosen:
            order.extend(chosen[k])
            k = range_at[k][1] + 1
        else:
            order.append(k)
            k += 1
    segments = [results[first] for first, _ in ranges]
    for index, segment in enumerate(segments):
        segment.index = index
    fixed = [during[k] for k in range(n) if is_cut[k]]
    peak_after = max([*fixed, *(s.peak_after for s in segments)], default=0)
    lower_bound = max([*fixed, *(s.lower_bound for s in segments)], default=0)
    nodes = [problem.nodes[k] for k in order]
    return Schedule(nodes, segments, peak_before, peak_after, lower_bound, sum(is_cut),
                    time.perf_counter() - started)


def apply_order(gm: torch.fx.GraphModule, order: Sequence[torch.fx.Node]) -> None:
    """Rearrange ``gm``'s graph so that the nodes of ``order`` run in that order, then recompile.

    Placeholders stay first (in their order); each ``get_attr`` moves to just before its first user.

    Raises:
        ValueError: ``order`` is not a valid order of the graph's other nodes.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> a = g.call_function(torch.neg, (x,)); b = g.call_function(torch.sin, (x,))
        >>> _ = g.output((a, b)); gm = torch.fx.GraphModule(torch.nn.Module(), g)
        >>> apply_order(gm, [b, a]); [n.name for n in gm.graph.nodes]
        ['x', 'sin', 'neg', 'output']
    """
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    attrs = [n for n in graph.nodes if n.op == "get_attr"]
    others = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    if len(order) != len(others) or set(order) != set(others):
        raise ValueError("order must list every node but placeholders, get_attr and the output once")
    before: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    unused: list[torch.fx.Node] = []
    position = {node: i for i, node in enumerate(order)}
    for attr in attrs:
        users = [position[u] for u in attr.users if u in position]
        if users:
            before.setdefault(order[min(users)], []).append(attr)
        else:
            unused.append(attr)
    done = set(placeholders) | set(attrs)
    for node in order:
        late = [a for a in node.all_input_nodes if a not in done]
        if late:
            raise ValueError(f"order runs {node.name} before its input {late[0].name}")
        done.add(node)
    for node in [*placeholders, *unused]:
        output.prepend(node)
    for node in order:
        for attr in before.get(node, ()):
            output.prepend(attr)
        output.prepend(node)
    graph.lint()
    gm.recompile()


def reorder_for_memory(gm: torch.fx.GraphModule, *, time_budget_s: float = TIME_BUDGET_S,
                       max_states: int = MAX_STATES) -> Schedule:
    """:func:`plan` the order of ``gm`` and apply it when it lowers the peak of some segment.

    Example:
        >>> gm = fxforge.capture(torch.nn.ReLU(), (torch.ones(4),)).graph_module
        >>> reorder_for_memory(gm).peak_after
        16
    """
    schedule = plan(gm, time_budget_s=time_budget_s, max_states=max_states)
    if schedule.changed:
        apply_order(gm, schedule.order)
    return schedule


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
        ctx.refused(missing[0], "no shape metadata: the memory of the graph cannot be simulated")
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
