"""conv_bn_fold: counts and numerics against eager for every form, refusals with reasons, training intact."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from examples.models import EXAMPLES
from examples.models._common import perturb_norm_stats
from fxforge.rewrites.canonical import canonicalize

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def _fold(model, inputs, method):
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cap = fxforge.capture(model, inputs, method=method)
    new = fxforge.rewrite(cap, ["cleanup", "conv_bn_fold"])
    assert not new.report.rolled_back, new.report.rolled_back
    with torch.no_grad():
        torch.testing.assert_close(new.graph_module(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    for key, value in model.state_dict().items():  # the model's own tensors are untouched
        assert torch.equal(value, snapshot[key]), key
    return new


def _batch_norms(gm):
    return [n for n in gm.graph.nodes if (op := canonicalize(n, gm)) is not None and op.name == "batch_norm"]


def _conv_bn_pairs(gm):
    """conv -> BN edges in a graph, counted independently of the rewrite."""
    pairs = 0
    for node in _batch_norms(gm):
        source = canonicalize(node, gm).args["input"]
        pairs += canonicalize(source, gm).name in ("conv1d", "conv2d", "conv3d")
    return pairs


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_module_forms_fold(dims, bias, method):
    model = perturb_norm_stats(nn.Sequential(CONV[dims](3, 5, 3, stride=2, padding=1, bias=bias), BN[dims](5),
                                             nn.ReLU())).eval()
    x = torch.randn(2, 3, *[7] * dims)
    new = _fold(model, (x,), method)
    assert new.report.counts == {"conv_bn_fold": 1}
    assert not _batch_norms(new.graph_module)
    assert new.report.matches[0].what == f"conv{dims}d + batch_norm"


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(6, 3, 3, 3)), nn.Parameter(torch.randn(6))
        self.w2 = nn.Parameter(torch.randn(6, 2, 1, 1))
        self.w3 = nn.Parameter(torch.randn(4, 6, 3))
        self.gamma, self.beta = nn.Parameter(torch.rand(6) + 0.5), nn.Parameter(torch.randn(6))
        for name, size in (("m6", 6), ("v6", 6), ("m4", 4), ("v4", 4)):
            self.register_buffer(name, torch.rand(size) + (0.5 if name[0] == "v" else -0.5))

    def forward(self, x):
        y = F.conv2d(x, self.w1, self.b1, stride=2, padding=1)
        y = F.batch_norm(y, self.m6, self.v6, self.gamma, self.beta, False, 0.1, 1e-3)
        y = torch.conv2d(y, self.w2, None, 1, 0, 1, 3)  # grouped, no bias
        y = F.batch_norm(y, self.m6, self.v6, None, self.beta, eps=1e-5)  # no affine weight
        y = F.conv1d(y.flatten(2), self.w3, padding="same")
        return F.batch_norm(y, self.m4, self.v4)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_functional_forms_fold(method):
    new = _fold(Functional().eval(), (torch.randn(2, 3, 8, 8),), method)
    assert new.report.counts == {"conv_bn_fold": 3}
    assert not _batch_norms(new.graph_module)


EXPECTED = {"resnet_cnn": 9, "densenet": 6, "inception": 20, "unet": 10}


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_models_fold_every_conv_bn_pair(name, method):
    model, inputs = EXAMPLES[name]()
    pairs = _conv_bn_pairs(fxforge.capture(model, inputs, method=method).graph_module)
    assert pairs == EXPECTED[name]  # DenseNet's BN-ReLU-Conv layers are not conv -> BN
    new = _fold(model, inputs, method)
    assert new.report.counts["conv_bn_fold"] == EXPECTED[name]
    assert _conv_bn_pairs(new.graph_module) == 0
    bns = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert len(_batch_norms(new.graph_module)) == bns - EXPECTED[name]


@pytest.mark.parametrize("method", ["fx", "export"])
def test_training_mode_refuses_and_matches_eager(method):
    model, inputs = EXAMPLES["resnet_cnn"]()
    model.train()
    eager = copy.deepcopy(model)
    new = fxforge.rewrite(fxforge.capture(model, inputs, method=method), ["cleanup", "conv_bn_fold"])
    assert "conv_bn_fold" not in new.report.counts
    reasons = {n.reason for n in new.report.near_misses if n.rule == "conv_bn_fold"}
    assert reasons == {"BatchNorm uses batch statistics in training mode; folding needs eval mode"}
    out, ref = new.graph_module(*inputs), eager(*inputs)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, rtol=0, atol=0, msg=name)


class ConvUsedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


@pytest.mark.parametrize("method", ["fx", "export"])
def test_conv_output_used_elsewhere_refuses(method):
    new = _fold(ConvUsedTwice().eval(), (torch.randn(1, 3, 6, 6),), method)
    assert "conv_bn_fold" not in new.report.counts
    conv = "conv" if method == "fx" else "conv2d"
    assert [n.reason for n in new.report.near_misses] == [f"the value of {conv} is also used outside the match (by add)"]


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's form: the input's rank and size are read before it is normalised, then an activation."""

    def forward(self, x):
        torch._assert(x.ndim == 4, "expected 4D input")
        rows = x.size(0)
        y = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return F.relu(y).reshape(rows, -1, x.shape[2], x.shape[3])


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_read_of_the_conv_output_shape_is_not_a_use(method):
    torch.manual_seed(0)
    model = perturb_norm_stats(nn.Sequential(nn.Conv2d(3, 8, 3), BatchNormAct2d(8), nn.Conv2d(8, 4, 3),
                                             BatchNormAct2d(4))).eval()
    new = _fold(model, (torch.randn(2, 3, 12, 12),), method)
    assert new.report.counts.get("conv_bn_fold") == 2, new.report
    assert not _batch_norms(new.graph_module)
    with torch.no_grad():  # fresh inputs, and (fx) the shape reads now read the folded convolution's output
        x = torch.randn(2, 3, 12, 12)
        torch.testing.assert_close(new.graph_module(x), model(x), rtol=1e-4, atol=1e-5)


class ConvShapeThenValue(ConvUsedTwice):
    def forward(self, x):
        y = self.conv(x)
        return self.bn(y).flatten(1) * y.size(1) + y.mean()  # a shape read, and a use of the value


def test_a_value_use_beside_a_shape_read_still_refuses():
    new = _fold(perturb_norm_stats(ConvShapeThenValue()).eval(), (torch.randn(1, 3, 6, 6),), "fx")
    assert "conv_bn_fold" not in new.report.counts
    assert [n.reason for n in new.report.near_misses] == ["the value of conv is also used outside the match (by size, mean)"]


def test_no_running_stats_refuses():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)).eval()
    new = _fold(model, (torch.randn(2, 3, 6, 6),), "fx")
    assert "conv_bn_fold" not in new.report.counts
    assert new.report.near_misses[0].reason == "BatchNorm has no running statistics (track_running_stats=False)"


def test_other_convolutions_are_left_alone():
    model = perturb_norm_stats(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(4),
                                             nn.ConvTranspose2d(4, 4, 2), nn.BatchNorm2d(4))).eval()
    new = _fold(model, (torch.randn(1, 3, 6, 6),), "fx")
    assert "conv_bn_fold" not in new.report.counts


def test_in_default_after_cleanup():
    from fxforge.rewrites.registry import DEFAULT

    assert DEFAULT.index("conv_bn_fold") == DEFAULT.index("cleanup") + 1


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_decomposed_aten_forms_fold(dims):
    """aten.convolution + aten._native_batch_norm_legit_no_training (+ getitem), as run_decompositions writes."""
    from fxforge.rewrites.conv_bn_fold import CONV_BN_FOLD
    from fxforge.rewrites.passes import PassContext

    model = perturb_norm_stats(nn.Sequential(CONV[dims](3, 4, 3), BN[dims](4), nn.ReLU())).eval()
    x = torch.randn(2, 3, *[6] * dims)
    gm = torch.export.export(model, (x,)).run_decompositions().module()
    assert any("_native_batch_norm_legit_no_training" in str(n.target) for n in gm.graph.nodes)
    ctx = PassContext("conv_bn_fold", training=False, method="export")
    CONV_BN_FOLD.apply(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    assert [m.what for m in ctx.matches] == [f"conv{dims}d + batch_norm"]
    assert not any("batch_norm" in str(n.target) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-5)


def _folded_constants(gm):
    from fxforge.core.verify import CONSTANT_BUFFER_PREFIX

    return [t for name, t in gm.named_buffers() if name.startswith(CONSTANT_BUFFER_PREFIX)]


def test_folded_weights_are_the_float64_computation_rounded_once():
    conv, bn = nn.Conv2d(3, 8, 3, bias=True), perturb_norm_stats(nn.BatchNorm2d(8))
    model = nn.Sequential(conv, bn).eval()
    new = fxforge.rewrite(fxforge.capture(model, (torch.randn(1, 3, 8, 8),)), ["conv_bn_fold"])
    scale = bn.weight.double() * torch.rsqrt(bn.running_var.double() + bn.eps)
    weight = (conv.weight.double() * scale.reshape(-1, 1, 1, 1)).float()
    shift = ((conv.bias.double() - bn.running_mean.double()) * scale + bn.bias.double()).float()
    folded = _folded_constants(new.graph_module)
    assert any(torch.equal(t, weight) for t in folded) and any(torch.equal(t, shift) for t in folded)
    assert all(t.dtype == torch.float32 for t in folded)



class LinearBN(nn.Module):
    """The ways users put a BatchNorm1d after a linear layer: on [N, C], on a flattened [B, L, C] (LeViT's
    MLPLayerWithBN, reshaped back), and functionally without affine weights."""

    def __init__(self):
        super().__init__()
        self.head, self.head_bn = nn.Linear(8, 6), nn.BatchNorm1d(6)
        self.proj, self.proj_bn = nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8)
        self.mlp, self.mlp_bn = nn.Linear(8, 4), nn.BatchNorm1d(4, affine=False)

    def forward(self, x):  # x: [B, L, 8]
        y = self.proj(x)
        y = self.proj_bn(y.flatten(0, 1)).reshape_as(y)
        z = F.batch_norm(torch.flatten(self.mlp(y), 0, 1), self.mlp_bn.running_mean, self.mlp_bn.running_var)
        return torch.relu(self.head_bn(self.head(y.mean(1)))), z


@pytest.mark.parametrize("method", ["fx", "export"])
def test_linear_then_batch_norm_folds_in_every_form(method):
    model = perturb_norm_stats(LinearBN()).eval()
    new = _fold(model, (torch.randn(3, 5, 8),), method)
    assert new.report.counts == {"conv_bn_fold": 3}
    assert not _batch_norms(new.graph_module)
    assert sorted(m.what for m in new.report.matches) == [
        "linear + batch_norm", "linear + flatten + batch_norm", "linear + flatten + batch_norm + reshape_as"]


def test_a_batch_norm_over_another_dim_of_a_linear_output_is_refused():
    class Tokens(nn.Module):  # BatchNorm1d on [B, L, C] normalizes the L tokens, not the linear's features
        def __init__(self):
            super().__init__()
            self.linear, self.bn = nn.Linear(8, 5), nn.BatchNorm1d(5)

        def forward(self, x):
            return self.bn(self.linear(x))

    model = perturb_norm_stats(Tokens()).eval()
    new = _fold(model, (torch.randn(3, 5, 8),), "fx")
    assert new.report.counts == {}
    assert any("normalizes dim 1 of a (3, 5, 5) value, not the linear layer's 5 features" in m.reason
               for m in new.report.near_misses)
