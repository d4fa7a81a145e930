"""Masks that can never hold ``-inf``, read from how the graph builds them: the proof that lets an additive
mask reach SDPA without the row patch for ``-inf``.

An additive mask ``where(keep, 0, finfo.min)`` (transformers' padding and causal masks) hides a key with a
finite value. A query row whose every key it hides is uniform in eager (the scores are absorbed into the
mask value by rounding) and in SDPA alike, in float32 and float64; only a row of ``-inf`` differs (NaN in
eager, 0 in SDPA's safe softmax), so the replacement patches those rows in with a pass over the mask on every
call (``where(all(mask == -inf), NaN, out)``) unless the mask cannot hold ``-inf``. A constant mask is
checked by value; a mask computed from the inputs (symbolic sizes, a padding mask) is read here: it is finite
if every value it can take is built from finite numbers by ops that cannot overflow (selections, fills,
views, widening casts: the vocabulary's :data:`~fxforge.core.vocabulary.SAME_VALUES` and ``to``, in any call
form). Sums and products are not read (``finfo.min + finfo.min`` is ``-inf``).

Example:
    >>> from fxforge.core.shapes import annotate
    >>> def mask(keep):
    ...     return torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    >>> gm = torch.fx.symbolic_trace(mask)
    >>> _ = annotate(gm, (torch.ones(2, 5, dtype=torch.bool),), {})
    >>> never_infinite(gm.graph.output_node().args[0])
    True
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import fake_value
from fxforge.core.vocabulary import SAME_VALUES, calls

aten = torch.ops.aten

# Ops filling a new tensor with one number: its position among the args, or its keyword.
_FILLED = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2, aten.scalar_tensor.default: 0,
           torch.full: 1, torch.full_like: 1, torch.scalar_tensor: 0}


def never_infinite(value: Any, seen: dict | None = None) -> bool:
    """Whether ``value`` (a graph node or a Python number) can hold no infinity for any input: a number that
    is finite; a node whose dtype is not floating; or a node built from such values by ``where``,
    ``masked_fill``, fills with a finite number, views and selections, or a cast that cannot overflow.

    Example:
        >>> never_infinite(-3.4e38), never_infinite(float("-inf"))
        (True, False)
    """
    if isinstance(value, bool):
        return True
    if isinstance(value, (int, float)):
        return math.isfinite(value)
    if not isinstance(value, Node):
        return False
    seen = {} if seen is None else seen
    if value not in seen:
        seen[value] = False  # (a cycle proves nothing)
        seen[value] = _never_infinite(value, seen)
    return seen[value]


def _never_infinite(node: Node, seen: dict) -> bool:
    fake = fake_value(node)
    if isinstance(fake, torch.Tensor) and not (fake.is_floating_point() or fake.is_complex()):
        return True  # bools and integers hold no infinity
    if node.op not in ("call_function", "call_method"):
        return False
    args = node.args
    if calls(node, "where") and len(args) == 3:
        return never_infinite(args[1], seen) and never_infinite(args[2], seen)
    if calls(node, "masked_fill") and len(args) == 3:
        return never_infinite(args[0], seen) and never_infinite(args[2], seen)
    if node.target in _FILLED:
        position = _FILLED[node.target]
        number = args[position] if len(args) > position else node.kwargs.get("fill_value", node.kwargs.get("s"))
        return never_infinite(number, seen)
    if calls(node, "zeros", "ones"):
        return True
    source = args[0] if args else None
    if calls(node, "to"):
        return _cast_keeps_finite(source, fake) and never_infinite(source, seen)
    if calls(node, *SAME_VALUES):
        return never_infinite(source, seen)
    return False


def _cast_keeps_finite(source: Any, result: Any) -> bool:
    """Whether casting ``source`` (a node) to ``result``'s dtype keeps every finite value finite: bools
    always; integers to float32, float64 or bfloat16 (up to about 1e38); floats to a dtype whose largest
    value is at least the source's."""
    before = fake_value(source) if isinstance(source, Node) else None
    if not isinstance(before, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    if not result.is_floating_point() or before.dtype == torch.bool:
        return True
    if not before.is_floating_point():
        return result.dtype in (torch.float32, torch.float64, torch.bfloat16)
    return torch.finfo(result.dtype).max >= torch.finfo(before.dtype).max
