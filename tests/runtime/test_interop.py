"""Independent branches run at the same time (fxforge.runtime.interop, interop_choice): the same answers as
eager in every mode, the caller's threads and modes kept, the choice measured and reported."""

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from examples.models.branchy import BRANCHY
from fxforge.lowering.build import build_plan
from fxforge.lowering.schedule import independent_branches
from fxforge.runtime import interop_choice
from fxforge.runtime.interop import BranchRunner, concurrent_module, run_branches
from fxforge.runtime.interop_choice import plan_regions, with_inter_op


class TwoTowers(nn.Module):
    """A stem, two towers of equal cost (BatchNorm folded, ReLU fused), a head over both."""

    def __init__(self, c=16):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)

        def tower():
            return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                                 nn.Conv2d(c, c, 3, padding=1))

        self.left, self.right = tower(), tower()
        self.head = nn.Conv2d(2 * c, 4, 1)

    def forward(self, x):
        y = F.relu(self.stem(x))
        return self.head(torch.cat([self.left(y), self.right(y)], 1))


def towers():
    model = TwoTowers()
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 3, 12, 12))  # BatchNorm statistics of its own
    return model.eval()


@pytest.fixture
def two_threads():
    """Two intra-op threads in this test (the suite's workers run on one each): what a region is shared by."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def concurrent_count(module) -> int:
    plan = next(p for p in module.cache.plans.values() if p is not None)
    return sum(n.target is run_branches for n in plan.executable.graph.nodes)


def test_forced_concurrent_plan_answers_as_eager_on_fresh_inputs_sizes_and_layouts(two_threads):
    model = towers()
    opt = fxforge.optimize(model, (torch.randn(1, 3, 12, 12),), inter_op="always")
    assert concurrent_count(opt) == 1
    assert opt.report.tuning[-1].rule == "inter_op" and opt.report.tuning[-1].choice == "concurrent"
    with torch.no_grad():
        for x in (torch.randn(1, 3, 12, 12), torch.randn(3, 3, 9, 7),
                  torch.randn(2, 3, 12, 12).to(memory_format=torch.channels_last)):
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_modes_of_the_caller_hold_in_every_branch(two_threads):
    model = towers()
    opt = fxforge.optimize(model, (torch.randn(1, 3, 12, 12),), inter_op="always")
    x = torch.randn(1, 3, 12, 12)
    with torch.inference_mode():
        out = opt(x)
        assert out.is_inference()
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert not opt(x).requires_grad
    out = opt(x)  # gradients recorded: eager's ops, and eager's gradients
    out.sum().backward()
    grad = model.stem.weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(grad, model.stem.weight.grad, rtol=1e-4, atol=1e-5)


def test_changed_weights_and_nan_reach_the_branches(two_threads):
    model = towers()
    opt = fxforge.optimize(model, (torch.randn(1, 3, 12, 12),), inter_op="always")
    x = torch.randn(1, 3, 12, 12)
    with torch.no_grad():
        model.right[0].weight.mul_(-2.0)      # a folded and prepacked weight inside one branch
        model.left[1].running_var.add_(0.5)   # a BatchNorm statistic folded in the other
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
        x[0, 0, 3, 3] = float("nan")
        assert torch.equal(opt(x).isnan(), model(x).isnan())


def test_forward_hooks_added_later_are_honoured():
    model = towers()
    opt = fxforge.optimize(model, (torch.randn(1, 3, 12, 12),), inter_op="always")
    seen = []
    model.right.register_forward_hook(lambda m, i, o: seen.append(o.shape) or o * 2)
    x = torch.randn(1, 3, 12, 12)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        got = opt(x)
        assert seen  # the hook ran in the optimized call
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)


def test_callers_thread_count_is_restored_and_concurrent_callers_agree(two_threads):
    model = towers()
    opt = fxforge.optimize(model, (torch.randn(1, 3, 12, 12),), inter_op="always")
    before = torch.get_num_threads()
    inputs = [torch.randn(1, 3, 12, 12) for _ in range(8)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    results = [None] * len(inputs)

    def call(i):
        with torch.no_grad():
            results[i] = opt(inputs[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.get_num_threads() == before
    for got, want in zip(results, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_one_thread_runs_the_groups_in_turn(two_threads):
    gm = torch.fx.symbolic_trace(lambda x: torch.cat([x.sin().exp(), x.cos().neg()]))
    both = concurrent_module(gm, independent_branches(gm), [[[0], [1]]])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        x = torch.randn(5)
        assert torch.equal(both(x), gm(x))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == 2


def test_an_error_in_a_branch_is_raised_after_every_branch_ended(two_threads):
    ended = threading.Event()

    def slow(a):
        torch.ones(1)
        ended.set()
        return (a,)

    def broken(a):
        raise RuntimeError("shape mismatch in a branch")

    runner = BranchRunner([broken, slow], [[0], [0]], [["broken"], ["slow"]])
    before = torch.get_num_threads()
    assert before == 2
    with pytest.raises(RuntimeError, match="shape mismatch"):
        runner((torch.ones(1),))
    assert torch.get_num_threads() == before
    assert ended.is_set()


def test_every_branchy_model_answers_as_eager_with_every_region_concurrent(two_threads):
    for name in ("randwire_n16", "wide_inception", "darts_cells", "nasnet_cells", "inception", "transformer_encoder"):
        model, args = BRANCHY[name]()
        model.eval()
        plan = build_plan(model, args, {})
        concurrent = with_inter_op(plan, args, {}, always=True)
        if independent_branches(plan.executable):
            assert concurrent is not plan, name
        with torch.no_grad():
            fresh = tuple(torch.randn_like(a) if a.is_floating_point() else a for a in args)
            torch.testing.assert_close(concurrent.executable(*fresh), model(*fresh), rtol=1e-4, atol=1e-5)


def test_the_choice_is_measured_and_reported(monkeypatch, two_threads):
    model = towers()
    x = torch.randn(1, 3, 12, 12)
    plan = build_plan(model, (x,), {})
    # the timing says concurrent is slower: the plan stays as it was, and the report says why
    monkeypatch.setattr(interop_choice, "time_in_blocks", lambda calls, **k: {"sequential": 1.0, "concurrent": 1.2})
    monkeypatch.setattr(interop_choice, "MIN_OVERLAP_MS", 0.0)
    assert with_inter_op(plan, (x,), {}) is plan
    entry = plan.report.tuning[-1]
    assert (entry.rule, entry.choice, entry.timings) == ("inter_op", "sequential", {"sequential": 1.0, "concurrent": 1.2})
    assert "after " in entry.note and "|" in entry.note  # the schedule: the fork and its groups
    monkeypatch.setattr(interop_choice, "time_in_blocks", lambda calls, **k: {"sequential": 1.0, "concurrent": 0.8})
    kept = with_inter_op(plan, (x,), {})
    assert kept is not plan and kept.report.tuning[-1].choice == "concurrent"
    assert "inter_op schedule graph: concurrent" in str(kept.report)


def test_a_clear_choice_on_a_quiet_machine_is_remembered(monkeypatch, tmp_path, two_threads):
    monkeypatch.setenv("FXFORGE_AUTOTUNE_CACHE", "1")
    monkeypatch.setenv("FXFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(interop_choice, "machine_load", lambda: 0.0)
    monkeypatch.setattr(interop_choice, "MIN_OVERLAP_MS", 0.0)
    monkeypatch.setattr(interop_choice, "time_in_blocks", lambda calls, **k: {"sequential": 1.0, "concurrent": 0.7})
    model, x = towers(), torch.randn(1, 3, 12, 12)
    plan = build_plan(model, (x,), {})  # (one plan: a second build may time other kernels under load)
    first = with_inter_op(plan, (x,), {})
    assert first.report.tuning[-1].choice == "concurrent"

    def untimed(calls, **k):
        raise AssertionError("timed again")

    monkeypatch.setattr(interop_choice, "time_in_blocks", untimed)
    again = with_inter_op(plan, (x,), {})
    entry = again.report.tuning[-1]
    assert entry.choice == "concurrent" and "autotune cache" in entry.note
    with torch.no_grad():
        torch.testing.assert_close(again.executable(x), model(x), rtol=1e-4, atol=1e-5)
    # a busy machine: a 1.1x gain is not enough, and nothing is remembered
    monkeypatch.setattr(interop_choice, "machine_load", lambda: 3.0)
    monkeypatch.setattr(interop_choice, "time_in_blocks", lambda calls, **k: {"sequential": 1.0, "concurrent": 0.9})
    busy = with_inter_op(build_plan(model, (torch.randn(2, 3, 12, 12),), {}), (torch.randn(2, 3, 12, 12),), {})
    assert busy.report.tuning[-1].choice == "sequential" and "busy" in busy.report.tuning[-1].note


def test_small_branches_are_left_sequential_without_timing():
    gm = torch.fx.symbolic_trace(lambda x: x.sin() + x.cos())
    kept, _groups, lines = plan_regions(independent_branches(gm), {"sin": 0.01, "cos": 0.01}, 2)
    assert kept == [] and "sequential" in lines[0]


def test_inter_op_false_and_bad_values():
    opt = fxforge.optimize(towers(), (torch.randn(1, 3, 12, 12),), inter_op=False)
    assert not any(t.rule == "inter_op" for t in opt.report.tuning)
    with pytest.raises(ValueError, match="inter_op must be"):
        fxforge.optimize(towers(), (torch.randn(1, 3, 12, 12),), inter_op="sometimes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: branches on side streams")
def test_branches_on_cuda_streams_answer_as_eager():
    model = towers().cuda()
    opt = fxforge.optimize(model, (torch.randn(1, 3, 12, 12, device="cuda"),), inter_op="always")
    assert concurrent_count(opt) == 1
    x = torch.randn(2, 3, 12, 12, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-3, atol=1e-4)


def test_towers_reading_their_own_inputs_run_concurrently_and_answer_as_eager(two_threads):
    from tests.lowering.test_schedule import TwoTowerRetrieval

    torch.manual_seed(0)
    model = TwoTowerRetrieval().eval()
    def inputs(batch):
        return (torch.randn(batch, 3, 16, 16), torch.randint(0, 50, (batch, 7)), torch.ones(batch, 7))

    opt = fxforge.optimize(model, inputs(2), inter_op="always")
    assert concurrent_count(opt) >= 1
    assert any("after the inputs" in t.note for t in opt.report.tuning if t.rule == "inter_op")
    with torch.no_grad():
        for batch in (2, 3):
            x = inputs(batch)
            torch.testing.assert_close(opt(*x), model(*x), rtol=1e-4, atol=1e-5)


def test_regions_no_order_can_serve_are_left_sequential_with_a_line():
    from fxforge.lowering.schedule import Region
    from fxforge.runtime.interop_choice import orderable

    def straddled(x):
        a = x.sin()
        y = x.clone()
        y.add_(1)  # an effect between the two branches' nodes: no order runs them as one step
        b = x.cos()
        return a + b + y

    gm = torch.fx.symbolic_trace(straddled)
    node = {n.name: n for n in gm.graph.nodes}
    kept, groups, dropped = orderable(gm, [Region(node["x"], ((node["sin"],), (node["cos"],)))], [[[0], [1]]])
    assert kept == [] and groups == [] and "left sequential" in dropped[0]


def test_a_profile_of_a_concurrent_plan_measures_its_nodes_one_by_one(two_threads):
    model = towers()
    x = torch.randn(1, 3, 12, 12)
    opt = fxforge.optimize(model, (x,), inter_op="always")
    assert concurrent_count(opt) == 1
    table = fxforge.profile(opt, (x,), warmup=0, repeat=1).table
    # stem, 2 x 2 towers, head: six convolutions, some fused with their activation where that measured faster
    convolutions = table["op"].isin(["conv2d", "fxforge.conv_pointwise"]).sum()
    assert "run_branches" not in set(table["op"]) and convolutions == 6
