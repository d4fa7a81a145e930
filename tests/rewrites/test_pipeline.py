"""The pipeline: passes in order, verification against the graph before, rollback with the error."""

import pytest
import torch
from torch import nn

import fxforge
from fxforge.rewrites.registry import UnknownRewriteError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.act(self.lin(x))) * 2


def relu_to_sigmoid(gm, ctx):
    """A deliberately wrong rewrite: relu is not sigmoid."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.ReLU):
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(torch.sigmoid, node.args)
            ctx.matched("relu made sigmoid", [node])
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)


def raising_pass(gm, ctx):
    raise RuntimeError("pass exploded")


WRONG = fxforge.Pass("wrong", relu_to_sigmoid, "replaces relu by sigmoid")


def _captured():
    model = Net().eval()
    return model, fxforge.capture(model, (torch.randn(4, 8),))


def test_wrong_pass_is_rolled_back_and_reported():
    model, cap = _captured()
    new = fxforge.rewrite(cap, ["cleanup", WRONG])
    assert new.report.counts == {"cleanup": 1}
    [rolled] = new.report.rolled_back
    assert rolled.rule == "wrong" and rolled.matches == 1
    assert "max abs error" in rolled.error and "on example inputs" in rolled.error
    assert "ROLLED BACK wrong" in str(new.report)
    assert "Rolled back" in new.report._repr_html_()
    x = torch.randn(4, 8)
    torch.testing.assert_close(new.graph_module(x), model(x))


def test_good_passes_are_verified_together():
    _, cap = _captured()
    harmless = fxforge.Pass("harmless", lambda gm, ctx: ctx.matched("looked", []), "matches, changes nothing")
    new = fxforge.rewrite(cap, ["cleanup", harmless])
    assert new.report.counts == {"cleanup": 1, "harmless": 1} and not new.report.rolled_back
    assert len(new.report.verified) == 1 and new.report.verified[0].startswith("cleanup, harmless: verified together")


def test_a_wrong_pass_after_good_ones_is_found_and_only_it_rolled_back():
    model, cap = _captured()
    new = fxforge.rewrite(cap, [WRONG, "cleanup"])
    assert new.report.counts == {"cleanup": 1}
    assert [r.rule for r in new.report.rolled_back] == ["wrong"]
    # Found pass by pass: the good one is verified on its own, after the wrong one was dropped.
    assert [v.split(":")[0] for v in new.report.verified] == ["cleanup"]
    x = torch.randn(4, 8)
    torch.testing.assert_close(new.graph_module(x), model(x))


def test_without_verification_the_wrong_pass_lands():
    model, cap = _captured()
    new = fxforge.rewrite(cap, [WRONG], verify=False)
    assert new.report.counts == {"wrong": 1} and not new.report.rolled_back
    x = torch.randn(4, 8)
    assert not torch.allclose(new.graph_module(x), model(x))


def test_a_pass_that_raises_is_rolled_back_not_fatal():
    _, cap = _captured()
    new = fxforge.rewrite(cap, [fxforge.Pass("boom", raising_pass), "cleanup"])
    assert new.report.rolled_back[0].error == "raised RuntimeError: pass exploded"
    assert new.report.counts == {"cleanup": 1}


def test_random_inputs_catch_what_the_example_hides():
    """A rewrite that is right only for the example's values is caught by the random inputs."""
    model = nn.Sequential(nn.ReLU()).eval()
    example = torch.ones(64)  # relu(x) == x for all-positive x

    def drop_relu(gm, ctx):
        for node in list(gm.graph.nodes):
            if node.op == "call_module":
                ctx.matched("relu dropped", [node])
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)

    new = fxforge.rewrite(fxforge.capture(model, (example,)), [fxforge.Pass("drop_relu", drop_relu)])
    assert new.report.rolled_back and "random inputs" in new.report.rolled_back[0].error


def test_unknown_rewrite_names_the_valid_ones():
    _, cap = _captured()
    with pytest.raises(UnknownRewriteError, match="built-in rewrites: cleanup"):
        fxforge.rewrite(cap, ["no_such_rule"])
    with pytest.raises(TypeError):
        fxforge.rewrite(cap, [42])


def test_report_summary_and_html():
    _, cap = _captured()
    new = fxforge.rewrite(cap, ["cleanup", "conv_bn_fold"])
    text = str(new.report)
    assert text.startswith("fxforge report: captured with fx;")
    assert "cleanup: dropout in eval removed [drop]" in text
    assert "test_pipeline.py" in text  # the user's source line
    html = new.report._repr_html_()
    assert "<table>" in html and "dropout in eval removed" in html
    assert new.report.nodes_after == new.report.nodes_before - 1


def test_graph_is_linted_and_parameters_shared():
    model, cap = _captured()
    new = fxforge.rewrite(cap)
    new.graph_module.graph.lint()
    assert new.graph_module.get_submodule("lin").weight is model.lin.weight


def test_a_subtly_wrong_rewrite_is_still_caught():
    """A 0.1% error in one weight (a wrong eps in a fold, say) is far above rounding: rolled back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()

    def scale_first_weight(gm, ctx):
        node = next(n for n in gm.graph.nodes if n.op == "call_module")
        gm.register_buffer("scaled_w", model[0].weight.detach() * 1.001)
        with gm.graph.inserting_before(node):
            w = gm.graph.get_attr("scaled_w")
            b = gm.graph.get_attr("0.bias")
            new = gm.graph.call_function(torch.nn.functional.linear, (node.args[0], w, b))
        ctx.matched("linear with a slightly wrong weight", [node])
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)

    cap = fxforge.capture(model, (torch.randn(8, 64),))
    new = fxforge.rewrite(cap, [fxforge.Pass("off_by_a_tenth_percent", scale_first_weight)])
    assert [r.rule for r in new.report.rolled_back] == ["off_by_a_tenth_percent"]


def explode_on_real_tensors(x):
    """Runs under fake tensors (so shape propagation passes) and raises on real ones."""
    if not torch._subclasses.fake_tensor.is_fake(x):
        raise RuntimeError("boom on real data")
    return x


def test_a_rewritten_graph_that_raises_when_run_is_rolled_back():
    def insert_explosion(gm, ctx):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        value = output.args[0]
        with gm.graph.inserting_before(output):
            output.args = (gm.graph.call_function(explode_on_real_tensors, (value,)),)
        ctx.matched("explosion", [value])

    _, cap = _captured()
    new = fxforge.rewrite(cap, ["cleanup", fxforge.Pass("broken", insert_explosion)])
    assert new.report.counts == {"cleanup": 1}
    assert new.report.rolled_back[0].error == "the rewritten graph raised RuntimeError: boom on real data"


def _double_folded_weights(gm, ctx):
    """A wrong pass that leaves the code alone: it swaps a folded weight for another tensor."""
    name = next(n for n, _ in gm.named_buffers() if "folded" in n)
    ctx.matched("weight doubled", [next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == name)])
    gm.register_buffer(name, getattr(gm, name) * 2, persistent=False)


def _sigmoid_instead_of_relu(gm, ctx):
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.fxforge.conv_pointwise.default)
    ctx.matched("relu made sigmoid", [node])
    node.args = (*node.args[:-3], "sigmoid", [], node.args[-1])


@pytest.mark.parametrize("wrong", [_double_folded_weights, _sigmoid_instead_of_relu])
def test_a_wrong_pass_after_autotune_is_caught_though_autotune_ran_the_graph(wrong):
    from fxforge.lowering.autotune import TuningPolicy

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 16, 16)
    new = fxforge.rewrite(fxforge.capture(model, (x,)),
                          ["conv_bn_fold", "conv_activation", fxforge.Pass("wrong", wrong)],
                          tuning=TuningPolicy(keep="fused", layout="channels-last", kernel="mkldnn"))
    assert [r.rule for r in new.report.rolled_back] == ["wrong"]
    assert new.report.counts == {"conv_bn_fold": 1, "conv_activation": 2}
    with torch.no_grad():
        torch.testing.assert_close(new.graph_module(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_recorded_output_holds_only_for_the_same_function_and_inputs():
    from fxforge.core.captured import LoweredRun

    def record(gm, x):
        return LoweredRun.record(gm, gm, {0: ((x,), {}, gm(x))})

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    x = torch.randn(2, 4)
    gm = torch.fx.symbolic_trace(model)
    run = record(gm, x)
    assert list(run.outputs_for(gm, [((x,), {}), ((x.clone(),), {})])) == [0]
    assert run.outputs_for(gm, [((x.clone(),), {})]) == {}  # other tensors
    with torch.no_grad():
        model[0].weight.add_(1)  # a parameter changed in place
    assert run.outputs_for(gm, [((x,), {})]) == {} and not run.lowers(gm)
    run = record(gm, x)
    gm.register_buffer("extra", torch.ones(1))  # another tensor reached
    assert run.outputs_for(gm, [((x,), {})]) == {}
    run = record(gm, x)
    x.add_(1)  # the inputs changed in place
    assert run.outputs_for(gm, [((x,), {})]) == {}
