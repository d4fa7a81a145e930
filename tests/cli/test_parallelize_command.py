"""``fxforge parallelize``: the candidates and the chosen mesh, ``--run`` from a user's shell (processes on
gloo, checked against one process), and the failures (one line, exit 1; usage errors exit 2)."""

import textwrap

import pytest
from cli_helpers import run_cli

from fxforge.cli import main

MODEL = textwrap.dedent('''
    import torch
    class Tower(torch.nn.Module):
        def __init__(self, width=32, depth=2):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
                for _ in range(depth))
            self.head = torch.nn.Linear(width, 4)
        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)
''')


@pytest.fixture
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "parallel_model.py"
    path.write_text(MODEL)
    return path


def test_plan_and_run_a_forced_mesh_as_a_user_does(model_file, tmp_path):
    result = run_cli("parallelize", f"{model_file}:Tower", "--input", "8x32", "--devices", "2", "--mesh", "tp=2",
                     "--run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for line in ("- plan 2 devices: tp2", "- run 2 processes (tp2): gradients max error", "chosen: tp2.",
                 "blocks.0.0: colwise", "blocks.0.2: rowwise", "tp2 on gloo: outputs max error", "link: gloo"):
        assert line in text, text
    assert list(tmp_path.iterdir()) == []


def test_every_candidate_is_listed_and_a_cap_refuses_with_the_figure(model_file, capsys):
    assert main(["parallelize", f"{model_file}:Tower", "--input", "8x32", "--devices", "2",
                 "--memory-per-device", "150KiB", "--optimizer", "sgd"]) == 0
    text = capsys.readouterr().out
    for mesh in ("dp2", "fsdp2", "tp2", "pp2"):
        assert f"│ {mesh} " in text, text
    assert "no: needs" in text and "KiB per device, over the 150.0 KiB given" in text
    assert main(["parallelize", f"{model_file}:Tower", "--input", "8x32", "--devices", "2",
                 "--memory-per-device", "1KiB"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing fits in 1.0 KiB per device; the smallest need is" in err[0], err


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: --devices"),
    (["--devices", "0"], "argument --devices: must be at least 1"),
    (["--devices", "2", "--mesh", "ep=2"], "unknown mesh axis 'ep'"),
    (["--devices", "2", "--mesh", "tp=two"], "mesh axis tp needs a positive whole size"),
    (["--devices", "2", "--optimizer", "lion"], "invalid choice: 'lion'"),
])
def test_usage_errors_exit_2(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["parallelize", "m.py:Tower", "--input", "8x8", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fxforge parallelize") and message in err
