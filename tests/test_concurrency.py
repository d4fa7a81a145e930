"""Threads: concurrent first calls, concurrent optimizations with their own tuning policies, optimized
modules that keep running while another thread captures a model (torch.fx patches nn.Module process-wide
while it traces), and models with graph breaks built in two threads at once (no lock taken in two orders)."""

from __future__ import annotations

import threading
import time
import traceback

import torch
from torch import nn

import fxforge
from fxforge.lowering.autotune import TuningPolicy


class Block(nn.Module):
    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))) + x


def convnet(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Block(), Block(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    with torch.no_grad():
        for _ in range(2):  # BatchNorm statistics of real activations, not the identity of a fresh layer
            model.train()(torch.randn(4, 3, 8, 8))
    return model.eval()


def inference(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # grad mode is per thread: each job sets its own
        return module(x)


def run_together(*jobs, timeout: float = 300) -> list:
    """Run the jobs in threads released at once; re-raise the first error with its traceback. A job still
    running after ``timeout`` seconds fails the test (a deadlock; its daemon thread is left behind)."""
    barrier, results, errors = threading.Barrier(len(jobs)), [None] * len(jobs), []

    def run(i, job):
        try:
            barrier.wait()
            results[i] = job()
        except BaseException:  # noqa: BLE001 - reported below
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), f"a job still runs after {timeout} s: a deadlock"
    assert not errors, errors[0]
    return results


def test_concurrent_first_calls_on_one_module_build_one_plan_and_answer_like_eager():
    for round in range(4):
        model = convnet(round)
        opt = fxforge.optimize(model)
        xs = [torch.randn(2, 3, 8, 8) for _ in range(3)]
        outs = run_together(*(lambda x=x, opt=opt: inference(opt, x) for x in xs))
        for x, out in zip(xs, outs):
            torch.testing.assert_close(out, inference(model, x), rtol=1e-4, atol=1e-5)
        assert len(opt.cache.plans) == 1  # one signature: one capture, the other calls waited for it


def test_concurrent_optimizations_keep_their_own_tuning_policies():
    models = [convnet(0), convnet(1)]
    x = torch.randn(1, 3, 8, 8)
    policies = [TuningPolicy(keep="fused", kernel="composite", layout="as captured"), TuningPolicy(keep="before")]
    for _ in range(2):
        opts = run_together(*(lambda m=m, p=p: fxforge.optimize(m, (x,), tuning=p) for m, p in zip(models, policies)))
        kept = [next(t for t in o.report.tuning if t.subject == "graph") for o in opts]
        assert [t.choice for t in kept] == ["fused", "before"]
        assert all("set by the tuning policy (keep=" in t.note for t in kept)
        assert opts[0].report.counts.get("conv_activation") and not opts[1].report.counts.get("conv_activation")
        for model, opt in zip(models, opts):
            torch.testing.assert_close(inference(opt, x), inference(model, x), rtol=1e-4, atol=1e-5)


def test_an_optimized_module_keeps_answering_while_another_thread_captures():
    serving = convnet(0)
    opt = fxforge.optimize(serving, (torch.randn(1, 3, 8, 8),))
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        expected = serving(x)
    stop = threading.Event()

    def serve() -> int:
        calls = 0
        with torch.no_grad():
            while not stop.is_set() or calls < 20:
                torch.testing.assert_close(opt(x), expected, rtol=1e-4, atol=1e-5)
                calls += 1
        return calls

    def capture_others() -> None:
        try:
            for seed in range(3):  # each a symbolic trace: nn.Module.__call__ is patched meanwhile
                fxforge.capture(convnet(seed), (torch.randn(2, 3, 8, 8),), method="fx")
        finally:
            stop.set()

    calls, _ = run_together(serve, capture_others)
    assert calls >= 20
    assert torch.nn.Module.__call__ is torch.fx._symbolic_trace._orig_module_call  # no tracer left installed


def test_concurrent_training_mode_verification_draws_each_threads_own_random_numbers():
    """Verification compares graphs under one seed; two threads verifying dropout at once must not draw
    from each other's seeds (which rolls a correct rewrite back)."""

    class Dropping(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.drop = nn.Linear(64, 64), nn.Dropout(0.5)

        def forward(self, x):
            for _ in range(8):  # many draws: a foreign seed shows
                x = self.drop(torch.relu(self.lin(x))) + nn.functional.dropout(x, 0.2)
            return x

    x = torch.randn(32, 64)
    for _ in range(3):
        models = [Dropping().train(), Dropping().train()]
        jobs = [lambda m=m: fxforge.rewrite(fxforge.capture(m, (x,)), ["cleanup", fxforge.Pass("copy", _copy_relu)])
                for m in models]
        for new in run_together(*jobs):
            assert new.report.rolled_back == [] and new.report.counts == {"copy": 8}


def _copy_relu(gm, ctx):
    """An exact rewrite that forces a verification run: each relu becomes relu(x.clone())."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.relu:
            with gm.graph.inserting_before(node):
                copy = gm.graph.call_method("clone", (node.args[0],))
            node.replace_input_with(node.args[0], copy)
            ctx.matched("relu of a copy", [node])


class Breaking(nn.Module):
    """A data-dependent ``if``: TorchDynamo runs it as two graphs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.a(x))
        if y.sum() > 0:
            y = y * 2
        return self.b(y)


def test_models_with_breaks_build_in_two_threads_at_once_without_waiting_for_each_other():
    """optimize's prepare runs a model with breaks inside isolated() (RNG lock, then TorchDynamo's), while a
    call of another one builds a graph's plan, which verifies inside isolated() (TorchDynamo's, then RNG): with
    two locks each thread held one and waited for the other forever (a CI run hung)."""
    torch.manual_seed(0)
    nets = [Breaking().eval(), Breaking().eval()]
    opts = [fxforge.optimize(net, (torch.randn(2, 8),), target="native") for net in nets]
    sizes = range(3, 7)

    def prepare_new_sizes() -> None:
        for size in sizes:
            opts[0].prepare(torch.randn(size, 8))

    def call_new_sizes() -> list:
        return [(x, inference(opts[1], x)) for x in (torch.randn(size + 10, 8) for size in sizes)]

    _, calls = run_together(prepare_new_sizes, call_new_sizes, timeout=120)
    for x, out in calls:
        torch.testing.assert_close(out, inference(nets[1], x), rtol=1e-4, atol=1e-5)
