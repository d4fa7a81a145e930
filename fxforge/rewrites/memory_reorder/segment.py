"""Scheduling one segment: the nodes between two cuts every valid order passes through.

A :class:`_Segment` is scheduled on its own (the memory alive at a cut is the same whatever the order
before it). It gives:

- the simulated peak of an order (:meth:`_Segment.peak_of`);
- the heuristic orders, upper bounds for the search: list schedules by a key of each ready node
  (:meth:`_Segment.list_schedule`) and a depth-first order computing the input with the largest
  footprint first (:meth:`_Segment.dfs_order`);
- a lower bound per node, what must be alive when it runs whatever the order (:meth:`_Segment.needs`);
- the exact search, best-first over sets of scheduled nodes, as a generator that stops when its budget
  (states, and a deadline) runs out and goes on when sent more (:meth:`_Segment.searcher`), or run once
  (:meth:`_Segment.search`).

Which segments there are, and how the budget is shared between them, is
:func:`~fxforge.rewrites.memory_reorder.planning.plan`'s business.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Generator, Sequence

from fxforge.rewrites.memory_reorder.problem import _Problem


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
