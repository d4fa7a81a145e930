"""Steps between the scores product and the softmax: casts, scales, additive masks and fills.

Each reader of :data:`SCORE_STEPS` looks at one node and says which step it is (a list: ``a + b`` may add
a mask to scores either way round), why it cannot be one (a :class:`~fxforge.rewrites.passes.Refusal`),
or None when the node is no such step.

Example:
    >>> from fxforge.core.shapes import annotate
    >>> gm = torch.fx.symbolic_trace(lambda s, m: s / 8 + m)
    >>> _ = annotate(gm, (torch.ones(2, 4), torch.zeros(4)), {})
    >>> s, m, div, add = list(gm.graph.nodes)[:4]
    >>> read_scale(div, gm, Constants(gm))
    [Scale(node=truediv, scores=s, factor=8, divide=True)]
    >>> read_additive_mask(add, gm, Constants(gm))
    [AddMask(node=add, scores=truediv, mask=m, coefficient=1.0)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import fake_value
from fxforge.core.vocabulary import argument, calls
from fxforge.rewrites.attention.constants import Constants
from fxforge.rewrites.attention.readers import read_cast
from fxforge.rewrites.canonical import canonicalize
from fxforge.rewrites.passes import Refusal


@dataclasses.dataclass(frozen=True)
class Cast:
    """``scores`` cast to another floating dtype (or copied).

    Example:
        >>> g = torch.fx.Graph(); s = g.placeholder("s")
        >>> Cast(g.call_method("float", (s,)), s).scores is s
        True
    """

    node: Node
    scores: Node


@dataclasses.dataclass(frozen=True)
class Scale:
    """``scores * factor`` or ``scores / factor``: a number, a node computing one, or a tensor of size 1 in
    the last two dims (a learned temperature, one per head: :func:`per_query_row`).

    Example:
        >>> g = torch.fx.Graph(); s = g.placeholder("s")
        >>> Scale(g.call_method("div", (s, 8)), s, 8, divide=True).is_tensor
        False
    """

    node: Node
    scores: Node
    factor: Any
    divide: bool

    @property
    def is_tensor(self) -> bool:
        """Whether the factor is a tensor (a learned temperature, one per head), not a number."""
        return fake_value(self.factor) is not None


@dataclasses.dataclass(frozen=True)
class AddMask:
    """``scores + coefficient * mask``: a float tensor ``mask``, or a bool or integer one (``scores + keep``),
    which torch promotes to the scores' dtype (True: 1.0) before adding; the replacement casts it alike.

    Example:
        >>> g = torch.fx.Graph(); s, m = g.placeholder("s"), g.placeholder("m")
        >>> AddMask(g.call_method("sub", (s, m)), s, m, -1.0).coefficient
        -1.0
    """

    node: Node
    scores: Node
    mask: Node
    coefficient: float


@dataclasses.dataclass(frozen=True)
class Fill:
    """``scores`` with ``value`` where keys are masked: ``condition`` marks kept keys when ``keeps`` (a
    ``where(condition, scores, value)``), masked ones otherwise (``masked_fill(condition, value)``).

    Example:
        >>> g = torch.fx.Graph(); s, c = g.placeholder("s"), g.placeholder("c")
        >>> Fill(g.call_method("masked_fill", (s, c, -1e4)), s, c, keeps=False, value=-1e4).keeps
        False
    """

    node: Node
    scores: Node
    condition: Node
    keeps: bool
    value: float


@dataclasses.dataclass(frozen=True)
class View:
    """``scores`` reshaped with their last two dims (queries, keys) kept: only the batch dims regrouped, as
    MBart's ``attn.view(bsz, heads, tgt, src) + mask`` around a 3-d ``bmm`` or Swin's windows do. Steps
    after it see the scores in its layout; their masks are brought back to the product's (:func:`to_layout`).

    Example:
        >>> g = torch.fx.Graph(); s = g.placeholder("s")
        >>> View(g.call_method("view", (s, 2, 3, 4, 4)), s).scores is s
        True
    """

    node: Node
    scores: Node


# One step between the scores product and the softmax.
Step = Cast | Scale | AddMask | Fill | View
# A reader of one kind of step: (node, graph module, constants) -> the steps it is, a Refusal, or None.
Reader = Callable[[Node, torch.fx.GraphModule, Constants], "list[Step] | Refusal | None"]


def read_cast_step(node: Node, gm: torch.fx.GraphModule, constants: Constants) -> list[Step] | None:
    """A cast of the scores (``.float()``, ``.to(dtype)``, ``.type_as(x)``...).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(2, dtype=torch.half)
        >>> y = g.call_method("float", (x,)); y.meta["val"] = torch.ones(2)
        >>> read_cast_step(y, None, None) == [Cast(y, x)]
        True
    """
    source = read_cast(node)
    return None if source is None else [Cast(node, source)]


def per_query_row(factor: torch.Tensor) -> bool:
    """Whether a tensor scaling the scores [.., L, S] is one number for each whole score matrix: of size 1 in
    the last two dims (a learned temperature, or one per head as ``scale.view(1, H, 1, 1)``). Such a factor
    multiplies q instead: ``(q * f) @ k^T == (q @ k^T) * f`` up to rounding.

    Example:
        >>> per_query_row(torch.ones(1, 4, 1, 1)), per_query_row(torch.ones(())), per_query_row(torch.ones(4, 1))
        (True, True, False)
    """
    return all(size == 1 for size in factor.shape[-2:])


def _scale_refusal(factor: Any, scores_value: torch.Tensor, op: str) -> Refusal | None:
    """None when ``factor`` can scale the scores (by ``op``, mul or div); else why it cannot."""
    if isinstance(factor, (int, float)) and not isinstance(factor, bool):
        return None
    what = repr(factor)
    if isinstance(factor, Node):
        value = factor.meta.get("val")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return None  # a number computed from shapes
        if isinstance(value, torch.Tensor) and value.ndim <= scores_value.ndim and per_query_row(value):
            return None  # one number, or one per batch item or head: it scales q's rows alike
        if isinstance(value, torch.Tensor):
            what = f"{factor.name} of shape {tuple(value.shape)}"
    return Refusal(f"an element-wise tensor gate ({op} by {what}) is applied to the scores before softmax")


def read_scale(node: Node, gm: torch.fx.GraphModule, constants: Constants) -> list[Step] | Refusal | None:
    """Scores times or divided by a number, a number from shapes, or a tensor with one number per score
    matrix (:func:`per_query_row`: a temperature, one per head).

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(lambda s, gate: (s / 8, s * gate))
        >>> _ = annotate(gm, (torch.ones(2, 4), torch.ones(2, 4)), {})
        >>> s, gate, div, mul = list(gm.graph.nodes)[:4]
        >>> read_scale(div, gm, Constants(gm)) == [Scale(div, s, 8, divide=True)]
        True
        >>> print(read_scale(mul, gm, Constants(gm)))
        an element-wise tensor gate (mul by gate of shape (2, 4)) is applied to the scores before softmax
    """
    op = canonicalize(node, gm)
    if op is None or op.name not in ("mul", "div"):
        return None
    if op.name == "div" and op.args["rounding_mode"] is not None:
        return None
    a, b, out = op.args["input"], op.args["other"], fake_value(node)
    pairs = [(a, b), (b, a)] if op.name == "mul" else [(a, b)]
    pairs = [(s, f) for s, f in pairs
             if fake_value(s) is not None and out is not None and fake_value(s).shape == out.shape]
    for scores, factor in pairs:
        if _scale_refusal(factor, fake_value(scores), op.name) is None:
            return [Scale(node, scores, factor, op.name == "div")]
    if not pairs:
        return None
    scores, factor = pairs[0]
    return _scale_refusal(factor, fake_value(scores), op.name)


def read_additive_mask(node: Node, gm: torch.fx.GraphModule, constants: Constants
                       ) -> list[Step] | Refusal | None:
    """Scores plus (or minus) a tensor of a shape that broadcasts to theirs: a float one, or a bool or integer
    one that torch promotes to the scores' dtype (``scores + keep_bool`` adds 0.0 or 1.0).

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(lambda s, m: s - m)
        >>> _ = annotate(gm, (torch.ones(2, 4), torch.ones(4)), {})
        >>> s, m, sub = list(gm.graph.nodes)[:3]
        >>> read_additive_mask(sub, gm, Constants(gm)) == [AddMask(sub, s, m, -1.0)]
        True
    """
    op = canonicalize(node, gm)
    if op is None or op.name not in ("add", "sub") or not isinstance(op.args["alpha"], (int, float)):
        return None
    a, b, alpha = op.args["input"], op.args["other"], op.args["alpha"]
    sign = -1.0 if op.name == "sub" else 1.0
    pairs = [(a, b, sign * alpha)]
    if op.name == "add" and alpha == 1:
        pairs.append((b, a, 1.0))
    out = fake_value(node)
    if out is None:
        return None
    steps: list[Step] = []
    for scores, mask, coefficient in pairs:
        s, m = fake_value(scores), fake_value(mask)
        if s is None or m is None or s.shape != out.shape:
            continue
        if m.is_complex():
            return Refusal(f"the additive mask {mask.name} is {m.dtype}, not a real tensor")
        steps.append(AddMask(node, scores, unexpanded(mask), float(coefficient)))
    return steps or None


def unexpanded(node: Any) -> Any:
    """x for ``node`` = x expanded (``expand``, ``expand_as``, ``broadcast_to``), else ``node``: a mask reaches
    SDPA as it is, which broadcasts it as the expand did (DistilBERT's ``mask.expand_as(scores)`` reads only
    the scores' shape; the replacement must not read the scores).

    Example:
        >>> g = torch.fx.Graph(); m, s = g.placeholder("m"), g.placeholder("s")
        >>> unexpanded(g.call_method("expand_as", (m, s))) is m
        True
    """
    while calls(node, "expand") and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _fill(node: Node, scores: Any, condition: Any, keeps: bool, value: Any, constants: Constants
          ) -> Step | Refusal | None:
    if fake_value(scores) is None or fake_value(node) is None:
        return None
    if fake_value(scores).shape != fake_value(node).shape:
        return None
    if fake_value(condition) is None or fake_value(condition).dtype != torch.bool:
        return None
    number = constants.number(value)
    if number is None:
        return Refusal(f"the scores are filled with {getattr(value, 'name', value)}, which is not a constant")
    # the number as the scores hold it (rounded to their dtype)
    number = torch.tensor(number, dtype=torch.float64).to(fake_value(node).dtype).item()
    return Fill(node, scores, unexpanded(condition), keeps, number)


def read_fill(node: Node, gm: torch.fx.GraphModule, constants: Constants) -> list[Step] | Refusal | None:
    """``masked_fill(mask, value)`` (also in place) or ``where(keep, scores, value)`` with a bool mask.

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(lambda s, keep: torch.where(keep, s, float("-inf")))
        >>> _ = annotate(gm, (torch.ones(2, 4), torch.ones(4, dtype=torch.bool)), {})
        >>> s, keep, where = list(gm.graph.nodes)[:3]
        >>> read_fill(where, gm, Constants(gm)) == [Fill(where, s, keep, keeps=True, value=float("-inf"))]
        True
    """
    if calls(node, "masked_fill"):
        scores, mask = argument(node, 0, "input"), argument(node, 1, "mask")
        found = [_fill(node, scores, mask, False, argument(node, 2, "value"), constants)]
    elif calls(node, "where"):
        # where(condition, input, other); x.where(condition, y) is where(condition, x, y)
        method = node.op == "call_method"
        names = ("input", "condition", "other") if method else ("condition", "input", "other")
        bound = {name: argument(node, i, name) for i, name in enumerate(names)}
        condition, a, b = bound["condition"], bound["input"], bound["other"]
        found = [_fill(node, a, condition, True, b, constants),
                 _fill(node, b, condition, False, a, constants)]
    else:
        return None
    steps = [f for f in found if isinstance(f, Fill)]
    return steps or next((f for f in found if isinstance(f, Refusal)), None)


def read_view(node: Node, gm: torch.fx.GraphModule, constants: Constants) -> list[Step] | Refusal | None:
    """A reshape of the scores (``view``, ``reshape``, ``flatten``, ``unsqueeze``) that keeps their last two
    dims and regroups only the batch dims, with sizes fixed by the input signature.

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(lambda s: (s.view(2, 3, 4, 5), s.view(6, 20)))
        >>> _ = annotate(gm, (torch.ones(6, 4, 5),), {})
        >>> s, batch, rows = list(gm.graph.nodes)[:3]
        >>> read_view(batch, gm, None) == [View(batch, s)]
        True
        >>> print(read_view(rows, gm, None))
        a view of the scores from (6, 4, 5) to (6, 20) changes their last two (query, key) dims
    """
    if not calls(node, "view", "reshape", "flatten", "unsqueeze") or not node.args:
        return None
    scores, before, after = node.args[0], fake_value(node.args[0]), fake_value(node)
    if before is None or after is None or before.ndim < 2 or after.ndim < 2:
        return None
    if not all(isinstance(d, int) for d in (*before.shape, *after.shape)):
        return Refusal("a view of the scores with sizes that change from call to call")
    shapes = f"from {tuple(before.shape)} to {tuple(after.shape)}"
    if tuple(before.shape[-2:]) != tuple(after.shape[-2:]) or before.numel() == 0:
        return Refusal(f"a view of the scores {shapes} changes their last two (query, key) dims")
    return [View(node, scores)]


def _groups(source: tuple[int, ...], target: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """The dims of ``source`` and ``target`` (shapes of one number of elements) paired into the smallest
    groups that hold the same elements in row-major order: ``(2, 3, 4)`` and ``(6, 4)`` -> ``[([0, 1], [0]),
    ([2], [1])]``."""
    groups, i, j = [], 0, 0
    while i < len(source) or j < len(target):
        dims_s, dims_t, size_s, size_t = [], [], 1, 1
        if i < len(source):
            dims_s, size_s, i = [i], source[i], i + 1
        if j < len(target):
            dims_t, size_t, j = [j], target[j], j + 1
        while size_s != size_t:
            if size_s < size_t:
                dims_s.append(i)
                size_s, i = size_s * source[i], i + 1
            else:
                dims_t.append(j)
                size_t, j = size_t * target[j], j + 1
        groups.append((dims_s, dims_t))
    return groups


def to_layout(builder: Any, mask: Any, shape: tuple[int, ...], source: tuple[int, ...],
              target: tuple[int, ...]) -> Any:
    """``mask`` (of ``shape``, broadcast over scores of shape ``source``) as eager applied it, for scores of
    shape ``target`` (the same scores, the batch dims regrouped by a :class:`View`): where the mask
    broadcast over every dim of a group it still does, else it is expanded over that group first.

    ``builder`` emits the ops (:mod:`~.folds`). Example:
        >>> from fxforge.rewrites.attention.folds import EagerBuilder
        >>> mask = torch.tensor([[0.0, -1.0]]).view(1, 1, 1, 2)   # [1, windows] over [batch, windows, 1, 2]
        >>> to_layout(EagerBuilder(None), mask, (1, 1, 1, 2), (3, 1, 1, 2), (3, 1, 2)).shape
        torch.Size([1, 1, 2])
        >>> to_layout(EagerBuilder(None), mask.view(1, 2, 1, 1), (1, 2, 1, 1), (3, 2, 1, 1), (6, 1, 1)).shape
        torch.Size([6, 1, 1])
    """
    if tuple(source) == tuple(target):
        return mask
    padded = (1,) * (len(source) - len(shape)) + tuple(shape)
    expanded, regrouped = list(padded[-2:]), list(padded[-2:])
    for dims_s, dims_t in reversed(_groups(tuple(source[:-2]), tuple(target[:-2]))):
        broadcast = all(padded[d] == 1 for d in dims_s)
        expanded[:0] = [1 if broadcast else source[d] for d in dims_s]
        regrouped[:0] = [1 if broadcast else target[d] for d in dims_t]
    if tuple(padded) != tuple(shape):
        mask = builder.call("reshape", mask, list(padded))
    if expanded != list(padded):
        mask = builder.call("expand", mask, expanded)
    return builder.call("reshape", mask, regrouped)


# Read top to bottom: the first reader that recognises a node says what step it is.
SCORE_STEPS: list[Reader] = [read_cast_step, read_scale, read_additive_mask, read_fill, read_view]
