"""The masks the score steps make, folded over a builder: into real tensors at rewrite time, or into nodes.

:func:`fold_mask` and :func:`fold_keep` walk the steps once and ask a builder for each operation: an
:class:`EagerBuilder` computes the mask from constants (to prove it causal, or all-kept), and
:class:`~.builders.GraphBuilder` emits the same operations as graph nodes for SDPA.

Example:
    >>> causal = lambda q: q.new_ones(q.size(-2), q.size(-2), dtype=torch.bool).tril()
    >>> from fxforge.rewrites.attention.checks import trace_attention
    >>> attend = lambda q, k, v: (q @ k.mT).masked_fill(~causal(q), -1e4).softmax(-1) @ v
    >>> gm, attention = trace_attention(attend, *[torch.randn(1, 1, 2, 8)] * 3)
    >>> builder = EagerBuilder(Constants(gm))
    >>> fold_mask(attention, builder).tolist(), fold_keep(attention, builder).tolist()
    ([[0.0, -10000.0], [0.0, 0.0]], [[True, False], [True, True]])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fxforge.core.nodes import fake_value
from fxforge.rewrites.attention.checks import Attention
from fxforge.rewrites.attention.constants import Constants
from fxforge.rewrites.attention.steps import AddMask, Fill, Scale, to_layout


class EagerBuilder:
    """Computes a mask from constants at rewrite time (:meth:`value` raises when it cannot).

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x + torch.ones(2))
        >>> x, ones = list(gm.graph.nodes)[:2]
        >>> builder = EagerBuilder(Constants(gm)); builder.call("mul", builder.value(ones), 3).tolist()
        [3.0, 3.0]
    """

    class NotConstant(Exception):
        """The mask depends on something other than constants."""

    def __init__(self, constants: Constants):
        self.constants = constants

    def value(self, node: Any) -> Any:
        """The constant value of ``node`` (anything that is no node is its own value)."""
        if not self.constants.is_constant(node):
            raise self.NotConstant
        return self.constants.value(node)

    def call(self, name: str, *args, **kwargs) -> Any:
        """The op ``name`` applied to real values."""
        return _EAGER[name](*args, **kwargs)


_EAGER: dict[str, Callable] = {
    "add": torch.add, "mul": lambda a, b: a * b, "div": lambda a, b: a / b, "where": torch.where,
    "logical_not": torch.logical_not, "logical_and": torch.logical_and, "zeros_like": torch.zeros_like,
    "masked_fill": torch.masked_fill, "to": torch.Tensor.to, "reshape": torch.reshape,
    "expand": torch.Tensor.expand,
}


def _in_product_layout(attention: Attention, step: Any, builder: Any, value: Any) -> Any:
    """``value``, a mask a step applies to the scores in that step's layout, in the scores product's layout
    (they differ after a :class:`~.steps.View`)."""
    shape = value.shape if isinstance(value, torch.Tensor) else fake_value(value).shape
    source, target = fake_value(step.node).shape, fake_value(attention.scores.product).shape
    return to_layout(builder, value, tuple(shape), tuple(source), tuple(target))


def fold_mask(attention: Attention, builder: Any) -> Any:
    """SDPA's float mask: additive masks summed, scaled by later factors, fills as ``where``; None if none.

    Example:
        >>> from fxforge.rewrites.attention.checks import trace_attention
        >>> attend = lambda q, k, v: ((q @ k.mT + torch.ones(2)) / 2).softmax(-1) @ v
        >>> gm, attention = trace_attention(attend, *[torch.randn(1, 1, 2, 8)] * 3)
        >>> fold_mask(attention, EagerBuilder(Constants(gm)))
        tensor([0.5000, 0.5000])
    """
    try:
        mask = None
        for step in attention.scores.steps:
            if isinstance(step, AddMask):
                term = builder.value(step.mask)
                if not fake_value(step.mask).is_floating_point():  # a bool or integer mask: promoted as torch does
                    term = builder.call("to", term, dtype=attention.dtype)
                term = _in_product_layout(attention, step, builder, term)
                if step.coefficient != 1:
                    term = builder.call("mul", term, step.coefficient)
                mask = term if mask is None else builder.call("add", mask, term)
            elif isinstance(step, Scale) and mask is not None:
                mask = builder.call("div" if step.divide else "mul", mask, builder.value(step.factor))
            elif isinstance(step, Fill):
                condition = _in_product_layout(attention, step, builder, builder.value(step.condition))
                if mask is None:
                    zeros = builder.call("zeros_like", condition, dtype=attention.dtype)
                    masked = builder.call("logical_not", condition) if step.keeps else condition
                    mask = builder.call("masked_fill", zeros, masked, step.value)
                elif step.keeps:
                    mask = builder.call("where", condition, mask, step.value)
                else:
                    mask = builder.call("where", condition, step.value, mask)
        return mask
    except EagerBuilder.NotConstant:
        return None


def fold_keep(attention: Attention, builder: Any) -> Any:
    """SDPA's bool mask (True: attend) from the fills: the AND of what each keeps; None if not constant.

    Example:
        >>> attend = lambda q, k, v, keep: (q @ k.mT).masked_fill(~keep, -1e4).softmax(-1) @ v
        >>> from fxforge.rewrites.attention.checks import trace_attention
        >>> q, keep = torch.randn(1, 1, 2, 8), torch.ones(2, dtype=torch.bool)
        >>> gm, attention = trace_attention(attend, q, q, q, keep)
        >>> fold_keep(attention, EagerBuilder(Constants(gm))) is None  # keep is a graph input
        True
    """
    try:
        keep = None
        for step in attention.scores.steps:
            if isinstance(step, Fill):
                condition = _in_product_layout(attention, step, builder, builder.value(step.condition))
                kept = condition if step.keeps else builder.call("logical_not", condition)
                keep = kept if keep is None else builder.call("logical_and", keep, kept)
        return keep
    except EagerBuilder.NotConstant:
        return None
