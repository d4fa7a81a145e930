"""Clean models give nothing above info: hand-written ones (tests/lint/clean.py) and the example models none at
all; the transformers corpus (tiny configs, random weights) at most one each, each named here with why it is
defensible."""

from __future__ import annotations

import pytest

import fxforge
from tests.corpus.models import TRANSFORMERS
from tests.lint.clean import CLEAN

# A finding above info on a transformers model, and why it is right: swin computes every stage's reshaped hidden
# states for output_hidden_states and drops them when they are not asked for (4 KiB a stage, every call).
EXPECTED = {"swin": {"dead-code"}}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_model_has_nothing_above_info(name):
    model, inputs = CLEAN[name]()
    findings = fxforge.lint(model, inputs)
    assert findings.above("info") == [], str(findings)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "t5", "vit", "swin", "convnext", "resnet"])
def test_transformers_models_have_at_most_one_finding_above_info(name):
    model, inputs = TRANSFORMERS[name]()
    findings = fxforge.lint(model, inputs)
    above = findings.above("info")
    assert len(above) <= 1, str(findings)
    assert {f.rule for f in above} == EXPECTED.get(name, set()), str(findings)
