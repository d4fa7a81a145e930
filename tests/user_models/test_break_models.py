"""Models with graph breaks through fxforge: TorchDynamo cuts them, fxforge optimizes every graph between the breaks.

Each model is compared with eager on fresh inputs (new shapes, new values, changed weights), in eval and in
training mode (outputs, gradients, BatchNorm statistics), and its report must name its break by the user's line.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_user_models import assert_close
from with_breaks import BREAK_LINES, BREAK_MODELS

import fxforge
from fxforge.runtime.fallbacks import FallbackWarning

NAMES = sorted(BREAK_MODELS)
# Models whose breaks fxforge's whole-graph captures get around (fx records .item() as a node, export runs print
# and a disabled helper as Python): method="auto" captures them whole, method="dynamo" still cuts them.
WHOLE = {name for name in NAMES if BREAK_MODELS[name]().capturable}
# Models with BatchNorm or dropout, whose training-mode behaviour is checked.
TRAINING = ["data_branch", "print_debug", "disabled_helper", "ragged_loop", "item_scale", "masked_pool"]


def calls(case):
    return [case.inputs, *case.fresh]


@pytest.mark.parametrize("name", NAMES)
def test_optimize_serves_fresh_inputs_like_eager_without_a_fallback(name):
    case = BREAK_MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        opt = fxforge.optimize(case.model, case.inputs)
        with torch.inference_mode():
            for inputs in calls(case):
                assert_close(opt(*inputs), case.model(*inputs), what=f"{name} at {[tuple(t.shape) for t in inputs]}")
        with torch.no_grad():
            for p in case.model.parameters():
                p.mul_(0.5)
            assert_close(opt(*case.fresh[0]), case.model(*case.fresh[0]), what=f"{name} after the weights changed")
    report = opt.report
    if name in WHOLE:
        assert report.method in ("fx", "export") and report.breaks == []
    else:
        assert report.method == "dynamo"
        assert report.flop_share is not None and report.flop_share > 0.5, str(report)
        assert report.nodes_after > 0 and len(report.graphs) >= 1


@pytest.mark.parametrize("name", NAMES)
def test_method_dynamo_names_each_break_by_the_users_line_with_a_fix(name):
    case = BREAK_MODELS[name]()
    opt = fxforge.optimize(case.model, case.inputs, method="dynamo")
    with torch.no_grad():
        for inputs in calls(case):
            assert_close(opt(*inputs), case.model(*inputs), what=name)
    report = opt.report
    assert report.method == "dynamo"
    codes = [b.code for b in report.breaks]
    if BREAK_LINES[name] is None:  # dynamo holds it in one graph (numpy traced through torch)
        assert codes == [] and len(report.graphs) == 1
        return
    assert BREAK_LINES[name] in codes, str(report)
    for item in report.breaks:
        assert item.line.startswith("tests/user_models/") or item.line.startswith("/"), item.line
        assert item.reason and item.fix and "dynamo cannot trace it" not in item.reason, item
    assert f"break at {report.breaks[0].line}" in str(report)
    assert "Graph breaks" in report._repr_html_()


@pytest.mark.parametrize("name", TRAINING)
def test_training_mode_outputs_gradients_and_statistics_are_eagers(name):
    case = BREAK_MODELS[name]()
    model = case.model.train()
    twin = copy.deepcopy(model)
    opt = fxforge.optimize(model, method="dynamo")
    for step, inputs in enumerate(calls(case)[:2]):
        floats = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        twins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        torch.manual_seed(step)
        out = opt(*floats)
        torch.manual_seed(step)
        want = twin(*twins)
        assert_close(out, want, what=f"{name} step {step}")
        out.float().square().sum().backward()
        want.float().square().sum().backward()
        for (key, p), q in zip(model.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), key
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
        for a, b in zip(floats, twins):
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
        for (key, a), b in zip(model.named_buffers(), twin.buffers()):
            torch.testing.assert_close(a, b, msg=lambda m, key=key: f"buffer {key}: {m}")
        model.zero_grad()
        twin.zero_grad()


@pytest.mark.parametrize("recompile_limit", [None, 2])
def test_switching_modes_hooks_and_autocast_are_guarded_per_graph(recompile_limit):
    """With a recompile limit of 2 TorchDynamo runs the hook's call eagerly (as it does once a process compiled
    the model's forward often): the eval graph's plan then meets BatchNorm statistics that the train graph's call
    moved behind their versions (0.03 off before they were watched by their counter)."""
    import torch._dynamo.config as dynamo_config

    limit = {} if recompile_limit is None else {"recompile_limit": recompile_limit}
    with dynamo_config.patch(**limit):
        _switch_modes_hooks_and_autocast()


def _switch_modes_hooks_and_autocast():
    case = BREAK_MODELS["data_branch"]()
    model = case.model
    opt = fxforge.optimize(model, case.inputs)
    x = case.fresh[0][0]
    with torch.no_grad():
        assert_close(opt(x), model(x), what="eval")
        model.train()
        torch.manual_seed(0)
        got = opt(x)
        model.eval()
        twin = copy.deepcopy(model).train()
        torch.manual_seed(0)
        assert_close(got, twin(x), what="train mode, no grad")
        handle = model.body[0].register_forward_hook(lambda module, inputs, output: output * 0.0)
        assert_close(opt(x), model(x), what="a hook added after optimize")
        handle.remove()
        assert_close(opt(x), model(x), what="the hook removed")
        with torch.autocast("cpu", torch.bfloat16):
            assert_close(opt(x).float(), model(x).float(), atol=5e-2, rtol=5e-2, what="autocast")
        nan = x.clone()
        nan[0, 0, 0, 0] = float("nan")
        got, want = opt(nan), model(nan)
        assert torch.equal(got.isnan(), want.isnan())


def test_a_swapped_parameter_is_followed():
    case = BREAK_MODELS["data_branch"]()
    model = case.model
    opt = fxforge.optimize(model, case.inputs)
    with torch.no_grad():
        model.pos.weight = torch.nn.Parameter(torch.randn_like(model.pos.weight))
        assert_close(opt(*case.inputs), model(*case.inputs), what="a new Parameter object")


def test_inductor_target_compiles_each_graph():
    case = BREAK_MODELS["data_branch"]()
    opt = fxforge.optimize(case.model, case.inputs, target="inductor")
    with torch.no_grad():
        for inputs in calls(case):
            assert_close(opt(*inputs), case.model(*inputs), what="inductor")
    assert opt.report.method == "dynamo" and len(opt.report.graphs) == 2
    assert any(t.rule == "inductor" or "inductor" in str(t) for t in opt.report.tuning) or \
        any("inductor" in note.lower() for note in opt.report.notes), str(opt.report)


def test_exports_that_need_one_graph_refuse_naming_each_break():
    case = BREAK_MODELS["data_branch"]()
    with pytest.raises(fxforge.CaptureError, match=r"TorchDynamo breaks it at .*hand_written.py:\d+ \(if h.sum\(\) > 0:\)"
                       r": branches on a tensor's value.*torch.where"):
        fxforge.export_onnx(case.model, "unused.onnx", case.inputs)
    opt = fxforge.optimize(case.model, case.inputs)
    from fxforge.targets import TARGETS

    with pytest.raises(ValueError, match=r"a \.pt2 file holds one graph, and BranchOnData runs as graphs between breaks: "
                                         r".*if h.sum\(\) > 0:"):
        TARGETS["native"].write(opt, "unused.pt2")


def test_new_sizes_reuse_dynamos_dynamic_graphs():
    case = BREAK_MODELS["greedy_decoder"]()
    opt = fxforge.optimize(case.model, case.inputs)
    built = opt.plans_built
    with torch.no_grad():
        for length in (6, 7, 8, 11):
            ids = torch.randint(0, 64, (2, length))
            assert torch.equal(opt(ids), case.model(ids))
    assert opt.plans_built <= built + 2, opt.plans_built  # the graphs dynamo made dynamic serve every length


def test_capture_with_method_dynamo_returns_each_graph_and_the_breaks():
    case = BREAK_MODELS["data_branch"]()
    found = fxforge.capture(case.model, case.inputs, method="dynamo")
    assert found.method == "dynamo" and len(found.graph_modules) == 2
    assert [b.code for b in found.breaks] == ["if h.sum() > 0:"]
    host, (graph, _, inputs) = found.graph_modules[0], found.graphs[0]
    names = {name for name, _ in host.named_parameters()}
    assert "body.0.weight" in names  # the model's own parameters, under their own names
    assert host.get_parameter("body.0.weight") is case.model.body[0].weight
    with torch.no_grad():
        assert_close(host(*inputs), graph.graph_module(*[*_bound_and_kept(graph, host, inputs)]), what="host")


def _bound_and_kept(graph, host, inputs):
    """dynamo's graph's inputs from a host's: the bound tensors at their positions, the kept inputs at theirs."""
    layout = graph.layout
    values = [None] * (len(layout.bound) + len(layout.sizes) + len(layout.kept))
    for i, name in zip(layout.bound, layout.names):
        values[i] = host.get_parameter(name) if name in dict(host.named_parameters()) else host.get_buffer(name)
    for i, value in zip(layout.kept, inputs):
        values[i] = value
    for i, (tensor_at, dim) in layout.sizes.items():
        values[i] = values[tensor_at].shape[dim]
    return values
