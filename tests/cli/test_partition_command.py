"""``fxforge partition``: the stages and split_spec, the peers' splits with ``--compare``, ``--run`` from a
user's shell (processes on gloo, checked against one process), and the failures (one line, exit 1; usage
errors exit 2)."""

import textwrap

import pytest
from cli_helpers import run_cli

from fxforge.cli import main

PIPELINE_MODEL = textwrap.dedent('''
    import torch
    class Tower(torch.nn.Module):
        def __init__(self, width=32, depth=6):
            super().__init__()
            self.embed = torch.nn.Linear(8, width)
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width))
                for _ in range(depth))
            self.head = torch.nn.Linear(width, 4)
        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)
    class Ints(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 2)
        def forward(self, x):
            return x.long()
''')


@pytest.fixture
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "pipeline_model.py"
    path.write_text(PIPELINE_MODEL)
    return path


def test_partition_and_run_as_a_user_does(model_file, tmp_path):
    result = run_cli("partition", f"{model_file}:Tower", "--input", "8x8", "--stages", "2", "--microbatches", "4",
                     "--run", "--steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    text = result.stdout
    for line in ("- partition into 2 stages: bottleneck ratio", "- run 2 processes (1F1B): outputs and gradients match",
                 "Tower (8x8): 2 stages, 4 microbatches, 1F1B, eval mode", "split_spec: {'blocks.",
                 "2 processes (gloo, 1F1B, 4 microbatches): outputs and gradients match the single process"):
        assert line in text, text
    assert list(tmp_path.iterdir()) == []


def test_compare_shows_the_peers_splits(model_file, capsys):
    assert main(["partition", f"{model_file}:Tower", "--input", "8x8", "--stages", "4", "--compare",
                 "--schedule", "GPipe", "--microbatches", "2"]) == 0
    text = capsys.readouterr().out
    assert "against the peers' splits" in text
    for policy in ("fxforge", "even-layers", "parameters"):
        assert f"│ {policy} " in text, text
    assert "GPipe: step" in text and "1F1B: step" in text and "│     3 │" in text


def test_a_memory_cap_is_shown_and_one_that_cannot_be_met_is_one_line(model_file, capsys):
    assert main(["partition", f"{model_file}:Tower", "--input", "8x8", "--stages", "2",
                 "--memory-per-stage", "1MiB"]) == 0
    assert "memory cap per stage: 1.00 MiB" in capsys.readouterr().out
    assert main(["partition", f"{model_file}:Tower", "--input", "8x8", "--stages", "2",
                 "--memory-per-stage", "1KiB"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no split into 2 stages fits 0.0 MiB" in err[0], err


@pytest.mark.parametrize("model, args, message", [
    ("missing.py:Tower", [], "no such file: missing.py"),
    ("{model}:Tower", ["--stages", "40", "--microbatches", "40", "--input", "40x8"], "places to split"),
    ("{model}:Tower", ["--stages", "2", "--microbatches", "3"], "the batch of 8 does not split into 3"),
    ("{model}:Tower", ["--stages", "4", "--microbatches", "2"], "1F1B needs at least as many microbatches"),
])
def test_failures_are_one_line_and_exit_1(model_file, capsys, model, args, message):
    inputs = [] if "--input" in args else ["--input", "8x8"]
    argv = ["partition", model.format(model=model_file), *inputs, *(args or ["--stages", "2"])]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fxforge: error: ") and message in err[0], err


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: --stages"),
    (["--stages", "0"], "argument --stages: must be at least 1"),
    (["--stages", "two"], "argument --stages: 'two' is not a whole number"),
    (["--stages", "2", "--memory-per-stage", "50%"], "not a percentage"),
    (["--stages", "2", "--schedule", "zb"], "invalid choice: 'zb'"),
])
def test_usage_errors_exit_2(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["partition", "m.py:Tower", "--input", "8x8", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fxforge partition") and message in err
