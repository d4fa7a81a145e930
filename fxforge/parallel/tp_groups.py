"""Column/row pairs of linear layers, found by following split values through the forward graph.

Every linear layer (``nn.Linear``, and GPT-2's ``Conv1D``, a linear layer with its weight transposed) and
every ``nn.Embedding`` is first assumed column-parallel: its output split by features across the ranks.
:func:`solve_groups` follows each split value through the graph with the rules of
:mod:`fxforge.parallel.tp_shard`. A linear layer the split value reaches, split along its input features,
becomes row-parallel (it sums the pieces). Values that meet (q, k and v in one attention) join one
**group**; a group is kept only if every value of it ends in row-parallel layers. Where a split cannot pass
(a norm over the features, a slice through a fused projection, a head count the degree does not divide, the
model's output), the whole group fails with that reason, its layers are no longer assumed column-parallel,
and the search runs again, until no group fails.

A layer the split value reaches is row-parallel rather than the start of a group of its own (in a chain of
linear layers, the first pairs with the second, the third with the fourth).

A full-size tensor combined with a split value can be split too when it is a constant built from a module
attribute (T5 adds ``zeros(1, n_heads, ...)`` to its cross-attention scores): the attribute is divided by
the degree. Such attributes are also found where a view splits features into heads by a module attribute
(``x.view(b, s, self.num_heads, self.head_dim)``): attributes of the module running the view whose value is
the head count (a name with ``head``) or the merged width (``inner``/``all_head``) are divided.

Example:
    >>> from fxforge.parallel.tp_trace import trace_forward
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    >>> groups, failed = solve_groups(trace_forward(model, (torch.randn(2, 8),)), model, {"0", "2"}, 2)
    >>> [(sorted(g.sources), sorted(g.sinks)) for g in groups]
    [(['0'], ['2'])]
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from fxforge.parallel.tp_shard import Split, State, is_factory, is_pointwise, propagate, shape_of
from fxforge.parallel.tp_trace import TracedForward, output_of, slot_of

HEAD_COUNT = re.compile(r"head", re.IGNORECASE)
WIDTH = re.compile(r"inner|all_head", re.IGNORECASE)


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` or a transposed linear layer (transformers' ``Conv1D``: weight ``[in, out]``)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: ``nf`` outputs, ``nx`` inputs, weight ``[nx, nf]``."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


@dataclasses.dataclass
class Group:
    """Layers whose split values meet, and the row-parallel layers that end them.

    Attributes:
        sources: the column-parallel layers (linear or embedding).
        sinks: the row-parallel linear layers.
        reason: why the group cannot be split (None when it can).
        edits: module -> attribute -> (value, value // degree), the attributes the local shapes need.
    """

    sources: set[str] = dataclasses.field(default_factory=set)
    sinks: set[str] = dataclasses.field(default_factory=set)
    reason: str | None = None
    edits: dict[str, dict[str, tuple[int, int]]] = dataclasses.field(default_factory=dict)

    def merge(self, other: Group) -> None:
        self.sources |= other.sources
        self.sinks |= other.sinks
        self.reason = self.reason or other.reason
        for module, attrs in other.edits.items():
            self.edits.setdefault(module, {}).update(attrs)


def _attributes(module: nn.Module, value: int, pattern: re.Pattern, exclude: re.Pattern | None) -> list[str]:
    return [name for name, v in vars(module).items()
            if type(v) is int and v == value and pattern.search(name) and not (exclude and exclude.search(name))]


def _factory_origin(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The factory nodes a value is built from, when it is built from nothing else (through elementwise
    ops, views and broadcasts of constants); None otherwise."""
    found, stack, seen = [], [node], set()
    while stack:
        item = stack.pop()
        if item in seen:
            continue
        seen.add(item)
        if is_factory(item):
            found.append(item)
        elif item.op == "call_function" and (is_pointwise(item) or "view" in str(item.target)
                                             or "expand" in str(item.target) or "unsqueeze" in str(item.target)
                                             or "alias" in str(item.target) or "_to_copy" in str(item.target)):
            stack.extend(item.all_input_nodes)
        else:
            return None
    return found or None


class _Search:
    """One pass over the graph with a given set of column-parallel candidates."""

    def __init__(self, traced: TracedForward, model: nn.Module, sources: set[str], degree: int):
        self.traced, self.degree = traced, degree
        self.modules = dict(model.named_modules())
        self.linears = {name for name, m in self.modules.items() if is_linear(m)}
        self.sources = sources
        self.parent: dict[str, str] = {}
        self.groups: dict[str, Group] = {}
        self.state: dict[torch.fx.Node, State] = {}
        self.group_of: dict[torch.fx.Node, str] = {}
        self.sink_of: dict[str, str] = {}
        self.blocked: dict[torch.fx.Node, str] = {}  # values left whole by a group's failure, and its reason

    def find(self, name: str) -> str:
        while self.parent.get(name, name) != name:
            name = self.parent[name]
        return name

    def union(self, names: list[str]) -> str:
        roots = sorted({self.find(n) for n in names})
        root = roots[0]
        for other in roots[1:]:
            self.parent[other] = root
            self.groups[root].merge(self.groups.pop(other))
        return root

    def fail(self, root: str, node: torch.fx.Node, why: str) -> None:
        group = self.groups[root]
        # An input that is not split because its own layers could not be: that is the reason here too.
        blocked = next((self.blocked[i] for i in node.all_input_nodes if i in self.blocked), None)
        if group.reason is None:
            group.reason = blocked or f"{self.traced.module_of(node) or 'the model'}: {why}"
        self.blocked[node] = group.reason

    def edit(self, root: str, module: str, size: int, pattern: re.Pattern, exclude: re.Pattern | None) -> bool:
        found = _attributes(self.modules[module], size, pattern, exclude) if module in self.modules else []
        for name in found:
            self.groups[root].edits.setdefault(module, {})[name] = (size, size // self.degree)
        return bool(found)

    def run(self) -> list[Group]:
        for node in self.traced.graph.nodes:
            self.visit(node)
        groups = []
        for group in self.groups.values():
            if group.reason is None and not group.sinks:
                group.reason = "its split output reaches no row-parallel linear layer"
            groups.append(group)
        return groups

    def split_inputs(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        return [i for i in node.all_input_nodes if self.state.get(i) is not None]

    def visit(self, node: torch.fx.Node) -> None:
        slot, out = slot_of(node), output_of(node)
        if slot is not None and slot[0] in self.linears:
            source = node.args[0]
            split = self.state.get(source)
            if isinstance(split, Split):
                root = self.find(self.group_of[source])
                self.groups[root].sinks.add(slot[0])
                self.sink_of[slot[0]] = root
                if split != Split(len(shape_of(source)) - 1):
                    self.fail(root, node, f"reaches {slot[0]} split along dimension {split.dim}, not its input "
                                          "features")
            return
        if out is not None and out[0] in self.sources and out[1] == 0 and out[0] not in self.sink_of:
            name = out[0]
            self.parent[name] = name
            self.groups[name] = Group(sources={name})
            self.state[node] = Split(len(shape_of(node)) - 1)
            self.group_of[node] = name
            return
        if node.op == "output":  # the model's outputs; the values saved for backward come after them
            returned = node.args[0][:self.traced.step.num_fwd_outputs]
            for item in [i for i in returned if isinstance(i, torch.fx.Node) and self.state.get(i) is not None]:
                self.fail(self.find(self.group_of[item]), item, "the split value is returned by the model")
            return
        if node.op != "call_function" or self.traced.module_of(node) in self.linears:
            return
        inputs = self.split_inputs(node)
        if not inputs:
            blocked = next((self.blocked[i] for i in node.all_input_nodes if i in self.blocked), None)
            if blocked is not None:
                self.blocked[node] = blocked
            return
        root = self.union([self.group_of[i] for i in inputs])
        if slot is not None or out is not None:  # a marker: the value itself
            self.state[node], self.group_of[node] = self.state[node.args[0]], root
            return
        outcome = propagate(node, self.state, self.degree)
        if outcome.reason is not None:
            self.fail(root, node, outcome.reason)
            return
        for other, dim in outcome.conflicts:
            size = shape_of(other)[dim]
            origin = _factory_origin(other)
            modules = {self.traced.module_of(f) for f in origin or []}
            if origin is None or not all(self.edit(root, m, size, HEAD_COUNT, WIDTH) for m in modules):
                self.fail(root, node, f"combines the split value with {other.name} {shape_of(other)}, of full "
                                      f"size {size} along the split dimension and not split")
                return
        self.state[node], self.group_of[node] = outcome.state, root
        self._view_edits(node, root)

    def _view_edits(self, node: torch.fx.Node, root: str) -> None:
        split, source = self.state[node], node.args[0] if node.args else None
        if not (isinstance(split, Split) and split.outer == 1 and "view" in str(node.target)):
            return
        before = self.state.get(source)
        size, old = shape_of(node)[split.dim], shape_of(source)[before.dim] if isinstance(before, Split) else None
        if old is not None and size != old:
            pattern, exclude = (HEAD_COUNT, re.compile("dim|size", re.IGNORECASE)) if size < old else (WIDTH, None)
            self.edit(root, self.traced.module_of(node), size, pattern, exclude)


def solve_groups(traced: TracedForward, model: nn.Module, candidates: set[str],
                 degree: int) -> tuple[list[Group], dict[str, str]]:
    """The groups that can be split, and for each layer that cannot be, why (the module docstring).

    Args:
        traced: the forward graph (:func:`fxforge.parallel.tp_trace.trace_forward`).
        model: the model traced.
        candidates: the layers that may be column-parallel (linear and embedding layers called once).
        degree: the tensor-parallel degree.
    """
    sources, failed = set(candidates), {}
    while True:
        groups = _Search(traced, model, sources, degree).run()
        bad = [g for g in groups if g.reason is not None]
        if not bad:
            return groups, failed
        for group in bad:
            for name in sorted(group.sinks - group.sources):
                # A layer fed by a group that cannot be split: that is why it stays whole.
                failed.setdefault(name, f"its input comes from {', '.join(sorted(group.sources))}, which cannot be "
                                        f"split: {group.reason}")
            for name in group.sources:
                sources.discard(name)
                failed.setdefault(name, group.reason)


def upstream_linears(traced: TracedForward, linears: set[str], name: str) -> list[str]:
    """The linear layers whose outputs reach ``name``'s input without passing another linear layer.

    Example:
        >>> from fxforge.parallel.tp_trace import trace_forward
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> upstream_linears(trace_forward(model, (torch.randn(2, 4),)), {"0", "2"}, "2")
        ['0']
    """
    calls = traced.calls_of(name)
    if not calls or 0 not in calls[0].inputs:
        return []
    found, stack, seen = set(), [calls[0].inputs[0]], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        out = output_of(node)
        if out is not None and out[0] in linears:
            found.add(out[0])
            continue
        stack.extend(node.all_input_nodes)
    return sorted(found)


def own_failure(traced: TracedForward, model: nn.Module, name: str, degree: int) -> str | None:
    """Why ``name`` alone cannot start a column-parallel group (None when it can)."""
    groups = _Search(traced, model, {name}, degree).run()
    return next((g.reason for g in groups if g.reason is not None), None)
