"""run_workers: results from every rank, a rank's own error, and no stall on a rank that writes a lot."""

from __future__ import annotations

import time

import pytest

from fxforge.parallel.processes import run_workers


def test_a_rank_writing_more_than_a_pipe_holds_does_not_stall_the_others():
    # 1 MiB of stderr: a pipe read rank by rank would block rank 1 while rank 0 waits for it in the all-reduce.
    start = time.monotonic()
    results = run_workers("tests.parallel.noisy_worker", {"backend": "gloo", "noise": 1 << 20}, 2, threads=1,
                          timeout=120)
    assert [r["total"] for r in results] == [3.0, 3.0]
    assert time.monotonic() - start < 60


def test_the_failing_rank_s_own_error_is_reported_and_its_peer_ended():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^worker 1 failed: ValueError: rank one refuses$"):
        run_workers("tests.parallel.noisy_worker", {"backend": "gloo", "noise": 0, "fail": True}, 2, threads=1,
                    timeout=120)
    assert time.monotonic() - start < 60
