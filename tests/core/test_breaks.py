"""Graph breaks in plain words: each of dynamo's reasons as the user reads it, with the usual fix."""

from __future__ import annotations

import pytest

from fxforge.core.breaks import BRANCH_FIXES, Break, GraphPart, distinct, explain_break, share_line

# dynamo's own first lines (torch 2.13), as its GraphCompileReason and compilation metrics give them.
SAMPLES = {
    "generic_jump TensorVariable()": ("branches on a tensor's value", "torch.where"),
    "Data-dependent branching\n  Explanation: Detected data-dependent branching": ("branches on a tensor's value",
                                                                                   "torch.cond"),
    "Unsupported Tensor.item() call with capture_scalar_outputs=False": (".item()", "capture_scalar_outputs"),
    "Tensor.tolist() with non-integer tensor": (".tolist()", "tensor ops"),
    "Failed to trace builtin operator\n  Explanation: Dynamo does not know how to trace builtin operator `print`":
        ("calls print()", "print outside the model"),
    "Skip calling `torch.compiler.disable()`d function": ("torch.compiler.disable", "remove the decorator"),
    "Dynamic shape operator\n  Explanation: Operator `aten.nonzero.default`": ("output size depends on the values",
                                                                               "torch.where(mask, x, 0)"),
    "Failed to trace builtin operator\n  Explanation: builtin `setattr`": ("Python builtin", "torch ops"),
}


@pytest.mark.parametrize("text", sorted(SAMPLES))
def test_each_dynamo_reason_reads_in_plain_words_with_its_fix(text):
    reason, fix = SAMPLES[text]
    found = explain_break(text, "/abs/model.py", 12, "    line of code  ")
    assert reason in found.reason and fix in found.fix
    assert found.line == "/abs/model.py:12" and found.code == "line of code"
    assert found.detail == text.splitlines()[0]


def test_an_unknown_reason_keeps_dynamos_words():
    found = explain_break("Something new in torch 3", "m.py", 1)
    assert found.reason == "dynamo cannot trace it (Something new in torch 3)" and "torch.compiler.disable" in found.fix


def test_the_branch_fix_is_the_one_the_fallback_warning_gives():
    from fxforge.runtime.fallbacks import BRANCH_FIXES as fallback_fixes

    assert fallback_fixes is BRANCH_FIXES


def test_repeats_go_and_the_order_stays():
    a, b = Break("m.py:3", "r", "f"), Break("m.py:9", "s", "g")
    assert distinct([b, a, b, a]) == [b, a]


def test_a_graph_part_and_the_share_line_read_as_sentences():
    part = GraphPart(2, "m.py:4-9", 12, 9, {"attention": 1}, Break("m.py:9", "r", "f"), calls=3, flops=10)
    assert str(part) == "graph 2 (m.py:4-9): 12 -> 9 nodes, runs 3 times per call; attention x1"
    assert share_line(0.5, None) == "50.0% of the model's FLOPs inside optimized graphs"
