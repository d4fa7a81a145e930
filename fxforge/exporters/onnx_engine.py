"""What a rule on the exported ONNX graph is, and the one loop that runs them (the ONNX side of
:mod:`fxforge.rewrites.passes` and :mod:`fxforge.rewrites.pipeline`).

A rule is an :class:`OnnxRule`: a name, a function ``(model, ctx) -> None`` that edits the ``ir.Model`` in
place and tells ``ctx`` each change (:meth:`OnnxContext.applied`) and each refusal
(:meth:`OnnxContext.refused`, with a :class:`~fxforge.rewrites.passes.Refusal` or its reason), and whether
it is for ONNX Runtime's CPU provider only. Where a rule is a pattern it is an onnxscript rewrite rule, a
:class:`PatternRule` (``pattern``, ``refusal`` returning why a match is left alone, ``rewrite``), and
:func:`pattern_pass` makes it such a function. :func:`run_onnx_rules` runs a list of rules in order and
hands back ``Applied`` and ``NearMiss`` entries (``stage="onnx"``) for the export's report.

Example:
    >>> from onnxscript import ir
    >>> def count_relus(model, ctx):
    ...     relus = [node for node in model.graph if node.op_type == "Relu"]
    ...     ctx.applied("looked at Relu", relus)
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    >>> relu = ir.Node("", "Relu", [x], outputs=[ir.Value(name="y")], name="relu_1")
    >>> model = ir.Model(ir.Graph([x], relu.outputs, nodes=[relu], opset_imports={"": 20}), ir_version=10)
    >>> matches, misses = run_onnx_rules(model, [OnnxRule("relus", count_relus, "counts Relu")], cpu=True)
    >>> [str(m) for m in matches]
    ['onnx relus: looked at Relu [relu_1]']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from onnxscript import ir
from onnxscript.ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleClassBase

from fxforge.core.report import Applied, NearMiss
from fxforge.core.source import user_line_of_stack_trace
from fxforge.rewrites.passes import Refusal

STAGE = "onnx"
# Where torch.onnx writes the fx node's stack trace on each ONNX node it emits.
STACK_TRACE = "pkg.torch.onnx.stack_trace"


def onnx_source(nodes: Sequence[ir.Node]) -> str | None:
    """The user's source line of the first of ``nodes`` whose stack trace torch.onnx recorded, or None.

    Example:
        >>> node = ir.Node("", "Relu", [], metadata_props={STACK_TRACE: 'File "/m.py", line 4, in f\\n  x.relu()'})
        >>> onnx_source([node])
        '/m.py:4: x.relu()'
    """
    for node in nodes:
        line = user_line_of_stack_trace(node.metadata_props.get(STACK_TRACE))
        if line:
            return line
    return None


@dataclasses.dataclass
class OnnxContext:
    """Where an ONNX rule writes down what it did (:class:`~fxforge.rewrites.passes.PassContext` of the fx side).

    Attributes:
        rule: the rule's name, used in the report.
        matches, near_misses: filled by :meth:`applied` and :meth:`refused`.

    Example:
        >>> ctx = OnnxContext("demo")
        >>> ctx.applied("Add -> Sum", [ir.Node("", "Add", [], name="add_1")])
        >>> ctx.refused(None, Refusal("shapes unknown")); ctx.counts(), ctx.reasons()
        ({'Add -> Sum': 1}, ['shapes unknown'])
    """

    rule: str
    matches: list[Applied] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)

    def applied(self, what: str, nodes: Sequence[ir.Node] = (), count: int = 1) -> None:
        """Record ``count`` applications that changed ``what``, at ``nodes`` (those replaced, where known)."""
        if count:
            self.matches.append(Applied(self.rule, what, [n.name or n.op_type for n in nodes], onnx_source(nodes),
                                        stage=STAGE, count=count))

    def refused(self, node: ir.Node | None, refusal: Refusal | str) -> None:
        """Record that the rule looked at ``node`` (None: at no one node) and left it, with the reason."""
        name = "" if node is None else node.name or node.op_type
        self.near_misses.append(NearMiss(self.rule, name, str(refusal), None if node is None else onnx_source([node]),
                                         stage=STAGE))

    def counts(self) -> dict[str, int]:
        """Applications per ``what``."""
        counts: dict[str, int] = {}
        for match in self.matches:
            counts[match.what] = counts.get(match.what, 0) + match.count
        return counts

    def reasons(self) -> list[str]:
        """The refusals' reasons, in order."""
        return [miss.reason for miss in self.near_misses]


OnnxPass = Callable[[ir.Model, OnnxContext], None]


@dataclasses.dataclass(frozen=True)
class OnnxRule:
    """A named rule on the exported ONNX graph.

    Attributes:
        name: how the report names it (``"onnx residual_norm"``).
        run: ``(model, ctx) -> None``; edits the model in place.
        description: one line.
        cpu_only: applied only when the file is for ONNX Runtime's CPU provider.

    Example:
        >>> OnnxRule("x", lambda model, ctx: None, "one line", cpu_only=True).cpu_only
        True
    """

    name: str
    run: OnnxPass
    description: str = ""
    cpu_only: bool = False

    def apply(self, model: ir.Model, ctx: OnnxContext) -> None:
        """Run the rule on ``model`` (:func:`run_onnx_rules` calls this)."""
        self.run(model, ctx)


def run_onnx_rules(model: ir.Model, rules: Sequence[OnnxRule], *, cpu: bool) -> tuple[list[Applied], list[NearMiss]]:
    """Run ``rules`` on ``model`` in order (those for the CPU provider only where ``cpu``), then drop the nodes
    nothing reads any more; returns what they applied and refused, in order.

    Example:
        >>> model = ir.Model(ir.Graph([], [], nodes=[], opset_imports={"": 20}), ir_version=10)
        >>> run_onnx_rules(model, [], cpu=False)
        ([], [])
    """
    matches, near_misses = [], []
    for rule in rules:
        if rule.cpu_only and not cpu:
            continue
        ctx = OnnxContext(rule.name)
        rule.apply(model, ctx)
        matches.extend(ctx.matches)
        near_misses.extend(ctx.near_misses)
    RemoveUnusedNodesPass()(model)  # what computed dropped guards' conditions, folded transposes
    return matches, near_misses


class PatternRule(RewriteRuleClassBase):
    """An onnxscript rewrite rule that says why it refused: subclasses write ``pattern(op, ...)``,
    ``refusal(context, ...)`` (None: rewrite; :data:`NOT_HERE`: not this rule's business, nothing recorded;
    a :class:`~fxforge.rewrites.passes.Refusal` or reason: a near miss at the match's root) and
    ``rewrite(op, ...)``; ``what`` is the report's line for an application. ``commute``: the pattern's
    commutative ops match their operands in either order.

    Example:
        >>> class DoubleNeg(PatternRule):
        ...     what = "Neg(Neg(x)) -> x"
        ...     def pattern(self, op, x):
        ...         return op.Neg(op.Neg(x))
        ...     def rewrite(self, op, x):
        ...         return op.Identity(x)
        >>> DoubleNeg().what
        'Neg(Neg(x)) -> x'
    """

    what = ""
    commute = False

    def __init__(self) -> None:
        super().__init__(type(self).__name__)
        self.ctx: OnnxContext | None = None

    def refusal(self, context, **bindings) -> Refusal | str | None:
        """Why this match is not rewritten (see the class docstring); None: rewrite it."""
        return None

    def check(self, context, **bindings) -> MatchResult:
        """onnxscript's check: :meth:`refusal`, with each refusal recorded in :attr:`ctx`."""
        result = MatchResult()
        refusal = self.refusal(context, **bindings)
        if refusal is NOT_HERE:
            return result.fail("not a match of this rule")
        refusal = Refusal.of(refusal)
        if refusal is not None:
            if self.ctx is not None:
                self.ctx.refused(context.root, refusal)
            return result.fail(str(refusal))
        return result

    def rules(self) -> list[RewriteRule]:
        """The onnxscript rule (its commuted forms too, with :attr:`commute`), checked by this instance."""
        rule = RewriteRule(self.pattern, self.rewrite, self.check, name=self.name, remove_nodes=self.remove_nodes)
        return list(rule.commute()) if self.commute else [rule]


NOT_HERE = Refusal("not this rule's business")  # a PatternRule's refusal that records nothing


def pattern_pass(rule: Callable[[], PatternRule]) -> OnnxPass:
    """An :class:`OnnxRule`'s function that applies a :class:`PatternRule` (made by ``rule()`` for each run)
    to every node of the model's graph and subgraphs, in graph order: each match its check passes is
    replaced (the replacement's single node takes the name of the single node it replaces; the new values
    take the old ones' names), and recorded with the names of the nodes it matched. A rule with
    ``remove_nodes=False`` replaces only the match's root; the other nodes stay for their other readers.

    Example:
        >>> class NegNeg(PatternRule):
        ...     what = "Neg(Neg(x)) -> x"
        ...     def pattern(self, op, x):
        ...         return op.Neg(op.Neg(x))
        ...     def rewrite(self, op, x):
        ...         return op.Identity(x)
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
        >>> a = ir.Node("", "Neg", [x], outputs=[ir.Value(name="a")], name="neg_a")
        >>> b = ir.Node("", "Neg", [a.outputs[0]], outputs=[ir.Value(name="b")], name="neg_b")
        >>> out = ir.Node("", "Relu", [b.outputs[0]], outputs=[ir.Value(name="y")])
        >>> model = ir.Model(ir.Graph([x], out.outputs, nodes=[a, b, out], opset_imports={"": 20}), ir_version=10)
        >>> ctx = OnnxContext("neg_neg"); pattern_pass(NegNeg)(model, ctx)
        >>> [node.op_type for node in model.graph], ctx.matches[0].nodes
        (['Identity', 'Relu'], ['neg_a', 'neg_b'])
    """

    def run(model: ir.Model, ctx: OnnxContext) -> None:
        instance = rule()
        instance.ctx = ctx
        rewrite_rules = instance.rules()
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            graph = node.graph
            if graph is None:
                continue  # removed by an earlier replacement
            for rewrite_rule in rewrite_rules:
                delta = rewrite_rule.try_rewrite(model, graph, node)
                if delta is None:
                    continue
                matched = list(reversed(delta.match.nodes))  # the matcher lists them from the root back
                if len(matched) == 1 and len(delta.new_nodes) == 1 and instance.remove_nodes:
                    delta.new_nodes[0].name = matched[0].name
                for initializer in delta.new_initializers:
                    graph.register_initializer(initializer)
                ctx.applied(instance.what, matched)
                ir.convenience.replace_nodes_and_values(graph, node, matched if instance.remove_nodes else [],
                                                        delta.new_nodes, delta.match.outputs, delta.new_outputs)
                if not instance.remove_nodes and not any(v.uses() or v.is_graph_output() for v in node.outputs):
                    graph.remove(node, safe=True)  # the root, replaced; the rest of the match stays where read
                break

    run.__name__ = run.__qualname__ = f"{getattr(rule, '__name__', 'pattern')}_pass"
    run.__doc__ = rule.__doc__
    return run


def apply_to_graph(run: OnnxPass, graph: ir.Graph, name: str) -> OnnxContext:
    """Run one rule's function on ``graph`` alone (a model made around it; a graph with no opset imports gets
    the default domain's 20), for testing a rule outside an export; returns its context.

    Example:
        >>> apply_to_graph(lambda model, ctx: ctx.applied("nothing", count=2), ir.Graph([], [], nodes=[]), "x").counts()
        {'nothing': 2}
    """
    if not graph.opset_imports:
        graph.opset_imports[""] = 20
    ctx = OnnxContext(name)
    run(ir.Model(graph, ir_version=10), ctx)
    return ctx
