"""Plans stand on the model's live tensors (issue 50, "No state change unseen"): a dtype round trip through
``.to()`` rebuilds what was folded from the buffers it replaced; a buffer a rewrite read as a constant (a causal
mask) is watched like a weight, in-place and ``.data`` edits included; BatchNorm statistics edited through
``.data`` are seen. Every comparison is against eager (the model itself, or a copy that did the same) on fresh
inputs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fxforge


class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 4, 3)

    def forward(self, x):
        return self.head(self.bn(self.conv(x)).relu())


class LinearGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        return self.out(nn.functional.gelu(self.fc(x)))


def _model(kind: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    model = kind().eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):  # statistics far from the defaults: folding them matters
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2.0)
    return model


def _input(kind: type[nn.Module], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, 3, 10, 10, dtype=dtype) if kind is ConvBnRelu else torch.randn(4, 16, dtype=dtype)


@pytest.mark.parametrize("kind", [ConvBnRelu, LinearGelu])
@pytest.mark.parametrize("back", ["float", "to"])
@pytest.mark.parametrize("who", ["optimized", "model"])
def test_a_bfloat16_round_trip_matches_eager_doing_the_same(kind, back, who):
    model = _model(kind)
    twin = copy.deepcopy(model)
    opt = fxforge.optimize(model)
    target = opt if who == "optimized" else model
    with torch.no_grad():
        opt(_input(kind))  # a float32 plan, folded from the float32 statistics
        target.to(torch.bfloat16)
        twin.to(torch.bfloat16)
        x = _input(kind, torch.bfloat16)
        torch.testing.assert_close(opt(x), twin(x), rtol=2e-2, atol=2e-2)
        target.float() if back == "float" else target.to(torch.float32)
        twin.float() if back == "float" else twin.to(torch.float32)
        for _ in range(2):
            x = _input(kind)
            torch.testing.assert_close(opt(x), twin(x), rtol=1e-5, atol=1e-5)
    assert opt.report.method != "eager"


def test_a_conversion_to_the_same_dtype_keeps_the_plans():
    model = _model(ConvBnRelu)
    opt = fxforge.optimize(model)
    with torch.no_grad():
        opt(_input(ConvBnRelu))
        opt.to(torch.float32)
        model.to("cpu")
        x = _input(ConvBnRelu)
        torch.testing.assert_close(opt(x), model(x))
    assert opt.plans_built == 1


class CausalAttention(nn.Module):
    """Hand-written attention masked by a boolean buffer (or a plain tensor attribute) that the attention
    rewrite proves causal and replaces with ``is_causal=True``."""

    def __init__(self, dim: int = 16, length: int = 8, as_buffer: bool = True):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        mask = torch.tril(torch.ones(length, length, dtype=torch.bool))
        if as_buffer:
            self.register_buffer("mask", mask)
        else:
            self.mask = mask

    def forward(self, x):
        _, t, c = x.shape
        q, k, v = self.qkv(x).split(c, -1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(c)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        return self.proj(scores.softmax(-1) @ v)


EDITS = {
    "fill_": lambda mask: mask.fill_(True),
    "data.fill_": lambda mask: mask.data.fill_(True),
    "data[0, 1]": lambda mask: mask.data.__setitem__((0, 1), True),  # one element, behind the counter
    "copy_": lambda mask: mask.copy_(torch.ones_like(mask).triu()),
    "data =": lambda mask: setattr(mask, "data", torch.ones_like(mask)),
}


@pytest.mark.parametrize("as_buffer", [True, False], ids=["buffer", "attribute"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_mask_read_as_a_constant_is_watched(edit, as_buffer):
    torch.manual_seed(0)
    model = CausalAttention(as_buffer=as_buffer).eval()
    opt = fxforge.optimize(model)
    with torch.no_grad():
        x = torch.randn(2, 8, 16)
        torch.testing.assert_close(opt(x), model(x))
        assert opt.report.counts.get("attention") == 1
        EDITS[edit](model.mask)
        for length in (8, 6):
            x = torch.randn(2, length, 16)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
        model.mask.copy_(torch.tril(torch.ones(8, 8, dtype=torch.bool)))  # causal again
        x = torch.randn(2, 8, 16)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    assert any("a rewrite read as a constant changed (mask)" in note for note in opt.cache.notes), opt.cache.notes


@pytest.mark.parametrize("edit", ["running_mean.data.add_", "running_var.data.mul_", "weight.data.mul_",
                                  "running_mean.data ="])
def test_batchnorm_edits_through_data_are_seen(edit):
    model = _model(ConvBnRelu)
    opt = fxforge.optimize(model)
    with torch.no_grad():
        x = _input(ConvBnRelu)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
        assert opt.report.counts.get("conv_bn_fold") == 1
        bn = model.bn
        if edit == "running_mean.data.add_":
            bn.running_mean.data.add_(1.0)
        elif edit == "running_var.data.mul_":
            bn.running_var.data.mul_(3.0)
        elif edit == "weight.data.mul_":
            bn.weight.data.mul_(-2.0)
        else:
            bn.running_mean.data = torch.full_like(bn.running_mean, 0.5)
        for _ in range(2):
            x = _input(ConvBnRelu)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


class BranchyConvBn(nn.Module):
    """conv + BatchNorm, then a branch on the data: TorchDynamo runs it as two graphs, each with its own plans."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        h = self.bn(self.conv(x)).relu()
        if h.mean() > 0:
            return self.head(h)
        return -self.head(h)


@pytest.mark.parametrize("kind", [ConvBnRelu, BranchyConvBn])
@pytest.mark.parametrize("who", ["model", "optimized"])
def test_statistics_updated_by_a_training_call_are_seen(kind, who):
    """BatchNorm's kernels update the running statistics in place without bumping their versions: a plan that
    folded them sees the update by the statistics' counter (before, a training call on the model itself left the
    optimized module 0.2 off; one through a graph's own plans left the other graphs' plans behind)."""
    model = _model(kind)
    opt = fxforge.optimize(model, (_input(ConvBnRelu),))
    with torch.no_grad():
        x = _input(ConvBnRelu)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
        assert opt.report.counts.get("conv_bn_fold") == 1
        model.train()
        (model if who == "model" else opt)(_input(ConvBnRelu) * 3 + 1)  # statistics move (momentum 0.1)
        model.eval()
        for _ in range(2):
            x = _input(ConvBnRelu)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)

