"""Each rule's near misses: code that looks like its bug but is right must not be reported by it (the seeded
corpus, tests/lint/seeded.py, and each rule's doctest show what it does find)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge


def _module(forward, **layers):
    """A module whose forward is ``forward(self, *inputs)``, with ``layers`` as its submodules."""
    cls = type("Net", (nn.Module,), {"forward": forward})
    model = cls()
    for name, layer in layers.items():
        setattr(model, name, layer)
    return model


def _scaled_then_shifted(self, x):
    h = self.fc(x)
    return h * 2 + h.add_(1)


NEAR_MISSES = {
    "broadcast-blowup": [
        (lambda self, a, b: (a[:, None] - b[None, :]).abs(), (torch.randn(4), torch.randn(5))),  # outer by design
        (lambda self, x, m: x + m, (torch.randn(2, 4, 8, 8), torch.zeros(2, 1, 1, 8))),  # a mask: one side grows
    ],
    "reduce-size-one": [
        (lambda self, x: x.sum(0), (torch.randn(1, 8),)),  # the example's batch of one
        (lambda self, x: x.softmax(-1), (torch.randn(4, 8),)),
    ],
    "softmax-dim": [
        (lambda self, x: x.softmax(-1), (torch.randn(4, 8),)),
        (lambda self, x: x.log_softmax(1).mean(), (torch.randn(4, 5),)),  # dim 1 of [B, C]: the last
    ],
    "float64-drift": [
        (lambda self, x: x * 2.5, (torch.randn(4, 8),)),  # a Python float is a weak scalar
        (lambda self, x: x * torch.tensor(np.float64(2.0)), (torch.randn(4, 8),)),  # a 0-d tensor does not promote
        (lambda self, x: (x * x).sum(), (torch.randn(4, 8, dtype=torch.float64),)),  # a float64 model
    ],
    "integer-division": [
        (lambda self, ids: ids // 2, (torch.randint(0, 9, (4, 8)),)),  # stays an integer (an index)
        (lambda self, x, m: x * (m.sum(1) / m.size(1))[:, None], (torch.randn(4, 8), torch.ones(4, 8, dtype=torch.int64))),
    ],
    "low-precision-reduction": [
        (lambda self, x: x.half().sum(-1, dtype=torch.float32), (torch.randn(2, 4096),)),
        (lambda self, x: x.half().sum(-1), (torch.randn(2, 16),)),  # a few values
    ],
    "large-upcast": [
        (lambda self, x: x.half().float(), (torch.randn(8, 8),)),  # small
        (lambda self, x: x.float() * 2, (torch.randn(512, 1024),)),  # already float32: no copy
    ],
    "layout-copy": [
        (lambda self, x: x.contiguous().view(4, -1), (torch.randn(4, 8, 8),)),  # contiguous already
        (lambda self, x: x.reshape(4, -1), (torch.randn(4, 8, 8),)),  # a view serves it
    ],
    "hoistable-constant": [
        (lambda self, x: self.fc(x) * self.fc.weight.norm(), (torch.randn(4, 64),)),  # a trainable parameter
    ],
    "dead-code": [
        (lambda self, x: x.sum(), (torch.randn(4, 8),)),
    ],
    "unused-parameter": [
        (lambda self, x: self.fc(x), (torch.randn(4, 64),)),  # the frozen one below is not trainable
    ],
    "computed-twice": [
        (lambda self, x: F.dropout(x, 0.5, True) + F.dropout(x, 0.5, True), (torch.randn(8, 64),)),  # random
    ],
    "host-sync": [
        (lambda self, x: x.to(x.device) + 1, (torch.randn(4, 8),)),
    ],
    "functional-dropout": [
        (lambda self, x: F.dropout(x, 0.1, training=self.training), (torch.randn(4, 8),)),
        (lambda self, x: self.drop(x), (torch.randn(4, 8),)),
    ],
    "mode-unreached": [
        (lambda self, x: self.drop(self.norm(x)), (torch.randn(4, 8),)),
    ],
    "inplace-on-saved": [
        (lambda self, x: F.relu(self.conv(x), inplace=True), (torch.randn(1, 3, 8, 8),)),  # conv saves its input
        (lambda self, x: self.fc(x).add_(1).sigmoid(), (torch.randn(4, 64),)),  # linear saves its input, not output
        (_scaled_then_shifted, (torch.randn(4, 64),)),  # h * 2 saves no h
    ],
}


def _layers():
    return {"fc": nn.Linear(64, 64), "frozen": nn.Linear(4, 4).requires_grad_(False), "drop": nn.Dropout(0.1),
            "norm": nn.BatchNorm1d(8), "conv": nn.Conv2d(3, 4, 3)}


@pytest.mark.parametrize("rule, index", [(r, i) for r, cases in NEAR_MISSES.items() for i in range(len(cases))])
def test_near_miss_is_not_reported(rule, index):
    forward, inputs = NEAR_MISSES[rule][index]
    layers = _layers()
    if rule == "unused-parameter":  # the layers the forward calls, and a frozen one it does not
        layers = {name: layers[name] for name in ("fc", "frozen")}
    model = _module(forward, **layers)
    findings = fxforge.lint(model, inputs, rules=[rule])
    assert len(findings) == 0, str(findings)


def test_every_rule_has_a_near_miss():
    from fxforge.lint import BUILTIN

    assert set(BUILTIN) == set(NEAR_MISSES)


def test_a_size_one_dim_an_input_may_have_made_is_only_info():
    class Decoder(nn.Module):  # one step of decoding: the keys are one token long in this example
        def forward(self, q, k):
            return (q @ k.transpose(-2, -1)).softmax(dim=-1)

    findings = fxforge.lint(Decoder(), (torch.randn(2, 1, 8), torch.randn(2, 1, 8)), rules=["reduce-size-one"])
    assert [f.severity for f in findings] == ["info"]
