"""``fxforge bench`` (latency, throughput, scalability per contender) and ``fxforge optimize --objective
throughput``: the rows printed, thread counts put back, failures one line (exit 1), usage errors exit 2. No
assertion on a speed: the figures are only checked to be numbers."""

import re
import textwrap

import pytest
import torch

from fxforge.cli import main

BENCH_MODEL = textwrap.dedent('''
    import torch
    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        def forward(self, x):
            return self.b(torch.relu(self.a(x)))
    class Singular(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.svd(x)[1]
''')


@pytest.fixture
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "bench_model.py"
    path.write_text(BENCH_MODEL)
    return path


def _row(out: str, name: str) -> list[str]:
    line = next(line for line in out.splitlines() if re.match(rf"^[│|]\s*{name}\s*[│|]", line))
    return [cell.strip() for cell in re.split(r"[│|]", line) if cell.strip()]


def test_bench_prints_a_row_per_contender(model_file, capsys):
    before = torch.get_num_threads()
    assert main(["bench", f"{model_file}:Small", "--input", "2x16", "--targets", "native,onnxruntime", "--cores",
                 "1", "--reps", "2"]) == 0
    assert torch.get_num_threads() == before
    out = capsys.readouterr().out
    assert "latency ms" in out and "samples/s" in out and "1 core" in out and "scaling" in out
    for name in ("eager", "native", "onnxruntime"):
        cells = _row(out, name)
        latency, rate = float(cells[1]), float(cells[2])
        assert latency > 0 and rate > 0
    assert "back-to-back calls" in " ".join(_row(out, "eager"))
    assert "throughput objective" in " ".join(_row(out, "native"))
    assert "throughput objective" in " ".join(_row(out, "onnxruntime"))
    assert "native, objective=throughput: every configuration tried" in out and "*" in out
    assert "onnxruntime, objective=throughput: every configuration tried" in out


def test_a_target_that_cannot_run_the_model_gets_a_row_saying_why(model_file, capsys):
    assert main(["bench", f"{model_file}:Singular", "--input", "2x4x4", "--targets", "onnxruntime", "--cores", "1",
                 "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert float(_row(out, "eager")[1]) > 0
    cells = _row(out, "onnxruntime")
    assert cells[1] == "failed" and "ExportError" in cells[2]


def test_optimize_with_objective_throughput_prints_the_configurations(model_file, capsys):
    assert main(["optimize", f"{model_file}:Small", "--input", "1x16", "--objective", "throughput",
                 "--no-bench"]) == 0
    out = capsys.readouterr().out
    assert "objective=throughput:" in out and "streams" in out and "utilization" in out
    assert "target" in out and "native" in out
    assert main(["optimize", f"{model_file}:Small", "--input", "1x16", "--objective", "throughput", "--target",
                 "onnxruntime", "--no-bench"]) == 0
    out = capsys.readouterr().out
    assert "objective=throughput:" in out and "onnxruntime" in out


@pytest.mark.parametrize("model, shape, message", [
    ("missing.py:Small", "2x16", "missing.py"),
    ("{model}:Small", "2x17", "raised on example inputs of shape 2x17"),
])
def test_failures_are_one_line_and_exit_1(model_file, capsys, model, shape, message):
    assert main(["bench", model.format(model=model_file), "--input", shape, "--cores", "1", "--targets", "native"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fxforge: error: ") and message in err[0], err


@pytest.mark.parametrize("args, message", [
    (["--targets", "tvm"], "expected names among"),
    (["--cores", "0"], "each must be between 1 and"),
    (["--cores", "1,9999"], "each must be between 1 and"),
    (["--cores", "one"], "expected comma-separated numbers"),
    (["--reps", "0"], "expected a whole number of 1 or more"),
    (["--input", "2xq"], "malformed shape"),
])
def test_bench_usage_errors_exit_2(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "m.py:Small", "--input", "2x16", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fxforge bench") and message in err


def test_objective_throughput_with_another_target_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["optimize", "m.py:Small", "--input", "2x16", "--objective", "throughput", "--target", "inductor"])
    assert exit_info.value.code == 2
    assert "--objective throughput runs with --target native or onnxruntime, not inductor" in capsys.readouterr().err
