"""objective="throughput": map and concurrent calls give eager's outputs, batching only where proven, the table of
configurations, thread counts left as they were, the combinations refused. No test asserts a speed."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import fxforge
from fxforge.core.throughput import Configuration, ThroughputTable
from fxforge.core.verify import compare_outputs
from fxforge.runtime.throughput import ThroughputModule
from fxforge.runtime.throughput_search import configurations

BUDGET = {"throughput_budget_s": 0.2}


class Pooled(nn.Module):
    """Conv, BatchNorm, ReLU, global pooling, Linear: takes any spatial size, batch-separable in eval mode."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class Centred(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


class Pair(nn.Module):
    def forward(self, x, w):
        return x @ w


def pooled() -> nn.Module:
    torch.manual_seed(0)
    model = Pooled()
    with torch.no_grad():
        model.train()(torch.randn(8, 3, 8, 8))  # statistics of real activations
    return model.eval()


class Recording(nn.Module):
    """Calls ``inner``, recording the shape of each call's input."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.seen = inner, []

    def forward(self, x):
        self.seen.append(tuple(x.shape))
        return self.inner(x)


def served(model: nn.Module, example, batch: int, streams: int = 2) -> ThroughputModule:
    """The optimized model served with a configuration set by hand (batching proven by the test's own model)."""
    table = ThroughputTable([Configuration(streams, 1, batch, 1.0, 1.0, 1.0, 1.0, 1.0)], 0)
    return ThroughputModule(Recording(fxforge.optimize(model, example)), table)


def test_map_returns_eager_outputs_for_fresh_requests():
    model = pooled()
    opt = fxforge.optimize(model, (torch.randn(1, 3, 8, 8),), objective="throughput", **BUDGET)
    torch.manual_seed(1)
    requests = [torch.randn(1, 3, 8, 8) for _ in range(11)]
    with torch.no_grad():
        outputs = opt.map(requests)
        expected = [model(r) for r in requests]
    assert len(outputs) == len(requests)
    for out, ref in zip(outputs, expected):
        assert out.shape == ref.shape
        assert compare_outputs(ref, out).ok


def test_map_batches_only_requests_of_one_signature():
    model = pooled()
    opt = served(model, (torch.randn(1, 3, 8, 8),), batch=4)
    torch.manual_seed(2)
    shapes = [(1, 3, 8, 8)] * 5 + [(1, 3, 10, 10)] * 3 + [(2, 3, 8, 8)] * 2 + [(1, 3, 8, 8)] * 2
    tensors = [torch.randn(*s) for s in shapes]
    requests: list = list(tensors)
    requests[3] = (tensors[3],)  # a tuple of args is a request too
    requests[6] = {"x": tensors[6]}  # and a dict of keyword inputs
    with torch.no_grad():
        outputs = opt.map(requests)
        expected = [model(x) for x in tensors]
    for out, ref in zip(outputs, expected):
        assert out.shape == ref.shape and compare_outputs(ref, out).ok
    # 7 requests of 1x3x8x8 (a tuple among them) -> batches of 4 and 3; 2 positional 1x3x10x10 -> one of 2, the
    # keyword one alone (another signature); 2 of 2x3x8x8 -> one of 2 requests (4 rows)
    assert sorted(opt.served.seen) == sorted([(4, 3, 8, 8), (3, 3, 8, 8), (2, 3, 10, 10), (1, 3, 10, 10),
                                              (4, 3, 8, 8)])


def test_concurrent_calls_from_four_threads_give_eager_results():
    model = pooled()
    opt = fxforge.optimize(model, (torch.randn(1, 3, 8, 8),), objective="throughput", **BUDGET)
    torch.manual_seed(3)
    inputs = [torch.randn(1, 3, 8, 8) for _ in range(4)]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def job(i: int) -> None:
        try:
            with torch.no_grad():
                results[i] = [opt(inputs[i]) for _ in range(5)]
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with torch.no_grad():
        for i, x in enumerate(inputs):
            for out in results[i]:
                assert compare_outputs(model(x), out).ok


def test_table_has_one_row_per_configuration_and_one_chosen():
    opt = fxforge.optimize(pooled(), (torch.randn(1, 3, 8, 8),), objective="throughput", **BUDGET)
    table = opt.report.throughput
    frame = table.frame()
    assert len(frame) == len(table.rows) >= 1
    assert frame["chosen"].sum() == 1 and frame["chosen"].iloc[table.chosen]
    assert table.best.samples_per_s == frame["samples_per_s"].max()
    keys = [(r.streams, r.threads, r.batch) for r in table.rows]
    assert len(set(keys)) == len(keys)
    assert set(keys) <= set(configurations(len(__import__("os").sched_getaffinity(0))))
    assert (1, len(__import__("os").sched_getaffinity(0)), 1) in keys  # the latency configuration is a row
    for row in table.rows:
        assert row.samples_per_s > 0 and 0 < row.p50_ms <= row.p90_ms <= row.p99_ms and 0 <= row.utilization <= 1
    assert "Throughput" in opt.report._repr_html_() and "throughput:" in str(opt.report)


def test_thread_counts_are_left_as_they_were():
    before = torch.get_num_threads()
    opt = fxforge.optimize(pooled(), (torch.randn(1, 3, 8, 8),), objective="throughput", **BUDGET)
    with torch.no_grad():
        opt.map([torch.randn(1, 3, 8, 8) for _ in range(4)])
        opt(torch.randn(1, 3, 8, 8))
    assert torch.get_num_threads() == before


def test_batching_refused_for_a_model_that_mixes_samples():
    model = Centred()
    opt = fxforge.optimize(model, (torch.randn(1, 6),), objective="throughput", **BUDGET)
    table = opt.report.throughput
    assert "mixes samples" in table.batching
    assert {r.batch for r in table.rows} == {1}
    x = torch.randn(1, 6)
    with torch.no_grad():
        assert torch.equal(opt.map([x])[0], model(x))


def test_batching_refused_for_batch_norm_in_training_mode_and_statistics_kept():
    model = pooled().train()
    running = model.bn.running_mean.clone()
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), objective="throughput", **BUDGET)
    assert "training mode" in opt.report.throughput.batching
    assert {r.batch for r in opt.report.throughput.rows} == {1}
    assert torch.equal(model.bn.running_mean, running)


def test_batching_refused_for_an_input_whose_dim_0_is_not_a_batch():
    opt = fxforge.optimize(Pair(), (torch.randn(1, 4), torch.randn(4, 4)), objective="throughput", **BUDGET)
    assert "not a batch dim" in opt.report.throughput.batching


def test_latency_objective_is_unchanged():
    opt = fxforge.optimize(pooled(), (torch.randn(1, 3, 8, 8),))
    assert type(opt).__name__ == "OptimizedModule"


@pytest.mark.parametrize("kwargs, words", [
    ({"objective": "speed"}, "objective must be"),
    ({"objective": "throughput", "target": "inductor"}, "target='inductor'"),
    ({"objective": "throughput", "memory_budget": "60%"}, "memory_budget"),
])
def test_unsupported_combinations_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        fxforge.optimize(pooled(), (torch.randn(1, 3, 8, 8),), **kwargs)


def test_class_decorator_and_missing_inputs_are_refused():
    with pytest.raises(ValueError, match="model instance"):
        fxforge.optimize(Pooled, objective="throughput")
    with pytest.raises(ValueError, match="model instance"):
        fxforge.optimize(objective="throughput")
    with pytest.raises(ValueError, match="example_inputs"):
        fxforge.optimize(pooled(), objective="throughput")
