"""The binary-folding cases PyTorch's Inductor checks (test/inductor/test_binary_folding.py), in fxforge's terms.

Inductor's suite builds a convolution (1d/2d/3d, 3 -> 32 channels, kernel 3, stride 2, with and without bias)
followed by ``torch.add``/``sub``/``mul``/``div`` of a number or of a ``[1, 32, 1...]`` tensor, then operands
that broadcast (``[32, 1, 32]``, ``[1, 1]``) or have another dtype (an int tensor), and convolution + BatchNorm.
Each case here is run through ``binary_fold`` (after ``conv_bn_fold``) and must either fold (no op left after
the convolution) or be refused with its reason, and give eager's outputs on fresh inputs either way: no case
may give a wrong answer. Inductor leaves the number cases unfolded (a TODO there); fxforge folds them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fxforge
from examples.models._common import perturb_norm_stats

OUT = 32
CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
NORMS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
OPS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


class ConvThenOp(nn.Module):
    """A convolution, then ``op(y, operand)``; the operand a number or a tensor attribute (as Inductor's is)."""

    def __init__(self, dims: int, bias: bool, op: Callable, operand, shape_of: Callable | None = None):
        super().__init__()
        self.conv = CONVS[dims](3, OUT, 3, stride=2, bias=bias)
        self.op, self.shape_of = op, shape_of
        if isinstance(operand, torch.Tensor):
            self.register_buffer("operand", operand)
        else:
            self.operand = operand

    def forward(self, x):
        operand = self.operand if self.shape_of is None else self.shape_of(self.operand)
        return self.op(self.conv(x), operand)


class ConvThenNorm(nn.Module):
    def __init__(self, dims: int, bias: bool):
        super().__init__()
        self.conv, self.norm = CONVS[dims](3, OUT, 3, stride=2, bias=bias), perturb_norm_stats(NORMS[dims](OUT))

    def forward(self, x):
        return self.norm(self.conv(x))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], nn.Module]
    dims: int
    rule: str = "binary_fold"
    refusal: str | None = None  # how the reason ends (after the operand's name, which the capture chooses); None: folds


def _per_channel(dims: int) -> torch.Tensor:
    return torch.rand([1, OUT] + [1] * dims) + 0.5


def _cases() -> list[Case]:
    cases = []
    # every dimensionality x op x a number or a per-channel tensor, with and without bias
    for dims, bias, (op, fn), number in itertools.product((1, 2, 3), (True, False), OPS.items(), (True, False)):
        operand = 2.0 if number else _per_channel(dims)
        name = f"conv{dims}d{'+bias' if bias else ''} {op} {'2.0' if number else '[1, 32, 1...]'}"
        cases.append(Case(name, lambda dims=dims, bias=bias, fn=fn, o=operand: ConvThenOp(dims, bias, fn, o), dims))
    # conv2d (output [4, 32, 1, 1]) with operands that broadcast, have another dtype, or are expanded
    for bias, (op, fn) in itertools.product((True, False), OPS.items()):
        suffix = f"{'+bias' if bias else ''} {op}"
        cases += [
            Case(f"conv2d{suffix} [32, 1, 32]", lambda bias=bias, fn=fn: ConvThenOp(2, bias, fn, torch.rand(32, 1, 32)),
                 2, refusal="of shape (32, 1, 32) changes the output's shape from (4, 32, 1, 1) to (4, 32, 1, 32)"),
            Case(f"conv2d{suffix} [1, 1]", lambda bias=bias, fn=fn: ConvThenOp(2, bias, fn, torch.rand(1, 1) + 0.5), 2),
            Case(f"conv2d{suffix} int [2]", lambda bias=bias, fn=fn: ConvThenOp(
                2, bias, fn, torch.tensor([2], dtype=torch.int32)), 2,
                 refusal="is a torch.int32 tensor: only floating-point operands fold"),
            Case(f"conv2d{suffix} [32, 1, 1] expanded to [1, 32, 1, 1]", lambda bias=bias, fn=fn: ConvThenOp(
                2, bias, fn, torch.rand(OUT, 1, 1) + 0.5, lambda t: t.expand(1, OUT, 1, 1)), 2),
            Case(f"conv2d{suffix} [1, 32, 1, 1] expanded to [4, 32, 1, 1]", lambda bias=bias, fn=fn: ConvThenOp(
                2, bias, fn, _per_channel(2), lambda t: t.expand(4, OUT, 1, 1)), 2,
                 refusal="of shape (4, 32, 1, 1) has size 4 along dim 0 of the output (a batch dim): only an operand "
                         "of size 1 there (one that varies along the channels, dim 1) folds"),
        ]
    # convolution + BatchNorm (Inductor folds it through binary folding; here conv_bn_fold)
    for dims, bias in itertools.product((1, 2, 3), (True, False)):
        cases.append(Case(f"conv{dims}d{'+bias' if bias else ''} + batch_norm",
                          lambda dims=dims, bias=bias: ConvThenNorm(dims, bias), dims, rule="conv_bn_fold"))
    return cases


CASES = _cases()


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_case_folds_or_says_why_and_matches_eager(case, method):
    torch.manual_seed(1234)
    model = case.make().eval()
    x = torch.rand([4, 3] + [4] * case.dims)
    new = fxforge.rewrite(fxforge.capture(model, (x,), method=method), ["cleanup", "conv_bn_fold", "binary_fold"])
    assert not new.report.rolled_back
    refusals = [m.reason for m in new.report.near_misses if m.rule == case.rule]
    if case.refusal is None:
        assert new.report.counts.get(case.rule) == 1 and refusals == []
        assert [n.op for n in new.graph_module.graph.nodes if n.op == "call_function"] == ["call_function"]
    else:
        assert case.rule not in new.report.counts and len(refusals) == 1 and refusals[0].endswith(case.refusal)
    with torch.no_grad():  # no wrong answer, folded or not
        for fresh in (torch.rand_like(x), torch.randn_like(x)):
            torch.testing.assert_close(new.graph_module(fresh), model(fresh), rtol=1e-4, atol=1e-5)


def test_the_tally():
    """How many of the peer's cases fold and how many are refused (with a reason)."""
    folded = sum(c.refusal is None for c in CASES)
    assert (len(CASES), folded, len(CASES) - folded) == (94, 70, 24)
