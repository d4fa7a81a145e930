"""``fxforge.lint``'s face: the Findings table, text and HTML, ``# fxforge: ignore[rule]``, a user's own rule,
``rules=``, the model's modes left as they were, and lint's time against one capture."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import fxforge
from fxforge.lint import RULES, Finding, Rule, UnknownRuleError, register, unregister
from tests.lint import seeded


class Silenced(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(8, 1)

    def forward(self, x, y):
        a = ((self.out(x) - y) ** 2).mean()  # fxforge: ignore[broadcast-blowup]
        b = ((self.out(x) - y) ** 2).sum()  # fxforge: ignore[dead-code]
        c = (self.out(x) - y).abs().max()  # fxforge: ignore
        return a + b + c


def test_ignore_comment_silences_its_rule_on_its_line_only():
    findings = fxforge.lint(Silenced(), (torch.randn(4, 8), torch.randn(4)), rules=["broadcast-blowup"])
    assert [f.code for f in findings] == ["b = ((self.out(x) - y) ** 2).sum()  # fxforge: ignore[dead-code]"]
    assert "2 findings silenced by # fxforge: ignore" in findings.notes


def test_findings_table_text_and_html():
    model, inputs = seeded.SEEDED["regression_head"][0]()
    findings = fxforge.lint(model, inputs)
    table = findings.table
    assert list(table.columns) == ["rule", "severity", "file", "line", "code", "message", "fix", "involved", "bytes"]
    row = table.iloc[0]
    assert (row["rule"], row["severity"], row["bytes"]) == ("broadcast-blowup", "error", 8 * 8 * 4)
    assert row["file"].endswith("seeded.py") and row["line"] > 0
    text = str(findings)
    assert "error [broadcast-blowup]" in text and "[8, 1]" in text and "fix:" in text
    html = findings._repr_html_()
    assert html.startswith("<div>") and "<td>broadcast-blowup</td>" in html and "[8, 1]" in html
    assert findings.has_errors and len(findings) >= 1


def test_a_user_rule_runs_by_name_once_registered_and_as_an_object():
    def big_matmuls(graph):
        for node in graph.calls("linear", "matmul", "mm"):
            if graph.nbytes(node) >= 1024:
                yield graph.finding(node, f"{graph.describe(node)} from a matrix product", "make it smaller")

    rule = Rule("big-matmul", "warning", big_matmuls, "large matrix products")
    model, inputs = torch.nn.Linear(64, 64), (torch.randn(8, 64),)
    assert [f.rule for f in fxforge.lint(model, inputs, rules=[rule])] == ["big-matmul"]
    register(rule)
    try:
        assert "big-matmul" in RULES
        findings = fxforge.lint(model, inputs)
        assert [(f.rule, f.severity) for f in findings] == [("big-matmul", "warning")]
    finally:
        unregister("big-matmul")
    assert fxforge.lint(model, inputs).rules() == []


def test_rule_names_are_checked():
    with pytest.raises(UnknownRuleError, match="no-such-rule"):
        fxforge.lint(torch.nn.Linear(2, 2), (torch.randn(1, 2),), rules=["no-such-rule"])
    with pytest.raises(ValueError, match="severity"):
        Rule("x", "fatal", lambda graph: [], "")
    with pytest.raises(ValueError, match="method"):
        fxforge.lint(torch.nn.Linear(2, 2), (torch.randn(1, 2),), method="fx")


def test_a_rule_may_set_its_own_severity():
    rule = Rule("always", "info", lambda graph: [Finding("", "error", "", 0, "", "m", "f")], "")
    assert [f.severity for f in fxforge.lint(torch.nn.Linear(2, 2), (torch.randn(1, 2),), rules=[rule])] == ["error"]


def test_the_model_keeps_its_modes():
    model = seeded.ListOfNorms()
    model.train()
    model.layers[0].eval()
    findings = fxforge.lint(model, (torch.randn(4, 16),))
    assert "mode-unreached" in findings.rules()
    assert model.training and not model.layers[0].training and model.layers[1].training
    assert all(norm.training for norm in model.norms)


def test_a_model_no_method_can_read_raises_capture_error():
    class Broken(nn.Module):
        def forward(self, x):
            return x @ torch.ones(3, 3)  # a shape error on these inputs

    with pytest.raises(fxforge.CaptureError):
        fxforge.lint(Broken(), (torch.randn(2, 4),))


def test_lint_takes_no_longer_than_one_capture():
    from tests.corpus.models import TRANSFORMERS

    model, inputs = TRANSFORMERS["bert"]()  # a mid model: 2 layers, export and checks
    fxforge.lint(model, inputs)
    fxforge.capture(model, inputs)  # both warm

    lint_s = capture_s = float("inf")
    for _ in range(3):  # the best of three each, interleaved: the machine is shared
        start = time.perf_counter()
        fxforge.lint(model, inputs)
        lint_s = min(lint_s, time.perf_counter() - start)
        start = time.perf_counter()
        fxforge.capture(model, inputs)
        capture_s = min(capture_s, time.perf_counter() - start)
    assert lint_s <= 1.5 * capture_s, (lint_s, capture_s)


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # the branch
            return x * 2
        return x


class GatedRegression(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.fc = Gate(), nn.Linear(8, 1)

    def forward(self, x, y):
        return ((self.fc(self.gate(x)) - y) ** 2).mean()  # the broadcast


def test_a_submodule_export_cannot_hold_is_linted_around_and_its_branch_found():
    import inspect

    lines, start = inspect.getsourcelines(Gate)
    branch = start + next(i for i, text in enumerate(lines) if "# the branch" in text)
    lines, start = inspect.getsourcelines(GatedRegression)
    broadcast = start + next(i for i, text in enumerate(lines) if "# the broadcast" in text)
    findings = fxforge.lint(GatedRegression(), (torch.randn(4, 8), torch.randn(4)))
    assert [(f.rule, f.line) for f in findings] == [("broadcast-blowup", broadcast), ("host-sync", branch)]
    assert any(n.startswith("captured by symbolic trace") for n in findings.notes)


class BranchyHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.spare = nn.Linear(16, 16), nn.Linear(16, 1), nn.Linear(3, 3)  # the spare

    def forward(self, x, y):
        h = torch.nn.functional.dropout(self.body(x), 0.1)  # the dropout
        if h.norm() > 10:  # the branch
            h = h / h.norm()
        return ((self.head(h) - y) ** 2).mean()  # the broadcast


def test_a_model_no_graph_holds_is_linted_graph_by_graph_between_its_breaks():
    import inspect

    lines, start = inspect.getsourcelines(BranchyHead)
    at = {tag: start + next(i for i, text in enumerate(lines) if f"# the {tag}" in text)
          for tag in ("spare", "dropout", "branch", "broadcast")}
    findings = fxforge.lint(BranchyHead(), (torch.randn(4, 16), torch.randn(4)))
    assert sorted((f.rule, f.line) for f in findings) == sorted([
        ("unused-parameter", at["spare"]), ("functional-dropout", at["dropout"]), ("host-sync", at["branch"]),
        ("broadcast-blowup", at["broadcast"])])
    assert any("graphs between TorchDynamo's 1 break" in n for n in findings.notes)


def test_train_mode_lints_the_model_as_it_trains():
    model, inputs = seeded.SEEDED["functional_dropout"][0]()
    assert "functional-dropout" in fxforge.lint(model, inputs).rules()
    assert "functional-dropout" not in fxforge.lint(model, inputs, mode="train").rules()  # it drops, as it should
    model, inputs = seeded.SEEDED["gated_inplace"][0]()
    assert fxforge.lint(model, inputs, mode="train").rules() == ["inplace-on-saved"]
    with pytest.raises(ValueError, match="mode"):
        fxforge.lint(model, inputs, mode="inference")


class TracedOnly(nn.Module):
    """Export fails on the gate's branch, so lint reads a symbolic trace: module calls and `*=` as what they run."""

    def __init__(self):
        super().__init__()
        self.gate, self.score, self.softmax = Gate(), nn.Linear(8, 1), nn.Softmax(dim=-1)
        self.drop, self.proj = nn.Dropout(0.1), nn.Linear(8, 8)

    def forward(self, x, mask):
        weights = self.softmax(self.score(self.gate(x)))  # the softmax
        g = torch.sigmoid(self.drop(self.proj(x)))
        g *= mask  # the in-place
        return weights * g


def test_a_symbolic_trace_reads_module_calls_and_augmented_assignments_as_the_ops_they_run():
    import inspect

    lines, start = inspect.getsourcelines(TracedOnly)
    at = {tag: start + next(i for i, text in enumerate(lines) if f"# the {tag}" in text) for tag in ("softmax", "in-place")}
    model = TracedOnly()
    findings = fxforge.lint(model, (torch.randn(4, 8), torch.ones(4, 8)))
    assert any(n.startswith("captured by symbolic trace") for n in findings.notes)
    found = {(f.rule, f.line) for f in findings}
    assert ("reduce-size-one", at["softmax"]) in found and ("inplace-on-saved", at["in-place"]) in found, str(findings)
    assert not {"mode-unreached", "functional-dropout"} & set(findings.rules())  # its Dropout is in the module tree
