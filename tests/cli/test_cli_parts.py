"""The command's parts in-process: the summary's rows, the HTML report, marked nodes, atomic outputs."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import fxforge
from fxforge.cli.graphs import marked_nodes
from fxforge.cli.html import render_html
from fxforge.cli.output import Outputs, atomic_write
from fxforge.cli.summary import Summary, compare_latency
from fxforge.core.report import NearMiss, Report, RolledBack
from fxforge.lowering.autotune import TuningPolicy


def test_summary_lists_refusals_with_reasons_and_the_html_escapes_them():
    report = Report(method="fx", nodes_before=10, nodes_after=7)
    report.near_misses.append(NearMiss("attention", "softmax", "softmax over dim 1 <not the last>", "m.py:4: y = f(x)"))
    report.rolled_back.append(RolledBack("mine", 2, "max abs error 3 exceeds tolerance"))
    summary = Summary("Net", "2x8", report, peak_before=4096, peak_after=2048, latency=(2.0, 4.0), reps=5,
                      max_error=1e-7, error_of="optimized graph")
    rows = dict(summary.rows())
    assert rows["refused"] == "2 (below)" and rows["nodes"] == "10 -> 7"
    assert rows["peak memory (simulated)"] == "4.0 KiB -> 2.0 KiB (-50%)"
    assert rows["latency"].startswith("eager 2 ms -> 4 ms (2.00x slower")
    assert summary.refused() == [("mine", "2 matches", "rolled back: max abs error 3 exceeds tolerance"),
                                 ("attention", "softmax (m.py:4: y = f(x))", "softmax over dim 1 <not the last>")]
    page = render_html(summary, {"rewritten": "<svg>x</svg>"})
    assert "softmax over dim 1 &lt;not the last&gt;" in page and "<svg>x</svg>" in page


def test_fused_nodes_are_marked():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    cap = fxforge.capture(model, (torch.randn(1, 3, 8, 8),))
    new = fxforge.rewrite(cap, tuning=TuningPolicy(kernel="composite", keep="fused"))
    marked = marked_nodes(cap.graph_module, new.graph_module)
    fused = [n.name for n in new.graph_module.graph.nodes if n.target is torch.ops.fxforge.conv_pointwise.default]
    assert fused and set(fused) <= set(marked)
    assert not any(name.startswith("_fxforge_folded") for name in marked)  # weights are not marked


def test_outputs_are_removed_when_a_later_step_fails(tmp_path):
    with pytest.raises(RuntimeError), Outputs() as outputs:
        outputs.write_text(str(tmp_path / "report.html"), "<p>")
        atomic_write(str(tmp_path / "m.pt2"), lambda path: Path(path).write_bytes(b"x"))
        outputs.written(str(tmp_path / "m.pt2"))
        raise RuntimeError("the report could not be drawn")
    assert os.listdir(tmp_path) == []


def test_compare_latency_interleaves_and_takes_medians():
    calls = []
    eager, optimized = (lambda x: calls.append("e")), (lambda x: calls.append("o"))
    compare_latency(eager, optimized, (None,), reps=4, warmup=1)
    assert calls == ["e", "o", "e", "o", "o", "e", "e", "o", "o", "e"]
