"""binary_fold: conv/linear followed by * / + - a constant folds into the weights, for every call form of the
layer and the op and every operand form; counts and outputs against eager (fresh inputs, channels-last), refusals
with their reasons, the BatchNorm orders, and folded weights that follow the model's tensors after optimize."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from examples.models._common import perturb_norm_stats
from fxforge.core.plan import CallConditions
from fxforge.rewrites.binary_fold import BINARY_OPS, LAYERS
from fxforge.rewrites.canonical import canonicalize

C = 4
REWRITES = ["cleanup", "conv_bn_fold", "binary_fold"]
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
FUNCTIONAL = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _ops_after_layers(gm: torch.fx.GraphModule) -> list[str]:
    """The binary ops left right after a convolution or linear layer, counted independently of the rewrite."""
    found = []
    for node in gm.graph.nodes:
        op = canonicalize(node, gm) if node.op.startswith("call") else None
        if op is not None and op.name in BINARY_OPS:
            operands = [op.args["input"], op.args["other"]]
            if any(isinstance(v, torch.fx.Node) and (o := canonicalize(v, gm)) is not None and o.name in LAYERS
                   for v in operands):
                found.append(node.name)
    return found


def _rewrite(model, inputs, method="fx", rewrites=REWRITES, **kwargs):
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    new = fxforge.rewrite(fxforge.capture(model, inputs, method=method), rewrites, **kwargs)
    assert not new.report.rolled_back, new.report.rolled_back
    for key, value in model.state_dict().items():  # the model's own tensors are untouched
        torch.testing.assert_close(value, snapshot[key], rtol=0, atol=0, equal_nan=True, msg=key)
    return new


def _same_as_eager(gm, model, *inputs):
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=1e-4, atol=1e-5, equal_nan=True)


def _reasons(new, rule="binary_fold"):
    return [m.reason for m in new.report.near_misses if m.rule == rule]


# ---------------------------------------------------------------------------------------------- every form

# The op after the layer, in each of its call forms: (op, written, fn(y, c)).
OP_FORMS = [
    ("mul", "y * c", lambda y, c: y * c), ("mul", "c * y", lambda y, c: c * y),
    ("mul", "torch.mul", lambda y, c: torch.mul(y, c)), ("mul", "y.mul", lambda y, c: y.mul(c)),
    ("mul", "y.mul_", lambda y, c: y.mul_(c)),
    ("div", "y / c", lambda y, c: y / c), ("div", "torch.div", lambda y, c: torch.div(y, c)),
    ("div", "y.div", lambda y, c: y.div(c)), ("div", "y.div_", lambda y, c: y.div_(c)),
    ("add", "y + c", lambda y, c: y + c), ("add", "c + y", lambda y, c: c + y),
    ("add", "torch.add", lambda y, c: torch.add(y, c)), ("add", "y.add", lambda y, c: y.add(c)),
    ("add", "y.add_", lambda y, c: y.add_(c)),
    ("sub", "y - c", lambda y, c: y - c), ("sub", "torch.sub", lambda y, c: torch.sub(y, c)),
    ("sub", "y.sub", lambda y, c: y.sub(c)), ("sub", "y.sub_", lambda y, c: y.sub_(c)),
    ("rsub", "c - y", lambda y, c: c - y), ("rsub", "torch.rsub", lambda y, c: torch.rsub(y, c)),
]


def _channels(rank: int, linear: bool) -> list[int]:
    """A per-channel shape's dims: the channel count where the output's channels are, 1 elsewhere."""
    return [C] if linear else [C] + [1] * (rank - 2)


# Operand forms: (name, make(rank, linear) -> tensor to register or None, get(module, name, y) -> operand).
OPERANDS = [
    ("float", None, lambda m, k, y: 0.75),
    ("int", None, lambda m, k, y: 3),
    ("0-d tensor", None, lambda m, k, y: torch.tensor(1.5)),
    ("buffer [1, C, 1...]", lambda r, lin: torch.rand([1] * (r - len(_channels(r, lin))) + _channels(r, lin)) + 0.5,
     lambda m, k, y: getattr(m, k)),
    ("buffer [C, 1...]", lambda r, lin: torch.rand(_channels(r, lin)) + 0.5, lambda m, k, y: getattr(m, k)),
    ("buffer [1]", lambda r, lin: torch.rand(1) + 0.5, lambda m, k, y: getattr(m, k)),
    ("parameter [C] reshaped", lambda r, lin: nn.Parameter(torch.rand(C) + 0.5),
     lambda m, k, y: getattr(m, k).reshape(_channels(m.rank, m.linear))),
    ("torch.ones(y.size())", None, lambda m, k, y: torch.ones(y.size())),
    ("torch.full_like(y, 2.0)", None, lambda m, k, y: torch.full_like(y, 2.0)),
]
# Every call form of every op with every operand form.
CASES = [(form, operand) for form in OP_FORMS for operand in OPERANDS]


class Branches(nn.Module):
    """One layer per case (with and without bias in turn), each followed by its case's op and operand."""

    def __init__(self, layer: str, functional: bool):
        super().__init__()
        self.linear, self.functional = layer == "linear", functional
        dims = 0 if self.linear else int(layer[4])
        self.dims = dims
        self.rank = rank = 3 if self.linear else dims + 2
        self.layers = nn.ModuleList(nn.Linear(5, C, bias=i % 2 == 0) if self.linear else
                                    CONV[dims](3, C, 3, padding=1, bias=i % 2 == 0) for i in range(len(CASES)))
        for i, (_, (_, make, _)) in enumerate(CASES):
            if make is not None:
                value = make(rank, self.linear)
                if isinstance(value, nn.Parameter):
                    self.register_parameter(f"c{i}", value)
                else:
                    self.register_buffer(f"c{i}", value)

    def forward(self, x):
        outputs = []
        for i, ((_, _, op), (_, _, get)) in enumerate(CASES):
            layer = self.layers[i]
            if not self.functional:
                y = layer(x)
            elif self.linear:
                y = F.linear(x, layer.weight, layer.bias)
            else:
                y = FUNCTIONAL[self.dims](x, layer.weight, layer.bias, padding=1)
            outputs.append(op(y, get(self, f"c{i}", y)))
        return tuple(outputs)


INPUTS = {"conv1d": (2, 3, 7), "conv2d": (2, 3, 5, 5), "conv3d": (2, 3, 3, 4, 4), "linear": (2, 3, 5)}


def _other_layouts(layer: str, x: torch.Tensor) -> list[torch.Tensor]:
    """A fresh input of the same shape, and one laid out otherwise (channels-last where the rank has one)."""
    fresh = torch.randn_like(x)
    if layer == "conv2d":
        return [fresh, fresh.to(memory_format=torch.channels_last)]
    if layer == "conv3d":
        return [fresh, fresh.to(memory_format=torch.channels_last_3d)]
    return [fresh, fresh.transpose(-1, -2).contiguous().transpose(-1, -2)]  # strides of a transposed tensor


# nn.ConvNd / nn.Linear and F.convNd / F.linear as traced, and ATen's ops as exported (one form for both).
LAYER_FORMS = [(False, "fx"), (True, "fx"), (False, "export")]


@pytest.mark.parametrize("functional, method", LAYER_FORMS, ids=["module", "functional", "aten"])
@pytest.mark.parametrize("layer", ["conv1d", "conv2d", "conv3d", "linear"])
def test_every_op_form_and_operand_form_folds(layer, functional, method):
    torch.manual_seed(0)
    model = Branches(layer, functional).eval()
    x = torch.randn(INPUTS[layer])
    new = _rewrite(model, (x,), method)
    assert new.report.counts.get("binary_fold") == len(CASES), new.report
    assert set(new.report.counts) <= {"cleanup", "binary_fold"}
    assert _ops_after_layers(new.graph_module) == []
    assert _reasons(new) == []
    whats = {m.what for m in new.report.matches if m.rule == "binary_fold"}
    assert whats == {f"{layer} {s} c" for s in "*/+-"} | {f"c - {layer}"}
    for fresh in _other_layouts(layer, x):
        _same_as_eager(new.graph_module, model, fresh)


# ---------------------------------------------------------------------------------------------- refusals


class Op(nn.Module):
    """A conv2d (or linear) layer and one op after it, written as ``fn(module, y, x)``; tensors as given."""

    def __init__(self, fn, linear=False, **tensors):
        super().__init__()
        self.layer = nn.Linear(5, C) if linear else nn.Conv2d(3, C, 3)
        self.fn = fn
        for name, value in tensors.items():
            if isinstance(value, nn.Parameter):
                self.register_parameter(name, value)
            else:
                self.register_buffer(name, value)

    def forward(self, x):
        return self.fn(self, self.layer(x), x)


X = torch.randn(2, 3, 6, 6)


def _refused(fn, reason, inputs=(X,), method="fx", **tensors):
    """The op after the layer is left alone, with ``reason``, and the graph still computes eager's outputs."""
    torch.manual_seed(0)
    model = Op(fn, **tensors).eval()
    new = _rewrite(model, inputs, method)
    assert "binary_fold" not in new.report.counts
    assert _reasons(new) == [reason]
    _same_as_eager(new.graph_module, model, *inputs)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_an_operand_computed_at_run_time_refuses(method):
    _refused(lambda m, y, x: y * x.mean(), "the operand mean is computed at run time, not from parameters and "
             "constants alone", method=method)
    _refused(lambda m, y, x: y + x[:, :1, :1, :1] * m.t, "the operand mul is computed at run time (from x), not from "
             "parameters and constants alone", method=method, t=torch.rand(1, C, 1, 1))


def test_a_second_input_as_operand_refuses():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, C, 3)

        def forward(self, x, scale):
            return self.conv(x) * scale

    model, inputs = TwoInputs().eval(), (X, torch.rand(1, C, 1, 1))
    new = _rewrite(model, inputs)
    assert _reasons(new) == ["the operand scale is computed at run time, not from parameters and constants alone"]
    _same_as_eager(new.graph_module, model, *inputs)


def test_a_run_time_value_of_the_outputs_shape_is_no_near_miss():
    """A residual branch (``conv(x) + x``) is nowhere near a constant: no near miss in the report."""
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x):
            return self.conv(x) + x * 2

    new = _rewrite(Residual().eval(), (X,))
    assert _reasons(new) == [] and "binary_fold" not in new.report.counts


@pytest.mark.parametrize("shape, dim, kind", [((2, 1, 1, 1), 0, "a batch dim"), ((1, 1, 4, 1), 2, "a spatial dim"),
                                              ((4,), 3, "a spatial dim"), ((C, 4), 2, "a spatial dim")])
def test_an_operand_along_the_batch_or_spatial_dims_refuses(shape, dim, kind):
    _refused(lambda m, y, x: y * m.t, f"the operand t of shape {shape} has size {shape[dim - 4]} along dim {dim} of "
             f"the output ({kind}): only an operand of size 1 there (one that varies along the channels, dim 1) folds",
             t=torch.rand(shape) + 0.5)


@pytest.mark.parametrize("shape", [(C, 1, 1, 1, 1), (1, 1, 1, 1, 1)])
def test_a_broadcast_that_changes_the_output_shape_refuses(shape):
    out = torch.broadcast_shapes((2, C, 4, 4), shape)
    _refused(lambda m, y, x: y + m.t, f"broadcasting the operand t of shape {shape} changes the output's shape from "
             f"(2, {C}, 4, 4) to {tuple(out)}", t=torch.rand(shape))


def test_a_broadcast_that_changes_the_dtype_refuses():
    _refused(lambda m, y, x: y * m.t, "broadcasting with the operand t changes the output's dtype from torch.float32 "
             "to torch.float64", t=torch.rand(1, C, 1, 1, dtype=torch.float64))


def test_an_integer_operand_refuses():
    _refused(lambda m, y, x: y + m.t, "the operand t is a torch.int32 tensor: only floating-point operands fold",
             t=torch.tensor([2], dtype=torch.int32))


@pytest.mark.parametrize("fn", [lambda m, y, x: y / m.t, lambda m, y, x: y / 0.0])
def test_division_by_a_constant_holding_zero_refuses(fn):
    _refused(fn, "divides by a constant that contains 0", t=torch.tensor([[[[1.0]], [[0.0]], [[2.0]], [[3.0]]]]))


@pytest.mark.parametrize("fn", [lambda m, y, x: y * float("inf"), lambda m, y, x: y / m.t])
def test_scaling_by_inf_or_nan_refuses(fn):
    _refused(fn, "the operand holds inf or NaN: folded into the weights it would not give eager's result",
             t=torch.tensor([1.0, float("nan"), 1.0, 1.0]).reshape(1, C, 1, 1))


def test_dividing_by_a_scalar_by_the_layer_output_refuses():
    _refused(lambda m, y, x: 2.0 / y, "c / conv2d divides by the convolution's output: no change of its weights "
             "computes that")


@pytest.mark.parametrize("method", ["fx", "export"])
def test_dividing_a_tensor_by_the_layer_output_refuses(method):
    _refused(lambda m, y, x: m.t / y, "c / conv2d divides by the convolution's output: no change of its weights "
             "computes that", method=method, t=torch.rand(1, C, 1, 1) + 0.5)
    torch.manual_seed(0)
    model = Op(lambda m, y, x: m.t / y, linear=True, t=torch.rand(C) + 0.5).eval()
    new = _rewrite(model, (torch.randn(2, 5),), method)
    assert _reasons(new) == ["c / linear divides by the linear layer's output: no change of its weights computes that"]


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_layer_output_used_elsewhere_refuses(method):
    conv = "layer" if method == "fx" else "conv2d"
    _refused(lambda m, y, x: y * 2.0 + y, f"the value of {conv} is also used outside the match (by add)",
             method=method)


def test_weights_computed_at_run_time_refuse():
    class Standardized(nn.Conv2d):
        def forward(self, x):
            return F.conv2d(x, self.weight - self.weight.mean(), self.bias) * 2.0

    model = Standardized(3, C, 3).eval()
    new = _rewrite(model, (X,))
    assert _reasons(new) == ["the convolution's weight is computed at run time, not a parameter or buffer"]
    _same_as_eager(new.graph_module, model, X)


def test_a_shape_built_operand_used_elsewhere_refuses():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, C, 3)

        def forward(self, x):
            y = self.conv(x)
            ones = torch.ones(y.size())
            return y + ones, ones

    model = Twice().eval()
    new = _rewrite(model, (X,))
    assert _reasons(new) == [("the operand ones is built from shapes alone and also used outside the match (by "
                             "output)")]
    _same_as_eager(new.graph_module, model, X)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_training_mode_refuses_and_keeps_eager_gradients(method):
    torch.manual_seed(0)
    model = Op(lambda m, y, x: m.gamma.reshape(1, C, 1, 1) * y + 1.0, gamma=nn.Parameter(torch.rand(C))).train()
    eager = copy.deepcopy(model)
    new = _rewrite(model, (X,), method)
    assert "binary_fold" not in new.report.counts
    assert set(_reasons(new)) == {"folds parameters into constants, which would stop their gradients in training mode"}
    out, ref = new.graph_module(X), eager(X)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_calls_that_record_gradients_refuse():
    model = Op(lambda m, y, x: torch.ones(y.size()) + y * m.t, t=torch.rand(1, C, 1, 1)).eval()  # one op after y
    new = _rewrite(model, (X,), conditions=CallConditions(gradients=True))
    assert "binary_fold" not in new.report.counts
    assert _reasons(new) == [("folds parameters into constants, which would stop their gradients: "
                             f"{CallConditions.FOR_GRADIENTS}")]
    _same_as_eager(new.graph_module, model, X)


def test_dynamic_sizes_fold_where_the_value_does_not_depend_on_them():
    """``ones(y.size())`` and ``full(y.shape, 2.0)`` are one number at every batch size; ``y.size(0)`` is not."""
    from fxforge.capture.dynamic import capture_dynamic

    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(nn.Conv2d(3, C, 3) for _ in range(3))

        def forward(self, x):
            y, z, w = (conv(x) for conv in self.convs)
            return y + torch.ones(y.size()), z * torch.full(z.shape, 2.0), w * w.size(0)

    model = Three().eval()
    new = fxforge.rewrite(capture_dynamic(model, (X,), {}), ["binary_fold"])
    assert new.report.counts == {"binary_fold": 2}
    assert _reasons(new) == ["the operand sym_size_int_1 depends on a dynamic size of x"]
    for batch in (1, 5):
        _same_as_eager(new.graph_module, model, torch.randn(batch, 3, 6, 6))


# ---------------------------------------------------------------------------------------------- with BatchNorm


class ConvChain(nn.Module):
    """conv -> ops, each ``"bn"`` (eval BatchNorm), ``"*"`` (a per-channel buffer), ``"+"`` (a number)."""

    def __init__(self, dims: int, ops: str):
        super().__init__()
        self.dims, self.ops = dims, ops
        self.conv = CONV[dims](3, C, 3, bias=False)
        self.bns = nn.ModuleList(perturb_norm_stats(BN[dims](C)) for op in ops if op == "b")
        self.register_buffer("scale", torch.rand([1, C] + [1] * dims) + 0.5)

    def forward(self, x):
        y, bns = self.conv(x), iter(self.bns)
        for op in self.ops:
            y = next(bns)(y) if op == "b" else y * self.scale if op == "*" else y + 0.5
        return y


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("ops, counts", [
    ("b*", {"conv_bn_fold": 1, "binary_fold": 1}),  # BatchNorm first: conv_bn_fold, then this pass
    ("*b", {"binary_fold": 1, "conv_bn_fold": 1}),  # BatchNorm after the op: this pass folds it after its fold
    ("b*+b*", {"conv_bn_fold": 2, "binary_fold": 3}),
])
def test_batch_norm_before_or_after_the_op_folds_fully(dims, ops, counts, method):
    torch.manual_seed(0)
    model = ConvChain(dims, ops).eval()
    x = torch.randn(2, 3, *[6] * dims)
    new = _rewrite(model, (x,), method)
    assert new.report.counts == counts
    calls = [n.op for n in new.graph_module.graph.nodes if n.op != "get_attr"]
    assert calls == ["placeholder", "call_function", "output"]  # one convolution
    _same_as_eager(new.graph_module, model, torch.randn_like(x))


def test_a_batch_norm_the_pass_reaches_that_cannot_fold_says_why():
    torch.manual_seed(0)
    model = nn.Sequential(ConvChain(2, "*")).eval()
    model.append(nn.BatchNorm2d(C, track_running_stats=False))
    new = _rewrite(model, (X,))
    assert new.report.counts == {"binary_fold": 1}
    assert _reasons(new, "conv_bn_fold") == ["BatchNorm has no running statistics (track_running_stats=False)"]
    _same_as_eager(new.graph_module, model, X)


def _folded(gm):
    from fxforge.core.verify import CONSTANT_BUFFER_PREFIX

    return {name: t for name, t in gm.named_buffers() if name.startswith(CONSTANT_BUFFER_PREFIX)}


def test_folded_weights_are_the_float64_computation_rounded_once_and_only_those_read_stay():
    torch.manual_seed(0)
    model = ConvChain(2, "*+*").eval()
    new = _rewrite(model, (X,))
    w, s = model.conv.weight.double(), model.scale.double().reshape(C, 1, 1, 1)
    folded = _folded(new.graph_module)
    assert len(folded) == 2 and set(new.graph_module.meta["fxforge_folds"]) == set(folded)  # weight and bias
    weight, bias = sorted(folded.values(), key=lambda t: t.dim(), reverse=True)
    assert torch.equal(weight, ((w * s).float().double() * s).float())  # each fold rounds once
    assert torch.equal(bias, (0.5 * model.scale.double().reshape(C)).float())
    for name, recipe in new.graph_module.meta["fxforge_folds"].items():  # computed again from the model's tensors
        assert all(any(s is t for t in (model.conv.weight, model.scale)) for s in recipe.sources)
        assert torch.equal(recipe.compute(), folded[name])  # the same value, rounded where each fold rounded


# ---------------------------------------------------------------------------------------------- end to end


class LayerScaleBlock(nn.Module):
    """A ResNet-style block whose branch ends in a per-channel layer scale, ``x + gamma[:, None, None] * conv(x)``
    (ConvNeXt's form)."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), perturb_norm_stats(nn.BatchNorm2d(c))
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.gamma = nn.Parameter(torch.rand(c) + 0.1)

    def forward(self, x):
        y = self.conv2(torch.relu(self.bn1(self.conv1(x))))
        return torch.relu(x + self.gamma[:, None, None] * y)


class InvertedResidual(nn.Module):
    """A MobileNetV2-style block: expand (scaled, then BatchNorm), depthwise, project (BatchNorm, then a per-channel
    residual scale)."""

    def __init__(self, c: int = 8, expand: int = 2):
        super().__init__()
        hidden = c * expand
        self.expand = nn.Conv2d(c, hidden, 1, bias=False)
        self.register_buffer("alpha", torch.rand(1, hidden, 1, 1) + 0.5)
        self.bn1 = perturb_norm_stats(nn.BatchNorm2d(hidden))
        self.dw = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False)
        self.bn2 = perturb_norm_stats(nn.BatchNorm2d(hidden))
        self.project, self.bn3 = nn.Conv2d(hidden, c, 1, bias=False), perturb_norm_stats(nn.BatchNorm2d(c))
        self.res_scale = nn.Parameter(torch.full((c,), 0.5))

    def forward(self, x):
        y = F.relu6(self.bn1(self.expand(x) * self.alpha))
        y = F.relu6(self.bn2(self.dw(y)))
        return x + self.bn3(self.project(y)) * self.res_scale.view(1, -1, 1, 1)


def _optimized(model, x):
    from fxforge.lowering.autotune import TuningPolicy

    opt = fxforge.optimize(model, (x,), tuning=TuningPolicy(keep="fused"))  # fused kernels on prepacked weights
    with torch.no_grad():
        for fresh in (torch.randn_like(x), torch.randn_like(x).to(memory_format=torch.channels_last)):
            torch.testing.assert_close(opt(fresh), model(fresh), rtol=1e-4, atol=1e-5)
    return opt


def _still_eager(opt, model, x):
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_optimize_a_resnet_block_with_a_layer_scale_and_edits_after_it():
    torch.manual_seed(0)
    model, x = LayerScaleBlock().eval(), torch.randn(2, 8, 10, 10)
    opt = _optimized(model, x)
    assert opt.report.counts["conv_bn_fold"] == 1 and opt.report.counts["binary_fold"] == 1
    assert [m.what for m in opt.report.matches if m.rule == "binary_fold"] == ["conv2d * c"]
    with torch.no_grad():
        model.conv2.weight.mul_(1.5)  # the conv weight in place
    _still_eager(opt, model, x)
    with torch.no_grad():
        model.gamma.data.mul_(-2.0)  # the multiplier, bypassing the version counter
    _still_eager(opt, model, x)
    with torch.no_grad():
        model.conv2.bias.add_(0.25)
    _still_eager(opt, model, x)


def test_optimize_a_mobilenet_block_and_edits_after_it():
    torch.manual_seed(0)
    model, x = InvertedResidual().eval(), torch.randn(2, 8, 10, 10)
    opt = _optimized(model, x)
    assert opt.report.counts["conv_bn_fold"] == 3 and opt.report.counts["binary_fold"] == 2
    assert not [m for m in opt.report.near_misses if m.rule in ("binary_fold", "conv_bn_fold")]
    with torch.no_grad():
        model.expand.weight.mul_(1.5)  # under a fold, then a BatchNorm folded after it
    _still_eager(opt, model, x)
    with torch.no_grad():
        model.alpha.add_(0.3)  # the multiplier buffer in place
    _still_eager(opt, model, x)
    with torch.no_grad():
        model.bn1.running_var.mul_(2.0)
        model.res_scale.copy_(torch.linspace(-1, 1, 8))
    _still_eager(opt, model, x)


def test_in_default_right_after_conv_bn_fold_and_listed_by_the_cli(capsys):
    from fxforge.cli.commands import run_rewrites
    from fxforge.rewrites.registry import DEFAULT

    assert DEFAULT.index("binary_fold") == DEFAULT.index("conv_bn_fold") + 1
    assert run_rewrites(None) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("binary_fold"))
    assert line.endswith("(default)") and "folded weights" in line
