"""The pattern engine: one pattern matches every call form, commutative operands, refusals with reasons."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from fxforge.rewrites.canonical import canonicalize
from fxforge.rewrites.conv_bn_fold import CONV_BN_FOLD
from fxforge.rewrites.pattern import Rule, rules_pass
from fxforge.rewrites.registry import BUILTIN, register


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def _rewrite(model, inputs, method, rewrites):
    cap = fxforge.capture(model, inputs, method=method)
    new = fxforge.rewrite(cap, rewrites)
    assert not new.report.rolled_back, new.report.rolled_back
    torch.testing.assert_close(new.graph_module(*inputs), model(*inputs))
    return new


# relu(x) -> clamp(x, min=0): a replacement the graph can be checked for afterwards.
RELU = Rule("relu", lambda x: F.relu(x), lambda x: torch.clamp(x, min=0))


class ReluForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.relu, self.relu_inplace = nn.ReLU(), nn.ReLU(inplace=True)

    def forward(self, a):
        outs = [self.relu(a * 1), self.relu_inplace(a * 2), F.relu(a * 3), F.relu(a * 4, inplace=True),
                torch.relu(a * 5), torch.relu_(a * 6), (a * 7).relu(), (a * 8).relu_(), F.relu_(a * 9)]
        return torch.stack(outs)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_every_call_form_of_relu_matches_one_pattern(method):
    new = _rewrite(ReluForms(), (torch.randn(4, 5),), method, [RELU])
    assert new.report.counts == {"relu": 9}
    assert not any("relu" in str(n.target).lower() for n in _calls(new.graph_module))


def test_canonical_names_of_call_forms():
    gm = torch.fx.symbolic_trace(ReluForms())
    names = {canonicalize(n, gm).name for n in _calls(gm) if "relu" in str(n.target).lower()}
    assert names == {"relu"}


# x + sigmoid(y) in either order, every form of add and sigmoid
ADD = Rule("add_sigmoid", lambda x, y: x + torch.sigmoid(y), lambda x, y: torch.addcmul(x, torch.sigmoid(y), 1.0 + y * 0))


class AddForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.sig = nn.Sigmoid()

    def forward(self, a, b):
        t = torch.sigmoid(b * 2)
        t += a
        outs = [a + torch.sigmoid(b), torch.sigmoid(b) + a, torch.add(b.sigmoid(), a), a.add(F.sigmoid(b)),
                self.sig(b) + a, (a * 1).add_(b.sigmoid()), t,
                torch.add(torch.sigmoid(b), a, alpha=2)]  # alpha=2: not x + sigmoid(y)
        return torch.stack(outs)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_add_matches_operands_in_either_order(method):
    new = _rewrite(AddForms(), (torch.randn(3, 4), torch.randn(3, 4)), method, [ADD])
    assert new.report.counts == {"add_sigmoid": 7}


def test_mul_is_commutative_and_swapped_bindings_are_right():
    rule = Rule("scale", lambda x, y: x * torch.tanh(y), lambda x, y: torch.tanh(y).mul(x).mul(1.0))
    class Net(nn.Module):
        def forward(self, a, b):
            return torch.tanh(b) * a - a.mul(b.tanh()) + torch.mul(torch.tanh(a), b)

    inputs = (torch.randn(5), torch.randn(5))
    new = _rewrite(Net(), inputs, "fx", [rule])
    assert new.report.counts == {"scale": 3}


class ConvBNForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.w = nn.Parameter(torch.randn(4, 4, 1, 1))
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("var", torch.rand(4) + 0.5)

    def forward(self, x):
        y = self.bn(self.conv(x))                                           # modules
        y = F.batch_norm(F.conv2d(y, self.w), self.mean, self.var, eps=1e-3)  # functionals, no bias
        return torch.batch_norm(torch.conv2d(y, self.w, None, 1, "same"), None, None, self.mean, self.var,
                                False, 0.1, 1e-5, False)                      # torch.*, padding="same"


@pytest.mark.parametrize("method", ["fx", "export"])
def test_conv_bn_in_every_form_matches_one_pattern(method):
    model = ConvBNForms().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_(), model.bn.running_var.uniform_(0.5, 2)
    new = _rewrite(model, (torch.randn(2, 3, 6, 6),), method, [CONV_BN_FOLD])
    assert new.report.counts == {"conv_bn_fold": 3}
    assert all(m.what == "conv2d + batch_norm" and "test_pattern.py" in m.source for m in new.report.matches)


class SharedIntermediate(nn.Module):
    def forward(self, x):
        s = torch.sigmoid(x)
        return x + s, s * 2


def test_match_refused_when_an_intermediate_is_used_outside():
    new = _rewrite(SharedIntermediate(), (torch.randn(3),), "fx", [ADD])
    assert new.report.counts == {}
    assert [n.reason for n in new.report.near_misses] == ["the value of sigmoid is also used outside the match (by mul)"]


# sum(relu(x), 0) -> sum(clamp(x, min=0), 0): the intermediate relu has another shape than the result.
RELU_SUM = Rule("relu_sum", lambda x: F.relu(x).sum(0), lambda x: torch.clamp(x, min=0).sum(0))
# relu(x) * 2 -> clamp(x, min=0) * 2: the intermediate relu has the result's shape.
RELU_TWICE = Rule("relu_twice", lambda x: F.relu(x) * 2, lambda x: torch.clamp(x, min=0) * 2)


class ShapeReadFirst(nn.Module):
    def forward(self, x):
        r = F.relu(x)
        rows = r.size(0)  # read before the result is computed
        return (r * 2).reshape(rows, -1) + r.shape[-1]


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_shape_read_of_an_intermediate_reads_the_replacement_instead(method):
    new = _rewrite(ShapeReadFirst(), (torch.randn(3, 4),), method, [RELU_TWICE])
    assert new.report.counts == {"relu_twice": 1}, new.report
    x = torch.randn(3, 4)
    torch.testing.assert_close(new.graph_module(x), ShapeReadFirst()(x))
    assert not any(n.target in (F.relu, torch.ops.aten.relu.default) for n in new.graph_module.graph.nodes)


class ShapeOfAnotherSize(nn.Module):
    def forward(self, x):
        r = F.relu(x)
        return r.sum(0) + r.size(0)


def test_a_shape_read_of_an_intermediate_of_another_shape_refuses():
    new = _rewrite(ShapeOfAnotherSize(), (torch.randn(3, 4),), "fx", [RELU_SUM])
    assert new.report.counts == {}
    assert [n.reason for n in new.report.near_misses] == ["the value of relu is also used outside the match (by size)"]


def test_in_place_change_of_an_input_is_not_dropped():
    class Net(nn.Module):
        def forward(self, x):
            F.relu(x, inplace=True)  # changes the caller's tensor: replacing it out of place would be wrong
            return x * 2

    cap = fxforge.capture(Net(), (torch.randn(3),), method="fx")
    new = fxforge.rewrite(cap, [RELU])
    assert new.report.counts == {}
    assert "changes x in place" in new.report.near_misses[0].reason


def test_check_refuses_with_its_reason():
    rule = Rule("never", lambda x: torch.tanh(x), lambda x: x, check=lambda m: f"{m['x'].op} is special")
    new = _rewrite(nn.Tanh(), (torch.randn(3),), "fx", [rule])
    assert new.report.counts == {}
    assert new.report.near_misses[0].reason == "placeholder is special"


def test_rules_pass_and_register_select_by_name():
    both = rules_pass("both", [RELU, ADD])
    new = _rewrite(AddForms(), (torch.randn(3, 4), torch.randn(3, 4)), "fx", [both])
    assert new.report.counts == {"both": 7}
    register(RELU)
    try:
        assert fxforge.rewrite(fxforge.capture(nn.ReLU(), (torch.randn(2),)), ["relu"]).report.counts == {"relu": 1}
    finally:
        del BUILTIN["relu"]


class Swish(nn.Module):
    def forward(self, x):
        y = 2 * x
        return x * torch.sigmoid(x) + torch.sigmoid(y) * y


def test_readme_user_rule():
    model, x = Swish(), torch.randn(8)
    # --- README snippet starts ---
    from fxforge.rewrites.pattern import Rule

    def pattern(x):
        return x * torch.sigmoid(x)  # also matches sigmoid(x) * x, x.mul(x.sigmoid()), aten.mul...

    def replacement(x):
        return F.silu(x)

    silu = Rule("silu", pattern, replacement)
    new = fxforge.rewrite(fxforge.capture(model, (x,)), ["default", silu])
    print(new.report.counts["silu"])  # 2
    # --- README snippet ends ---
    assert new.report.counts["silu"] == 2 and set(new.report.counts) <= {"silu", "memory_reorder"}
    torch.testing.assert_close(new.graph_module(x), model(x))
    assert [n.target for n in _calls(new.graph_module)].count(F.silu) == 2
    assert all("test_pattern.py" in m.source for m in new.report.matches)
