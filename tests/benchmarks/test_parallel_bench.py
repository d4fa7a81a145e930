"""Smoke test of the parallel-plans benchmark (``python -m benchmarks --suite parallel``, issue 52): the whole
runner on a tiny ViT, its best candidate run on gloo and the float64 tensor-parallel check at 2 ranks, its
rows and markdown block. ``benchmarks/RESULTS.md`` is never touched."""

from __future__ import annotations

import json

from benchmarks import parallel_plans
from benchmarks.harness import main
from benchmarks.sections import SECTIONS


def test_the_section_plans_runs_and_reports(tmp_path):
    markdown = tmp_path / "RESULTS.md"
    assert main(["--suite", "parallel", "--quick", "--models", "vit", "--top", "1", "--rounds", "1", "--degrees", "2",
                 "--out", str(tmp_path), "--markdown", str(markdown)]) == 0
    data = json.loads((tmp_path / "results-parallel.json").read_text())
    (plan,) = data["plans"]
    assert plan["chosen"] == plan["candidates"][0]["strategy"] and plan["plan_s"] > 0
    (row,) = data["measured"]
    assert row["status"] == "ok" and row["rank"] == 1 and row["ok"] and row["fastest_measured"]
    assert row["collectives_match"] in (True, None) and row["measured_ms"] > 0
    (exact,) = data["exact"]
    assert exact["status"] == "ok" and exact["grad_error"] < 1e-10 and exact["collectives_match"]
    text = markdown.read_text()
    assert "## Parallel plans" in text and "| vit | 1 |" in text and "- vit: first choice" in text
    assert SECTIONS["parallel"] is parallel_plans.SECTION


def test_every_model_builds_from_its_config():
    for name in parallel_plans.MODELS:
        model, inputs = parallel_plans.build(name, **parallel_plans.QUICK)
        out = model(**inputs)
        assert out is not None and sum(p.numel() for p in model.parameters()) > 0
