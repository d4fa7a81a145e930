"""The call-form vocabulary: every form of an op is the same op, and dropout is read as torch runs it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxforge
from fxforge.core.vocabulary import OPS, calls, op_name, read_dropout, reads_metadata

F = nn.functional
aten = torch.ops.aten


def one_call(fn) -> tuple[torch.fx.Node, torch.fx.GraphModule]:
    gm = torch.fx.symbolic_trace(fn)
    return next(n for n in gm.graph.nodes if n.op.startswith("call")), gm


@pytest.mark.parametrize("fn, name", [
    (lambda x: torch.softmax(x, -1), "softmax"),
    (lambda x: x.softmax(-1), "softmax"),
    (nn.Softmax(-1), "softmax"),
    (lambda x: F.dropout(x, 0.1), "dropout"),
    (nn.AlphaDropout(0.1), "dropout"),
    (lambda x: x.transpose(-2, -1), "transpose"),
    (lambda x: torch.swapaxes(x, 0, 1), "transpose"),
    (lambda x: x.view(-1), "view"),
    (lambda x: x.reshape_as(x), "reshape"),
    (lambda x: x.float(), "to"),
    (lambda x: x + 1, "add"),
    (nn.ReLU6(), "hardtanh"),
    (nn.MaxPool2d(2), "max_pool"),
])
def test_every_form_names_the_same_op(fn, name):
    node, gm = one_call(fn)
    assert op_name(node, gm) == name and calls(node, name, gm=gm)


def test_aten_overloads_match_their_packet_and_listed_overloads_only_themselves():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    assert op_name(g.call_function(aten.relu.default, (x,))) == "relu"  # packet listed: any overload
    assert op_name(g.call_function(aten.to.dtype, (x, torch.float16))) == "to"
    assert op_name(g.call_function(aten.to.prim_dtype, (x, torch.float16))) is None  # not a listed overload


def test_a_module_that_overrides_forward_is_not_the_op_it_subclasses():
    class NotReally(nn.Dropout):
        def forward(self, x):
            return x * 2

    root = nn.Module()
    root.drop = NotReally()
    g = torch.fx.Graph()
    node = g.call_module("drop", (g.placeholder("x"),))
    gm = torch.fx.GraphModule(root, g)
    assert op_name(node, gm) is None and read_dropout(node, gm) is None
    root.drop = nn.Dropout()
    assert op_name(node, torch.fx.GraphModule(root, g)) == "dropout"


@pytest.mark.parametrize("fn, drops", [
    (lambda x: F.dropout(x, 0.1), True),  # F.dropout trains unless told not to
    (lambda x: F.alpha_dropout(x, 0.1), False),  # F.alpha_dropout does not
    (lambda x: F.feature_alpha_dropout(x, 0.1, True), True),
    (lambda x: torch.dropout(x, 0.1, False), False),
    (lambda x: F.dropout(x, 0.0), False),
])
def test_dropout_drops_as_torch_runs_it(fn, drops):
    node, _ = one_call(fn)
    assert read_dropout(node).drops is drops


def test_cleanup_removes_alpha_dropout_called_without_its_training_flag():
    model = nn.Sequential(nn.Linear(4, 4)).eval()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            return F.alpha_dropout(self.body(x), 0.3)

    net = Net().eval()
    x = torch.randn(2, 4)
    new = fxforge.rewrite(fxforge.capture(net, (x,), method="fx"), ["cleanup"])
    assert "dropout in eval removed" in [m.what for m in new.report.matches]
    torch.testing.assert_close(new.graph_module(x), net(x))


def test_metadata_reads_are_not_value_reads():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    assert reads_metadata(g.call_method("size", (x, 1)))
    assert reads_metadata(g.call_function(getattr, (x, "dtype")))
    assert not reads_metadata(g.call_method("sum", (x,)))


def test_every_listed_form_exists_in_this_torch():
    for name, forms in OPS.items():
        assert forms.functions or forms.methods or forms.modules, name
