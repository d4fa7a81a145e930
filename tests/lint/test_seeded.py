"""Every seeded bug (tests/lint/seeded.py) is found by its rule, at the line marked ``# BUG: rule``."""

from __future__ import annotations

import inspect
import os

import pytest

import fxforge
from tests.lint import seeded

SOURCE = inspect.getsourcefile(seeded)


def marked_lines(rule: str) -> set[int]:
    with open(SOURCE) as file:
        return {i for i, text in enumerate(file, 1) if text.rstrip().endswith(f"# BUG: {rule}")}


@pytest.mark.parametrize("method", ["auto", "export"])  # the graph fxforge.capture chooses (a trace, mostly), ATen's
@pytest.mark.parametrize("name", sorted(seeded.SEEDED))
def test_the_seeded_bug_is_found_at_its_line(name, method):
    factory, rule = seeded.SEEDED[name]
    model, inputs = factory()
    findings = fxforge.lint(model, inputs, method=method)
    hits = [f for f in findings if f.rule == rule]
    assert hits, f"{name}: {rule} not found; found:\n{findings}"
    lines = {f.line for f in hits if os.path.abspath(f.file) == SOURCE}
    assert lines & marked_lines(rule), f"{name}: {rule} at {[f.where for f in hits]}, marked {marked_lines(rule)}"


def test_every_rule_has_a_seeded_bug():
    from fxforge.lint import BUILTIN

    assert set(BUILTIN) - {rule for _, rule in seeded.SEEDED.values()} == set()
