"""``objective="throughput"`` with ``target="onnxruntime"``: the streams x threads x batch search over an ONNX
Runtime module whose calls on each stream run on a session of that stream's intra-op thread count."""

from __future__ import annotations

import threading

import pytest
import torch

import fxforge
from fxforge.core.verify import compare_outputs
from fxforge.runtime.throughput import ThroughputModule
from fxforge.targets.onnxruntime import onnxruntime_module
from tests.runtime.test_throughput import BUDGET, pooled
from tests.test_concurrency import inference, run_together

pytest.importorskip("onnxruntime")


def _in_thread(threads: int, call):
    """``call()`` in a new thread that computes on ``threads`` intra-op threads (as a stream does)."""
    box = {}

    def run():
        torch.set_num_threads(threads)
        box["out"] = call()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return box["out"]


def test_the_onnxruntime_target_serves_requests_and_concurrent_calls_as_eager():
    model = pooled()
    opt = fxforge.optimize(model, (torch.randn(1, 3, 8, 8),), target="onnxruntime", objective="throughput",
                           **BUDGET)
    assert isinstance(opt, ThroughputModule) and type(opt.served).__name__ == "OnnxRuntimeModule"
    assert opt.served.follow_threads
    frame = opt.report.throughput.frame()
    assert len(frame) > 1 and frame["chosen"].sum() == 1
    torch.manual_seed(5)
    requests = [torch.randn(1, 3, 8, 8) for _ in range(6)]
    with torch.no_grad():
        outs = opt.map(requests)
        expected = [model(x) for x in requests]
    assert all(compare_outputs(e, o).ok for e, o in zip(expected, outs, strict=True))
    results = run_together(*(lambda x=x: inference(opt, x) for x in requests[:3]), timeout=120)
    assert all(compare_outputs(expected[i], results[i]).ok for i in range(3))
    opt.close()


def test_a_stream_runs_on_a_session_of_its_own_thread_count_and_a_new_export_drops_them():
    model = pooled()
    module = onnxruntime_module(model, (torch.randn(2, 3, 8, 8),), intra_op_num_threads=1)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = model(x)
        assert compare_outputs(expected, _in_thread(2, lambda: module(x))).ok
        assert module._by_threads == {}  # not following: the module's own session, one thread
        module.follow_threads = True
        assert compare_outputs(expected, _in_thread(2, lambda: module(x))).ok
        assert list(module._by_threads) == [2]
        assert module._by_threads[2].get_session_options().intra_op_num_threads == 2
        assert compare_outputs(expected, _in_thread(1, lambda: module(x))).ok and list(module._by_threads) == [2]
        old = module._by_threads[2]
        bigger = torch.randn(3, 3, 8, 8)  # a new size: exported again (dynamic=None); the old sessions go
        assert compare_outputs(model(bigger), _in_thread(2, lambda: module(bigger))).ok
        assert module.exports == 2 and list(module._by_threads) == [2] and module._by_threads[2] is not old
