"""target="inductor": fxforge's verified rewrites, then torch.compile of the rewritten graph, with the native
target's guards (live weights, modes, plan cache), checked against eager on fresh inputs."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import fxforge
from fxforge.lowering.inductor import CompileRefused, inductor_plan
from fxforge.runtime.plans import FallbackWarning


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    net.train()
    with torch.no_grad():
        net(torch.randn(4, 3, 8, 8))  # BatchNorm statistics from data
    return net.eval()


def test_inductor_target_runs_the_rewritten_graph_compiled():
    model = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), target="inductor")
    counts = opt.report.counts
    assert counts.get("conv_bn_fold") == 1 and "conv_activation" not in counts  # the fusion is Inductor's own
    assert any(note.startswith("inductor: the rewritten graph compiled") for note in opt.report.notes)
    assert type(opt.cache.last.executable).__name__ == "OptimizedModule"  # torch._dynamo's compiled module
    with torch.no_grad():
        x = torch.randn(2, 3, 8, 8)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
        model[4].weight.mul_(2)  # the plan follows the model's weights (rebuilt and compiled again)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_compiled_graph_that_differs_is_refused():
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    cap = fxforge.capture(model, (torch.randn(2, 4),))
    original = torch.compile

    def wrong(fn, **kwargs):  # a "compiler" whose code computes something else
        return lambda *args: fn(*args) + 1

    torch.compile = wrong
    try:
        inductor_plan(cap)
    except CompileRefused as refused:
        assert "differs from the rewritten one" in str(refused)
    else:
        raise AssertionError("a wrong compiled graph was accepted")
    finally:
        torch.compile = original


def test_inductor_is_a_target_of_the_decorator():
    @fxforge.optimize(target="inductor")
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.linear(x))

    net = Net().eval()
    with torch.no_grad():
        x = torch.randn(3, 4)
        expected = torch.relu(net.linear(x))
        torch.testing.assert_close(net(x), expected)
    assert any(note.startswith("inductor:") for note in net.report.notes), net.report


def test_new_sizes_get_one_compiled_shape_generic_plan():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    opt = fxforge.optimize(model, (torch.randn(2, 8),), target="inductor")
    with torch.no_grad():
        for rows in (3, 5, 9, 2):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    assert opt.plans_built == 2  # the example's, then one compiled with the batch dim dynamic
    assert any(note.startswith("inductor:") for note in opt.report.notes)


def test_a_new_batch_compiles_once_and_that_plan_serves_a_batch_of_one_without_another_compile():
    # issue 48: auto -> inductor's first batch-1 call cost 24 s (a plan of its own, then torch.compile
    # specialising the size 1); the re-plan for the dim that changed is compiled size-oblivious instead
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    opt = fxforge.optimize(model, (torch.randn(4, 8),), target="inductor")
    with torch.no_grad():
        for n in (6, 3):
            x = torch.randn(n, 8)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
        assert opt.plans_built == 2 and opt.cache.last.shapes is not None
        counters.clear()
        for _ in range(2):
            x = torch.randn(1, 8)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    assert opt.plans_built == 2
    assert counters["stats"]["unique_graphs"] == 0  # nothing compiled for the batch of one
    assert any("checked against eager at" in note for note in opt.cache.notes)


def test_a_conv_net_gets_one_shape_generic_plan_for_new_image_sizes_and_inference_mode_compiles_nothing():
    """A U-Net-style conv net (pooling, transposed convs, skip connections): its first new image size re-plans
    once with the batch and H/W dynamic (Inductor cannot compile its dims unbacked; the backed compile that
    follows used to fail on TorchDynamo's memory of that failure, and each new size got a plan of its own), and
    the plan was compiled for inference mode at build time, so calls under it compile nothing more for inputs
    of that kind (made outside or inside inference mode)."""
    import sys
    from pathlib import Path

    from torch._dynamo.utils import counters

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "user_models"))
    from hand_written import UNet, _settle

    torch.manual_seed(0)
    model = _settle(UNet(), torch.randn(2, 3, 32, 32))
    opt = fxforge.optimize(model, (torch.randn(2, 3, 32, 32),), target="inductor")
    with torch.inference_mode():
        for shape in ((2, 3, 32, 48), (3, 3, 64, 32), (2, 3, 48, 48)):
            x = torch.randn(shape)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
            if shape == (2, 3, 32, 48):
                counters.clear()  # the re-plan's compiles are done: the next sizes and modes compile nothing
    assert opt.plans_built == 2 and opt.cache.last.shapes is not None
    assert not any("could not be built" in note for note in opt.cache.notes)
    assert counters["stats"]["unique_graphs"] == 0
    outside = torch.randn(2, 3, 40, 40)
    with torch.inference_mode():
        torch.testing.assert_close(opt(outside), model(outside), rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 0


def test_a_model_returning_a_cache_object_compiles_and_gets_it_back():
    """LLaMA returns a DynamicCache: the export graph's unflatten of it ran inside TorchDynamo, which failed on
    its generator ("'LocalGeneratorObjectVariable' object has no attribute 'remaining_items'") and the model ran
    eagerly. The compiled graph now returns its outputs flat and the structure is rebuilt outside it."""
    import transformers

    from fxforge.lowering.inductor import RebuiltOutputs

    torch.manual_seed(0)
    model = transformers.LlamaModel(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        opt = fxforge.optimize(model, (torch.randint(0, 256, (2, 12)),), target="inductor")
        assert isinstance(opt.cache.last.executable, RebuiltOutputs)
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))   # fresh tokens
        with torch.no_grad():
            got, expected = opt(ids), model(ids)
    assert type(got.past_key_values) is type(expected.past_key_values)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(got.past_key_values.layers, expected.past_key_values.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-5)
