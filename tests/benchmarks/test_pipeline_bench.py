"""Smoke test of the pipeline benchmark (``python -m benchmarks --suite pipeline``, issue 23): the whole
runner on a tiny GPT-2 at 2 and 4 stages with one measured round at 2 stages (gloo runs of each split, and
the float64 check), its rows, its
markdown block and the section's registration. ``benchmarks/RESULTS.md`` is never touched."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import pipeline
from benchmarks.harness import main
from benchmarks.sections import SECTIONS


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    markdown = out / "RESULTS.md"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # not the section's 2: test_the_run_leaves_the_callers_threads sees it put back
    try:
        assert main(["--suite", "pipeline", "--quick", "--models", "gpt2", "--stages", "2,4", "--out", str(out),
                     "--markdown", str(markdown)]) == 0
        left = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "results-pipeline.json").read_text()), markdown.read_text(), left


def test_every_policy_has_a_row_per_stage_count(result):
    data, _, _ = result
    rows = {(r["stages"], r["policy"]): r for r in data["plans"]}
    assert set(rows) == {(s, p) for s in (2, 4) for p in pipeline.POLICIES}
    ours, even = rows[(2, "fxforge")], rows[(2, "even-layers")]
    assert ours["status"] == even["status"] == "ok" and ours["engine"] == "runs"
    assert ours["bottleneck"] <= even["bottleneck"] and ours["gain_vs_even"] >= 1.0
    assert rows[(4, "even-layers")]["status"] == "no split"           # two blocks, four stages
    assert all(r["throughput_1f1b"] > 0 for r in data["plans"] if r["status"] == "ok")


def test_the_measured_runs_match_the_single_process(result):
    data, _, _ = result
    measured = {r["policy"]: r for r in data["measured"]}
    # fxforge-measured (the split from measured costs) runs only where it differs from the roofline split.
    assert {"fxforge", "even-layers"} <= set(measured) <= {"fxforge", "even-layers", "fxforge-measured"}
    for row in measured.values():
        assert row["status"] == "ok" and row["matches"] and row["step_ms"] > 0 and row["single_process_ms"] > 0
        assert row["float64_matches"] is True, row["float64_error"]
    assert measured["fxforge"]["fxforge_speedup"] == pytest.approx(1.0)


def test_the_block_and_the_section(result):
    data, text, _ = result
    assert "<!-- harness:pipeline:begin -->" in text and "<!-- harness:pipeline:end -->" in text
    assert "| gpt2 | 2 | fxforge |" in text and "Measured at 2 stages" in text and "- gpt2: k=2: fxforge" in text
    assert data["meta"]["complete"] is True
    assert SECTIONS["pipeline"] is pipeline.SECTION
    assert data["meta"]["command"].startswith("python -m benchmarks --suite pipeline --quick --models gpt2")


def test_the_run_leaves_the_callers_threads(result):
    # The section computes on 2 threads; a pytest-xdist worker (1 thread) kept 2 for every later test file.
    assert result[2] == 1
