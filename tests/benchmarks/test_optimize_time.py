"""Smoke tests of ``--suite optimize-time`` (a cold optimize in a new process, A against B) and ``--suite against``."""

import os

from benchmarks import optimize_time
from benchmarks.harness import main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cold_optimize_in_a_new_process_with_an_empty_cache(capsys):
    assert main(["--suite", "optimize-time", "--model", "tiny_conv_bn", "--reps", "1", "--threads", "1",
                 "--against", REPO_ROOT]) == 0
    out = capsys.readouterr().out
    assert "tiny_conv_bn rep 0 this   : optimize" in out and "rep 0 against: optimize" in out
    assert "'conv_bn_fold': 1" in out  # the child really optimized the model
    assert "this / against per pair: median" in out


def test_cold_row_is_a_results_row_of_first_time_optimizes():
    row = optimize_time.cold_row("tiny_conv_bn", reps=1, threads=1)
    assert row["model"] == "tiny_conv_bn" and row["contender"] == "fxforge (new process)"
    assert row["status"] == "ok" and row["prepare_s"] == row["cold_runs_s"][0] > 0
    assert "median of 1 new processes" in row["note"]


def test_against_compares_two_checkouts_in_alternating_processes(capsys):
    assert main(["--suite", "against", ".", "--models", "tiny_conv_bn", "--reps", "1", "--rounds", "3",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "rep 0 this" in out and "rep 0 other" in out
    assert "| tiny_conv_bn |" in out and "Lowest ratio" in out
