"""Seeded bugs: small models written the way people write them, each with one bug of a kind ``fxforge lint``
finds, on a line marked ``# BUG: rule-name``. :data:`SEEDED` maps a name to ``(factory, rule)``; a factory returns
``(model, example_inputs)``. The marker is a plain comment, so it is also on the line the finding must name.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class RegressionHead(nn.Module):
    """Predicts one value per sample and returns its MSE against a [B] target: [B, 1] - [B] is [B, B]."""

    def __init__(self, features=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 32), nn.ReLU())
        self.out = nn.Linear(32, 1)

    def forward(self, x, target):
        pred = self.out(self.body(x))
        return ((pred - target) ** 2).mean()  # BUG: broadcast-blowup


class ContrastiveLoss(nn.Module):
    """A loss that calls F.mse_loss on [B, 1] scores and [B] labels."""

    def __init__(self, dim=16):
        super().__init__()
        self.scorer = nn.Bilinear(dim, dim, 1)

    def forward(self, a, b, labels):
        scores = torch.sigmoid(self.scorer(a, b))
        return F.mse_loss(scores, labels)  # BUG: broadcast-blowup


class AttentionPooling(nn.Module):
    """Pools a sequence with learned scores, softmax over the wrong dim: the score dim has size 1."""

    def __init__(self, dim=32):
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, h):
        weights = torch.softmax(self.score(h), dim=-1)  # BUG: reduce-size-one
        return (weights * h).sum(dim=1)


class BatchSoftmaxClassifier(nn.Module):
    """Returns class probabilities, normalized over the batch."""

    def __init__(self, features=20, classes=5):
        super().__init__()
        self.fc = nn.Linear(features, classes)

    def forward(self, x):
        logits = self.fc(x)
        return F.softmax(logits, dim=0)  # BUG: softmax-dim


class NumpyNormalize(nn.Module):
    """ImageNet normalization with statistics from numpy: float64 buffers."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor(np.array([0.485, 0.456, 0.406])).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(np.array([0.229, 0.224, 0.225])).view(1, 3, 1, 1))
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, image):
        x = (image - self.mean) / self.std  # BUG: float64-drift
        return self.conv(x.float())


class CoverageWeighting(nn.Module):
    """Scales token features by the fraction of real tokens: an integer division rounds it to 0 or 1."""

    def __init__(self, dim=16):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, h, mask):
        coverage = mask.sum(dim=1) // mask.size(1)  # BUG: integer-division
        return self.proj(h) * coverage[:, None, None]


class HalfPrecisionScorer(nn.Module):
    """Runs its scoring in bfloat16, softmax included."""

    def __init__(self, dim=64, vocab=2048):
        super().__init__()
        self.proj = nn.Linear(dim, vocab)

    def forward(self, x):
        logits = self.proj(x).to(torch.bfloat16)
        return torch.log_softmax(logits, dim=-1)  # BUG: low-precision-reduction


class DoubleStatistics(nn.Module):
    """Computes feature statistics in float64 'for accuracy': a full float64 copy of the feature map."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 3, padding=1)

    def forward(self, x):
        feats = self.conv(x)
        var = feats.double().var(dim=(2, 3))  # BUG: large-upcast
        return var.float()


class ChannelsLastPingPong(nn.Module):
    """Switches a block to channels-last and back for the next one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(16, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        x = self.a(x.contiguous(memory_format=torch.channels_last)).relu()
        x = x.contiguous()  # BUG: layout-copy
        return self.b(x)


class CausalSelfAttention(nn.Module):
    """Builds its causal mask from scratch on every call."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(C // self.heads)
        mask = torch.triu(torch.ones(T, T, device=x.device), diagonal=1).bool()  # BUG: hoistable-constant
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.out(y)


class AuxLossNet(nn.Module):
    """Computes an auxiliary output it forgets to return."""

    def __init__(self, dim=16):
        super().__init__()
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 4)
        self.aux = nn.Linear(dim, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        aux_logits = self.aux(h)  # noqa: F841  # BUG: dead-code
        return self.head(h)


class TwoHeads(nn.Module):
    """Defines a second classifier that forward never calls."""

    def __init__(self, dim=16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.classifier = nn.Linear(dim, 3)
        self.domain_classifier = nn.Linear(dim, 2)  # BUG: unused-parameter

    def forward(self, x):
        return self.classifier(self.encoder(x))


class PreNormBlock(nn.Module):
    """A pre-norm residual block that normalizes its input twice."""

    def __init__(self, dim=32):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        gate = torch.sigmoid(self.norm(x).mean(dim=-1, keepdim=True))
        return x + gate * self.mlp(self.norm(x))  # BUG: computed-twice


class AdaptiveScale(nn.Module):
    """Reads a statistic into Python to scale its input."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        peak = x.abs().max().item()  # BUG: host-sync
        return self.fc(x / (peak + 1e-6))


class ClampIfLarge(nn.Module):
    """Branches in Python on a tensor's value."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.fc(x)
        if h.norm() > 10:  # BUG: host-sync
            h = h / h.norm()
        return h


class MLPWithFunctionalDropout(nn.Module):
    """Uses F.dropout without passing the module's mode."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc1 = nn.Linear(dim, 64)
        self.fc2 = nn.Linear(64, 2)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = F.dropout(h, p=0.2)  # BUG: functional-dropout
        return self.fc2(h)


class ListOfNorms(nn.Module):
    """Keeps its BatchNorms in a plain Python list: model.eval() never reaches them."""

    def __init__(self, dim=16, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.norms = [nn.BatchNorm1d(dim) for _ in range(depth)]

    def forward(self, x):
        for layer, norm in zip(self.layers, self.norms):
            x = torch.relu(norm(layer(x)))  # BUG: mode-unreached
        return x


class DropoutInForward(nn.Module):
    """Creates its dropout layer inside forward."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return nn.Dropout(0.3)(self.fc(x))  # BUG: mode-unreached


class GatedUnit(nn.Module):
    """Masks a sigmoid gate in place, which sigmoid's backward still needs."""

    def __init__(self, dim=16):
        super().__init__()
        self.gate = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)

    def forward(self, x, mask):
        g = torch.sigmoid(self.gate(x))
        g *= mask  # BUG: inplace-on-saved
        return g * self.value(x)


SEEDED = {
    "regression_head": (lambda: (RegressionHead(), (torch.randn(8, 16), torch.randn(8))), "broadcast-blowup"),
    "contrastive_loss": (lambda: (ContrastiveLoss(), (torch.randn(8, 16), torch.randn(8, 16), torch.rand(8))),
                         "broadcast-blowup"),
    "attention_pooling": (lambda: (AttentionPooling(), (torch.randn(4, 10, 32),)), "reduce-size-one"),
    "batch_softmax": (lambda: (BatchSoftmaxClassifier(), (torch.randn(8, 20),)), "softmax-dim"),
    "numpy_normalize": (lambda: (NumpyNormalize(), (torch.rand(2, 3, 16, 16),)), "float64-drift"),
    "integer_division": (lambda: (CoverageWeighting(), (torch.randn(4, 6, 16), torch.ones(4, 6, dtype=torch.int64))),
                         "integer-division"),
    "half_scorer": (lambda: (HalfPrecisionScorer(), (torch.randn(4, 64),)), "low-precision-reduction"),
    "double_statistics": (lambda: (DoubleStatistics(), (torch.randn(2, 3, 64, 64),)), "large-upcast"),
    "channels_last_ping_pong": (lambda: (ChannelsLastPingPong(), (torch.randn(2, 16, 16, 16),)), "layout-copy"),
    "causal_mask": (lambda: (CausalSelfAttention(), (torch.randn(2, 256, 32),)), "hoistable-constant"),
    "aux_dead": (lambda: (AuxLossNet(), (torch.randn(4, 16),)), "dead-code"),
    "two_heads": (lambda: (TwoHeads(), (torch.randn(4, 16),)), "unused-parameter"),
    "prenorm_twice": (lambda: (PreNormBlock(), (torch.randn(2, 8, 32),)), "computed-twice"),
    "item_scale": (lambda: (AdaptiveScale(), (torch.randn(4, 16),)), "host-sync"),
    "branch_on_value": (lambda: (ClampIfLarge(), (torch.randn(4, 16),)), "host-sync"),
    "functional_dropout": (lambda: (MLPWithFunctionalDropout(), (torch.randn(4, 16),)), "functional-dropout"),
    "list_of_norms": (lambda: (ListOfNorms(), (torch.randn(4, 16),)), "mode-unreached"),
    "dropout_in_forward": (lambda: (DropoutInForward(), (torch.randn(4, 16),)), "mode-unreached"),
    "gated_inplace": (lambda: (GatedUnit(), (torch.randn(4, 16), torch.ones(4, 16))), "inplace-on-saved"),
}
