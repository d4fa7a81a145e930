"""``fxforge lint MODEL --input ...``: exit 0 without error findings, 1 with one (and when lint fails), 2 for
a usage error; ``--rules`` and ``--csv``."""

from __future__ import annotations

import csv
import pathlib

import pytest

from fxforge.cli import main

SEEDED = str(pathlib.Path(__file__).with_name("seeded.py"))
CLEAN = str(pathlib.Path(__file__).with_name("clean.py"))


def test_an_error_finding_exits_1_and_prints_line_and_fix(capsys):
    assert main(["lint", f"{SEEDED}:RegressionHead", "--input", "8x16", "--input", "8"]) == 1
    out = capsys.readouterr().out
    assert "error [broadcast-blowup]" in out and "seeded.py:26" in out and "fix:" in out


def test_a_clean_model_and_warnings_only_exit_0(capsys, tmp_path):
    assert main(["lint", f"{CLEAN}:SmallCNN", "--input", "2x3x16x16"]) == 0
    assert "SmallCNN (2x3x16x16)" in capsys.readouterr().out
    table = tmp_path / "findings.csv"
    assert main(["lint", f"{SEEDED}:TwoHeads", "--input", "4x16", "--csv", str(table)]) == 0
    out = capsys.readouterr().out
    assert "warning [unused-parameter]" in out
    rows = list(csv.DictReader(table.open()))
    assert [(r["rule"], r["severity"]) for r in rows] == [("unused-parameter", "warning")]


def test_rules_selects_rules(capsys):
    assert main(["lint", f"{SEEDED}:RegressionHead", "--input", "8x16", "--input", "8", "--rules", "dead-code"]) == 0
    assert "no findings" in capsys.readouterr().out


def test_train_mode_lints_the_model_as_it_trains(capsys):
    argv = ["lint", f"{SEEDED}:MLPWithFunctionalDropout", "--input", "4x16"]
    main(argv)
    assert "[functional-dropout]" in capsys.readouterr().out  # in eval mode F.dropout still drops
    assert main([*argv, "--mode", "train", "--method", "export"]) == 0
    out = capsys.readouterr().out
    assert "MLPWithFunctionalDropout (4x16, train mode): no findings" in out  # in training it drops, as it should


def test_usage_errors_exit_2(capsys):
    for argv in (["lint", f"{SEEDED}:RegressionHead"],  # no inputs
                 ["lint", f"{SEEDED}:RegressionHead", "--input", "8x16", "--rules", "nope"],
                 ["lint", f"{SEEDED}:RegressionHead", "--input", "8x16", "--mode", "inference"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
    assert "unknown lint rule 'nope'" in capsys.readouterr().err


def test_a_model_that_fails_exits_1_with_one_line(capsys):
    assert main(["lint", f"{SEEDED}:RegressionHead", "--input", "8x3", "--input", "8"]) in (1, 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(("fxforge: error:", "fxforge lint: error:"))


def test_the_process_exit_status_is_what_ci_sees(tmp_path):
    import os
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "fxforge.cli", "lint", f"{SEEDED}:MLPWithFunctionalDropout",
                             "--input", "4x16"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240,
                            check=False)
    assert result.returncode == 1, result.stderr
    assert "error [functional-dropout]" in result.stdout and result.stderr == ""
