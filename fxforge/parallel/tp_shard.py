"""How a value split across tensor-parallel ranks flows through the ops of a forward graph.

A column-parallel linear layer leaves each rank a contiguous block of the output features. Where that value
goes next decides whether the split can stay local until a row-parallel layer sums it up: an elementwise
op keeps it, a view that splits the features into ``(heads, head_dim)`` keeps it when the heads divide by
the degree (whole heads per rank), a transpose moves it, an attention matmul over the head dimension keeps
it; a softmax or norm over the split features, a slice through them (a fused ``q, k, v`` projection split
apart), or a value of full size combined with it do not.

A split is :class:`Split` ``(dim, outer)``: dimension ``dim``, seen as ``outer`` blocks each cut in
``degree`` contiguous pieces (``outer`` is 1 except where batch and heads are merged into one dimension,
as ATen's ``matmul`` does before ``bmm``). Equivalently, the rank of flat element ``f`` is
``(f // stride) % degree`` for one stride: any view keeps the stride, which is how :func:`view_split` maps
a split through ``view``/``reshape`` exactly.

:func:`propagate` is the rule table: one node, the splits of its inputs -> the split of its output, or why
the split cannot pass (an :class:`Outcome`).

Example:
    >>> view_split((2, 8, 64), (2, 8, 4, 16), Split(2), degree=2)     # 4 heads of 16: 2 heads per rank
    Split(dim=2, outer=1)
    >>> view_split((2, 8, 64), (2, 8, 4, 16), Split(2), degree=8) is None   # 4 heads cannot be cut in 8
    True
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Split:
    """A value split across the ranks along ``dim`` (``outer`` blocks, each cut in ``degree`` pieces)."""

    dim: int
    outer: int = 1


State = Any  # Split | None | tuple of State (a node returning several tensors)


@dataclasses.dataclass
class Outcome:
    """What a node does to the split values it receives.

    Attributes:
        state: the split of the node's output (a tuple for several outputs; None: not split).
        reason: why the split cannot pass (the group of layers behind it must be replicated), or None.
        conflicts: unsplit inputs of full size along the split dimension, ``(node, dim)``: the split passes
            only if these can be split too (a constant of that size built from a module attribute).
    """

    state: State = None
    reason: str | None = None
    conflicts: list[tuple[torch.fx.Node, int]] = dataclasses.field(default_factory=list)


def shape_of(value: Any) -> tuple[int, ...] | None:
    """The static shape of a node's value (None for non-tensors)."""
    value = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
    if isinstance(value, torch.Tensor):
        return tuple(int(s) for s in value.shape)
    return None


def _stride(shape: tuple[int, ...], split: Split, degree: int) -> int:
    inner = math.prod(shape[split.dim + 1:])
    return inner * (shape[split.dim] // split.outer // degree)


def view_split(in_shape: tuple[int, ...], out_shape: tuple[int, ...], split: Split, degree: int) -> Split | None:
    """The split of ``view(x, out_shape)`` for ``x`` of ``in_shape`` split as ``split``; None when the
    ranks' pieces are no longer contiguous blocks of one dimension (a head cut in two).

    Example:
        >>> view_split((2, 4, 8, 16), (8, 8, 16), Split(1), degree=2)    # (batch, heads) merged for bmm
        Split(dim=0, outer=2)
        >>> view_split((8, 8, 16), (2, 4, 8, 16), Split(0, outer=2), degree=2)
        Split(dim=1, outer=1)
    """
    stride = _stride(in_shape, split, degree)
    inner = 1
    for dim in reversed(range(len(out_shape))):
        size = out_shape[dim]
        if size > 1 and inner <= stride < inner * size:
            if stride % inner or (inner * size) % (stride * degree):
                return None
            return Split(dim, (inner * size) // (stride * degree))
        inner *= size
    return None


def cut_dimension(in_shape: tuple[int, ...], out_shape: tuple[int, ...], split: Split, degree: int) -> int | None:
    """The outermost dimension of ``out_shape`` made from the split one (the heads, when features are viewed
    as ``(heads, head_dim)``): the one the degree must divide when :func:`view_split` fails.

    Example:
        >>> cut_dimension((2, 8, 48), (2, 8, 3, 16), Split(2), degree=2)   # 3 heads: one would be cut in two
        2
    """
    low = math.prod(in_shape[split.dim + 1:])
    high = low * in_shape[split.dim]
    inner, found = 1, None
    for dim in reversed(range(len(out_shape))):
        if inner >= low and inner * out_shape[dim] <= high and out_shape[dim] > 1:
            found = dim
        inner *= out_shape[dim]
    return found


def _dims(value: Any, ndim: int) -> list[int]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return sorted(int(v) % ndim for v in values)


_IDENTITY = {aten.alias, aten.clone, aten.detach, aten._to_copy, aten.contiguous, aten.lift_fresh_copy,
             aten.dropout, aten.alias_copy}
_RESHAPE = {aten.view, aten._unsafe_view, aten.reshape, aten.view_copy, aten._reshape_alias}
_SOFTMAX = {aten._softmax, aten._log_softmax, aten.softmax, aten.log_softmax, aten._safe_softmax}
_REDUCE = {aten.sum, aten.mean, aten.amax, aten.amin, aten.var, aten.std, aten.var_mean, aten.max, aten.min,
           aten.logsumexp, aten.prod, aten.any, aten.all, aten.norm, aten.linalg_vector_norm, aten.argmax,
           aten.argmin}
_SLICE = {aten.slice, aten.narrow, aten.select, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind,
          aten.index_select}
_FACTORY = {aten.zeros, aten.ones, aten.full, aten.empty, aten.new_zeros, aten.new_ones, aten.new_full,
            aten.new_empty, aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like, aten.scalar_tensor}


def _packet(node: torch.fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", None)


def is_pointwise(node: torch.fx.Node) -> bool:
    """Elementwise ops (ATen's ``pointwise`` tag, and the few elementwise ops that lack it)."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags or _packet(node) in (aten.where, aten.masked_fill, aten.native_dropout,
                                                            aten.clamp, aten.clamp_min, aten.clamp_max)


def is_factory(node: torch.fx.Node) -> bool:
    """Ops that make a uniform tensor from sizes (zeros, ones, full...)."""
    return _packet(node) in _FACTORY


def broadcast(node: torch.fx.Node, inputs: list[tuple[Any, State]], out_shape: tuple[int, ...]) -> Outcome:
    """Elementwise combination with broadcasting: every split input split the same way (aligned from the
    right); unsplit inputs must have size 1 (or no dimension) there.

    Example:
        >>> broadcast(None, [((2, 4, 8, 8), Split(1)), ((2, 1, 8, 8), None)], (2, 4, 8, 8)).state
        Split(dim=1, outer=1)
    """
    found: Split | None = None
    ndim = len(out_shape)
    for shape, state in inputs:
        if isinstance(state, Split):
            aligned = Split(state.dim + ndim - len(shape), state.outer)
            if found is not None and aligned != found:
                return Outcome(reason=f"combines values split along different dimensions ({found.dim} and "
                                      f"{aligned.dim})")
            found = aligned
    if found is None:
        return Outcome()
    conflicts = []
    for item, (shape, state) in zip(_tensor_args(node) if node is not None else [None] * len(inputs), inputs):
        if state is None and shape:
            dim = found.dim - (ndim - len(shape))
            if dim >= 0 and shape[dim] != 1:
                conflicts.append((item, dim))
    return Outcome(found, conflicts=conflicts)


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    flat = [a for a in node.args] + list(node.kwargs.values())
    found = []
    for arg in flat:
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        found += [a for a in items if isinstance(a, torch.fx.Node) and shape_of(a) is not None]
    return found


def propagate(node: torch.fx.Node, state_of: dict[torch.fx.Node, State], degree: int) -> Outcome:
    """The split of ``node``'s output from its inputs' (``state_of``), or why it cannot pass.

    Only called when at least one input is split. See the module docstring for the rules.
    """
    packet = _packet(node)
    out_shape = shape_of(node)
    args = node.args
    first = args[0] if args else None
    state = state_of.get(first) if isinstance(first, torch.fx.Node) else None
    in_shape = shape_of(first) if isinstance(first, torch.fx.Node) else None
    name = str(packet or node.target).removeprefix("aten.")

    if node.target is operator.getitem:
        states = state_of.get(first)
        return Outcome(states[args[1]] if isinstance(states, tuple) else states)
    if packet in _IDENTITY or packet is aten.native_dropout:
        return Outcome((state, state) if packet is aten.native_dropout else state)
    if packet in _RESHAPE:
        mapped = view_split(in_shape, out_shape, state, degree)
        if mapped is None:
            cut = cut_dimension(in_shape, out_shape, state, degree)
            count = out_shape[cut] if cut is not None else in_shape[state.dim]
            return Outcome(reason=f"views {in_shape} as {out_shape}: {count} heads are not divisible by the degree "
                                  f"{degree} (a rank would get part of a head)")
        return Outcome(mapped)
    if packet in (aten.transpose, aten.t, aten.permute, aten.swapaxes):
        ndim = len(in_shape)
        order = list(range(ndim))
        if packet is aten.permute:
            order = [int(d) % ndim for d in args[1]]
        elif packet is aten.t:
            order = order[::-1]
        else:
            a, b = int(args[1]) % ndim, int(args[2]) % ndim
            order[a], order[b] = order[b], order[a]
        return Outcome(Split(order.index(state.dim), state.outer))
    if packet is aten.unsqueeze:
        dim = int(args[1]) % (len(in_shape) + 1)
        return Outcome(Split(state.dim + (dim <= state.dim), state.outer))
    if packet is aten.squeeze:
        ones = [d for d in range(len(in_shape)) if in_shape[d] == 1]
        removed = _dims(args[1], len(in_shape)) if len(args) > 1 else ones
        removed = [d for d in removed if d in ones]
        return Outcome(Split(state.dim - sum(d < state.dim for d in removed), state.outer))
    if packet in (aten.expand, aten.expand_copy):
        return Outcome(Split(state.dim + len(out_shape) - len(in_shape), state.outer))
    if packet in _SLICE:
        position = 2 if packet in (aten.split, aten.split_with_sizes, aten.chunk) else 1
        dim = int(args[position]) if len(args) > position else int(node.kwargs.get("dim", 0))
        dim %= len(in_shape)
        if dim == state.dim:
            return Outcome(reason=f"{name} along the split dimension of {in_shape}: the pieces of the split "
                                  f"({in_shape[dim]} // {degree} each) do not line up with the parts taken (a fused "
                                  "projection split into q, k, v, or a slice of the features)")
        new = Split(state.dim - (packet in (aten.select, aten.unbind) and dim < state.dim), state.outer)
        if isinstance(node.meta.get("val"), (tuple, list)):
            return Outcome(tuple(new for _ in node.meta["val"]))
        return Outcome(new)
    if packet in (aten.cat, aten.stack):
        tensors = [t for t in args[0] if shape_of(t) and math.prod(shape_of(t)) > 0]
        states = [state_of.get(t) for t in tensors]
        split = next(s for s in states if isinstance(s, Split))
        dim = (int(args[1]) if len(args) > 1 else 0) % len(out_shape)
        if packet is aten.cat and dim == split.dim:
            return Outcome(reason=f"cat along the split dimension of {shape_of(tensors[0])}")
        if packet is aten.stack:
            return Outcome(reason="stack of split values")
        outcome = broadcast(None, [(shape_of(t), s) for t, s in zip(tensors, states)], out_shape)
        outcome.conflicts = [(t, split.dim) for t, s in zip(tensors, states) if s is None]
        return outcome
    if packet in _SOFTMAX:
        if int(args[1]) % len(in_shape) == state.dim:
            return Outcome(reason=f"{name} over the split dimension of {in_shape}")
        return Outcome(state)
    if packet in _REDUCE:
        dims = _dims(args[1], len(in_shape)) if len(args) > 1 and args[1] is not None else list(range(len(in_shape)))
        if state.dim in dims:
            return Outcome(reason=f"{name} over the split dimension of {in_shape} (a norm or a sum over the "
                                  "split features)")
        keep = len(out_shape or ()) == len(in_shape)
        new = Split(state.dim - (0 if keep else sum(d < state.dim for d in dims)), state.outer)
        return Outcome(tuple(new for _ in node.meta["val"]) if isinstance(node.meta.get("val"), tuple) else new)
    if packet is aten.native_layer_norm:
        normalized = len(args[1])
        if state.dim >= len(in_shape) - normalized:
            return Outcome(reason=f"layer_norm over the split dimension of {in_shape}")
        return Outcome((state, state, state))
    if packet in (aten.mm, aten.bmm, aten.baddbmm, aten.matmul):
        offset = 1 if packet is aten.baddbmm else 0
        a, b = args[offset], args[offset + 1]
        sa, sb = state_of.get(a), state_of.get(b)
        na = len(shape_of(a))
        if isinstance(sa, Split) and isinstance(sb, Split):
            if na == 3 and sa == sb and sa.dim == 0:
                result = Outcome(sa)
            else:
                return Outcome(reason=f"{name} contracts the split dimension (a partial sum)")
        elif isinstance(sa, Split):
            if sa.dim == na - 1:
                return Outcome(reason=f"{name} contracts the split dimension (a partial sum)")
            result = Outcome(sa, conflicts=[(b, 0)] if na == 3 and sa.dim == 0 else [])
        else:
            if sb.dim == len(shape_of(b)) - 2:
                return Outcome(reason=f"{name} contracts the split dimension (a partial sum)")
            result = Outcome(sb, conflicts=[(a, 0)] if na == 3 and sb.dim == 0 else [])
        if offset and state_of.get(args[0]) != result.state and shape_of(args[0]):
            result.conflicts.append((args[0], result.state.dim))
        return result
    if "scaled_dot_product" in str(node.target):
        q, k, v = args[:3]
        states = [state_of.get(t) for t in (q, k, v)]
        if not all(isinstance(s, Split) and s.dim == 1 and s.outer == 1 for s in states):
            return Outcome(reason="attention whose q, k and v are not all split by heads")
        outcome = Outcome(Split(1))
        mask = node.kwargs.get("attn_mask", args[3] if len(args) > 3 and isinstance(args[3], torch.fx.Node) else None)
        if isinstance(mask, torch.fx.Node) and state_of.get(mask) is None and shape_of(mask)[-3] != 1:
            outcome.conflicts.append((mask, len(shape_of(mask)) - 3))
        values = node.meta.get("val")
        if isinstance(values, (tuple, list)):
            outcome.state = tuple(Split(1) if isinstance(t, torch.Tensor) and t.dim() >= 2 else None for t in values)
        return outcome
    if is_pointwise(node):
        inputs = [(shape_of(t), state_of.get(t)) for t in _tensor_args(node)]
        outcome = broadcast(node, inputs, out_shape)
        if isinstance(node.meta.get("val"), tuple):
            outcome.state = tuple(outcome.state for _ in node.meta["val"])
        return outcome
    return Outcome(reason=f"{name} is not known to keep a split value split")
