"""Smoke test of the benchmark harness: one quick in-process run on tiny models, then its files.

The run uses eager, ONNX Runtime and fxforge (fxforge may still fail while the library is being written:
its row must then carry the error text). torch.compile is left out: compiling takes tens of seconds on
a small CPU machine.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from benchmarks import report, suite
from benchmarks.contenders import CONTENDERS, Prepared, register
from benchmarks.harness import main
from benchmarks.rounds import OutputMismatch, max_abs_error, time_interleaved

PROSE_BEFORE = "# My results\n\nHand-written text before the harness block.\n\n"
PROSE_AFTER = "\n## fxforge -> ORT\n\nA section another issue wrote. | keep | this |\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One quick run on tiny_mlp (built-in) and a test-only model, with a pre-existing RESULTS.md."""
    tmp = tmp_path_factory.mktemp("bench")
    md = tmp / "RESULTS.md"
    md.write_text(
        f"{PROSE_BEFORE}{report.BEGIN}\nstale harness table\n{report.END}\n{PROSE_AFTER}", encoding="utf-8"
    )

    def broken():
        raise RuntimeError("this model does not build")

    test_suite = [
        *suite.SUITE,
        suite.SuiteEntry("test_broken", broken, "test", default=False),
    ]
    argv = [
        "--quick",
        "--models", "tiny_mlp,test_broken",
        "--contenders", "eager,ort,fxforge",
        "--out", str(tmp / "out"),
        "--markdown", str(md),
    ]
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(suite, "SUITE", test_suite)
        rc = main(argv)
    assert torch.get_num_threads() == threads  # main() leaves torch's thread count as it found it
    data = json.loads((tmp / "out" / "results.json").read_text(encoding="utf-8"))
    return rc, data, md.read_text(encoding="utf-8")


def _row(data, model, contender):
    rows = [r for r in data["rows"] if r["model"] == model and r["contender"] == contender]
    assert len(rows) == 1, (model, contender, data["rows"])
    return rows[0]


def test_run_completes(run):
    rc, data, _ = run
    assert rc == 0
    assert data["meta"]["complete"] is True
    assert data["meta"]["models"] == ["tiny_mlp", "test_broken"]
    assert list(data["meta"]["contenders"]) == ["eager", "ort", "fxforge"]
    assert data["meta"]["machine"]["threads"] == 2  # --threads defaults to 2
    assert data["meta"]["command"].startswith("python -m benchmarks --quick --models tiny_mlp")


def test_eager_row(run):
    _, data, _ = run
    row = _row(data, "tiny_mlp", "eager")
    assert row["status"] == "ok" and row["error"] is None
    assert row["median_ms"] > 0
    assert row["ratio_vs_eager"] == 1.0
    assert row["max_abs_err"] == 0.0
    assert row["n_calls"] == 3  # --quick: 1 round x 3 reps
    assert row["prepare_s"] >= 0


def test_ort_row(run):
    _, data, _ = run
    row = _row(data, "tiny_mlp", "ort")
    assert row["status"] == "ok", row.get("error")
    assert row["median_ms"] > 0
    eager = _row(data, "tiny_mlp", "eager")
    assert row["ratio_vs_eager"] == pytest.approx(eager["median_ms"] / row["median_ms"])
    assert row["max_abs_err"] < 1e-4
    assert row["info"]["providers"][-1] == "CPUExecutionProvider"


def test_fxforge_row_has_latency_or_error(run):
    _, data, _ = run
    row = _row(data, "tiny_mlp", "fxforge")
    if row["error"] is None:
        assert row["median_ms"] > 0
        assert row["max_abs_err"] is not None and row["max_abs_err"] < 1e-4
        assert "rewrite_counts" in row["info"]
    else:
        assert row["status"] == "failed"
        assert row["stage"] in {"prepare", "run"}
        assert row["median_ms"] is None


def test_broken_model_fails_its_rows_only(run):
    _, data, _ = run
    for contender in ("eager", "ort", "fxforge"):
        row = _row(data, "test_broken", contender)
        assert row["status"] == "failed" and row["stage"] == "build"
        assert "this model does not build" in row["error"]


def test_markdown(run):
    _, _, text = run
    assert text.startswith(PROSE_BEFORE)
    assert text.endswith(PROSE_AFTER)
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    assert "stale harness table" not in text
    block = text[text.index(report.BEGIN): text.index(report.END)]
    assert "| model | contender | median ms | × vs eager | prepare s | max abs err | note |" in block
    assert "- Command: `python -m benchmarks --quick" in block
    assert "- Machine: " in block and "torch " in block
    assert "| tiny_mlp | eager |" in block and "| 1.00× |" in block
    assert "| tiny_mlp | ort |" in block
    assert "| tiny_mlp | fxforge |" in block
    assert "**failed** (build): RuntimeError: this model does not build" in block


# --------------------------------------------------------------------------------------------------
# pieces, without a run


def test_replace_block_keeps_outside_text():
    text = f"a\n{report.BEGIN}\nold\n{report.END}\nb\n"
    assert report.replace_block(text, "new") == f"a\n{report.BEGIN}\nnew\n{report.END}\nb\n"
    # No markers yet: the block is appended, the text kept.
    assert report.replace_block("hand text\n", "new") == f"hand text\n\n{report.BEGIN}\nnew\n{report.END}\n"
    # Empty file: the skeleton's prose, then the block.
    out = report.replace_block("", "new")
    assert out.startswith("# fxforge benchmark results") and f"{report.BEGIN}\nnew\n{report.END}" in out


def test_write_markdown_creates_file(tmp_path):
    path = tmp_path / "sub" / "R.md"
    result = {
        "meta": {
            "date": "d", "command": "python -m benchmarks", "commit": None,
            "machine": report.machine_info(1), "timing": {"warmup": 1, "rounds": 1, "reps": 1},
        },
        "rows": [],
    }
    report.write_markdown(str(path), result)
    assert report.BEGIN in path.read_text(encoding="utf-8")
    assert [p.name for p in path.parent.iterdir()] == ["R.md"]  # no temporary file left behind


def test_max_abs_error_pytree():
    a = {"x": torch.ones(2), "y": (torch.zeros(3), 4)}
    b = [torch.ones(2) + 0.5, torch.zeros(3)]
    assert max_abs_error(a, b) == pytest.approx(0.5)
    with pytest.raises(OutputMismatch, match="output tensors"):
        max_abs_error(a, [torch.ones(2)])


def test_interleaved_order_rotates():
    calls = []
    fns = {n: (lambda n=n: calls.append(n)) for n in "abc"}
    times, failures = time_interleaved(fns, (), warmup=0, rounds=3, reps=2)
    assert not failures
    assert calls == list("aabbcc" "bbccaa" "ccaabb")
    assert all(len(t) == 3 and all(len(r) == 2 for r in t) for t in times.values())


def test_custom_contender_and_run_failure(tmp_path):
    """A contender registered by a later issue shows up; one that fails while timed becomes a failed row."""
    state = {"n": 0}

    def flaky(model: nn.Module, args: tuple):
        def fn(*a):
            state["n"] += 1
            if state["n"] > 2:
                raise RuntimeError("flaky broke")
            return model(*a)

        return Prepared(fn, note="hello", info={"k": 1})

    register("test-flaky", "fails after two calls")(flaky)
    try:
        rc = main(
            ["--quick", "--models", "tiny_mlp", "--contenders", "test-flaky",
             "--out", str(tmp_path), "--no-markdown"]
        )
    finally:
        CONTENDERS.pop("test-flaky")
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert [r["contender"] for r in data["rows"]] == ["eager", "test-flaky"]  # eager is always added
    row = data["rows"][1]
    assert row["status"] == "failed" and row["stage"] == "run" and "flaky broke" in row["error"]
    assert row["info"] == {"k": 1} and row["prepare_s"] is not None
