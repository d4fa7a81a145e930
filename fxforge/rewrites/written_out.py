"""Ops written out as their formula, and the forms of a linear layer, recognised as the op itself.

The ``conv_activation`` pass applies these rules first, so that the op then runs as one vectorised kernel and
fuses after a convolution or linear layer like the op itself (:mod:`fxforge.rewrites.conv_activation`):

- GELU's tanh approximation as transformers writes it (``gelu_new``: eight elementwise passes) -> ``F.gelu(y,
  approximate="tanh")``, one;
- leaky ReLU written as ``torch.where(y > 0, y, y * slope)`` -> ``F.leaky_relu(y, slope)``;
- ``torch.addmm(b, x, w.t())`` (a linear layer as ``nn.Linear`` wrote it in old torch, and as export graphs
  spell some) -> ``F.linear(x, w, b)``.

They stay when autotune undoes the fusions (they are not fused ops).

Example:
    >>> class LeakyWhere(nn.Module):
    ...     def forward(self, y):
    ...         return torch.where(y > 0, y, y * 0.2)
    >>> new = fxforge.rewrite(fxforge.capture(LeakyWhere().eval(), (torch.randn(4),)), ["conv_activation"])
    >>> [m.what for m in new.report.matches]
    ['leaky_relu written as where(y > 0, y, y * slope)']
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.fx import Node

from fxforge.rewrites.passes import Refusal
from fxforge.rewrites.pattern import Match, Rule

F = nn.functional


def gelu_tanh_written_out(y):
    """GELU's tanh approximation as transformers writes it (``NewGELUActivation``: GPT-2, GPT-Neo, CodeGen,
    T5 v1.1 ``gelu_new``): eight elementwise passes where ``F.gelu(approximate="tanh")`` makes one."""
    return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))


def refuse_non_float(match: Match) -> Refusal | None:
    """Refuse an activation written out on values that are not floating point (or have no metadata)."""
    value = match.tensor("y")
    if value is None or not value.is_floating_point():
        return Refusal("the activation's input is not a floating point tensor with shape metadata")
    return None


def refuse_computed_slope(match: Match) -> Refusal | None:
    """Refuse a ``where`` form of leaky ReLU whose slope is not a number (or whose input is not floating point)."""
    if isinstance(match["p"], Node) or not isinstance(match["p"], (int, float)):
        return Refusal("the slope is computed at run time, not a number")
    return refuse_non_float(match)


def refuse_unlike_linear(match: Match) -> Refusal | None:
    """Refuse an ``addmm`` that is not a linear layer: scaled (beta, alpha not 1), a bias that is not one row of
    the output's width, or operands that are not floating point matrices."""
    if not (match["beta"] == 1 and match["alpha"] == 1):
        return Refusal("addmm scales its terms (beta or alpha is not 1), which a linear layer does not")
    x, w, b = match.tensor("x"), match.tensor("w"), match.tensor("b")
    if x is None or w is None or b is None or not all(t.is_floating_point() for t in (x, w, b)):
        return Refusal("no floating point metadata for the matrices")
    if tuple(b.shape) not in ((w.shape[0],),):
        return Refusal(f"the added tensor has shape {tuple(b.shape)}, not the bias of a linear layer ({w.shape[0]},)")
    return None


# Written-out forms become the op first (one vectorised kernel; then the fusion rules see it after a convolution
# or a linear layer).
WRITTEN_OUT: list[Rule] = [
    Rule("gelu(approximate='tanh') written out", gelu_tanh_written_out, lambda y: F.gelu(y, approximate="tanh"),
         check=refuse_non_float, description="0.5*y*(1+tanh(sqrt(2/pi)*(y+0.044715*y^3))) -> gelu(y, approximate='tanh')"),
    Rule("leaky_relu written as where(y > 0, y, y * slope)", lambda y, p: torch.where(y > 0, y, y * p),
         lambda y, p: F.leaky_relu(y, p), check=refuse_computed_slope,
         description="where(y > 0, y, y * slope) -> leaky_relu(y, slope)"),
    Rule("linear written as addmm(b, x, w.t())", lambda b, x, w, beta, alpha: torch.addmm(b, x, w.t(), beta=beta,
                                                                                          alpha=alpha),
         lambda b, x, w, beta=1, alpha=1: F.linear(x, w, b), check=refuse_unlike_linear,
         description="addmm(b, x, w.t()) -> linear(x, w, b)"),
]
