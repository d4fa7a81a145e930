"""Planning a graph's order for memory, and applying it: the search on its own, outside any pass.

:func:`plan` takes a GraphModule with shape metadata and returns a :class:`Schedule` without changing
the graph: it cuts the graph at the nodes every valid order passes through, scores the heuristics on
every segment, shares the exact search's budget between the segments, and keeps the capture order where
nothing does better. :func:`apply_order` rearranges a graph's nodes into an order, and
:func:`reorder_for_memory` does both. Nothing here needs the rewrite pipeline, so any graph with shape
metadata on its nodes can be scheduled this way.

Example:
    >>> gm = fxforge.capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
    ...                      (torch.ones(2, 4),)).graph_module
    >>> schedule = reorder_for_memory(gm)
    >>> schedule.changed, schedule.peak_before == schedule.peak_after
    (False, True)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Sequence

import torch

from fxforge.core.memory import GraphMemory
from fxforge.rewrites.memory_reorder.problem import _Problem
from fxforge.rewrites.memory_reorder.segment import _Segment

# Defaults of :func:`plan` and of the pass: states the exact search may expand over all segments (0.1-0.4 s
# on one server core), and a time limit on top of that for slow machines.
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

    This is the schedule search on its own: it needs no pass context and no pipeline, only shape
    metadata (``meta["val"]``) on the graph's nodes, so any GraphModule can be scheduled with it; apply
    the result with :func:`apply_order`. The pass (``run_memory_reorder``) calls it, after refusing a
    graph whose nodes lack that metadata.

    Args:
        gm: a graph with shape metadata on every node.
        time_budget_s: a limit on the time the exact search takes over all segments, for slow machines
            (the heuristics and the analysis come on top); the budget proper is ``max_states``.
        max_states: states the exact search may expand over all segments, segments with the highest peaks
            first. Counting states rather than seconds makes the order the same on every run.

    Returns:
        The :class:`Schedule`: the order of the nodes other than placeholders, ``get_attr`` and the
        output, never worse than the capture order, and one :class:`SegmentSchedule` per segment with
        more than one valid order.

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
