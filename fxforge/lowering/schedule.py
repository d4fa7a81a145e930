"""Independent branches of a graph, and an order of the graph that runs each fork's branches as one step:
what inter-operator parallelism may run at the same time.

A *fork* is a value two or more nodes read. Following the graph from a fork, every node is labelled with the
fork's users it descends from; the nodes that descend from exactly one of them form that user's *branch*. Two
branches of one fork share nothing but the fork and values computed before it, so they may run at the same
time once those exist; whatever reads a branch runs after the step that runs them all. A :class:`Region` is a
fork's branches. Nodes whose effects fxforge cannot see (in-place ops, random numbers, opaque modules:
:func:`~fxforge.core.nodes.is_effectful`) never join a branch, and keep their place relative to every
branch (a region that would have to run both before and after one of them is not formed).

How the branches are grouped onto threads and run is :mod:`fxforge.runtime.interop`'s job; which fork's
branches are worth it is measured there.

Example:
    >>> class TwoHeads(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.cat([x.sin().cos(), x.exp().neg()], 1)
    >>> gm = torch.fx.symbolic_trace(TwoHeads())
    >>> [region.names() for region in independent_branches(gm)]
    [[['sin', 'cos'], ['exp', 'neg']]]
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence

import torch
from torch.fx import Node

from fxforge.core.nodes import is_effectful

_FREE = ("placeholder", "get_attr", "output")
_POISON = "<not a branch>"  # the label of nodes no branch may hold


@dataclasses.dataclass(frozen=True)
class Region:
    """A fork's independent branches, each a tuple of nodes in graph order (largest first once grouped).

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x.sin() + x.cos())
        >>> region = independent_branches(gm)[0]
        >>> region.fork.name, region.names(), [n.name for n in region.outputs(0)]
        ('x', [['sin'], ['cos']], ['sin'])
    """

    fork: Node | None
    branches: tuple[tuple[Node, ...], ...]

    @property
    def label(self) -> str:
        """The fork's name, or ``"the inputs"`` for branches that each read their own inputs."""
        return self.fork.name if self.fork is not None else "the inputs"

    def names(self) -> list[list[str]]:
        """The branches' node names."""
        return [[n.name for n in branch] for branch in self.branches]

    def nodes(self) -> set[Node]:
        """Every node of every branch."""
        return {n for branch in self.branches for n in branch}

    def inputs(self, index: int) -> list[Node]:
        """What branch ``index`` reads from outside itself (the fork, weights, earlier values), in order."""
        return external_inputs(self.branches[index])

    def outputs(self, index: int) -> list[Node]:
        """The nodes of branch ``index`` that something outside it reads, in graph order."""
        return external_outputs(self.branches[index])


def external_inputs(nodes: Sequence[Node]) -> list[Node]:
    """The nodes outside ``nodes`` that they read, in the order first read.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x, y: torch.relu(x + y))
        >>> add, relu = [n for n in gm.graph.nodes if n.op == "call_function"]
        >>> [n.name for n in external_inputs([add, relu])]
        ['x', 'y']
    """
    inside = set(nodes)
    seen: dict[Node, None] = {}
    for node in nodes:
        for source in node.all_input_nodes:
            if source not in inside:
                seen.setdefault(source)
    return list(seen)


def external_outputs(nodes: Sequence[Node]) -> list[Node]:
    """The nodes of ``nodes`` that a node outside them reads (the graph's output included), in order.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.relu(x + 1))
        >>> add, relu = [n for n in gm.graph.nodes if n.op == "call_function"]
        >>> [n.name for n in external_outputs([add, relu])]
        ['relu']
    """
    inside = set(nodes)
    return [n for n in nodes if any(user not in inside for user in n.users)]


def _labels(order: Sequence[Node], position: dict[Node, int], start: int, fork: Node,
            barred: set[Node]) -> dict[Node, frozenset]:
    """Each node after ``fork`` that descends from it -> the users of ``fork`` it descends from (a node in
    ``barred`` gets the poison label, and so does everything after it)."""
    labels: dict[Node, frozenset] = {}
    # Only a reader of the fork or of a node with one label can get one label: past the last of those readers
    # every label has two or more, and the scan stops.
    horizon = max(position[user] for user in fork.users)
    for node in order[start + 1:]:
        if position[node] > horizon:
            break
        if node.op in _FREE:
            continue
        found: set = set()
        for source in node.all_input_nodes:
            found |= labels.get(source, frozenset())
            if source is fork:
                found.add(node)
        if found:
            labels[node] = frozenset(found | {_POISON}) if node in barred else frozenset(found)
            if len(labels[node]) == 1 and node.users:
                horizon = max(horizon, *(position[user] for user in node.users))
    return labels


def _branches_of(fork: Node, labels: dict[Node, frozenset], order: Sequence[Node]) -> tuple[tuple[Node, ...], ...]:
    by_origin: dict[Node, list[Node]] = {}
    for node in order:
        label = labels.get(node)
        if label is not None and len(label) == 1:
            by_origin.setdefault(next(iter(label)), []).append(node)
    return tuple(tuple(nodes) for nodes in by_origin.values())


def effectful_nodes(graph_module: torch.fx.GraphModule) -> set[Node]:
    """The nodes no branch may hold and no order may move across (:func:`~fxforge.core.nodes.is_effectful`:
    in-place ops, random numbers, modules in training mode, opaque modules).

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x.relu_() + x.sin())
        >>> sorted(n.name for n in effectful_nodes(gm))
        ['relu_']
    """
    return {n for n in graph_module.graph.nodes if n.op not in _FREE and is_effectful(n, graph_module)}


def independent_branches(graph_module: torch.fx.GraphModule, *, min_branches: int = 2) -> list[Region]:
    """Every fork of the graph with at least ``min_branches`` branches, no node in two regions, the forks with
    the most nodes in branches other than their largest first (where several forks claim the same nodes).

    The graph's inputs count as one more fork (:func:`input_branches`): two towers that read inputs of their own
    (an image and a text encoder, an encoder and a decoder's first layers) are branches too.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x.relu_() + x.sin())   # an in-place op: never in a branch
        >>> independent_branches(gm)
        []
    """
    order = list(graph_module.graph.nodes)
    position = {node: i for i, node in enumerate(order)}
    barred = effectful_nodes(graph_module)
    candidates: list[tuple[int, int, Region]] = []
    for node in order:
        if node.op == "output" or len([u for u in node.users if u.op not in _FREE]) < 2 or node in barred:
            continue
        branches = _branches_of(node, _labels(order, position, position[node], node, barred), order)
        if len(branches) >= min_branches:
            overlap = sum(len(b) for b in branches) - max(len(b) for b in branches)
            candidates.append((-overlap, position[node], Region(node, branches)))
    inputs = input_branches(order, barred)
    if inputs is not None and len(inputs.branches) >= min_branches:
        overlap = sum(len(b) for b in inputs.branches) - max(len(b) for b in inputs.branches)
        candidates.append((-overlap, -1, inputs))
    taken: set[Node] = set()
    chosen: list[Region] = []
    for _, _, region in sorted(candidates, key=lambda c: c[:2]):
        nodes = region.nodes()
        if nodes & taken or (region.fork is not None and region.fork in taken):
            continue
        # (without effectful nodes every set of regions has an order: a path out of a branch and back into it
        # would give the nodes after it two labels)
        # (the inputs' region labels by other means: a fork inside one of its branches can enclose another of its
        # nodes, so with it the order is checked too)
        mixed = region.fork is None or any(r.fork is None for r in chosen)
        if (barred or mixed) and schedule([*chosen, region], graph_module.graph, barred) is None:
            continue  # it would have to run both before and after an effectful node
        chosen.append(region)
        taken |= nodes
    return sorted(chosen, key=lambda r: min(position[n] for n in r.nodes()))


def input_branches(order: Sequence[Node], barred: set[Node]) -> Region | None:
    """The branches that read different inputs of the graph: the inputs grouped so that no node reads two
    groups (a node reading every input, where the towers meet, does not join them), each group's branch the
    nodes that read that group's inputs alone (none after an effectful node). None for a graph of one input.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda image, ids, mask: image.sin().sum() + (ids * mask).cos().sum())
        >>> region = input_branches(list(gm.graph.nodes), set())
        >>> region.label, region.names()
        ('the inputs', [['sin', 'sum_1'], ['mul', 'cos', 'sum_2']])
    """
    placeholders = [n for n in order if n.op == "placeholder"]
    if len(placeholders) < 2:
        return None
    reads: dict[Node, frozenset] = {p: frozenset({p}) for p in placeholders}
    spoiled: set[Node] = set()
    for node in order:
        if node.op in _FREE:
            continue
        reads[node] = frozenset().union(*(reads.get(source, frozenset()) for source in node.all_input_nodes))
        if node in barred or any(source in spoiled for source in node.all_input_nodes):
            spoiled.add(node)
    group = {p: p for p in placeholders}

    def root(p: Node) -> Node:
        while group[p] is not p:
            p = group[p]
        return p

    every = frozenset(placeholders)
    for inputs in {v for v in reads.values() if 1 < len(v) < len(every)}:
        first, *rest = inputs
        for other in rest:
            group[root(other)] = root(first)
    branches: dict[Node, list[Node]] = {}
    for node in order:
        if node.op in _FREE or node in spoiled or not reads.get(node):
            continue
        roots = {root(p) for p in reads[node]}
        if len(roots) == 1:
            branches.setdefault(roots.pop(), []).append(node)
    return Region(None, tuple(tuple(nodes) for nodes in branches.values())) if len(branches) > 1 else None


Step = Node | tuple[Region, int]  # a node, or (region, its index): the step that runs the region's branches


def schedule(regions: Sequence[Region], graph: torch.fx.Graph, barred: Iterable[Node] | None = None) -> list[Step] | None:
    """The graph's nodes in an order that runs each region's branches as one step: a node or ``(region, index)``
    each, every value computed before it is read, each effectful node on the same side of every region as in the
    graph. None when no such order exists.

    The order stays as close to the graph's as it can (a step as early as its inputs and the effectful nodes
    before it allow), so that values are freed where they were.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: (x.sin() * 2) + x.cos())
        >>> steps = schedule(independent_branches(gm), gm.graph)
        >>> [s.name if isinstance(s, Node) else "region" for s in steps]
        ['x', 'region', 'add', 'output']
    """
    order = list(graph.nodes)
    position = {node: i for i, node in enumerate(order)}
    barred = set(barred) if barred is not None else set()
    step_of: dict[Node, Step] = {}
    for index, region in enumerate(regions):
        for node in region.nodes():
            step_of[node] = (region, index)
    steps: list[Step] = [n for n in order if n not in step_of] + [(r, i) for i, r in enumerate(regions)]
    key = {}
    for step in steps:
        key[_key(step)] = position[step] if isinstance(step, Node) else min(position[n] for n in step[0].nodes())
    before: dict[object, set] = {_key(s): set() for s in steps}
    for node in order:
        mine = _key(step_of.get(node, node))
        for source in node.all_input_nodes:
            theirs = _key(step_of.get(source, source))
            if theirs != mine:
                before[mine].add(theirs)
    for effect in barred:
        for index, region in enumerate(regions):
            places = {position[n] < position[effect] for n in region.nodes()}
            if len(places) > 1:
                return None
            if places == {True}:
                before[_key(effect)].add(("region", index))
            else:
                before[("region", index)].add(_key(effect))
    return _stable_topological(steps, before, key)


def _key(step: Step) -> object:
    return step if isinstance(step, Node) else ("region", step[1])


def _stable_topological(steps: list[Step], before: dict[object, set], key: dict[object, int]) -> list[Step] | None:
    by_key = {_key(s): s for s in steps}
    waiting = {k: len(v) for k, v in before.items()}
    after: dict[object, list] = {k: [] for k in before}
    for k, sources in before.items():
        for source in sources:
            after[source].append(k)
    ready = [(key[k], i, k) for i, k in enumerate(before) if waiting[k] == 0]
    heapq.heapify(ready)
    result: list[Step] = []
    counter = len(before)
    while ready:
        _, _, k = heapq.heappop(ready)
        result.append(by_key[k])
        for user in after[k]:
            waiting[user] -= 1
            if waiting[user] == 0:
                counter += 1
                heapq.heappush(ready, (key[user], counter, user))
    return result if len(result) == len(steps) else None


def grouped(costs: Sequence[float], groups: int) -> list[list[int]]:
    """Branch indices split into at most ``groups`` groups of close total cost, longest first onto the least
    loaded group (LPT); the group holding the costliest branch (the critical path) first.

    Example:
        >>> grouped([5.0, 1.0, 3.0, 2.0], 2)
        [[0, 1], [2, 3]]
    """
    groups = max(1, min(groups, len(costs)))
    loads = [0.0] * groups
    members: list[list[int]] = [[] for _ in range(groups)]
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        target = min(range(groups), key=lambda g: (loads[g], len(members[g])))
        loads[target] += costs[index]
        members[target].append(index)
    members = [sorted(m) for m in members if m]
    return sorted(members, key=lambda m: -sum(costs[i] for i in m))
