"""The pattern engine: rules written as ordinary torch code that match every call form of their ops.

A :class:`Rule` is a pattern function, a replacement function and an optional ``check``. The pattern is
traced with ``torch.fx`` and each of its nodes, like each node of the graph being rewritten, is seen as a
*canonical op* (:func:`~fxforge.rewrites.canonical.canonicalize`): ``nn.ReLU()``, ``F.relu``, ``torch.relu``,
``x.relu()``, ``relu_``, ``inplace=True`` and ``aten.relu_`` are all ``relu``; ``+``, ``torch.add``, ``x.add_``
and ``aten.add.Tensor`` are all ``add`` (operands in either order); ``/``, ``torch.div`` and
``aten.div.Tensor`` are all ``div``; ``@``, ``mm`` and ``bmm`` are all ``matmul``; ``nn.Conv2d``,
``F.conv2d``, ``aten.conv2d`` and ``aten.convolution`` are all ``conv2d``. Matching then compares canonical
ops and their arguments:

- a pattern *argument* (a parameter of the pattern function) matches anything and binds it; used twice,
  it must bind the same value;
- a constant in the pattern, or an argument it leaves at its default, must equal the graph's value;
- a match never swallows an intermediate value used outside it, never drops a side effect, and never
  moves an op past an in-place change of its input: such matches are refused with the reason. A use that
  only reads an intermediate value's shape, dtype or device is not a use of the value: where the value has
  the result's shape, the read moves to the replacement's result (placed before the read).

The replacement is called with the bindings (graph values as ``torch.fx.Proxy``, constants as they are)
and its torch calls are recorded into the graph. With ``fold=True`` the parts of the replacement that
depend only on parameters are computed once (in float64) and registered as new tensors on the
GraphModule (:mod:`fxforge.rewrites.folding`); the model's own parameters are never modified.

Example:
    >>> import torch.nn.functional as F
    >>> from fxforge.rewrites.pattern import Rule
    >>> silu = Rule("silu", lambda x: x * torch.sigmoid(x), lambda x: F.silu(x))
    >>> gm = torch.fx.symbolic_trace(lambda x: torch.sigmoid(x).mul(x) + 1)
    >>> from fxforge.rewrites.passes import PassContext
    >>> ctx = PassContext("silu", training=False, method="fx")
    >>> silu.apply(gm, ctx); [m.what for m in ctx.matches]
    ['silu']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import CALL_OPS, is_effectful, is_view_op
from fxforge.core.plan import CallConditions
from fxforge.core.shapes import propagate_meta
from fxforge.core.source import inherit_origin
from fxforge.core.symbolic import size_expr
from fxforge.core.tracing import symbolic_trace
from fxforge.core.vocabulary import COMMUTATIVE, SIGNATURES, op_name, reads_metadata
from fxforge.rewrites.canonical import Op, ParamRef, bound_tensor, canonicalize, same_value
from fxforge.rewrites.folding import fold_constants
from fxforge.rewrites.passes import Pass, PassContext, Refusal


@dataclasses.dataclass
class Match:
    """One place where a rule's pattern matched: what the pattern's arguments bound to, and the nodes.

    ``match["w"]`` is what the pattern argument ``w`` bound to (a graph node, a module parameter or a
    constant); :meth:`tensor` gives its tensor (real for parameters and buffers, a FakeTensor otherwise).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); _ = g.output(x)
        >>> Match(torch.fx.GraphModule(torch.nn.Module(), g), {"x": x}, [x])["x"].name
        'x'
    """

    graph_module: torch.fx.GraphModule
    bindings: dict[str, Any]
    nodes: list[Node]
    ops: dict[str, Op] = dataclasses.field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def tensor(self, name: str) -> torch.Tensor | None:
        """The tensor a pattern argument bound to, or None (a constant, or no metadata)."""
        return bound_tensor(self.graph_module, self.bindings[name])

    @property
    def anchor(self) -> Node:
        """The node whose value the pattern computes (its uses get the replacement)."""
        return self.nodes[-1]


class Pattern:
    """A pattern function traced into canonical ops, matched against graph nodes.

    Example:
        >>> p = Pattern(lambda x, y: torch.relu(x + y))
        >>> gm = torch.fx.symbolic_trace(lambda a, b: (b + a).relu_())
        >>> m = next(p.matches(list(gm.graph.nodes)[-2], gm))
        >>> m["x"].name, m["y"].name, [n.name for n in m.nodes]
        ('b', 'a', ['add', 'relu_'])
    """

    def __init__(self, fn: Callable):
        self.graph_module = symbolic_trace(fn)
        nodes = list(self.graph_module.graph.nodes)
        self.arguments = [n.target for n in nodes if n.op == "placeholder"]
        output = nodes[-1].args[0]
        if not isinstance(output, Node) or output.op == "placeholder":
            raise ValueError("a pattern must return the result of a torch call")
        self.output = output
        self.ops = {n: canonicalize(n, self.graph_module) for n in nodes if n.op.startswith("call")}
        broken = [n.name for n, op in self.ops.items() if op is None]
        if broken:
            raise ValueError(f"pattern calls it cannot read: {', '.join(broken)}")
        self.output_op = op_name(output, self.graph_module)  # what a node must be named to be matched at all

    def may_match(self, named: str | None) -> bool:
        """Whether a node the vocabulary names ``named`` (:func:`~fxforge.core.vocabulary.op_name`) can be this
        pattern's output: a cheap test before :meth:`matches`. A node it names nothing (``aten.convolution``,
        a module it does not know) or ``getitem`` (a batch norm's tuple) may still be the op.

        Example:
            >>> p = Pattern(lambda x: torch.relu(x))
            >>> p.may_match("relu"), p.may_match("add"), p.may_match(None)
            (True, False, True)
        """
        return self.output_op is None or named is None or named == "getitem" or named == self.output_op

    def matches(self, node: Node, gm: torch.fx.GraphModule) -> Iterator[Match]:
        """Every way the pattern's output matches ``node`` (commutative operands give alternatives)."""
        for bindings, mapping in self._op(self.output, node, gm, {}, {}):
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            matched = sorted((op.node for op in mapping.values()), key=order.__getitem__)
            ops = {p.name: op for p, op in mapping.items()}
            yield Match(gm, bindings, matched, ops)

    def _op(self, p: Node, t: Node, gm, bindings: dict, mapping: dict) -> Iterator[tuple[dict, dict]]:
        if p in mapping:
            if mapping[p].node is t:
                yield bindings, mapping
            return
        if any(op.node is t for op in mapping.values()):
            return
        p_op, t_op = self.ops[p], canonicalize(t, gm)
        if t_op is None or t_op.name != p_op.name:
            return
        orders = [p_op.args]
        if p_op.name in COMMUTATIVE and same_value(t_op.args.get("alpha", 1), 1) and same_value(p_op.args.get("alpha", 1), 1):
            orders.append({**p_op.args, "input": p_op.args["other"], "other": p_op.args["input"]})
        for p_args in orders:
            if set(p_args) != set(t_op.args):
                continue
            yield from self._args(list(p_args.items()), t_op, gm, bindings, {**mapping, p: t_op})

    def _args(self, items: list, t_op: Op, gm, bindings: dict, mapping: dict) -> Iterator[tuple[dict, dict]]:
        if not items:
            yield bindings, mapping
            return
        (name, p_value), rest = items[0], items[1:]
        for b, m in self._value(p_value, t_op.args[name], gm, bindings, mapping):
            yield from self._args(rest, t_op, gm, b, m)

    def _value(self, p: Any, t: Any, gm, bindings: dict, mapping: dict) -> Iterator[tuple[dict, dict]]:
        if isinstance(p, Node) and p.op == "placeholder":
            if p.target not in bindings:
                yield {**bindings, p.target: t}, mapping
            elif same_value(bindings[p.target], t):
                yield bindings, mapping
        elif isinstance(p, Node):
            if isinstance(t, Node):
                yield from self._op(p, t, gm, bindings, mapping)
        elif isinstance(p, (list, tuple)) and any(isinstance(v, Node) for v in p):
            if isinstance(t, (list, tuple)) and len(t) == len(p):
                yield from self._args(list(zip(range(len(p)), p)), Op("", dict(enumerate(t)), None), gm,
                                      bindings, mapping)
        elif same_value(p, t):
            yield bindings, mapping


@dataclasses.dataclass
class Rule:
    """A rewrite rule: ``pattern`` and ``replacement`` written with ordinary torch calls.

    A Rule is also a pass (``.name``, ``.apply``): ``fxforge.rewrite(cap, [rule])`` applies it alone and
    counts it under its own name; :func:`rules_pass` groups several under one name.

    Attributes:
        name: how the report names each change the rule makes.
        pattern: a function of tensors (and, for attributes such as strides, other values) returning
            the value to replace.
        replacement: a function with the same parameters returning the new value.
        check: ``check(match) -> Refusal | None`` (the reason may be a plain string too); a refusal
            leaves the match alone and lands in the report.
        fold: compute the parameter-only parts of the replacement once, as new tensors (eval only).
        description: one line for ``fxforge rewrites``.

    Example:
        >>> rule = Rule("double", lambda x: x + x, lambda x: x * 2)
        >>> rule.pattern_graph.arguments
        ['x']
    """

    name: str
    pattern: Callable
    replacement: Callable
    check: Callable[[Match], Refusal | str | None] | None = None
    fold: bool = False
    description: str = ""
    keeps_meta = True  # the engine gives each node it creates shape metadata (see Pass.keeps_meta)

    def __post_init__(self) -> None:
        self.pattern_graph = Pattern(self.pattern)

    def apply(self, graph_module: torch.fx.GraphModule, ctx: PassContext) -> None:
        """Apply this rule everywhere in ``graph_module`` (the pipeline calls this)."""
        apply_rules(graph_module, ctx, [self])


def rules_pass(name: str, rules: list[Rule], description: str = "") -> Pass:
    """A :class:`~fxforge.rewrites.passes.Pass` applying ``rules`` top to bottom, each over the whole graph.

    Example:
        >>> rules_pass("double", [Rule("x+x", lambda x: x + x, lambda x: x * 2)]).name
        'double'
    """
    return Pass(name, lambda gm, ctx: apply_rules(gm, ctx, rules), description, keeps_meta=True)


def apply_rules(gm: torch.fx.GraphModule, ctx: PassContext, rules: list[Rule], at: Iterable[Node] | None = None
                ) -> None:
    """Apply each rule, top to bottom, at every node where its pattern matches and nothing refuses; with ``at``,
    only at those nodes (the nodes whose values the patterns compute).

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x + x)
        >>> ctx = PassContext("d", False, "fx"); apply_rules(gm, ctx, [Rule("d", lambda x: x + x, lambda x: 2 * x)])
        >>> len(ctx.matches)
        1
        >>> apply_rules(gm, ctx, [Rule("d", lambda x: x * 2, lambda x: x + x)], at=[]); len(ctx.matches)
        1
    """
    where = None if at is None else set(at)
    named: dict[Node, str | None] = {}  # a node's op never changes (a replacement makes new nodes)
    for rule in rules:
        for node in list(gm.graph.nodes):
            if getattr(node, "_erased", False) or node.op not in CALL_OPS or (where is not None and node not in where):
                continue
            if node not in named:
                named[node] = op_name(node, gm)
            if not rule.pattern_graph.may_match(named[node]):
                continue
            reason = None
            for match in rule.pattern_graph.matches(node, gm):
                reason = _refusal(rule, match, ctx)
                if reason is None:
                    ctx.matched(rule.name, match.nodes)
                    _replace(rule, match)
                    break
            if reason is not None:
                ctx.refused(node, reason)


def _refusal(rule: Rule, match: Match, ctx: PassContext) -> Refusal | None:
    """Why this match must not be replaced, or None: the rule's check, then the engine's safety rules."""
    refusal = Refusal.of(rule.check(match)) if rule.check is not None else None
    if refusal is not None:
        return refusal
    if rule.fold and ctx.training:
        return Refusal("folds parameters into constants, which would stop their gradients in training mode")
    if rule.fold and ctx.conditions.gradients:
        return Refusal(f"folds parameters into constants, which would stop their gradients: "
                       f"{CallConditions.FOR_GRADIENTS}")
    gm, inside = match.graph_module, _inside(match)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted(inside - {match.anchor}, key=order.__getitem__):
        outside = [u for u in node.users if u not in inside]
        if any(not _reads_shape(u) for u in outside) or (outside and not _same_shape(node, match.anchor)):
            names = ", ".join(u.name for u in outside)
            return Refusal(f"the value of {node.name} is also used outside the match (by {names})")
    reads = _shape_reads(match, inside)
    if reads:  # the replacement goes before the first of them: what it reads must exist there already
        first = min(reads, key=lambda pair: order[pair[0]])[0]
        late = [v for v in match.bindings.values() if isinstance(v, Node) and order[v] > order[first]
                and v.op != "get_attr"]  # (a parameter read has no inputs: it moves up with the replacement)
        if late:
            return Refusal(f"{first.name} reads the shape of a matched value before {late[0].name}, which the "
                           "replacement needs, is computed")
    for op in match.ops.values():
        unknown = op.name not in SIGNATURES  # known ops' only state is BatchNorm's (op.effect)
        if op.effect or (unknown and is_effectful(op.node, gm)):
            return Refusal(f"{op.node.name} has a side effect the replacement would drop "
                           f"({op.effect or 'state or mutation'})")
        mutated = op.args.get("input") if op.inplace else None
        visible = isinstance(mutated, Node) and (mutated.op in ("placeholder", "get_attr") or is_view_op(mutated)
                                                 or len(mutated.users) > 1)
        if visible and mutated not in inside:
            return Refusal(f"{op.node.name} changes {mutated.name} in place, and that change is visible outside "
                           "the match")
    first, last = order[match.nodes[0]], order[match.anchor]
    for value in match.bindings.values():
        for user in value.users if isinstance(value, Node) else ():
            if user not in inside and first < order[user] < last and is_effectful(user, gm):
                return Refusal(f"{value.name} is changed in place by {user.name} between the matched ops")
    return None


def _inside(match: Match) -> set[Node]:
    """The nodes a match replaces: its pattern's nodes and what their canonical ops cover."""
    inside = set(match.nodes)
    for op in match.ops.values():
        inside.update(op.covered)
    return inside


def _reads_shape(node: Node) -> bool:
    """A use that reads only shape, dtype or device (``x.shape``, ``x.size(1)``, ``aten.sym_size``), which the
    replacement's value answers as the replaced one did: not a use of the value (strides are not promised)."""
    return reads_metadata(node) and node.target is not torch.ops.aten.sym_stride.int


def _same_shape(node: Node, anchor: Node) -> bool:
    """Whether a replaced intermediate value has the shape, dtype and device of the match's result (so a read
    of its shape can read the replacement's instead): timm's ``BatchNormAct2d`` reads the convolution's
    output size before normalising it."""
    a, b = node.meta.get("val"), anchor.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    return a.dtype == b.dtype and a.device == b.device and len(a.shape) == len(b.shape) and all(
        size_expr(x) == size_expr(y) for x, y in zip(a.shape, b.shape))


def _shape_reads(match: Match, inside: set[Node]) -> list[tuple[Node, Node]]:
    """``(reader, replaced node)`` for each read of a replaced intermediate value's shape outside the match."""
    return [(user, node) for node in inside - {match.anchor} for user in node.users if user not in inside]


def _replace(rule: Rule, match: Match) -> None:
    gm, graph, anchor = match.graph_module, match.graph_module.graph, match.anchor
    before = set(graph.nodes)
    tracer = torch.fx.proxy.GraphAppendingTracer(graph)
    # reads of a replaced value's shape (the only uses outside a match the refusals let through) read the
    # replacement's instead, which is placed before the first of them
    doomed = _inside(match)
    reads = _shape_reads(match, doomed)
    order = {n: i for i, n in enumerate(graph.nodes)} if reads else {}
    at = min([anchor, *(reader for reader, _ in reads)], key=lambda n: order.get(n, 0))
    for value in match.bindings.values():
        if at is not anchor and isinstance(value, Node) and value.op == "get_attr" and order[value] > order[at]:
            at.prepend(value)
    with graph.inserting_before(at):
        def proxy(value):
            if isinstance(value, ParamRef):
                value = graph.get_attr(value.target)
            return torch.fx.Proxy(value, tracer) if isinstance(value, Node) else value
        result = rule.replacement(**{k: proxy(v) for k, v in match.bindings.items()})
        if not isinstance(result, torch.fx.Proxy):
            raise TypeError(f"rule {rule.name!r}: the replacement must return a value computed from its inputs")
        new = [n for n in graph.nodes if n not in before]
        if rule.fold:
            new = fold_constants(gm, new)
    inherit_origin(new, match.nodes, gm)
    propagate_meta(gm, new, result=(result.node, anchor.meta.get("val")))
    anchor.replace_all_uses_with(result.node)
    for reader, node in reads:
        reader.replace_input_with(node, result.node)
    doomed.update(v for v in match.bindings.values() if isinstance(v, Node) and v.op == "get_attr")
    for node in reversed(list(graph.nodes)):
        if node in doomed and not node.users:
            graph.erase_node(node)
