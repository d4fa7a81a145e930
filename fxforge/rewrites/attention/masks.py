"""Mask planning: how the score steps' masks reach SDPA, and which rows need eager's value patched in.

Additive masks become a float mask; fills alone a boolean keep-mask; both one float mask where that is
exact (see :mod:`fxforge.rewrites.attention`). A mask computed from constants only is computed here: if
it keeps exactly the lower triangle it becomes ``is_causal=True``, if it keeps every key it is dropped, and
rows in which every key is masked are patched only if the mask has any.

Example:
    >>> causal = lambda q: q.new_ones(q.size(-2), q.size(-2), dtype=torch.bool).tril()
    >>> from fxforge.rewrites.attention.checks import trace_attention
    >>> attend = lambda q, k, v: (q @ k.mT).masked_fill(~causal(q), -1e4).softmax(-1) @ v
    >>> gm, attention = trace_attention(attend, *[torch.randn(1, 1, 3, 8)] * 3)
    >>> plan_mask(attention, Constants(gm))
    MaskPlan(kind='causal', fix=None)
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fxforge.core.nodes import fake_value
from fxforge.rewrites.attention.checks import Attention
from fxforge.rewrites.attention.constants import Constants
from fxforge.rewrites.attention.finite import never_infinite
from fxforge.rewrites.attention.folds import EagerBuilder, fold_keep, fold_mask
from fxforge.rewrites.attention.index_masks import (
    LARGE_NEGATIVE,
    Additive,
    Keep,
    causal_for_every_size,
    hides,
    negated,
    python_number,
    read_mask,
)
from fxforge.rewrites.attention.steps import AddMask, Fill, Scale
from fxforge.rewrites.passes import Refusal


@dataclasses.dataclass
class MaskPlan:
    """How the steps' masks reach SDPA.

    Attributes:
        kind: ``"none"``, ``"float"`` (additive, or mixed with fills), ``"bool"`` (fills only),
            ``"causal"`` (proven lower-triangular) or ``"dropped"`` (proven to keep every key).
        fix: the value of rows in which every key is masked: ``"mean"`` of v or ``"nan"`` (by the fills'
            keep-mask), ``"additive"`` (by the float mask: NaN where every key is ``-inf``, and in float16 or
            bfloat16 the mean of v where every key is hidden), or None when no such row can occur or SDPA
            already agrees.

    Example:
        >>> MaskPlan("bool", fix="mean")
        MaskPlan(kind='bool', fix='mean')
    """

    kind: str
    fix: str | None = None


def _is_masked(value: torch.Tensor) -> torch.Tensor:
    return (value == float("-inf")) | (value <= LARGE_NEGATIVE)


def plan_mask(attention: Attention, constants: Constants) -> MaskPlan | Refusal:
    """Check the steps' masks and decide how they become SDPA's (see :mod:`fxforge.rewrites.attention`).

    Example:
        >>> attend = lambda q, k, v, keep: (q @ k.mT).masked_fill(~keep, -5).softmax(-1) @ v
        >>> from fxforge.rewrites.attention.checks import trace_attention
        >>> q, keep = torch.randn(1, 1, 3, 8), torch.ones(3, dtype=torch.bool)
        >>> gm, attention = trace_attention(attend, q, q, q, keep)
        >>> print(plan_mask(attention, Constants(gm)))
        the fill value -5.0 does not mask: only -inf and values <= -10000 hide a key
    """
    steps = attention.scores.steps
    fills = [s for s in steps if isinstance(s, Fill)]
    additive = any(isinstance(s, AddMask) for s in steps)
    if not fills and not additive:
        return MaskPlan("none")
    values = []
    for fill in fills:
        value = fill.value
        for later in steps[steps.index(fill) + 1:]:
            if isinstance(later, Scale):
                factor = constants.number(later.factor)
                if later.is_tensor or factor is None or factor <= 0 or additive:
                    name = getattr(later.factor, "name", later.factor)
                    return Refusal(f"the scores are scaled by {name} after the fill at {fill.node.name}")
                value = value / factor if later.divide else value * factor
        values.append(value)
    if fills and not additive:
        if any(v != values[0] for v in values):
            other = next(v for v in values if v != values[0])
            return Refusal(f"the masks fill different values ({values[0]} and {other})")
        if not hides(values[0]):
            return Refusal(f"the fill value {values[0]} does not mask: only -inf and values <= "
                           f"{LARGE_NEGATIVE:g} hide a key")
        fix = "nan" if values[0] == -math.inf else "mean"
        return _constant_plan(attention, constants, MaskPlan("bool", fix))
    exact = [-math.inf] + ([] if attention.dtype == torch.float16 else [torch.finfo(attention.dtype).min])
    for fill in fills:
        if fill.value not in exact:
            combine = "-inf" if len(exact) == 1 else f"-inf or finfo({attention.dtype}).min"
            return Refusal(f"a fill with {fill.value} combined with an additive mask has no exact SDPA mask "
                           f"(only {combine} combine in {attention.dtype})")
    return _constant_plan(attention, constants, MaskPlan("float", "additive"))


def _constant_plan(attention: Attention, constants: Constants, plan: MaskPlan) -> MaskPlan:
    """For a mask computed only from constants: causal, dropped, or kept with the row fix only if needed."""
    keep = fold_keep(attention, EagerBuilder(constants)) if plan.kind == "bool" else None
    if plan.kind == "float":
        mask = fold_mask(attention, EagerBuilder(constants))
        if isinstance(mask, torch.Tensor):
            kept, masked = mask == 0, _is_masked(mask)
            keep = kept if bool((kept | masked).all()) else None
            hidden = masked if attention.dtype in (torch.float16, torch.bfloat16) else mask == -math.inf
            if not bool(hidden.all(-1).any()):  # no row the fix would change
                plan = MaskPlan("float")
            return _keep_plan(attention, keep, plan)
        if _causal_for_every_size(attention):
            return MaskPlan("causal")
        return MaskPlan("float") if _never_minus_infinity(attention) else plan
    if not isinstance(keep, torch.Tensor):
        return MaskPlan("causal") if _causal_for_every_size(attention) else plan
    return _keep_plan(attention, keep, plan)


def _causal_for_every_size(attention: Attention) -> bool:
    """Whether the steps' masks, which no constant computes (their sizes are symbolic), keep exactly the
    lower triangle for every size (:mod:`~fxforge.rewrites.attention.index_masks`): fills by their kept keys,
    additive masks (``where(keep, 0, -inf)``, added once, as they are) by theirs. A boolean mask added to the
    scores (promoted to 0/1) hides nothing, so it proves nothing."""
    keeps: list = []
    for step in attention.scores.steps:
        if isinstance(step, Fill):
            condition = read_mask(step.condition)
            keeps.append((condition if step.keeps else negated(condition)) if isinstance(condition, Keep) else None)
        elif isinstance(step, AddMask):
            mask = read_mask(step.mask)
            keeps.append(mask.keep if isinstance(mask, Additive) and step.coefficient == 1.0 else None)
    return None not in keeps and causal_for_every_size(keeps, attention.softmax.node)


def _never_minus_infinity(attention: Attention) -> bool:
    """Whether SDPA's float mask, computed from the inputs, can hold no ``-inf`` (so no row differs from eager
    and none needs the patch) in float32 or float64: one additive mask that
    :func:`~fxforge.rewrites.attention.finite.never_infinite` proves finite, no fills, and no later scale
    that could push ``finfo.min`` past the range (only number factors of size at most 1). In float16 and
    bfloat16 a row hidden by finite values still differs (eager adds in the low precision)."""
    if attention.dtype not in (torch.float32, torch.float64):
        return False
    steps = attention.scores.steps
    added = [s for s in steps if isinstance(s, AddMask)]
    if len(added) != 1 or any(isinstance(s, Fill) for s in steps) or abs(added[0].coefficient) > 1:
        return False
    for step in steps[steps.index(added[0]) + 1:]:
        if isinstance(step, Scale):
            factor = python_number(step.factor)
            if step.is_tensor or not factor or abs(1 / factor if step.divide else factor) > 1:
                return False
    return never_infinite(added[0].mask)


def _keep_plan(attention: Attention, keep: torch.Tensor | None, plan: MaskPlan) -> MaskPlan:
    if keep is None:
        return plan
    shape = tuple(fake_value(attention.softmax.node).shape)
    keep = keep.broadcast_to(shape)
    if bool(keep.all()):
        return MaskPlan("dropped")
    length, keys = shape[-2:]
    causal = torch.ones(length, keys, dtype=torch.bool).tril()
    if length == keys and torch.equal(keep, causal.broadcast_to(shape)):
        return MaskPlan("causal")
    if plan.kind == "bool" and bool(keep.any(-1).all()):
        return MaskPlan("bool")
    return plan
