"""Values a graph computes from nothing but constants, computed once at rewrite time (part of ``cleanup``).

Eager code often rebuilds a table on every call that depends on no input and no weight, and caches it
(``functools.lru_cache``: BEiT's and Swin's relative-position index, built from ``arange``, ``meshgrid``,
``zeros`` and slice assignments). A captured graph holds that computation without its cache, so it runs on
every call. Here the nodes whose inputs are only Python values (and other such nodes) are run once, and each
value the rest of the graph reads becomes a non-persistent buffer of the GraphModule. Graphs are specialised to
their input signature, so these values cannot change between calls; a node with a symbolic size, a random op,
or one reading a placeholder, parameter or buffer is never part of such a computation.

The computation may write into its own tensors (``index[1:, 1:] = coords.sum(-1)``): a group of connected
constant nodes is folded only when every read of it from outside comes after its last write.

Example:
    >>> from fxforge.rewrites.passes import PassContext
    >>> g = torch.fx.Graph(); x = g.placeholder("x")
    >>> steps = g.call_method("mul", (g.call_method("float", (g.call_function(torch.arange, (4,)),)), 2))
    >>> _ = g.output(g.call_function(torch.add, (x, steps)))   # as export records ``x + torch.arange(4) * 2``
    >>> gm = torch.fx.GraphModule(torch.nn.Module(), g)
    >>> ctx = PassContext("cleanup", training=False, method="export")
    >>> fold_constant_subgraphs(gm, ctx); [m.what for m in ctx.matches]
    ['constant computation (3 nodes) computed once']
    >>> gm(torch.zeros(4)).tolist()
    [0.0, 2.0, 4.0, 6.0]
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import attribute_tensor, call_node, is_effectful, is_inplace, mutated_aliases
from fxforge.rewrites.folding import free_name
from fxforge.rewrites.passes import PassContext

PREFIX = "_fxforge_computed"
# Ops whose result depends on more than their arguments' values, or that draw random numbers.
_RANDOM = ("rand", "randn", "randint", "randperm", "bernoulli", "dropout", "normal", "uniform", "empty")


def _plain(value: Any) -> bool:
    """A Python value a constant computation may take: numbers, dtypes, devices, and sequences of them."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                                torch.memory_format, slice, type(Ellipsis)))


def _capture_made(target: str) -> bool:
    """Whether a ``get_attr`` target is a constant the capture made (export's lifted tensors, fx's
    ``_tensor_constant``), not a tensor of the user's model."""
    last = target.rsplit(".", 1)[-1]
    return last.startswith("_tensor_constant") or "lifted_tensor" in last


def _leaves(value: Any) -> list:
    leaves: list = []
    torch.fx.node.map_aggregate(value, lambda a: leaves.append(a) or a)
    return leaves


def constant_nodes(gm: torch.fx.GraphModule, weights: bool = False) -> set[Node]:
    """The call nodes computed from Python values and other such nodes alone (no random op, no effect but
    writing into their own tensors); with ``weights``, the model's parameters and buffers count as such values.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> _ = g.output(g.call_function(torch.add, (x, g.call_method("mul", (g.call_function(torch.arange, (3,)), 2)))))
        >>> sorted(n.name for n in constant_nodes(torch.fx.GraphModule(torch.nn.Module(), g)))
        ['arange', 'mul']
    """
    constant: set[Node] = set()
    parameters = {name for name, _ in gm.named_parameters()}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and (weights or node.target not in parameters and _capture_made(str(node.target))):
            constant.add(node)  # a tensor the capture made from the code (``torch.tensor(3)`` in forward)
        if node.op not in ("call_function", "call_method"):
            continue
        name = str(getattr(node.target, "__name__", node.target))
        if any(word in name for word in _RANDOM) or (is_effectful(node, gm) and not is_inplace(node, gm)):
            continue
        if all(a in constant if isinstance(a, Node) else _plain(a) for a in _leaves((node.args, node.kwargs))):
            constant.add(node)
    return constant


def groups(constant: set[Node], order: dict[Node, int]) -> list[list[Node]]:
    """The constant nodes in groups connected through their data edges, each in graph order (``order``: each
    node's position in the graph).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); steps = g.call_function(torch.arange, (3,))
        >>> y = g.call_function(torch.add, (x, g.call_method("mul", (steps, 2))))
        >>> _ = g.output(g.call_function(torch.add, (y, g.call_function(torch.ones, (3,)))))
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), g); order = {n: i for i, n in enumerate(g.nodes)}
        >>> [[n.name for n in group] for group in groups(constant_nodes(gm), order)]
        [['arange', 'mul'], ['ones']]
    """
    parent = {n: n for n in constant}

    def root(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in constant:
        for source in node.all_input_nodes:
            parent[root(node)] = root(source)
    groups: dict[Node, list[Node]] = {}
    for node in sorted(constant, key=order.__getitem__):
        groups.setdefault(root(node), []).append(node)
    return list(groups.values())


def foldable_reads(group: list[Node], gm: torch.fx.GraphModule, order: dict[Node, int]) -> list | None:
    """``(node, reader)`` for each read of ``group`` from outside it, or None where the group cannot be computed
    once: nothing outside reads it, it is one node, a value of it is returned as it is (the caller's to change),
    a read from outside comes before its last write, or something outside writes into it.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> _ = g.output(g.call_function(torch.add, (x, g.call_method("mul", (g.call_function(torch.arange, (3,)), 2)))))
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), g); order = {n: i for i, n in enumerate(g.nodes)}
        >>> [(n.name, u.name) for n, u in foldable_reads(groups(constant_nodes(gm), order)[0], gm, order)]
        [('mul', 'add')]
    """
    members = set(group)
    outside = [(n, u) for n in group for u in n.users if u not in members]
    writes = [n for n in group if is_inplace(n, gm)]
    if not outside or len(group) < 2 or any(u.op == "output" for _, u in outside):
        return None
    if writes and min(order[u] for _, u in outside) < max(order[w] for w in writes):
        return None
    if any(is_inplace(u, gm) or mutated_aliases(u, gm) for _, u in outside):
        return None
    return outside


def fold_constant_subgraphs(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """Compute each group of constant nodes once; the values read from outside become buffers."""
    constant = constant_nodes(gm)
    if not constant:
        return
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for group in groups(constant, order):
        outside = foldable_reads(group, gm, order)
        if outside is None:
            continue
        values: dict[Node, Any] = {}
        with torch.no_grad():
            for node in group:  # (in graph order)
                values[node] = (attribute_tensor(gm, node.target) if node.op == "get_attr"
                                else call_node(node, values.__getitem__))
        read = [n for n in dict.fromkeys(n for n, _ in outside) if n.op != "get_attr"]
        if not all(isinstance(values[n], torch.Tensor) for n in read):
            continue
        ctx.matched(f"constant computation ({len(group)} nodes) computed once", group)
        for node in read:
            name = free_name(gm, PREFIX)
            gm.register_buffer(name, values[node].detach().clone(), persistent=False)
            with gm.graph.inserting_before(node):
                buffer = gm.graph.get_attr(name)
            buffer.meta.update(node.meta)
            for user in [u for u in node.users if u not in group]:
                user.replace_input_with(node, buffer)
        for node in reversed(group):
            if not node.users and node.op != "get_attr":
                gm.graph.erase_node(node)
