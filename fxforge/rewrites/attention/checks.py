"""One attention read around a softmax (:class:`Attention`), and the checks it must pass to be replaced.

:func:`read_attention` walks from a softmax to both products; :data:`CHECKS` then say, top to bottom, why
the replacement would not be exact (each returns a :class:`~fxforge.rewrites.passes.Refusal`, or None);
:func:`find_gqa` finds K and V repeated per head, which SDPA takes un-repeated with ``enable_gqa=True``.

Example:
    >>> attend = lambda q, k, v: torch.softmax(q @ k.mT / 8, -1) @ v
    >>> gm, attention = trace_attention(attend, *[torch.randn(1, 2, 4, 8)] * 3)
    >>> [n.name for n in attention.nodes], [check(attention, gm) for check in CHECKS]
    (['matmul', 'truediv', 'softmax', 'matmul_1'], [None, None, None, None, None, None])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import fake_value, mutated_aliases
from fxforge.core.shapes import annotate
from fxforge.core.vocabulary import calls, reads_metadata
from fxforge.rewrites.attention.constants import Constants
from fxforge.rewrites.attention.operands import Operand, repeated_heads, untransposed
from fxforge.rewrites.attention.readers import Softmax, ignorable, read_softmax
from fxforge.rewrites.attention.steps import AddMask, Cast, Scale, View
from fxforge.rewrites.attention.walks import Scores, Values, walk_probs, walk_scores
from fxforge.rewrites.passes import Refusal

aten = torch.ops.aten

# Whether this torch's SDPA takes K and V with fewer heads than Q (``enable_gqa``).
SDPA_HAS_GQA = any(a.name == "enable_gqa"
                   for a in aten.scaled_dot_product_attention.default._schema.arguments)


@dataclasses.dataclass
class Attention:
    """One attention found at a softmax: everything the replacement needs.

    Attributes:
        softmax: the anchor.
        scores: the scores product, q, k and the steps to the softmax.
        values: the casts/dropouts after the softmax, the value product, v and the output layout.
        gqa: ``(k, v, n)`` un-repeated when K and V repeat each head n times, else None.

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> from fxforge.rewrites.attention.readers import read_softmax
        >>> gm = torch.fx.symbolic_trace(lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v)
        >>> _ = annotate(gm, (torch.randn(1, 2, 4, 8, dtype=torch.half),) * 3, {})
        >>> read_attention(read_softmax(list(gm.graph.nodes)[5], gm), gm, Constants(gm)).dtype
        torch.float16
    """

    softmax: Softmax
    scores: Scores
    values: Values
    gqa: tuple[Operand, Operand, int] | None = None

    @property
    def nodes(self) -> list[Node]:
        """The nodes the replacement removes, in graph order."""
        position = {n: i for i, n in enumerate(self.softmax.node.graph.nodes)}
        nodes = {self.scores.product, *(s.node for s in self.scores.steps), self.softmax.node,
                 *self.values.between, self.values.product}
        return sorted(nodes, key=position.__getitem__)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of q, which the attention runs in."""
        return fake_value(self.scores.q.node).dtype


def read_attention(softmax: Softmax, gm: torch.fx.GraphModule, constants: Constants) -> Attention | Refusal:
    """The attention around ``softmax`` (over the last dim) from the scores product to the value product,
    not yet checked; or why there is none.

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> from fxforge.rewrites.attention.readers import read_softmax
        >>> gm = torch.fx.symbolic_trace(lambda q, k, v: torch.softmax(q @ k.mT, 2) @ v)
        >>> _ = annotate(gm, (torch.randn(1, 2, 4, 8),) * 3, {})
        >>> print(read_attention(read_softmax(list(gm.graph.nodes)[5], gm), gm, Constants(gm)))
        softmax over dim 2 of 4, not the last (key) dim
    """
    ndim = fake_value(softmax.node).ndim
    if softmax.dim != ndim - 1:
        return Refusal(f"softmax over dim {softmax.dim} of {ndim}, not the last (key) dim")
    scores = walk_scores(softmax.input, softmax.node, gm, constants)
    if isinstance(scores, Refusal):
        return scores
    values = walk_probs(softmax.node, gm)
    if isinstance(values, Refusal):
        return values
    return Attention(softmax, scores, values)


def trace_attention(fn: Any, *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, Attention | Refusal]:
    """``fn`` traced, with shape metadata for ``inputs``, and the attention around its first softmax (for
    examples and tests; the pass itself reads every softmax of a graph).

    Example:
        >>> attend = lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v
        >>> gm, attention = trace_attention(attend, *[torch.randn(1, 2, 4, 8)] * 3)
        >>> attention.dtype, attention.values.product.name
        (torch.float32, 'matmul_1')
    """
    gm = torch.fx.symbolic_trace(fn)
    annotate(gm, inputs, {})
    softmax = next(s for s in (read_softmax(n, gm) for n in gm.graph.nodes) if s is not None)
    return gm, read_attention(softmax, gm, Constants(gm))


def metadata_reads(attention: Attention, node: Node) -> list[Node]:
    """Users of ``node`` that only read its dtype or device (``scores.dtype`` in a traced graph), where q has
    the same: they read q's instead, so ``node`` can go.

    Example:
        >>> attend = lambda q, k, v: torch.softmax(q @ k.mT, -1).to((q @ k.mT).dtype) @ v
        >>> gm, attention = trace_attention(attend, *[torch.randn(1, 2, 4, 8)] * 3)
        >>> metadata_reads(attention, attention.scores.product)
        []
    """
    q = fake_value(attention.scores.q.node)
    value = fake_value(node)
    return [u for u in node.users if u.op == "call_function" and u.target is getattr and u.args[0] is node
            and u.args[1] in ("dtype", "device") and value is not None
            and (value.dtype, value.device) == (q.dtype, q.device)]


def shape_reads(attention: Attention, node: Node) -> list[Node]:
    """Users of ``node`` that read only its shape (``x.expand_as(scores)``, ``scores.shape``, ``size``) and
    whose results reach nothing but the attention's own nodes: they go with the attention, so they are no
    use of the scores' values.

    Example:
        >>> attend = lambda q, k, v, m: (lambda s: s.masked_fill(m.expand_as(s), -1e9))(q @ k.mT).softmax(-1) @ v
        >>> q, m = torch.randn(1, 2, 4, 8), torch.zeros(1, 1, 1, 4, dtype=torch.bool)
        >>> gm, attention = trace_attention(attend, q, q, q, m)
        >>> [n.name for n in shape_reads(attention, attention.scores.product)]
        ['expand_as']
    """
    inside = set(attention.nodes)
    found = []
    for user in node.users:
        reads = (reads_metadata(user) and user.args[:1] == (node,)) or (
            calls(user, "expand") and bool(user.args) and user.args[0] is not node)
        if reads and _dies_with(user, inside):
            found.append(user)
    return found


def _dies_with(node: Node, inside: set[Node]) -> bool:
    """Whether everything computed from ``node`` ends in ``inside`` (so it can be erased with it)."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in inside or current in seen:
            continue
        if current.op == "output" or current.op not in ("call_function", "call_method") or not current.users:
            return False
        seen.add(current)
        stack.extend(current.users)
    return True


def _inputs(attention: Attention) -> list[Node]:
    """The graph values the replacement reads: q, k, v and what the steps scale, add and fill with."""
    nodes = [attention.scores.q.node, attention.scores.k.node, attention.values.v.node]
    for step in attention.scores.steps:
        nodes.extend(n for n in (getattr(step, "mask", None), getattr(step, "condition", None),
                                 getattr(step, "factor", None)) if isinstance(n, Node))
    return nodes


def check_metadata(attention: Attention, gm: torch.fx.GraphModule) -> Refusal | None:
    """Every value involved has shape metadata, and none of the replacement's inputs is a removed node.

    Example:
        >>> attend = lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v
        >>> gm, attention = trace_attention(attend, *[torch.randn(1, 2, 4, 8)] * 3)
        >>> del attention.scores.q.node.meta["val"]; print(check_metadata(attention, gm))
        no shape metadata for q
    """
    step_inputs = [getattr(s, name, None) for s in attention.scores.steps for name in ("mask", "condition")]
    tensors = [attention.scores.q.node, attention.scores.k.node, attention.values.v.node, *attention.nodes,
               *(n for n in step_inputs if n is not None)]
    missing = [n.name for n in tensors if fake_value(n) is None]
    if missing:
        return Refusal(f"no shape metadata for {', '.join(missing)}")
    inside = set(attention.nodes)
    for node in _inputs(attention):
        if node in inside:
            return Refusal(f"{node.name} is both an input of the attention and part of it")
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = position[attention.scores.product]
    for node in _inputs(attention):
        source = _computed_from(attention, node, position, first)
        if source is not None:
            return Refusal(f"{node.name}, an input of the attention, is computed from its {source.name}")
    return None


def _computed_from(attention: Attention, node: Node, position: dict[Node, int], first: int) -> Node | None:
    """A node of the attention that ``node`` is computed from, else None (only nodes after ``first`` can
    be); reading its dtype or device does not count (:func:`metadata_reads`: q's are read instead)."""
    inside = set(attention.nodes)
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        for parent in current.all_input_nodes:
            if parent in inside and current not in metadata_reads(attention, parent):
                return parent
            if parent in inside:
                continue
            if parent not in seen and position[parent] > first:
                seen.add(parent)
                stack.append(parent)
    return None


def check_users(attention: Attention, gm: torch.fx.GraphModule) -> Refusal | None:
    """Scores and probabilities must be used only on the way to the value product.

    Example:
        >>> attend = lambda q, k, v: (lambda p: (p @ v, p))(torch.softmax(q @ k.mT, -1))
        >>> gm, attention = trace_attention(attend, *[torch.randn(1, 2, 4, 8)] * 3)
        >>> print(check_users(attention, gm))
        the attention probabilities (softmax) are also used by output (returned or reused)
    """
    inside = set(attention.nodes)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in attention.nodes[:-1]:
        reads = metadata_reads(attention, node) + shape_reads(attention, node)
        outside = [u.name for u in node.users if u not in inside and not ignorable(u, gm) and u not in reads]
        if not outside:
            continue
        after_softmax = position[node] >= position[attention.softmax.node]
        if after_softmax:
            return Refusal(f"the attention probabilities ({node.name}) are also used by {', '.join(outside)} "
                           "(returned or reused)")
        return Refusal(f"the attention scores ({node.name}) are also used by {', '.join(outside)}")
    return None


def check_dtypes(attention: Attention, gm: torch.fx.GraphModule) -> Refusal | None:
    """q, k, v and the output share one floating dtype; casts never drop below it; float masks have it.

    Example:
        >>> attend = lambda q, k, v: torch.softmax(q @ k.mT, -1).half() @ v.half()
        >>> gm, attention = trace_attention(attend, *[torch.randn(1, 2, 4, 8)] * 3)
        >>> print(check_dtypes(attention, gm).reason.replace("torch.", ""))
        query, key, value and output dtypes differ (q float32, k float32, v float16, output float16)
    """
    scores, values = attention.scores, attention.values
    operands = (("q", scores.q), ("k", scores.k), ("v", values.v))
    dtypes = {name: fake_value(o.node).dtype for name, o in operands}
    dtypes["output"] = fake_value(values.product).dtype
    if len(set(dtypes.values())) > 1:
        return Refusal("query, key, value and output dtypes differ ("
                       + ", ".join(f"{k} {v}" for k, v in dtypes.items()) + ")")
    dtype = attention.dtype
    if not dtype.is_floating_point:
        return Refusal(f"the attention runs in {dtype}, not a floating dtype")
    chain = [scores.product, *(s.node for s in scores.steps), attention.softmax.node, *values.between]
    for node in chain:
        if fake_value(node) is None or not fake_value(node).is_floating_point():
            return Refusal(f"no floating-point shape metadata for {node.name}")
        if torch.finfo(fake_value(node).dtype).eps > torch.finfo(dtype).eps:
            return Refusal(f"{node.name} casts the attention to {fake_value(node).dtype}, "
                           f"below the query's {dtype}")
    for step in scores.steps:
        mask = fake_value(step.mask) if isinstance(step, AddMask) else None
        if mask is not None and mask.is_floating_point() and mask.dtype != dtype:
            return Refusal(f"the additive mask {step.mask.name} is {fake_value(step.mask).dtype}, "
                           f"the attention {dtype}")
        if not isinstance(step, Cast) and fake_value(step.node).dtype != fake_value(step.scores).dtype:
            return Refusal(f"{step.node.name} changes the scores' dtype")
    return None


def check_layout(attention: Attention, gm: torch.fx.GraphModule) -> Refusal | None:
    """q [.., L, E], k [.., S, E] and v [.., S, Ev] with the same batch dims (SDPA does not broadcast them).

    Example:
        >>> attend = lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v
        >>> q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)  # k: one head, q: two
        >>> gm, attention = trace_attention(attend, q, k, q)
        >>> print(check_layout(attention, gm))
        query (1, 2, 4, 8), key (1, 1, 4, 8) and value (1, 2, 4, 8) do not line up without broadcasting
    """
    q, k, v = attention.scores.q.shape, attention.scores.k.shape, attention.values.v.shape
    scores = tuple(fake_value(attention.values.between[-1] if attention.values.between else attention.softmax.node
                              ).shape)  # (the probabilities as the value product reads them)
    if not (len(q) == len(k) == len(v) == len(scores)) or len(q) < 2:
        return Refusal(f"query, key and value have {len(q)}, {len(k)} and {len(v)} dims")
    if q[:-2] != k[:-2] or q[:-2] != v[:-2] or q[-1] != k[-1] or k[-2] != v[-2] or scores != (*q[:-1], k[-2]):
        return Refusal(f"query {q}, key {k} and value {v} do not line up without broadcasting")
    return None


def check_inputs_unchanged(attention: Attention, gm: torch.fx.GraphModule) -> Refusal | None:
    """The replacement reads its inputs at the value product: none may be changed in place meanwhile.

    Example:
        >>> apply = lambda p, v: (p @ v, v.mul_(2))  # v changes after the value product reads it
        >>> attend = lambda q, k, v: apply(torch.softmax(q @ k.mT, -1), v)
        >>> gm, attention = trace_attention(attend, *[torch.randn(1, 2, 4, 8)] * 3)
        >>> print(check_inputs_unchanged(attention, gm))
        v (or a view of it) is changed in place
    """
    for node in _inputs(attention):
        if mutated_aliases(node, gm):
            return Refusal(f"{node.name} (or a view of it) is changed in place")
    return None


def check_views(attention: Attention, gm: torch.fx.GraphModule) -> Refusal | None:
    """Views between the scores product and softmax (:class:`~.steps.View`) must bring the scores back to
    the product's layout, and a tensor scale must be applied in that layout (it multiplies q).

    Example:
        >>> attend = lambda q, k, v: torch.softmax((q @ k.mT).view(2, 1, 4, 4), -1) @ v.view(2, 1, 4, 8)
        >>> gm, attention = trace_attention(attend, *[torch.randn(2, 4, 8)] * 3)
        >>> print(check_views(attention, gm))
        the scores reach softmax as (2, 1, 4, 4), not in the layout of their product (2, 4, 4)
    """
    steps = attention.scores.steps
    if not any(isinstance(s, View) for s in steps):
        return None
    product = tuple(fake_value(attention.scores.product).shape)
    final = tuple(fake_value(attention.softmax.input).shape)
    between = attention.values.between
    if final != product and between and tuple(fake_value(between[-1]).shape) == product:
        final = product  # viewed back after softmax (BLOOM): softmax over the last dim is the same in both layouts
    if final != product:
        return Refusal(f"the scores reach softmax as {final}, not in the layout of their product {product}")
    for step in steps:
        if isinstance(step, Scale) and step.is_tensor and tuple(fake_value(step.node).shape) != product:
            return Refusal(f"the tensor scale {step.factor.name} is applied to the scores viewed as "
                           f"{tuple(fake_value(step.node).shape)}, not in the layout of their product {product}")
    return None


# Read top to bottom: the first refusal stands.
CHECKS: list[Callable[[Attention, torch.fx.GraphModule], Refusal | None]] = [
    check_metadata,
    check_users,
    check_dtypes,
    check_views,
    check_layout,
    check_inputs_unchanged,
]


def find_gqa(attention: Attention) -> tuple[Operand, Operand, int] | None:
    """Un-repeated k and v when both repeat each of their heads n times (and SDPA can take them so).

    Example:
        >>> rep = lambda t: t.repeat_interleave(2, dim=1)
        >>> attend = lambda q, k, v: torch.softmax(q @ rep(k).mT, -1) @ rep(v)
        >>> q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
        >>> gm, attention = trace_attention(attend, q, kv, kv)
        >>> find_gqa(attention)[2] if SDPA_HAS_GQA else 2
        2
    """
    if not SDPA_HAS_GQA:
        return None
    k, v = attention.scores.k, attention.values.v
    if k.perm is not None or not v.plain:
        return None
    if k.swap:  # q @ repeat(k^T): the repeat is on the transposed tensor
        repeat = repeated_heads(k.node)
        small_k = (untransposed(repeat[0]), repeat[1]) if repeat else None
    else:
        repeat = repeated_heads(k.node)
        small_k = (Operand(repeat[0]), repeat[1]) if repeat else None
    small_v = repeated_heads(v.node)
    if small_k is None or small_v is None or small_k[1] != small_v[1] or small_k[0].perm is not None:
        return None
    return small_k[0], Operand(small_v[0]), small_v[1]
