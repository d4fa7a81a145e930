"""Which orders of a graph's nodes are allowed, and the memory each node's step takes.

:class:`_Problem` is the scheduling problem of a graph as :mod:`~fxforge.rewrites.memory_reorder.segment`
and :func:`~fxforge.rewrites.memory_reorder.planning.plan` see it: the nodes to order (every node but the
placeholders and ``get_attr``), their predecessors (data dependencies plus the edges effects add, see
:func:`effect_kind`), and per node the activation bytes it allocates, its scratch and the storages it
touches, read from :class:`~fxforge.core.memory.GraphMemory`.

Example:
    >>> g = torch.fx.Graph(); x = g.placeholder("x")
    >>> a = g.call_function(torch.neg, (x,)); b = g.call_function(torch._assert, (True, "m"))
    >>> _ = g.output(a); gm = torch.fx.GraphModule(torch.nn.Module(), g)
    >>> a.meta["val"] = torch.ones(1)
    >>> effect_kind(a, gm), effect_kind(b, gm)
    (None, 'global')
"""

from __future__ import annotations

import operator

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

_ROOTS = ("placeholder", "get_attr")


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
        """Bitset of each node's descendants."""
        desc = [0] * self.n
        for k in range(self.n - 1, -1, -1):
            bits = 0
            for s in self.succs[k]:
                bits |= desc[s] | (1 << s)
            desc[k] = bits
        return desc

