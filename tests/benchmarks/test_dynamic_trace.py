"""Smoke test of the dynamic-shapes trace (``python -m benchmarks --suite dynamic``, issue 19).

One short trace (6 calls, batch 1 or 2, S in [8, 24]) on a tiny BERT through eager and fxforge, in process:
the rows carry every figure and no output differs from eager's. The markdown block is written to a temporary
file only; ``benchmarks/RESULTS.md`` is never touched. torch.compile and the ONNX exports are left out (tens of
seconds and several seconds on a small CPU machine); the ORT session's calling convention is checked with a
stand-in session.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import dynamic, report
from benchmarks.harness import build_parser
from benchmarks.sections import SECTIONS

TINY = dynamic.ModelSize(hidden=32, layers=2, heads=2, kv_heads=1, vocab=1000)
CALLS = 6
FIGURES = ("setup_s", "trace_s", "trace_vs_eager", "p50_ms", "p99_ms", "warm_p99_over_p50", "per_call_vs_eager",
           "mismatches", "calls")
# The section's 2 threads; under pytest-xdist the worker's one (conftest.py): two threads beside the other
# worker's fight it for the two cores.
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def _trace(calls: int = CALLS) -> list[dynamic.Request]:
    return dynamic.make_trace(calls, seed=0, batches=(1, 2), seq_range=(8, 24))


@pytest.fixture(scope="module")
def rows():
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        model = dynamic.build_model("bert", TINY)
        return dynamic.run_model(model, _trace(), ["eager", "fxforge"], warmup_calls=2, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)


def test_every_contender_serves_the_trace_with_eager_outputs(rows):
    assert [r["contender"] for r in rows] == ["eager", "fxforge"]
    for row in rows:
        assert row["status"] == "ok", (row["contender"], row["error"])
        for key in FIGURES:
            assert row[key] is not None, (row["contender"], key)
        assert row["calls"] == CALLS and len(row["times_ms"]) == CALLS
        assert row["mismatches"] == 0, row
        assert row["warm_calls"] == CALLS - 2
        assert row["p50_ms"] <= row["p99_ms"]
    eager, fx = rows
    assert eager["trace_vs_eager"] == 1.0 and eager["max_abs_err"] is None
    assert fx["max_abs_err"] < 1e-3
    # fxforge's first-time work is counted (plans built, or before that count exists the plans its cache holds).
    assert fx["setup_work"] >= 1 and fx["trace_work"] is not None and fx["work_unit"].startswith("plans")


def test_markdown_block_goes_to_its_own_markers(rows, tmp_path):
    md = tmp_path / "RESULTS.md"
    before = "# results\n\nkept text\n"
    md.write_text(before, encoding="utf-8")
    meta = {"title": "Dynamic shapes (test)", "date": "today", "command": "python -m benchmarks --suite dynamic",
            "machine": report.machine_info(2), "contenders": {"eager": "", "fxforge": ""},
            "trace": {"calls": CALLS, "seed": 0, "batches": [1, 2], "seq_range": [8, 24], "warmup_calls": 2}}
    result = {"meta": meta, "rows": rows, "summary": dynamic.summary(rows)}
    dynamic.write_markdown(str(md), result)
    text = md.read_text(encoding="utf-8")
    begin, end = report.markers("dynamic")
    assert text.startswith(before) and begin in text and end in text
    assert "| bert | fxforge |" in text and "p99/p50 after warm-up" in text
    assert "calls whose output differs from eager's" in text and "none (target: none: met)" in text
    assert "compile not in this run" in text  # the summary says what it could not judge
    assert "- bert: set-up + trace: fxforge " in text and "eager " in text  # set-up counted for reading


def test_a_contender_that_fails_mid_trace_is_a_failed_row_and_the_trace_goes_on(monkeypatch):
    def broken(model, example):
        calls = []

        def fn(**inputs):
            calls.append(1)
            if len(calls) > 2:  # the set-up call and the first trace call work
                raise RuntimeError("no plan for this shape")
            return model(**inputs)

        return dynamic.Setup(fn)

    monkeypatch.setitem(dynamic.SETUPS, "broken", broken)
    tiny = dynamic.ModelSize(hidden=16, layers=1, heads=2, kv_heads=1, vocab=100)
    rows = dynamic.run_model(dynamic.build_model("gpt2", tiny), _trace(3), ["broken"], log=lambda _: None)
    eager, bad = rows
    assert eager["status"] == "ok" and eager["calls"] == 3
    assert bad["status"] == "failed" and bad["stage"].startswith("call 1 ") and "no plan" in bad["error"]
    assert bad["calls"] == 1 and bad["trace_s"] is None


def test_trace_and_inputs():
    trace = dynamic.make_trace(50, seed=3)
    assert trace == dynamic.make_trace(50, seed=3)
    assert {r.batch for r in trace} <= set(dynamic.BATCHES)
    assert all(16 <= r.seq <= 512 and max(r.lengths) == r.seq and min(r.lengths) >= 1 for r in trace)
    request = dynamic.Request(2, 5, (5, 2))
    right = dynamic.request_inputs(request, 100, "right", seed=0)["attention_mask"]
    left = dynamic.request_inputs(request, 100, "left", seed=0)["attention_mask"]
    assert right.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert left.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]


def test_ort_callable_feeds_the_session_by_input_name():
    class Session:
        def get_inputs(self):
            return [type("Input", (), {"name": n})() for n in ("input_ids", "attention_mask")]

        def run(self, outputs, feeds):
            assert outputs is None and list(feeds) == ["input_ids", "attention_mask"]
            return [feeds["input_ids"] * 2]

    fn = dynamic.OrtKwargsCallable(Session())
    out = fn(attention_mask=torch.ones(1, 2, dtype=torch.long), input_ids=torch.tensor([[3, 4]]))
    assert out[0].tolist() == [[6, 8]]
    with pytest.raises(ValueError, match="missing"):
        fn(input_ids=torch.tensor([[3, 4]]))


def test_compare_ignores_padding_only():
    mask = torch.tensor([[1, 1, 0]])
    ref = torch.zeros(1, 3, 2)
    assert dynamic.compare(ref, ref + torch.tensor([0.0, 0.0, 5.0]).view(1, 3, 1), mask) == (True, 0.0)
    close, err = dynamic.compare(ref, ref + torch.tensor([0.0, 0.1, 0.0]).view(1, 3, 1), mask)
    assert not close and err == pytest.approx(0.1)
    assert dynamic.compare(ref, torch.zeros(1, 2, 2), mask) == (False, float("inf"))


def test_stats_and_the_harness_parses_the_dynamic_options():
    stats = dynamic.trace_stats([0.1, 0.001, 0.002, 0.004], [0.001, 0.001, 0.001, 0.002], warmup_calls=1)
    assert stats["trace_s"] == pytest.approx(0.107)
    assert stats["warm_p99_over_p50"] == pytest.approx(3.96 / 2)
    assert stats["per_call_vs_eager"] == pytest.approx(0.5)
    args = build_parser(SECTIONS["dynamic"], SECTIONS).parse_args(["--suite", "dynamic", "--calls", "5"])
    assert args.suite == "dynamic" and args.calls == 5 and args.models == list(dynamic.MODELS)
    assert SECTIONS["dynamic"] is dynamic.SECTION
