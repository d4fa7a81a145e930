"""The report as text: every change listed, the same change at the same line of the user's code on one line."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import fxforge

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "user_models"))
from hand_written import USER_MODELS  # the user-style corpus


def test_a_unets_repeated_blocks_are_one_line_per_source_line_with_every_node():
    case = USER_MODELS["unet"]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = fxforge.optimize(case.model, case.inputs, target="native").report
    text = str(report)
    folds = [line for line in text.splitlines() if line.strip().startswith("conv_bn_fold:")]
    # ten folds, written at two lines of the block's forward (conv1 + bn1, conv2 + bn2): two lines, x5 each
    assert report.counts["conv_bn_fold"] == 10 and len(folds) == 2, text
    assert all(" x5 [" in line and "hand_written.py:8" in line for line in folds)
    for match in report.matches:  # no node left out of the text
        assert all(node in text for node in match.nodes)
