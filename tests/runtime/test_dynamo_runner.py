"""The dynamo runner: each graph between breaks an optimized module of its own, the model's own tensors, and what
happens when dynamo itself fails or the model raises."""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fxforge
from fxforge.runtime.fallbacks import FallbackWarning


class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.head = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        if h.mean() > 0.4:
            h = h * 0.5
        return self.head(h)


def _settled(model):
    with torch.no_grad():
        model.train()(torch.randn(4, 3, 8, 8))
    return model.eval()


def test_each_graph_is_optimized_and_the_report_names_the_latest_calls_graphs():
    model = _settled(Branch())
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), method="dynamo")
    report = opt.report
    assert report.counts.get("conv_bn_fold") == 1
    assert [g.index for g in report.graphs] == [1, 2] and report.graphs[0].counts.get("conv_bn_fold") == 1
    assert report.graphs[0].ends == report.breaks[0]
    assert 0.99 <= report.flop_share <= 1.0 and 0 < report.time_share <= 1.0
    with torch.no_grad():
        for shape in ((3, 3, 10, 12), (1, 3, 8, 8), (5, 3, 8, 8)):
            x = torch.randn(shape)
            torch.testing.assert_close(opt(x), model(x))
    assert len(opt.report.graphs) == 2  # not one entry per graph dynamo compiled (static, then dynamic)


def test_plans_built_counts_every_graphs_plans_and_new_sizes_reuse_dynamic_graphs():
    model = _settled(Branch())
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), method="dynamo")
    with torch.no_grad():
        opt(torch.randn(3, 3, 9, 9))  # dynamo compiles its graphs again with the sizes symbolic
        built = opt.plans_built
        for n in (4, 5, 6):
            opt(torch.randn(n, 3, 7 + n, 9))
    assert opt.plans_built == built


def test_new_weights_and_a_swapped_parameter_are_followed():
    model = _settled(Branch())
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), method="dynamo")
    x = torch.randn(2, 3, 8, 8)
    other = _settled(Branch())
    opt.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(opt(x), other(x))
        model.conv.weight = nn.Parameter(torch.randn_like(model.conv.weight))
        torch.testing.assert_close(opt(x), model(x))
        model.bn.running_mean.add_(1.0)  # a buffer changed in place: the folded weights are made again
        torch.testing.assert_close(opt(x), model(x))


def test_a_buffer_edited_through_data_stays_edited_when_a_gradients_plan_is_built():
    """Building a plan checks graphs in blocks that restore the model's buffers; a copy taken before a ``.data``
    edit (which leaves the version) was written back, undoing the user's edit (error 0.6)."""
    model = _settled(Branch())
    twin = copy.deepcopy(model)
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), method="dynamo")
    for m in (model, twin):
        m.bn.running_mean.data.add_(1.0)
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(opt(x), twin(x))  # a new plan, for gradients
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), twin(x))


def test_hooks_fire_once_per_users_call_not_on_fxforges_own_runs():
    """optimize runs the model to build and measure its graphs, and an error that one graph cannot hold the model
    runs dynamo to name the breaks: a feature-collecting hook saw 3 calls before the user made one."""
    model = _settled(Branch())
    twin = copy.deepcopy(model)
    seen, seen_eager = [], []
    model.conv.register_forward_hook(lambda m, args, out: seen.append(out.detach().clone()))
    twin.conv.register_forward_hook(lambda m, args, out: seen_eager.append(out.detach().clone()))
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), method="dynamo")
    assert seen == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for grad in (False, True, False):
            x = torch.randn(2, 3, 8, 8)
            with torch.set_grad_enabled(grad):
                torch.testing.assert_close(opt(x), twin(x))
    assert len(seen) == len(seen_eager) == 3
    for got, expected in zip(seen, seen_eager):
        torch.testing.assert_close(got, expected)
    from fxforge.capture.model import breaks_of
    assert len(breaks_of(model, (torch.randn(2, 3, 8, 8),), {})) == 1 and len(seen) == 3


def test_copies_of_a_graph_by_graph_module_are_independent():
    model = _settled(Branch())
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), method="dynamo")
    x = torch.randn(2, 3, 8, 8)
    for twin in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert twin.original is not model
        with torch.no_grad():
            twin.original.conv.weight.mul_(2.0)
            torch.testing.assert_close(twin(x), twin.original(x))
            torch.testing.assert_close(opt(x), model(x))
        assert twin.report.method == "dynamo"


def test_a_decorated_class_runs_graph_by_graph():
    @fxforge.optimize(method="dynamo")
    class Net(Branch):
        pass

    net = _settled(Net())
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        got = net(x)
    plain = Branch()
    plain.load_state_dict(net.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(got, plain.eval()(x))
    assert net.report.method == "dynamo" and net.report.breaks


def test_the_models_own_error_is_raised_as_it_is():
    model = _settled(Branch())
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), method="dynamo")
    with pytest.raises(RuntimeError, match="channels"), torch.no_grad():
        opt(torch.randn(2, 5, 8, 8))  # the model fails on these inputs too
    assert not opt.dynamo.failed


class Percentile(nn.Module):
    """numpy's percentile, which dynamo traces through torch and returns differently from numpy (torch 2.13)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        top = np.percentile(h.detach().numpy(), 90)
        return torch.clamp(h, max=float(top))


def test_where_dynamo_fails_on_a_call_the_model_serves_it_runs_eagerly_after_one_warning():
    model = Percentile().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        opt = fxforge.optimize(model, method="dynamo")
        with pytest.warns(FallbackWarning, match="TorchDynamo failed on a call the model serves"):
            torch.testing.assert_close(opt(x), model(x))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.testing.assert_close(opt(x * 2), model(x * 2))
    assert opt.report.notes[0].startswith("runs eagerly: TorchDynamo failed")


def test_threads_share_the_compiled_code_and_each_call_its_own_owner():
    import threading

    model = _settled(Branch())
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), method="dynamo")
    inputs = [torch.randn(2, 3, 8, 8) for _ in range(4)]
    results = [None] * 4

    def run(i):
        with torch.no_grad():
            results[i] = opt(inputs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with torch.no_grad():
        for got, x in zip(results, inputs):
            torch.testing.assert_close(got, model(x))


def test_two_instances_of_one_class_keep_their_own_weights():
    first, second = _settled(Branch()), _settled(Branch())
    x = torch.randn(2, 3, 8, 8)
    a = fxforge.optimize(first, (x,), method="dynamo")
    b = fxforge.optimize(second, (x,), method="dynamo")
    with torch.no_grad():
        torch.testing.assert_close(a(x), first(x))
        torch.testing.assert_close(b(x), second(x))
        torch.testing.assert_close(a(x), first(x))
