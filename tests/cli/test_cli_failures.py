"""Every failure the fxforge command knows: exit 1 with one line naming the cause (exit 2 with usage for
bad arguments), no traceback, and no output file or temporary file left behind."""

import os
import textwrap

import pytest
from cli_helpers import REPO, USER_MODEL, run_cli, run_cli_forked

from fxforge.cli import main

# (arguments after "optimize", what the one line on stderr says); {model} is the user's model file.
FAILURES = {
    "missing file": (["missing.py:Net", "--input", "2x8", "-o", "m.pt2"], ["no such file: missing.py"]),
    "name not in the file": (["{model}:Nope", "--input", "2x8", "-o", "m.pt2"], ["user_model.py has no 'Nope'"]),
    "factory raises": (["{model}:broken", "--input", "2x8", "-o", "m.pt2"],
                       ["broken() raised ValueError: no weights for width 8", "user_model.py:13"]),
    "model raises": (["{model}:Raises", "--input", "2x8", "-o", "m.onnx"],
                     ["Raises raised on example inputs of shape 2x8: NotImplementedError: forward is not written yet"]),
    "input shape rejected": (["{model}:Net", "--input", "2x5", "-o", "m.pt2", "--report", "r.html"],
                             ["Net raised on example inputs of shape 2x5: RuntimeError: mat1 and mat2 shapes",
                              "user_model.py:9: return self.drop(self.lin(x))"]),
    "op with no ONNX translation": (["{model}:Mystery", "--input", "2x8", "-o", "m.onnx", "--report", "r.html"],
                                    ["cannot export Mystery to ONNX: no ONNX translation for fxclitest::mystery",
                                     "user_model.py:25"]),
    "output folder missing": (["{model}:Net", "--input", "2x4", "-o", "no/such/m.pt2"],
                              ["cannot write no/such/m.pt2: no folder"]),
    "output folder is a file": (["{model}:Net", "--input", "2x4", "-o", "{model}/m.onnx"], ["is a file, not a folder"]),
    "report folder missing": (["{model}:Net", "--input", "2x4", "-o", "m.pt2", "--report", "no/r.html"],
                              ["cannot write no/r.html: no folder"]),
    "weights missing": (["{model}:Net", "--input", "2x4", "--weights", "w.pt", "-o", "m.pt2"],
                        ["no such weights file: w.pt"]),
    "factory calls sys.exit": (["{model}:exits", "--input", "2x4", "-o", "m.pt2"], ["exits() called sys.exit(3)"]),
    "forward calls sys.exit": (["{model}:ExitsInForward", "--input", "2x4", "-o", "m.onnx"],
                               ["the model called sys.exit(4)"]),
}


@pytest.fixture(scope="module")
def failure_runs(tmp_path_factory):
    """All the failure cases, each in an empty output folder, run by one process that imports fxforge.cli once
    and forks a ``python -m fxforge.cli`` per case (each run was mostly importing torch; real subprocesses:
    ``test_usage_error_exits_2_with_usage_as_a_subprocess``, ``test_debug_shows_the_traceback``)."""
    root = tmp_path_factory.mktemp("failures")
    model = root / "models" / "user_model.py"
    model.parent.mkdir()
    model.write_text(USER_MODEL)
    logs = root / "logs"
    logs.mkdir()
    folders = {case: root / f"out{i}" for i, case in enumerate(FAILURES)}
    for folder in folders.values():
        folder.mkdir()
    results = run_cli_forked([(["optimize", *(a.format(model=model) for a in FAILURES[case][0])], folders[case])
                              for case in FAILURES], logs)
    return {case: (result, folders[case]) for case, result in zip(FAILURES, results, strict=True)}


@pytest.mark.parametrize("case", list(FAILURES))
def test_failures_are_one_line_with_exit_1_and_leave_no_file(failure_runs, case):
    result, out = failure_runs[case]
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxforge: error: "), result.stderr
    for message in FAILURES[case][1]:
        assert message in lines[0]
    assert "Traceback" not in result.stderr
    assert list(out.iterdir()) == []  # no output, no temporary file


def test_debug_shows_the_traceback(user_model, out):
    result = run_cli("optimize", f"{user_model}:broken", "--input", "2x8", "--debug", cwd=out)
    assert result.returncode == 1 and "Traceback" in result.stderr and "no weights for width 8" in result.stderr


def test_usage_error_exits_2_with_usage_as_a_subprocess(user_model, out):
    result = run_cli("optimize", f"{user_model}:Net", "--input", "2x8", "--rewrites", "cleanup,nope", cwd=out)
    assert result.returncode == 2 and result.stderr.startswith("usage: fxforge optimize")
    assert "unknown rewrite 'nope'; built-in rewrites: cleanup, conv_bn_fold, binary_fold, conv_activation" in result.stderr
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("args, message, command", [
    (["--input", "2y8"], "malformed shape '2y8'", "optimize"),
    (["--input", "2x8:complex7"], "unknown dtype 'complex7'", "optimize"),
    (["--input", "2x8", "--rewrites", "nope"], "unknown rewrite 'nope'; built-in rewrites: cleanup", "optimize"),
    (["--input", "2x8", "-o", "m.txt"], "-o m.txt: the file name must end in .pt2 or .onnx", "optimize"),
    (["--input", "2x8", "--target", "native", "-o", "m.onnx"], "an .onnx file is for --target onnxruntime", "optimize"),
    (["--input", "2x8", "-o", "m.pt2", "--report", "r.txt"], "--report r.txt: the file name must end in .html", "optimize"),
    (["--input", "2x8", "--target", "inductor", "-o", "m.pt2"], "target inductor writes no file; drop -o, or write .pt2",
     "optimize"),
    (["--input", "2x8", "--target", "tvm"], "argument --target: invalid choice: 'tvm'", "optimize"),
    (["--input", "2x8", "--model-args", "{width: 8}"], "--model-args is not valid JSON", "optimize"),
    (["--input", "2x8", "--model-args", "[8]"], "--model-args must be a JSON object", "optimize"),
    ([], "give the model's example inputs: --input SHAPE[:DTYPE] (one per input) or --inputs FILE.py:FACTORY", "optimize"),
    (["--input", "2x8", "-o", "graph.png"], "-o graph.png: the file name must end in .svg or .html or .htm", "show"),
    (["--input", "2x8", "--csv", "t.xlsx"], "--csv t.xlsx: the file name must end in .csv", "profile"),
    (["--input", "2x8"], "the following arguments are required: -o/--output", "export"),
    (["--input", "2x8", "--precision", "bf16", "--target", "inductor"], "--precision bf16 runs with --target native or auto",
     "optimize"),
    (["--input", "2x8", "--precision", "bf16", "--target", "native", "-o", "m.pt2"],
     "--precision bf16 plans of --target native are not written to files yet; leave out -o", "optimize"),
    (["--input", "2x8", "--precision", "int8", "--target", "auto", "-o", "m.onnx"],
     "--precision int8 plans of --target auto are not written to files yet", "optimize"),
    (["--input", "2x8", "--target", "native", "--precision", "bf16", "--tolerance", "0"],
     "--tolerance 0.0: expected a positive relative error", "optimize"),
    (["--input", "2x8", "--precision", "int4"], "argument --precision: invalid choice: 'int4'", "optimize"),
    (["--input", "2x8", "--precision", "auto", "--target", "onnxruntime"],
     "--precision auto runs with --target native or auto", "optimize"),
])
def test_usage_errors_exit_2(capsys, args, message, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "m.py:Net", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: fxforge {command}") and message in err


def test_a_model_file_that_calls_sys_exit_on_import_is_one_line_and_exit_1(tmp_path, out):
    model = tmp_path / "exits_on_import.py"
    model.write_text("import sys\nsys.exit(5)\n")
    result = run_cli("export", f"{model}:Net", "--input", "2x4", "-o", "m.onnx", cwd=out)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == f"fxforge: error: {model} called sys.exit(5) while being imported"
    assert list(out.iterdir()) == []


# Each stage of an export that can take long: Ctrl-C there is "interrupted", exit 130, and no file.
INTERRUPTED_STAGES = {
    "capture": ("fxforge.capture.model", "trace_with_leaves"),
    "torch.export": ("torch.export", "export"),
    "torch.onnx": ("torch.onnx._internal.exporter._core", "export"),  # what fxforge.exporters.torch_onnx calls
    "onnx checker": ("onnx.checker", "check_model"),
    "ONNX Runtime session": ("onnxruntime", "InferenceSession"),
}


@pytest.mark.parametrize("stage", list(INTERRUPTED_STAGES))
def test_ctrl_c_during_export_exits_130_and_leaves_no_file(user_model, out, monkeypatch, capsys, stage):
    import importlib

    module, name = INTERRUPTED_STAGES[stage]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), name, interrupted)
    monkeypatch.chdir(out)
    assert main(["export", f"{user_model}:Net", "--input", "2x4", "-o", "m.onnx", "--report", "r.html"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "fxforge: interrupted"
    assert list(out.iterdir()) == []


def test_a_real_sigint_while_the_model_runs_exits_130(tmp_path, out):
    """SIGINT (Ctrl-C) sent to the command while it runs the model: exit 130, one line, no file."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "running"
    model = tmp_path / "slow_model.py"
    model.write_text(textwrap.dedent(f"""
        import pathlib, time, torch
        class Slow(torch.nn.Module):
            def forward(self, x):
                pathlib.Path({str(marker)!r}).touch()
                time.sleep(60)
                return x + 1
    """))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # as from a terminal: Ctrl-C raises KeyboardInterrupt (a background job of a script would ignore SIGINT)
    command = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "from fxforge.cli import main; sys.exit(main())")
    process = subprocess.Popen([sys.executable, "-c", command, "export", f"{model}:Slow", "--input", "2x4",
                                "-o", "m.onnx"], cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 120
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == "fxforge: interrupted"
    assert list(out.iterdir()) == []
