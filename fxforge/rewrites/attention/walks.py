"""The walks from a softmax: back through the score steps to the scores product, forward to the value product.

:func:`walk_scores` follows the softmax's input back through :data:`~.steps.SCORE_STEPS` (and steps applied
in place, which the graph shows only as extra users) to ``q @ k^T``; :func:`walk_probs` follows the
probabilities forward through casts and dropout that does not drop to ``probs @ v``. Anything else on the
way is a refusal that names it.

Example:
    >>> from fxforge.core.shapes import annotate
    >>> gm = torch.fx.symbolic_trace(lambda q, k, v: torch.softmax((q @ k.mT).float() / 8, -1) @ v)
    >>> _ = annotate(gm, (torch.randn(1, 2, 4, 8),) * 3, {})
    >>> softmax = next(n for n in gm.graph.nodes if n.name == "softmax")
    >>> [type(s).__name__ for s in walk_scores(softmax.args[0], softmax, gm, Constants(gm)).steps]
    ['Cast', 'Scale']
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from fxforge.core.nodes import fake_value, is_inplace
from fxforge.core.vocabulary import calls, read_dropout
from fxforge.rewrites.attention.constants import Constants
from fxforge.rewrites.attention.operands import Operand, scores_operands, value_operand
from fxforge.rewrites.attention.readers import describe, ignorable, read_cast
from fxforge.rewrites.attention.steps import SCORE_STEPS, Step
from fxforge.rewrites.passes import Refusal

_NONLINEAR = {"relu", "gelu", "silu", "sigmoid", "tanh", "hardtanh", "leaky_relu", "hardswish", "exp", "log",
              "abs", "clamp", "clip", "pow", "sqrt", "rsqrt", "square", "softplus", "elu", "sin", "cos",
              "erf", "log_softmax", "softmax", "sign", "round", "floor", "ceil", "maximum", "minimum", "max",
              "min"}


def _capped(tanh: Node) -> bool:
    """Whether ``tanh`` reads its input divided (or multiplied) by a number: ``tanh(scores / cap)``."""
    inner = tanh.args[0] if tanh.args else None
    return (isinstance(inner, Node) and calls(inner, "div", "mul") and len(inner.args) == 2
            and any(isinstance(a, (int, float)) for a in inner.args))


def _unknown_step(node: Node, gm: torch.fx.GraphModule) -> Refusal:
    name = describe(node, gm)
    if name.rstrip("_").lower() == "tanh" and _capped(node):
        return Refusal("the scores are soft-capped (cap * tanh(scores / cap), as Gemma 2 writes them) before softmax: "
                       "scaled_dot_product_attention has no soft cap")
    if name.rstrip("_").lower() in _NONLINEAR:
        return Refusal(f"a non-linear function ({name}) is applied to the scores before softmax")
    return Refusal(f"{name} between the scores product and softmax is not a scale, a mask or a cast")


@dataclasses.dataclass(frozen=True)
class Scores:
    """The scores side: the product, q and k, and the steps from the product to the softmax, in order.

    Example:
        >>> g = torch.fx.Graph(); q, k = g.placeholder("q"), g.placeholder("k")
        >>> Scores(g.call_function(torch.matmul, (q, k)), Operand(q), Operand(k, swap=True), ()).k.swap
        True
    """

    product: Node
    q: Operand
    k: Operand
    steps: tuple[Step, ...]


def _inplace_steps(node: Node, consumer: Node, gm: torch.fx.GraphModule, constants: Constants
                   ) -> list[Step] | Refusal:
    """Steps applied to ``node`` in place (``scores.masked_fill_(...)`` as a statement) before ``consumer``
    reads it; their results are unused, so the graph only shows them as extra users of ``node``."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    steps: list[Step] = []
    for user in sorted(node.users, key=position.__getitem__):
        if position[user] > position[consumer] or user.users or not is_inplace(user, gm):
            continue
        if user.args[:1] != (node,):
            continue
        found = next((r for r in (read(user, gm, constants) for read in SCORE_STEPS) if r is not None), None)
        step = next((s for s in found if s.scores is node), None) if isinstance(found, list) else None
        if step is None:
            return found if isinstance(found, Refusal) else _unknown_step(user, gm)
        steps.append(step)
    return steps


def walk_scores(node: Node, consumer: Node, gm: torch.fx.GraphModule, constants: Constants,
                depth: int = 0) -> Scores | Refusal:
    """Walk back from ``node`` (what ``consumer`` reads) through :data:`~.steps.SCORE_STEPS` to the scores
    product.

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(lambda q, k: torch.softmax((q @ k.mT).relu(), -1))
        >>> _ = annotate(gm, (torch.randn(1, 2, 4, 8),) * 2, {})
        >>> softmax = next(n for n in gm.graph.nodes if n.name == "softmax")
        >>> print(walk_scores(softmax.args[0], softmax, gm, Constants(gm)))
        a non-linear function (relu) is applied to the scores before softmax
    """
    if depth > 32:
        return Refusal("more than 32 steps between the scores product and softmax")
    inplace = _inplace_steps(node, consumer, gm, constants)
    if isinstance(inplace, Refusal):
        return inplace
    found = scores_operands(node, gm)
    if isinstance(found, Refusal):
        return found
    if found is not None:
        return Scores(node, found[0], found[1], tuple(inplace))
    steps = next((r for r in (reader(node, gm, constants) for reader in SCORE_STEPS) if r is not None), None)
    if steps is None:
        return _unknown_step(node, gm)
    if isinstance(steps, Refusal):
        return steps
    failure: Refusal | None = None
    for step in steps:
        result = walk_scores(step.scores, node, gm, constants, depth + 1)
        if isinstance(result, Scores):
            return dataclasses.replace(result, steps=(*result.steps, step, *inplace))
        failure = failure or result
    return failure


def _regroups_batch_dims(view: Node, probs: Node) -> bool:
    """Whether ``view`` reshapes ``probs`` keeping their last two (query, key) dims: BLOOM's softmax over
    [B, H, L, S] viewed back as the [B * H, L, S] of its batched products (:func:`~.checks.check_views` then
    requires it to be their layout)."""
    if not calls(view, "view", "reshape") or not view.args or view.args[0] is not probs:
        return False
    before, after = fake_value(probs), fake_value(view)
    return (before is not None and after is not None and after.ndim >= 2
            and tuple(before.shape[-2:]) == tuple(after.shape[-2:]))


@dataclasses.dataclass(frozen=True)
class Values:
    """The values side: casts and no-op dropouts after the softmax, the value product, v, output layout.

    Example:
        >>> g = torch.fx.Graph(); p, v = g.placeholder("p"), g.placeholder("v")
        >>> Values((), g.call_function(torch.matmul, (p, v)), Operand(v), None).v.plain
        True
    """

    between: tuple[Node, ...]
    product: Node
    v: Operand
    out_perm: tuple[int, ...] | None


def walk_probs(softmax: Node, gm: torch.fx.GraphModule) -> Values | Refusal:
    """Walk forward from the softmax through casts and dropout to the product with the values.

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(lambda s, v: torch.dropout(s.softmax(-1), 0.1, False) @ v)
        >>> _ = annotate(gm, (torch.randn(1, 2, 4, 4),) * 2, {})
        >>> softmax = next(n for n in gm.graph.nodes if n.name == "softmax")
        >>> [n.name for n in walk_probs(softmax, gm).between]
        ['dropout']
    """
    node, between = softmax, []
    while True:
        users = [u for u in node.users if not ignorable(u, gm)]
        for user in users:
            found = value_operand(user, node, gm)
            if found is not None:
                return found if isinstance(found, Refusal) else Values(tuple(between), user, *found)
        following = [u for u in users if read_cast(u) is node or getattr(read_dropout(u, gm), "input", None) is node
                     or _regroups_batch_dims(u, node)]
        if len(following) != 1:
            others = [u for u in users if u not in following]
            name = describe(others[0], gm) if others else "nothing"
            return Refusal(f"{name} between softmax and the value product "
                           "(only casts, dropout and views of the batch dims may be there)")
        dropout = read_dropout(following[0], gm)
        if dropout is not None and dropout.drops:
            return Refusal(f"dropout (p={dropout.p}) on the attention probabilities is active in training "
                           "mode: SDPA's dropout draws different random numbers, so the result could not be "
                           "verified")
        node = following[0]
        between.append(node)
