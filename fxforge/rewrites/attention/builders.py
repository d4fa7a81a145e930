"""Building the replacement: the SDPA call and what it needs, as graph nodes, and the report's line for it.

:class:`GraphBuilder` emits torch calls in traced graphs and ATen ops in exported ones (so they stay ATen);
:func:`build` folds q, k, v, the scale and the mask (:mod:`~.folds`) into one SDPA call, patching rows in
which every key is masked when the plan says so, and query rows with a NaN (eager gives NaN there).

Example:
    >>> from fxforge.rewrites.attention.checks import trace_attention
    >>> attend = lambda q, k, v: torch.softmax(q @ k.mT / 8, -1) @ v
    >>> gm, attention = trace_attention(attend, *[torch.randn(1, 2, 4, 8)] * 3)
    >>> out = build(attention, MaskPlan("none"), GraphBuilder(gm, attention.values.product, aten_ops=False))
    >>> sdpa = out.args[2]   # where(a query row has a NaN, NaN, sdpa)
    >>> sdpa.target is F.scaled_dot_product_attention, sdpa.kwargs["scale"]
    (True, 0.125)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from fxforge.core.nodes import fake_value
from fxforge.core.shapes import propagate_meta
from fxforge.core.vocabulary import calls
from fxforge.rewrites.attention.checks import Attention
from fxforge.rewrites.attention.constants import Constants
from fxforge.rewrites.attention.folds import fold_keep, fold_mask
from fxforge.rewrites.attention.guards import NAN_ROWS
from fxforge.rewrites.attention.index_masks import Keep, holds_everywhere, read_mask
from fxforge.rewrites.attention.kernel_choice import strided_last_dim
from fxforge.rewrites.attention.masks import LARGE_NEGATIVE, MaskPlan
from fxforge.rewrites.attention.operands import Operand
from fxforge.rewrites.attention.steps import Scale

F = nn.functional
aten = torch.ops.aten

# name -> (symbolic-trace target, ATen target)
_TARGETS: dict[str, tuple[Callable, Any]] = {
    "transpose": (torch.transpose, aten.transpose.int),
    "permute": (torch.permute, aten.permute.default),
    "unsqueeze": (torch.unsqueeze, aten.unsqueeze.default),
    "squeeze": (torch.squeeze, aten.squeeze.dim),
    "mul": (torch.mul, aten.mul.Tensor),
    "div": (torch.div, aten.div.Tensor),
    "add": (torch.add, aten.add.Tensor),
    "logical_not": (torch.logical_not, aten.logical_not.default),
    "logical_and": (torch.logical_and, aten.logical_and.default),
    "zeros_like": (torch.zeros_like, aten.zeros_like.default),
    "masked_fill": (torch.masked_fill, aten.masked_fill.Scalar),
    "any": (torch.any, aten.any.dim),
    "sum": (torch.sum, aten.sum.dim_IntList),
    "all": (torch.all, aten.all.dim),
    "isnan": (torch.isnan, aten.isnan.default),
    "eq": (torch.eq, aten.eq.Scalar),
    "le": (torch.le, aten.le.Scalar),
    "mean": (torch.mean, aten.mean.dim),
    "repeat_interleave": (torch.repeat_interleave, aten.repeat_interleave.self_int),
    "reshape": (torch.reshape, aten.reshape.default),
    "expand": (torch.Tensor.expand, aten.expand.default),
    "size": (aten.sym_size.int, aten.sym_size.int),
    "contiguous": (torch.clone, aten.clone.default),
    "to": (torch.Tensor.to, aten._to_copy.default),
    "sdpa": (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default),
    "nan_rows": (NAN_ROWS, NAN_ROWS),
}
# The SDPA call in both forms (traced graphs, exported ones): what :func:`build` emits.
SDPA_TARGETS = _TARGETS["sdpa"]


class GraphBuilder:
    """Emits the replacement's nodes before ``anchor``: torch calls in traced graphs, ATen ops in exported
    ones.

    Masks reach SDPA narrowed (:meth:`value`): a condition AND-ed with one that constants prove all-True
    (or, with symbolic sizes, that :func:`~fxforge.rewrites.attention.index_masks.holds_everywhere` proves
    true for every size) is dropped, so a ``[B, 1, 1, S]`` padding mask spread over the queries by ``q_idx >= 0``
    (transformers' mask builders) stays ``[B, 1, 1, S]`` and SDPA broadcasts it, instead of an S x S
    tensor being built.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x.relu()); x, relu = list(gm.graph.nodes)[:2]
        >>> GraphBuilder(gm, relu, aten_ops=True).call("transpose", x, -2, -1).target
        <OpOverload(op='aten.transpose', overload='int')>
    """

    def __init__(self, gm: torch.fx.GraphModule, anchor: Node, aten_ops: bool,
                 constants: Constants | None = None):
        self.gm, self.graph, self.anchor, self.aten_ops = gm, gm.graph, anchor, aten_ops
        self.constants = constants
        self.nodes: list[Node] = []

    def value(self, node: Any) -> Any:
        """``node`` as SDPA's mask takes it: narrowed when constants are known, else as it is."""
        return self._narrowed(node) if self.constants is not None else node

    def _narrowed(self, node: Any, depth: int = 0) -> Any:
        """``node``'s value up to broadcasting, without AND-ed conditions proven all-True."""
        if not isinstance(node, Node) or node.op != "call_function" or depth > 16:
            return node
        is_bool = getattr(fake_value(node), "dtype", None) == torch.bool
        if calls(node, "logical_and") and is_bool and len(node.args) == 2:
            a, b = node.args
            for other, kept in ((a, b), (b, a)):
                value = self.constants.value(other)
                if isinstance(value, torch.Tensor) and value.dtype == torch.bool and bool(value.all()):
                    return self._narrowed(kept, depth + 1)
                if not isinstance(value, torch.Tensor):  # symbolic sizes: a formula over positions, always true?
                    keep = read_mask(other)
                    if isinstance(keep, Keep) and holds_everywhere(keep):
                        return self._narrowed(kept, depth + 1)
            new_a, new_b = self._narrowed(a, depth + 1), self._narrowed(b, depth + 1)
            return node if (new_a, new_b) == (a, b) else self.call("logical_and", new_a, new_b)
        if calls(node, "where") and node.args and isinstance(node.args[0], Node):
            condition = self._narrowed(node.args[0], depth + 1)
            if condition is node.args[0]:
                return node
            return self._emit(node.target, (condition, *node.args[1:]), dict(node.kwargs))
        return node

    def _emit(self, target: Any, args: tuple, kwargs: dict) -> Node:
        existing = self._existing(target, args, kwargs)
        if existing is not None:  # an earlier replacement computed it (one mask narrowed for every layer)
            return existing
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        self.nodes.append(node)
        propagate_meta(self.gm, [node])  # later calls read its shape and whether it is a tensor
        return node

    def _existing(self, target: Any, args: tuple, kwargs: dict) -> Node | None:
        """A node before the anchor that already calls ``target`` on these arguments (the ops emitted here
        are pure: the same call gives the same value), or None."""
        first = next((a for a in args if isinstance(a, Node)), None)
        if first is None:
            return None
        for user in first.users:
            if (user.op == "call_function" and user.target == target and user.args == args
                    and user.kwargs == kwargs and user not in self.nodes and self._before_anchor(user)):
                return user
        return None

    def _before_anchor(self, node: Node) -> bool:
        walk = node.next
        while walk.op != "root":
            if walk is self.anchor:
                return True
            walk = walk.next
        return False

    def call(self, name: str, *args, **kwargs) -> Node:
        """Emit the op ``name`` (numbers multiply and divide in Python, or as ``operator`` nodes)."""
        if name in ("mul", "div") and not isinstance(args[0], Node) and not isinstance(args[1], Node):
            return args[0] * args[1] if name == "mul" else args[0] / args[1]
        if name in ("mul", "div") and not any(isinstance(fake_value(a), torch.Tensor) for a in args):
            return self._emit(operator.mul if name == "mul" else operator.truediv, args, kwargs)  # numbers
        if name == "where":
            return self._where(*args)
        if name in ("any", "all", "mean", "sum") and self.aten_ops:
            args = (args[0], [args[1]] if name in ("mean", "sum") else args[1], *args[2:])
        return self._emit(_TARGETS[name][1 if self.aten_ops else 0], args, kwargs)

    def _where(self, condition: Node, a: Any, b: Any) -> Node:
        if not self.aten_ops:
            return self._emit(torch.where, (condition, a, b), {})
        numbers = (not isinstance(a, Node), not isinstance(b, Node))
        target = {(False, False): aten.where.self, (True, False): aten.where.ScalarSelf,
                  (False, True): aten.where.ScalarOther, (True, True): aten.where.Scalar}[numbers]
        return self._emit(target, (condition, a, b), {})

    def operand(self, operand: Operand) -> Node:
        """Emit the permute and transpose that bring ``operand`` to SDPA's layout."""
        node = operand.node
        if operand.perm is not None:
            node = self.call("permute", node, list(operand.perm))
        if operand.swap:
            node = self.call("transpose", node, -2, -1)
        return node


def _scale(attention: Attention, builder: GraphBuilder) -> Any:
    """SDPA's ``scale``: the product of the number factors (a float, or a graph value in traced graphs)."""
    scale: Any = 1.0
    for step in attention.scores.steps:
        if isinstance(step, Scale) and not step.is_tensor:
            scale = builder.call("div" if step.divide else "mul", scale, step.factor)
    return scale


def build(attention: Attention, plan: MaskPlan, builder: GraphBuilder, *, guards_as_ops: bool = False) -> Node:
    """Emit the SDPA call and what it needs; return the node that replaces the value product. With
    ``guards_as_ops`` (:attr:`~fxforge.core.plan.CallConditions.guards_as_ops`), the guard of query rows
    with a NaN is one ``fxforge::nan_rows`` call on SDPA's output (:mod:`~fxforge.rewrites.attention.guards`)
    where it is the guard alone (not AND-ed with an additive mask's rows; q, k, v of at most 4 dims).

    Example:
        >>> from fxforge.rewrites.attention.checks import trace_attention
        >>> attend = lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v
        >>> gm, attention = trace_attention(attend, *[torch.randn(1, 2, 4, 8)] * 3)
        >>> out = build(attention, MaskPlan("causal"), GraphBuilder(gm, attention.values.product, True))
        >>> out.target, out.args[2].kwargs
        (<OpOverload(op='aten.where', overload='ScalarSelf')>, {'attn_mask': None, 'dropout_p': 0.0, 'is_causal': True, 'scale': 1.0})
    """
    scores, values = attention.scores, attention.values
    q = builder.operand(scores.q)
    for step in scores.steps:  # tensor scales (one number per score matrix) multiply q: their gradients flow
        if isinstance(step, Scale) and step.is_tensor:
            q = builder.call("div" if step.divide else "mul", q, step.factor)
    k_operand, v_operand = (attention.gqa[0], attention.gqa[1]) if attention.gqa else (scores.k, values.v)
    k, v = builder.operand(k_operand), builder.operand(v_operand)
    mask, keep = None, None
    if plan.kind == "float":
        mask = fold_mask(attention, builder)
    if plan.kind == "bool" or plan.fix:
        keep = fold_keep(attention, builder)
    if plan.kind == "bool":
        mask = keep
    while mask is not None and fake_value(mask) is not None and fake_value(mask).ndim < 2:
        mask = builder.call("unsqueeze", mask, 0)  # SDPA wants [.., L, S]; leading 1s broadcast the same
    row_mask = mask  # before it is lifted: its last dim is the keys of a row
    q_rows = q
    rank = len(scores.q.shape)
    lift = max(0, 4 - rank)  # SDPA's fast kernels (and torch.onnx's SDPA) take 4-d inputs
    for _ in range(lift):
        q, k, v = (builder.call("unsqueeze", t, 0) for t in (q, k, v))
    leading = [builder.call("size", q, i) for i in range(rank - 3)] if rank > 4 else None
    if leading is not None:  # [B, G, H, L, E] -> [B*G, H, L, E]: q, k and v share their batch dims (check_layout)
        q, k, v = (_to_4d(builder, t) for t in (q, k, v))
        mask = None if mask is None else _mask_to_4d(builder, mask, leading)
    while mask is not None and fake_value(mask) is not None and fake_value(mask).ndim < 4:
        mask = builder.call("unsqueeze", mask, 0)  # torch's fused CPU kernel takes masks of 2 or 4 dims, not 3
    q, k, v = (_last_dim_contiguous(builder, t) for t in (q, k, v))
    kwargs: dict[str, Any] = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": plan.kind == "causal",
                              "scale": _scale(attention, builder)}
    if attention.gqa:
        kwargs["enable_gqa"] = True
    out = builder.call("sdpa", q, k, v, **kwargs)
    named = guards_as_ops and leading is None and plan.fix != "additive"
    if named:  # on SDPA's own output, where a translation sees which kernel it chose for that SDPA
        out = builder.call("nan_rows", out, q_rows)
    for _ in range(lift):
        out = builder.call("squeeze", out, 0)
    if leading is not None:
        out = builder.call("reshape", out, [*leading, *(builder.call("size", out, i) for i in (-3, -2, -1))])
    if plan.fix == "additive":
        out = _patch_additive(attention, builder, out, row_mask, v_operand)
    # A query row with a NaN gives NaN in eager (SDPA's fused CPU kernel gives 0 there) unless fills hide
    # every key of the row: a fill replaces the NaN scores (an additive mask adds to them). The row is found
    # as a NaN sum of q * 0 (NaN exactly where q holds a NaN or an infinity, which gives NaN in eager and
    # SDPA alike): one vectorised pass, about 10x cheaper than isnan(q).any(-1), and a sum propagates NaN in
    # every runtime (ONNX Runtime's ReduceMax does not).
    nan_rows = None if named else builder.call("isnan", builder.call("sum", builder.call("mul", q_rows, 0), -1, True))
    alive = builder.call("any", keep, -1, True) if plan.fix and keep is not None else None
    if alive is not None and plan.fix == "additive":
        nan_rows = builder.call("logical_and", nan_rows, alive)
    if nan_rows is not None:
        out = builder.call("where", nan_rows, math.nan, out)
    if alive is not None and plan.fix != "additive":
        fallback = _mean_of_v(attention, builder, v_operand) if plan.fix == "mean" else math.nan
        out = builder.call("where", alive, out, fallback)
    if values.out_perm is not None:
        out = builder.call("permute", out, list(values.out_perm))
    return _eager_layout(builder, out, fake_value(values.product))


def memory_order(value: torch.Tensor) -> list[int] | None:
    """The dims of a dense tensor from outermost to innermost in memory (dims of size 1 do not matter and
    go where they are), or None when its strides are not a permutation of a contiguous layout.

    Example:
        >>> memory_order(torch.ones(2, 3, 4).transpose(0, 1)), memory_order(torch.ones(4, 4)[:, :2])
        ([1, 0, 2], None)
    """
    order = sorted(range(value.ndim), key=lambda d: (-value.stride(d) if value.shape[d] > 1 else 0, d))
    order = [d for d in order if value.shape[d] > 1]
    expected = 1
    for d in reversed(order):
        if value.stride(d) != expected:
            return None
        expected *= value.shape[d]
    ones = [d for d in range(value.ndim) if value.shape[d] == 1]
    for d in ones:  # size-1 dims keep their place among the others
        order.insert(min(d, len(order)), d)
    return order


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one shape) hold their elements in the same memory order: the order a
    following random op (dropout) draws its numbers in.

    Example:
        >>> x = torch.ones(2, 3)
        >>> same_layout(x, x.clone()), same_layout(x, x.t().contiguous().t())
        (True, False)
    """
    return all(a.stride(d) == b.stride(d) for d in range(a.ndim) if a.shape[d] > 1)


def _eager_layout(builder: GraphBuilder, out: Node, eager: torch.Tensor | None) -> Node:
    """``out`` laid out in memory as eager's value product (``eager``, its metadata) was.

    SDPA returns its own layout (on CPU, [B, L, H, E] for q given as a transposed [B, L, H, E]; an einsum
    with its output in another order has yet another). Values are equal either way, but a random op that
    follows (dropout in training) draws its numbers in memory order, so it would drop other elements than
    eager did. Where the metadata says the layouts differ, ``out`` is copied into eager's.
    """
    got = fake_value(out)
    if eager is None or got is None or tuple(got.shape) != tuple(eager.shape) or same_layout(got, eager):
        return out
    order = memory_order(eager)
    if order is None:
        return out  # not a dense layout: nothing to copy into (the verification decides)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    out = builder.call("contiguous", builder.call("permute", out, order), memory_format=torch.contiguous_format)
    return builder.call("permute", out, inverse)


def _last_dim_contiguous(builder: GraphBuilder, t: Node) -> Node:
    """``t``, copied where its last dim is not contiguous in memory (K given as a [.., D, S] tensor and
    transposed back): torch's fused kernels need a unit stride there, and the copy costs one pass over t."""
    value = fake_value(t)
    if value is None or not strided_last_dim(value):
        return t
    return builder.call("contiguous", t, memory_format=torch.contiguous_format)


def _to_4d(builder: GraphBuilder, t: Node) -> Node:
    """``t`` [..., H, L, E] with its leading dims flattened into one: [N, H, L, E]."""
    return builder.call("reshape", t, [-1, *(builder.call("size", t, i) for i in (-3, -2, -1))])


def _mask_to_4d(builder: GraphBuilder, mask: Node, leading: list) -> Node:
    """The mask of an attention whose q, k and v were flattened to 4-d (:func:`_to_4d`), flattened the same way.

    A mask of at most 3 dims broadcasts over the flattened batch as it did over the leading dims; so does one
    whose leading dims are all 1 (they are dropped). Otherwise it is expanded to q's leading dims first (a
    copy only where it broadcast over them).
    """
    dims = list(fake_value(mask).shape)
    if len(dims) <= 3:
        return mask
    zone = dims[:-3]
    if all(isinstance(d, int) and d == 1 for d in zone):
        return builder.call("reshape", mask, [builder.call("size", mask, i) for i in (-3, -2, -1)])
    return _to_4d(builder, builder.call("expand", mask, [*leading, -1, -1, -1]))


def _mean_of_v(attention: Attention, builder: GraphBuilder, v_operand: Any) -> Node:
    """The value of a row whose keys are all hidden by one finite value: softmax is uniform, so the mean of v."""
    mean = builder.call("mean", builder.operand(v_operand), -2, True)
    return builder.call("repeat_interleave", mean, attention.gqa[2], 1) if attention.gqa else mean


def _patch_additive(attention: Attention, builder: GraphBuilder, out: Node, mask: Node, v_operand: Any) -> Node:
    """Eager's value in the rows an additive mask hides entirely: NaN where every key is ``-inf`` (SDPA gives
    0); in float16/bfloat16 also the mean of v where every key is hidden by a finite value (eager's scores
    are absorbed by rounding into the mask value and the softmax is uniform; SDPA adds in float32)."""
    if attention.dtype in (torch.float16, torch.bfloat16):
        hidden = builder.call("all", builder.call("le", mask, LARGE_NEGATIVE), -1, True)
        out = builder.call("where", hidden, _mean_of_v(attention, builder, v_operand), out)
    all_inf = builder.call("all", builder.call("eq", mask, -math.inf), -1, True)
    return builder.call("where", all_inf, math.nan, out)


def describe_change(attention: Attention, plan: MaskPlan) -> str:
    """The report's line for one replacement: the SDPA arguments that differ from plain attention.

    Example:
        >>> from fxforge.rewrites.attention.checks import trace_attention
        >>> attend = lambda q, k, v: torch.softmax(q @ k.mT * 0.5, -1) @ v
        >>> gm, attention = trace_attention(attend, *[torch.randn(1, 2, 4, 8)] * 3)
        >>> describe_change(attention, MaskPlan("causal"))
        'attention -> scaled_dot_product_attention(scale=0.5, is_causal=True)'
    """
    details = []
    scale = 1.0
    for step in attention.scores.steps:
        if isinstance(step, Scale) and not step.is_tensor:
            factor = step.factor.meta.get("val") if isinstance(step.factor, Node) else step.factor
            scale = scale / factor if step.divide else scale * factor
    details.append(f"scale={scale:.4g}" if isinstance(scale, float) else "scale=<from shapes>")
    if any(isinstance(s, Scale) and s.is_tensor for s in attention.scores.steps):
        details.append("tensor scale on q")
    details.extend({"float": ["attn_mask=<float>"], "bool": ["attn_mask=<bool>"],
                    "causal": ["is_causal=True"]}.get(plan.kind, []))
    if plan.fix:
        details.append("rows with every key masked kept as eager")
    if attention.gqa:
        details.append(f"enable_gqa=True ({attention.gqa[2]} query heads per kv head)")
    return f"attention -> scaled_dot_product_attention({', '.join(details)})"
