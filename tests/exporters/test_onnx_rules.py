"""The ONNX rules' engine: one list, one loop, Applied/NearMiss entries with the stage named."""

from __future__ import annotations

import numpy as np
from ir_graphs import run_graph
from onnxscript import ir

from fxforge.core.report import Report
from fxforge.exporters.onnx_engine import NOT_HERE, OnnxRule, PatternRule, pattern_pass, run_onnx_rules
from fxforge.exporters.onnx_rules import ONNX_RULES


class DoubleNegation(PatternRule):
    """Neg(Neg(x)) -> x, refused (with a reason) where x is a graph input named "keep"."""

    what = "Neg(Neg(x)) -> Identity(x)"

    def pattern(self, op, x):
        return op.Neg(op.Neg(x))

    def refusal(self, context, x):
        if x.name == "skip":
            return NOT_HERE
        return "x is called keep" if x.name == "keep" else None

    def rewrite(self, op, x):
        return op.Identity(x)


def _model() -> ir.Model:
    """``Neg(Neg(a)) + Neg(Neg(keep)) + Neg(Neg(skip))``."""
    values = [ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3])) for n in ("a", "keep", "skip")]
    nodes, ends = [], []
    for value in values:
        first = ir.Node("", "Neg", [value], outputs=[ir.Value(name=f"{value.name}_1")], name=f"neg_{value.name}_1")
        second = ir.Node("", "Neg", first.outputs, outputs=[ir.Value(name=f"{value.name}_2")], name=f"neg_{value.name}_2")
        nodes += [first, second]
        ends.append(second.outputs[0])
    total = ir.Node("", "Sum", ends, outputs=[ir.Value(name="y", type=ir.TensorType(ir.DataType.FLOAT))])
    return ir.Model(ir.Graph(values, total.outputs, nodes=[*nodes, total], opset_imports={"": 20}), ir_version=10)


def test_a_new_rule_is_one_entry_and_reaches_the_report():
    model = _model()
    feeds = {name: np.arange(3, dtype=np.float32) + i for i, name in enumerate(("a", "keep", "skip"))}
    expected = run_graph(model.graph, feeds)
    rules = [*ONNX_RULES, OnnxRule("double_negation", pattern_pass(DoubleNegation), "Neg(Neg(x)) -> x")]
    matches, near_misses = run_onnx_rules(model, rules, cpu=False)
    assert [(m.rule, m.stage, m.nodes) for m in matches] == [("double_negation", "onnx", ["neg_a_1", "neg_a_2"])]
    assert [(n.rule, n.stage, n.node, n.reason) for n in near_misses] == [
        ("double_negation", "onnx", "neg_keep_2", "x is called keep")]  # "skip" is not the rule's business
    assert [node.op_type for node in model.graph].count("Neg") == 4
    np.testing.assert_array_equal(run_graph(model.graph, feeds)[0], expected[0])

    report = Report(method="fx")
    report.matches.extend(matches)
    report.near_misses.extend(near_misses)
    assert report.counts == {"onnx double_negation": 1}
    text = str(report)
    assert "onnx double_negation: Neg(Neg(x)) -> Identity(x) [neg_a_1, neg_a_2]" in text
    assert "near miss: onnx double_negation refused at neg_keep_2: x is called keep" in text
    assert "onnx double_negation" in report._repr_html_()


def test_cpu_only_rules_are_skipped_for_other_providers():
    ran = []
    rules = [OnnxRule("cpu", lambda model, ctx: ran.append("cpu"), cpu_only=True),
             OnnxRule("any", lambda model, ctx: ran.append("any"))]
    run_onnx_rules(_model(), rules, cpu=False)
    run_onnx_rules(_model(), rules, cpu=True)
    assert ran == ["any", "cpu", "any"]


def test_the_list_names_each_rule_once_and_says_where_it_applies():
    names = [rule.name for rule in ONNX_RULES]
    assert len(names) == len(set(names))
    assert names[0] == "residual_norm" and names[-2:] == ["transpose_pairs", "unit_transposes"]
    assert all(rule.cpu_only for rule in ONNX_RULES[:-2]) and not any(rule.cpu_only for rule in ONNX_RULES[-2:])
    assert all(rule.description for rule in ONNX_RULES)
