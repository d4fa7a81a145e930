"""Every failure the fxforge command knows: exit 1 with one line naming the cause (exit 2 with usage for
bad arguments), no traceback, and no output file or temporary file left behind."""

import pytest
from cli_helpers import USER_MODEL, run_cli

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
}


@pytest.fixture(scope="module")
def failure_runs(tmp_path_factory):
    """All the failure cases, each in an empty output folder, run at once (each run is mostly importing torch)."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("failures")
    model = root / "models" / "user_model.py"
    model.parent.mkdir()
    model.write_text(USER_MODEL)
    folders = {case: root / f"out{i}" for i, case in enumerate(FAILURES)}
    for folder in folders.values():
        folder.mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case: pool.submit(run_cli, "optimize", *(a.format(model=model) for a in FAILURES[case][0]),
                                     cwd=folders[case]) for case in FAILURES}
        return {case: (future.result(), folders[case]) for case, future in futures.items()}


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
    assert "unknown rewrite 'nope'; built-in rewrites: cleanup, conv_bn_fold, conv_activation, attention" in result.stderr
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("args, message, command", [
    (["--input", "2y8"], "malformed shape '2y8'", "optimize"),
    (["--input", "2x8:complex7"], "unknown dtype 'complex7'", "optimize"),
    (["--input", "2x8", "--rewrites", "nope"], "unknown rewrite 'nope'; built-in rewrites: cleanup", "optimize"),
    (["--input", "2x8", "-o", "m.txt"], "-o m.txt: the file name must end in .onnx or .pt2", "optimize"),
    (["--input", "2x8", "--target", "native", "-o", "m.onnx"], "an .onnx file is for --target onnxruntime", "optimize"),
    (["--input", "2x8", "-o", "m.pt2", "--report", "r.txt"], "--report r.txt: the file name must end in .html", "optimize"),
    (["--input", "2x8", "--model-args", "{width: 8}"], "--model-args is not valid JSON", "optimize"),
    (["--input", "2x8", "--model-args", "[8]"], "--model-args must be a JSON object", "optimize"),
    ([], "the following arguments are required: --input", "optimize"),
    (["--input", "2x8", "-o", "graph.png"], "-o graph.png: the file name must end in .svg or .html or .htm", "show"),
    (["--input", "2x8", "--csv", "t.xlsx"], "--csv t.xlsx: the file name must end in .csv", "profile"),
    (["--input", "2x8"], "the following arguments are required: -o/--output", "export"),
])
def test_usage_errors_exit_2(capsys, args, message, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "m.py:Net", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: fxforge {command}") and message in err
