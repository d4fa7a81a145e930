"""``fxforge.lint`` on the user models of tests/user_models: the hand-written ones give nothing above info (but
the one that branches on its data, whose branch is a host sync); each model TorchDynamo breaks for a value read is
reported as a ``host-sync`` at the line it breaks at, and nothing else above info."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fxforge

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "user_models"))  # as tests/user_models imports them

from hand_written import USER_MODELS
from with_breaks import BREAK_LINES, BREAK_MODELS

# Breaks that read a tensor's value on the host (print of a shape and a torch.compiler.disable'd helper do not).
VALUE_READS = {"data_branch", "item_scale", "ragged_loop", "masked_pool", "greedy_decoder", "hf_greedy"}


def _lint(case):
    return fxforge.lint(case.model, case.inputs, example_kwargs=case.kwargs)


@pytest.mark.parametrize("name", sorted(USER_MODELS))
def test_hand_written_models_have_nothing_above_info_but_their_data_branch(name):
    findings = _lint(USER_MODELS[name]())
    expected = ["host-sync"] if name == "data_branch" else []
    assert [f.rule for f in findings.above("info")] == expected, str(findings)


@pytest.mark.parametrize("name", sorted(BREAK_MODELS))
def test_a_break_that_reads_a_value_is_a_host_sync_at_its_line(name):
    findings = _lint(BREAK_MODELS[name]())
    above = findings.above("info")
    if name in VALUE_READS:
        assert [(f.rule, f.code) for f in above] == [("host-sync", BREAK_LINES[name])], str(findings)
    elif name == "numpy_threshold":  # one graph (dynamo runs numpy as torch), and .cpu().numpy() in it
        assert [f.rule for f in above] == ["host-sync"] and ".numpy()" in above[0].code, str(findings)
    else:
        assert above == [], str(findings)
