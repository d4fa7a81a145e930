"""The fxforge command, driven as a subprocess, the way a user runs it."""

import subprocess
import sys
import textwrap

import pytest


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fxforge.cli", *args], capture_output=True, text=True, check=False,
                          cwd=cwd, timeout=120)


@pytest.fixture
def user_model(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(textwrap.dedent("""
        import torch
        class Net(torch.nn.Module):
            def __init__(self, width=4):
                super().__init__()
                self.lin = torch.nn.Linear(width, width)
                self.drop = torch.nn.Dropout(0.5)
            def forward(self, x):
                return self.drop(self.lin(x))
        def build():
            return Net(width=8)
    """))
    return path


def test_rewrites_lists_builtins():
    result = run("rewrites")
    assert result.returncode == 0 and result.stdout.startswith("cleanup")


def test_optimize_a_model_file_outside_the_repo(user_model, tmp_path):
    result = run("optimize", f"{user_model}:Net", "--input", "2x8", "--model-args", '{"width": 8}', cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "cleanup: dropout in eval removed [drop]" in result.stdout
    assert "user_model.py:9: return self.drop(self.lin(x))" in result.stdout
    factory = run("optimize", f"{user_model}:build", "--input", "3x8", cwd=tmp_path)
    assert factory.returncode == 0, factory.stderr


@pytest.mark.parametrize("args, message", [
    (["missing.py:Net", "--input", "2x8"], "no such file: missing.py"),
    (["{model}:Nope", "--input", "2x8"], "has no 'Nope'"),
    (["{model}:Net", "--input", "2x5"], "the module raised on the example inputs"),
])
def test_failures_are_one_line_with_exit_1(user_model, args, message):
    args = [a.format(model=user_model) for a in args]
    result = run("optimize", *args)
    assert result.returncode == 1
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--input", "2y8"], "malformed shape '2y8'"),
    (["--input", "2x8:complex7"], "unknown dtype 'complex7'"),
    (["--input", "2x8", "--rewrites", "nope"], "unknown rewrite 'nope'; built-in rewrites: cleanup"),
])
def test_usage_errors_exit_2(user_model, args, message):
    result = run("optimize", f"{user_model}:Net", *args)
    assert result.returncode == 2 and message in result.stderr
