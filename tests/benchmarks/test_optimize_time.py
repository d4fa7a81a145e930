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


def test_cold_row_is_a_results_row_of_first_time_optimizes(monkeypatch):
    # The new process itself (time_once) runs for real in the test above; here, the row made of its figures.
    calls, totals = [], [3.0, 1.5, 1.75]

    def time_once(checkout, model, threads):
        calls.append((checkout, model, threads))
        total = totals[len(calls) - 1]
        return {"prepare": total - 0.25, "first_call": 0.25, "total": total, "counts": {}}

    monkeypatch.setattr(optimize_time, "time_once", time_once)
    row = optimize_time.cold_row("tiny_conv_bn", reps=3, threads=1)
    assert calls == [(optimize_time.REPO, "tiny_conv_bn", 1)] * 3 and optimize_time.REPO == REPO_ROOT
    assert row["model"] == "tiny_conv_bn" and row["contender"] == "fxforge (new process)"
    assert row["status"] == "ok" and row["prepare_s"] == 1.75 and row["cold_runs_s"] == [1.5, 1.75, 3.0]
    assert "median of 3 new processes" in row["note"] and "(min 1.50 s, max 3.00 s)" in row["note"]


def test_against_compares_two_checkouts_in_alternating_processes(capsys):
    assert main(["--suite", "against", ".", "--models", "tiny_conv_bn", "--reps", "1", "--rounds", "3",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "rep 0 this" in out and "rep 0 other" in out
    assert "| tiny_conv_bn |" in out and "Lowest ratio" in out
