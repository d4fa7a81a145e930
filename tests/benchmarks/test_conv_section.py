"""The conv section (issue 3): ``python -m benchmarks --suite conv``.

One quick in-process section run on tiny models (the real section's models take minutes), then the
pieces: the ``optimize_for_inference`` contender, the section's block of ``RESULTS.md``, its summary
lines (computed from hand-made rows) and its suite entries.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from benchmarks import report, suite
from benchmarks.contenders import CONTENDERS, as_prepared
from benchmarks.harness import main
from benchmarks.rounds import max_abs_error
from benchmarks.timed import TIMED

CONV_BEGIN, CONV_END = report.markers("conv")
MAIN_BLOCK = f"{report.BEGIN}\nmain harness table | keep | me |\n{report.END}"
PROSE = "# Results\n\nHand-written text.\n\n"
PROSE_AFTER = "\n## Notes\n\nMore hand-written text.\n"


class DataDependent(nn.Module):
    """Python control flow on a tensor: ``torch.fx.symbolic_trace`` cannot trace it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y * 2 if y.sum() > 0 else y


def data_dependent() -> tuple[nn.Module, tuple]:
    return DataDependent().eval(), (torch.randn(1, 3, 8, 8),)


def conv_stack() -> nn.Module:
    """Conv-BN-ReLU twice and a pool: a subgraph long enough for optimize_for_inference to keep in MKLDNN."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.MaxPool2d(2),
    )
    with torch.no_grad():
        for bn in (model[1], model[4]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return model.eval()


@pytest.fixture(scope="module")
def section_run(tmp_path_factory):
    """``--suite conv --quick`` on a test suite, with the section's contenders minus torch.compile (slow)."""
    tmp = tmp_path_factory.mktemp("conv")
    md = tmp / "RESULTS.md"
    md.write_text(f"{PROSE}{MAIN_BLOCK}\n\n{CONV_BEGIN}\nstale conv table\n{CONV_END}\n{PROSE_AFTER}",
                  encoding="utf-8")
    by_name = {e.name: e for e in suite.SUITE}
    test_suite = [
        by_name["tiny_mlp"],  # not tagged: must not run
        dataclasses.replace(by_name["tiny_conv_bn"], tags=("conv",)),
        suite.SuiteEntry("test_data_dependent", data_dependent, "test", default=False, tags=("conv",)),
    ]
    section = TIMED["conv"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(TIMED, "conv", dataclasses.replace(
            section, contenders=tuple(c for c in section.contenders if c != "torch.compile")))
        patch.setattr(suite, "SUITE", test_suite)
        rc = main(["--suite", "conv", "--quick", "--out", str(tmp / "out"), "--markdown", str(md)])
    data = json.loads((tmp / "out" / "results-conv.json").read_text(encoding="utf-8"))
    return rc, data, md.read_text(encoding="utf-8"), tmp / "out"


def _row(data, model, contender):
    rows = [r for r in data["rows"] if r["model"] == model and r["contender"] == contender]
    assert len(rows) == 1, (model, contender, data["rows"])
    return rows[0]


def test_section_runs_tagged_models_with_its_contenders(section_run):
    rc, data, _, out = section_run
    assert rc == 0 and data["meta"]["complete"] is True
    assert data["meta"]["suite"] == "conv"
    assert data["meta"]["models"] == ["tiny_conv_bn", "test_data_dependent"]
    assert list(data["meta"]["contenders"]) == ["eager", "optimize_for_inference", "fxforge"]
    assert data["meta"]["command"].startswith("python -m benchmarks --suite conv --quick --out ")
    assert not (out / "results.json").exists()  # the main run's results are not overwritten
    assert data["summary"] == report.conv_summary(data["rows"])


def test_optimize_for_inference_row(section_run):
    _, data, _, _ = section_run
    row = _row(data, "tiny_conv_bn", "optimize_for_inference")
    assert row["status"] == "ok", row.get("error")
    assert row["median_ms"] > 0 and row["prepare_s"] > 0
    assert row["max_abs_err"] < 1e-5
    assert set(row["info"]) == {"mkldnn_modules", "mkldnn_conversions"}


def test_optimize_for_inference_trace_failure_is_one_line(section_run):
    _, data, text, _ = section_run
    row = _row(data, "test_data_dependent", "optimize_for_inference")
    assert row["status"] == "failed" and row["stage"] == "prepare"
    assert row["error"].startswith("RuntimeError: torch.fx.symbolic_trace failed: TraceError: ")
    prefix = "| test_data_dependent | optimize_for_inference |"
    line = next(ln for ln in text.splitlines() if ln.startswith(prefix))
    assert "**failed** (prepare): RuntimeError: torch.fx.symbolic_trace failed: TraceError:" in line
    assert _row(data, "test_data_dependent", "eager")["status"] == "ok"  # the run went on


def test_section_block_and_other_block_kept(section_run):
    _, data, text, _ = section_run
    assert text.startswith(f"{PROSE}{MAIN_BLOCK}\n\n{CONV_BEGIN}\n")
    assert text.endswith(f"{CONV_END}\n{PROSE_AFTER}")
    assert text.count(CONV_BEGIN) == 1 and text.count(CONV_END) == 1
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    assert "stale conv table" not in text
    block = text[text.index(CONV_BEGIN): text.index(CONV_END)]
    assert f"## {TIMED['conv'].title}" in block
    assert "- Command: `python -m benchmarks --suite conv --quick" in block
    assert "ONNX Runtime" not in block  # not a contender of this section
    assert "| tiny_conv_bn | optimize_for_inference |" in block
    assert "tiny_mlp" not in block
    table_end = block.index("| test_data_dependent | fxforge |")
    for line in data["summary"]:
        assert block.index(line) > table_end  # the summary follows the table


# --------------------------------------------------------------------------------------------------
# the optimize_for_inference contender, directly


def test_optimize_for_inference_keeps_dense_inputs_and_outputs():
    model = conv_stack()
    x = torch.randn(2, 3, 16, 16)
    prepared = as_prepared(CONTENDERS["optimize_for_inference"].prepare(copy.deepcopy(model), (x,)))
    assert prepared.info["mkldnn_modules"] >= 2 and prepared.info["mkldnn_conversions"] >= 2
    assert prepared.note.startswith("mkldnn: ")
    with torch.no_grad():
        out, ref = prepared.fn(x), model(x)
    assert out.layout == torch.strided  # to_dense before the outputs: called and compared like eager
    assert max_abs_error(ref, out) < 1e-5


def test_optimize_for_inference_other_errors_pass_through():
    model = conv_stack().double()  # the pass asserts float32 modules, outside tracing
    with pytest.raises(AssertionError, match="torch.float"):
        CONTENDERS["optimize_for_inference"].prepare(model, (torch.randn(1, 3, 8, 8, dtype=torch.double),))


# --------------------------------------------------------------------------------------------------
# markers


def test_section_markers_are_separate():
    assert report.markers() == (report.BEGIN, report.END)
    assert report.markers("conv") == ("<!-- harness:conv:begin -->", "<!-- harness:conv:end -->")
    text = f"a\n{report.BEGIN}\nmain\n{report.END}\nb\n"
    with_conv = report.replace_block(text, "conv 1", "conv")
    assert with_conv == f"{text}\n{CONV_BEGIN}\nconv 1\n{CONV_END}\n"  # appended, the rest kept
    assert report.replace_block(with_conv, "conv 2", "conv") == with_conv.replace("conv 1", "conv 2")
    assert report.replace_block(with_conv, "main 2") == with_conv.replace("\nmain\n", "\nmain 2\n")


# --------------------------------------------------------------------------------------------------
# summary lines, from hand-made rows


def _r(model, contender, median_ms=None, *, eager_ms=None, prepare_s=0.1, status="ok", stage=None):
    ratio = eager_ms / median_ms if eager_ms and median_ms else None
    return {"model": model, "contender": contender, "status": status, "median_ms": median_ms,
            "ratio_vs_eager": ratio, "prepare_s": prepare_s, "stage": stage}


def summary_rows(resnet_prepare_s=1.5):
    return [
        _r("a", "eager", 10.0, eager_ms=10.0),
        _r("a", "optimize_for_inference", 8.0, eager_ms=10.0),
        _r("a", "fxforge", 5.0, eager_ms=10.0),  # 2.00x; 1.60x vs optimize_for_inference
        _r("b", "eager", 10.0, eager_ms=10.0),
        _r("b", "optimize_for_inference", None, prepare_s=None, status="failed", stage="prepare"),
        _r("b", "fxforge", 12.5, eager_ms=10.0),  # 0.80x: slower than eager
        _r("c", "eager", 10.0, eager_ms=10.0),
        _r("c", "optimize_for_inference", 5.0, eager_ms=10.0),
        _r("c", "fxforge", None, prepare_s=None, status="failed", stage="prepare"),
        _r("d", "eager", 10.0, eager_ms=10.0),
        _r("d", "optimize_for_inference", 20.0, eager_ms=10.0),
        _r("d", "fxforge", 9.0, eager_ms=10.0, status="mismatch"),  # wrong outputs: not counted
        _r("hf_resnet50", "eager", 100.0, eager_ms=100.0),
        _r("hf_resnet50", "optimize_for_inference", 100.0, eager_ms=100.0),
        _r("hf_resnet50", "fxforge", 80.0, eager_ms=100.0, prepare_s=resnet_prepare_s),  # 1.25x, 1.25x
    ]


def test_conv_summary_lines():
    # fxforge timed on a, b, hf_resnet50: (2.0 * 0.8 * 1.25) ** (1/3) = 2 ** (1/3) = 1.26
    # vs optimize_for_inference on a and hf_resnet50: sqrt(1.6 * 1.25) = sqrt(2) = 1.41
    assert report.conv_summary(summary_rows()) == [
        ("- fxforge × vs eager, geometric mean over 3 of 5 models: 1.26× (target ≥ 1.20×: met); "
         "not timed on c, d"),
        ("- fxforge slower than eager (× < 1.00) on: b 0.80×; not timed on c, d "
         "(target: no model: **not met**)"),
        ("- fxforge vs optimize_for_inference (optimize_for_inference ms / fxforge ms), geometric mean over "
         "the 2 models where both ran: 1.41× (target > 1.00×: met); "
         "optimize_for_inference did not run on b"),
        "- fxforge optimize time (prepare s) on hf_resnet50: 1.50 s (target < 2 s: met)",
    ]


def test_conv_summary_targets_missed_and_met():
    lines = report.conv_summary(summary_rows(resnet_prepare_s=2.5))
    assert lines[3] == (
        "- fxforge optimize time (prepare s) on hf_resnet50: 2.50 s (target < 2 s: **not met**)"
    )
    fast = [r for r in summary_rows() if r["model"] in {"a", "hf_resnet50"}]
    assert report.conv_summary(fast) == [
        "- fxforge × vs eager, geometric mean over 2 of 2 models: 1.58× (target ≥ 1.20×: met)",
        "- fxforge slower than eager (× < 1.00) on: none (target: no model: met)",
        ("- fxforge vs optimize_for_inference (optimize_for_inference ms / fxforge ms), geometric mean over "
         "the 2 models where both ran: 1.41× (target > 1.00×: met)"),
        "- fxforge optimize time (prepare s) on hf_resnet50: 1.50 s (target < 2 s: met)",
    ]
    slow = [r for r in summary_rows() if r["model"] == "b"]
    assert report.conv_summary(slow)[0].startswith(
        "- fxforge × vs eager, geometric mean over 1 of 1 model: 0.80× (target ≥ 1.20×: **not met**)"
    )
    assert report.conv_summary(slow)[2].endswith(
        "the 0 models where both ran: — (target > 1.00×: **not met**); "
        "optimize_for_inference did not run on b"
    )
    assert report.conv_summary(slow)[3] == (
        "- fxforge optimize time (prepare s) on hf_resnet50: not in this run"
    )


def test_conv_summary_prepare_failed():
    rows = [_r("hf_resnet50", "eager", 100.0, eager_ms=100.0),
            _r("hf_resnet50", "fxforge", None, prepare_s=None, status="failed", stage="prepare")]
    assert report.conv_summary(rows)[3] == (
        "- fxforge optimize time (prepare s) on hf_resnet50: — fxforge failed (prepare) "
        "(target < 2 s: **not met**)"
    )


# --------------------------------------------------------------------------------------------------
# suite entries


CONV_NAMES = [
    "densenet_b1", "densenet_b8", "inception_b1", "inception_b8", "unet_b1", "unet_b8",
    "hf_resnet50", "hf_resnet50_b8", "hf_mobilenet_v2_224", "hf_mobilenet_v2_224_b8",
]


def test_conv_entries_selected_together_and_not_by_default():
    assert [e.name for e in suite.select(None, tag="conv")] == CONV_NAMES
    assert not set(CONV_NAMES) & {e.name for e in suite.select(None)}
    assert suite.select(["densenet_b1"], tag="conv")[0].name == "densenet_b1"  # --models wins


@pytest.mark.parametrize("name, shape", [("densenet_b1", (1, 3, 32, 32)), ("unet_b8", (8, 3, 64, 64))])
def test_rebatched_example_inputs(name, shape):
    entry = next(e for e in suite.SUITE if e.name == name)
    model, (x,) = suite.build(entry)
    assert tuple(x.shape) == shape and x.dtype == torch.float32
    assert not model.training
    again = suite.build(entry)[1][0]
    assert torch.equal(x, again)  # seeded


def test_random_like_batch_keeps_dtype_and_values_of_ids():
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    out = suite.random_like_batch(ids, 8)
    assert out.shape == (8, 3) and out.dtype == ids.dtype
    assert all(any(torch.equal(row, r) for r in ids) for row in out)
    x = suite.random_like_batch(torch.zeros(2, 4, dtype=torch.float64), 8)
    assert x.shape == (8, 4) and x.dtype == torch.float64 and x.abs().sum() > 0
    assert suite.random_like_batch(3, 8) == 3


def test_conv_summary_judges_the_optimize_time_on_a_new_process_when_the_run_timed_one():
    cold = {"model": "hf_resnet50", "contender": report.COLD_CONTENDER, "status": "ok", "prepare_s": 1.7,
            "cold_runs_s": [1.6, 1.7, 1.9]}
    lines = report.conv_summary([*summary_rows(resnet_prepare_s=2.4), cold])
    assert lines[3] == ("- fxforge optimize time (prepare s) on hf_resnet50: 1.70 s, first use in a new process "
                        "(median of 3); 2.40 s inside this run's process (target < 2 s: met)")
    slow = dict(cold, prepare_s=2.1)
    assert report.conv_summary([*summary_rows(), slow])[3].endswith("(target < 2 s: **not met**)")
    # The cold row is not a timed contender: the other lines are those of the rows without it.
    assert lines[:3] == report.conv_summary(summary_rows(resnet_prepare_s=2.4))[:3]
    assert "fxforge (new process)" in report.markdown_table([cold])
