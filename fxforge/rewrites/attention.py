"""``attention``: hand-written attention becomes one ``scaled_dot_product_attention`` call.

The pass anchors at each softmax, walks back to the product that made the scores and forward to the
product that applies the probabilities to the values, and replaces the chain with
``F.scaled_dot_product_attention`` (``aten.scaled_dot_product_attention`` in exported graphs, so they stay
ATen)::

    softmax(q @ k^T * scale + mask) @ v   ->   scaled_dot_product_attention(q, k, v, mask, scale=scale)

What it reads, top to bottom; each op in every call form (functions, methods, modules, operators, aten):

- the softmax: ``F.softmax``, ``torch.softmax``, ``x.softmax``, ``nn.Softmax``, ``aten.softmax``/``_softmax``,
  with or without ``dtype``, over the last dim;
- the scores product: ``matmul``/``@``/``bmm`` with K given as any swap of its last two dims
  (``transpose(-2, -1)``, ``transpose(2, 3)``, ``permute``, ``mT``) or as any other [.., D, S] tensor, or an
  ``einsum`` contracting one head dim, in any layout (``bqhd,bkhd->bhqk``);
- between scores and softmax, :data:`SCORE_STEPS`: casts; scaling by mul or div with a Python number, a
  number computed from shapes (``math.sqrt(q.size(-1))``, ``d ** -0.5``) or a one-element tensor; additive
  float masks of any broadcastable shape (``+``, ``-``); ``masked_fill``/``where`` with a boolean mask and
  ``-inf``, ``finfo.min`` or another value <= -1e4 (:data:`LARGE_NEGATIVE`), in place (``masked_fill_``) too;
- between softmax and the value product: casts and dropout;
- the value product: ``matmul``/``@``/``bmm`` or an ``einsum`` with its output in any layout;
- K and V repeated per head for grouped-query attention (``repeat_interleave(n, dim=1)``, or
  ``[:, :, None].expand(...).reshape(...)`` as transformers' ``repeat_kv``) become ``enable_gqa=True`` with
  the un-repeated tensors, where this torch has it; otherwise the repeated tensors are used.

How the replacement stays exact:

- **Scale.** The product of the factors applied to the scores is passed as ``scale=`` (1.0 when there are
  none, never SDPA's default). Numbers computed from shapes stay graph values; one-element tensors (a
  learned temperature) multiply q instead, so their gradients flow. Scales applied to Q or K before the
  product are part of q and k and stay where they are.
- **Masks.** Additive masks are summed, each multiplied by the scales applied after it, and passed as a float
  mask: SDPA computes ``q @ k^T * scale + mask`` as eager does. Fills alone (``masked_fill``/``where``)
  become a boolean keep-mask: masked keys get weight exactly 0 in both, as long as a kept score is not
  within ~100 of the fill value (for -1e4 that needs scores near -1e4; for ``finfo.min`` and ``-inf``
  never). A row in which every key is masked is uniform in eager (the mean of v) or NaN (``-inf``), and 0 in
  SDPA, so the output is patched with ``where(row has a kept key, sdpa, mean of v or NaN)`` unless the mask
  is a constant proven to have no such row; outputs and gradients then equal eager's. Fills combined with
  additive masks become one float mask ``where(mask, fill, additive)``; that is exact when the fill is
  ``-inf`` or ``finfo.min`` of float32/bfloat16/float64 (the score it replaces is absorbed by rounding), so
  other fill values are refused there. Additive masks whose row is all ``-inf`` give NaN in eager and 0 in
  SDPA (torch's safe softmax): that row differs, as it would with any SDPA user. A condition AND-ed into a
  mask that constants prove all-True (transformers' ``q_idx >= 0`` spreading a [B, 1, 1, S] padding mask
  over the queries) is dropped, so SDPA broadcasts the small mask and no S x S tensor is built.
- **Causal.** A mask whose inputs are only shapes, dtypes, constants and buffers is computed at rewrite time
  (graphs are specialised to their input signature). ``x.new_ones(...)``/``zeros_like(x)`` count as
  constants even for a graph input x; graph inputs, parameters, buffers the graph changes, module calls,
  random ops and Python numbers read from tensor data (``.item()``) do not. Entries are kept (0 / True) or masked (``-inf``, <= -1e4 / False); if the kept
  ones are exactly the lower triangle of a square [L, L] mask for every batch and head, the mask is not
  materialised and ``is_causal=True`` is passed; if every key is kept the mask is dropped.
- **Dropout.** Dropout that does not drop (eval mode, ``training=False``, p = 0) is left out. Active dropout
  on the probabilities (training, p > 0) is refused: SDPA's dropout draws different random numbers, so its
  result could not be checked against eager, and the pipeline compares passes under the same seed.
- **Training.** The replacement holds in training: SDPA has autograd, and its gradients are eager's. One
  exception, where eager itself computes garbage: a row in which an *additive* mask hides every key
  (``finfo.min`` everywhere, e.g. a left-padded query) has eager's output, but its gradient may differ
  (torch's fused CPU kernel differs from its own math path there).

Refusals, each a near miss with its reason (only where a softmax sits between two products):
softmax over another dim; a non-linear function or an element-wise tensor gate on the scores; anything
other than casts and dropout between softmax and the value product; scores or probabilities also used
elsewhere; an einsum that does not contract one head dim (scores) or the key dim (values); probabilities
as the second operand of the value product; batch dims that broadcast; dtypes that differ; masks that are
not masks; active dropout in training; an input changed in place.

Example:
    >>> import torch.nn.functional as F
    >>> from fxforge.rewrites.passes import PassContext
    >>> gm = torch.fx.symbolic_trace(lambda q, k, v: F.softmax(q @ k.transpose(-2, -1) / 8, dim=-1) @ v)
    >>> from fxforge.core.shapes import annotate
    >>> _ = annotate(gm, (torch.randn(1, 2, 4, 8),) * 3, {})
    >>> ctx = PassContext("attention", training=False, method="fx")
    >>> replace_attention(gm, ctx); [m.what for m in ctx.matches]
    ['attention -> scaled_dot_product_attention(scale=0.125)']
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from fxforge.core.nodes import (
    attribute_tensor,
    call_node,
    fake_value,
    is_effectful,
    is_inplace,
    mutated_aliases,
    submodule,
    target_name,
)
from fxforge.core.shapes import propagate_meta
from fxforge.core.source import first_line, inherit_origin
from fxforge.rewrites.canonical import canonicalize
from fxforge.rewrites.cleanup import proven_assertion
from fxforge.rewrites.passes import Pass, PassContext, Refusal

F = nn.functional
aten = torch.ops.aten

# A fill or additive value at or below this hides a key (see the module docstring).
LARGE_NEGATIVE = -1e4
SDPA_HAS_GQA = any(a.name == "enable_gqa" for a in aten.scaled_dot_product_attention.default._schema.arguments)


# --------------------------------------------------------------------------------------------------
# Reading single nodes


def _bound(node: Node, names: tuple[str, ...]) -> dict[str, Any]:
    """``node``'s arguments by name, for a call whose parameters are ``names`` in order."""
    values = dict(zip(names, node.args))
    values.update({k: v for k, v in node.kwargs.items() if k in names})
    return values


def _is_call(node: Any, methods: tuple[str, ...] | set[str], functions: tuple | set) -> bool:
    if not isinstance(node, Node):
        return False
    if node.op == "call_method":
        return node.target in methods
    return node.op == "call_function" and node.target in functions


def _tensor(node: Any) -> torch.Tensor | None:
    return fake_value(node) if isinstance(node, Node) else None


def describe(node: Node, gm: torch.fx.GraphModule) -> str:
    """What a node calls, named the same in traced and exported graphs: ``tanh`` for ``torch.tanh``,
    ``x.tanh()`` and ``aten.tanh.default``; ``mul`` for ``*``; a module's class name (``Tanh``).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> [describe(g.call_function(f, (x,)), None) for f in (torch.tanh, aten.tanh.default, operator.mul)]
        ['tanh', 'tanh', 'mul']
    """
    if node.op == "call_module":
        module = submodule(node, gm)
        return type(module).__name__ if module is not None else str(node.target)
    op = canonicalize(node, gm) if node.op.startswith("call") and gm is not None else None
    if op is not None and isinstance(op.name, str):
        return op.name
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._opname
    if node.target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[node.target]
    return target_name(node)


_OPERATOR_NAMES = {operator.mul: "mul", operator.add: "add", operator.sub: "sub", operator.truediv: "div",
                   operator.matmul: "matmul", operator.getitem: "getitem", operator.neg: "neg"}


@dataclasses.dataclass(frozen=True)
class Softmax:
    """A softmax node: its input and the dim it normalises (non-negative)."""

    node: Node
    input: Node
    dim: int


_SOFTMAX_FUNCTIONS: dict[Any, tuple[str, ...]] = {
    F.softmax: ("input", "dim", "_stacklevel", "dtype"),
    torch.softmax: ("input", "dim", "dtype"),
    torch.special.softmax: ("input", "dim", "dtype"),
    aten.softmax.int: ("self", "dim", "dtype"),
    aten._softmax.default: ("self", "dim", "half_to_float"),
}


def read_softmax(node: Node, gm: torch.fx.GraphModule) -> Softmax | None:
    """``node`` as a :class:`Softmax`, or None when it is no softmax (or has no shape metadata).

    ``dim=None`` is resolved as torch does (dim 0 for 0-, 1- and 3-d inputs, else 1).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(2, 3)
        >>> s = g.call_method("softmax", (x, -1)); s.meta["val"] = torch.ones(2, 3)
        >>> read_softmax(s, None).dim
        1
    """
    if node.op == "call_module":
        module = submodule(node, gm)
        if type(module) is not nn.Softmax or len(node.args) != 1 or node.kwargs:
            return None
        source, dim = node.args[0], module.dim
    elif node.op == "call_method" and node.target == "softmax":
        bound = _bound(node, ("self", "dim", "dtype"))
        source, dim = bound.get("self"), bound.get("dim")
    elif node.op == "call_function" and node.target in _SOFTMAX_FUNCTIONS:
        names = _SOFTMAX_FUNCTIONS[node.target]
        bound = _bound(node, names)
        source, dim = bound.get(names[0]), bound.get("dim")
    else:
        return None
    value = _tensor(source)
    if value is None or not isinstance(dim, (int, type(None))) or fake_value(node) is None:
        return None
    if dim is None:
        dim = 0 if value.ndim in (0, 1, 3) else 1
    return Softmax(node, source, dim % max(value.ndim, 1))


_CAST_METHODS = {"to", "type", "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone"}
_CAST_FUNCTIONS = {aten.to.dtype, aten.to.dtype_layout, aten.to.other, aten.to.device, aten._to_copy.default,
                   aten.type_as.default, aten.contiguous.default, aten.clone.default, torch.clone}


def read_cast(node: Node) -> Node | None:
    """The input of a floating-point cast or copy that keeps shape and device, else None.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(2, dtype=torch.half)
        >>> y = g.call_method("float", (x,)); y.meta["val"] = torch.ones(2)
        >>> read_cast(y) is x
        True
    """
    if not _is_call(node, _CAST_METHODS, _CAST_FUNCTIONS) or not node.args or not isinstance(node.args[0], Node):
        return None
    before, after = _tensor(node.args[0]), _tensor(node)
    if before is None or after is None or not after.is_floating_point():
        return None
    if before.shape != after.shape or before.device != after.device:
        return None
    return node.args[0]


_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_DROPOUT_FUNCTIONS: dict[Any, tuple[tuple[str, ...], bool]] = {
    F.dropout: (("input", "p", "training", "inplace"), True),
    torch.dropout: (("input", "p", "train"), True),
    aten.dropout.default: (("input", "p", "train"), True),
}


def read_dropout(node: Node, gm: torch.fx.GraphModule) -> tuple[Node, Any, bool] | None:
    """``(input, p, drops)`` of a dropout call; ``drops`` is False in eval mode or with p = 0.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> read_dropout(g.call_function(torch.dropout, (x, 0.1, False)), None)[1:]
        (0.1, False)
    """
    module = submodule(node, gm)
    if isinstance(module, _DROPOUT_MODULES) and len(node.args) == 1:
        return node.args[0], module.p, bool(module.training and module.p > 0)
    if node.op != "call_function" or node.target not in _DROPOUT_FUNCTIONS:
        return None
    names, training_default = _DROPOUT_FUNCTIONS[node.target]
    bound = _bound(node, names)
    p = bound.get("p", 0.5)
    training = bound.get(names[2], training_default)
    drops = not (training is False or (isinstance(p, (int, float)) and p == 0))
    return bound.get(names[0]), p, drops


def _ignorable(user: Node, gm: torch.fx.GraphModule) -> bool:
    """A user that may be dropped with the value it uses: export's dtype/device assertions that the shape
    metadata proves (graphs are specialised to their input signature)."""
    return user.target is aten._assert_tensor_metadata.default and isinstance(proven_assertion(user, gm, None), Node)


# --------------------------------------------------------------------------------------------------
# Products: the scores q @ k^T and the output probs @ v


@dataclasses.dataclass(frozen=True)
class Operand:
    """A tensor the replacement passes to SDPA: ``node`` permuted by ``perm``, then its last two dims swapped.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(2, 3, 4)
        >>> Operand(x, (1, 0, 2), swap=True).shape
        (3, 4, 2)
    """

    node: Node
    perm: tuple[int, ...] | None = None
    swap: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(_tensor(self.node).shape)
        if self.perm is not None:
            shape = [shape[i] for i in self.perm]
        if self.swap:
            shape[-2:] = shape[-1], shape[-2]
        return tuple(shape)

    @property
    def plain(self) -> bool:
        return self.perm is None and not self.swap


_TRANSPOSES = {torch.transpose, torch.swapaxes, torch.swapdims, aten.transpose.int, aten.swapaxes.default,
               aten.swapdims.default}
_PERMUTES = {torch.permute, aten.permute.default}


def swapped_source(node: Any) -> Node | None:
    """x when ``node`` is x with its last two dims swapped (``transpose``, ``permute``, ``mT``, ``.t()``).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(2, 3, 4)
        >>> t = g.call_method("transpose", (x, 2, 1)); t.meta["val"] = torch.ones(2, 4, 3)
        >>> swapped_source(t) is x
        True
    """
    value = _tensor(node)
    if value is None or value.ndim < 2 or not node.args or not isinstance(node.args[0], Node):
        return None
    n, source = value.ndim, node.args[0]
    last_two = {n - 2, n - 1}
    if _is_call(node, ("transpose", "swapaxes", "swapdims"), _TRANSPOSES):
        dims = node.args[1:3]
        if len(dims) == 2 and all(isinstance(d, int) for d in dims) and {d % n for d in dims} == last_two:
            return source
    if _is_call(node, ("permute",), _PERMUTES):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        if all(isinstance(d, int) for d in dims) and [d % n for d in dims] == [*range(n - 2), n - 1, n - 2]:
            return source
    if node.op == "call_function" and node.target is getattr and node.args[1:] in (("mT",), ("T",) * (n == 2)):
        return source
    if _is_call(node, ("t",), {torch.t, aten.t.default, aten.mT.default}) and (n == 2 or node.target is aten.mT.default):
        return source
    return None


def untransposed(node: Node) -> Operand:
    """K ([.., S, E]) for a product ``q @ node``: the tensor ``node`` swaps, or ``node`` to be swapped."""
    source = swapped_source(node)
    return Operand(source) if source is not None else Operand(node, swap=True)


_RESHAPES = {torch.reshape, torch.flatten, torch.unsqueeze, aten.view.default, aten.reshape.default,
             aten._unsafe_view.default, aten.unsqueeze.default, aten.flatten.using_ints}


def _reshape_source(node: Any) -> Node | None:
    """x when ``node`` is a reshape of x (view, reshape, flatten, unsqueeze, or indexing with only ``:``
    and ``None``): its values in the same order under another shape."""
    if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
        return None
    if _is_call(node, ("view", "reshape", "flatten", "unsqueeze"), _RESHAPES):
        return node.args[0]
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], tuple):
        index = node.args[1]
        if all(i is None or i is Ellipsis or i == slice(None) for i in index):
            return node.args[0]
    return None


def repeated_heads(node: Any) -> tuple[Node, int] | None:
    """``(x, n)`` when ``node`` is 4-d x with each head (dim 1) repeated n times in place: as
    ``repeat_interleave(x, n, dim=1)`` or ``x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)``.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(1, 2, 3, 4)
        >>> r = g.call_method("repeat_interleave", (x, 2), {"dim": 1}); r.meta["val"] = torch.ones(1, 4, 3, 4)
        >>> repeated_heads(r)[1]
        2
    """
    out = _tensor(node)
    if out is None or out.ndim != 4:
        return None
    if _is_call(node, ("repeat_interleave",), {torch.repeat_interleave, aten.repeat_interleave.self_int}):
        bound = _bound(node, ("input", "repeats", "dim", "output_size"))
        source, n, dim = node.args[0], bound.get("repeats"), bound.get("dim")
        x = _tensor(source)
        if (isinstance(n, int) and isinstance(dim, int) and dim % 4 == 1 and x is not None and x.ndim == 4
                and tuple(out.shape) == (x.shape[0], x.shape[1] * n, *x.shape[2:])):
            return source, n
        return None
    expanded = _reshape_source(node)
    if not _is_call(expanded, ("expand",), {aten.expand.default, torch.broadcast_to}):
        return None
    source = _reshape_source(expanded.args[0])
    x, e = _tensor(source), _tensor(expanded)
    if x is None or e is None or x.ndim != 4 or _tensor(expanded.args[0]).shape != (*x.shape[:2], 1, *x.shape[2:]):
        return None
    n = e.shape[2]
    if tuple(e.shape) == (*x.shape[:2], n, *x.shape[2:]) and tuple(out.shape) == (x.shape[0], x.shape[1] * n,
                                                                                 *x.shape[2:]):
        return source, n
    return None


_EINSUMS = {torch.einsum, torch.functional.einsum, aten.einsum.default}


def read_einsum(node: Node) -> tuple[str, list[Node], list[list[str]], list[str]] | None:
    """``(equation, operands, letters of each operand, output letters)`` of a two-operand einsum; an
    ellipsis becomes numbered letters.

    Example:
        >>> g = torch.fx.Graph(); a, b = g.placeholder("a"), g.placeholder("b")
        >>> a.meta["val"] = b.meta["val"] = torch.ones(2, 3, 4)
        >>> read_einsum(g.call_function(torch.einsum, ("...qd,...kd->...qk", a, b)))[2:]
        ([['.0', 'q', 'd'], ['.0', 'k', 'd']], ['.0', 'q', 'k'])
    """
    if node.op != "call_function" or node.target not in _EINSUMS or not node.args:
        return None
    equation, operands = node.args[0], list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    values = [_tensor(o) for o in operands]
    if not isinstance(equation, str) or len(operands) != 2 or any(v is None for v in values):
        return None
    equation = equation.replace(" ", "")
    if equation.count("->") != 1:
        return None
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        return None
    ellipsis = {v.ndim - len(t.replace("...", "")) for t, v in zip(terms, values) if "..." in t}
    if len(ellipsis) > 1:
        return None
    dots = [f".{i}" for i in range(ellipsis.pop() if ellipsis else 0)]

    def letters(term: str) -> list[str]:
        head, _, tail = term.partition("...")
        return [*head, *dots, *tail] if "..." in term else list(term)

    parsed = [letters(t) for t in terms]
    if any(len(p) != v.ndim or len(set(p)) != len(p) for p, v in zip(parsed, values)):
        return None
    return equation, operands, parsed, letters(output)


def _perm(letters: list[str], order: list[str]) -> tuple[int, ...] | None:
    perm = tuple(letters.index(c) for c in order)
    return None if perm == tuple(range(len(perm))) else perm


def scores_operands(node: Node, gm: torch.fx.GraphModule) -> tuple[Operand, Operand] | Refusal | None:
    """``(q, k)`` with q [.., L, E] and k [.., S, E] when ``node`` is a product giving scores [.., L, S]."""
    op = canonicalize(node, gm)
    if op is not None and op.name == "matmul":
        a, b = op.args["input"], op.args["other"]
        va, vb = _tensor(a), _tensor(b)
        if va is None or vb is None or va.ndim < 2 or vb.ndim < 2:
            return None
        return Operand(a), untransposed(b)
    einsum = read_einsum(node)
    if einsum is None:
        return None
    equation, operands, (la, lb), out = einsum
    if len(out) < 2:
        return None
    query, key, batch = out[-2], out[-1], out[:-2]
    contracted = (set(la) & set(lb)) - set(out)
    if len(contracted) != 1:
        return Refusal(f"the scores einsum '{equation}' contracts over {len(contracted)} dims, not one head dim")
    head = contracted.pop()
    for first, second in ((0, 1), (1, 0)):
        lq, lk = (la, lb)[first], (la, lb)[second]
        if sorted(lq) == sorted([*batch, query, head]) and sorted(lk) == sorted([*batch, key, head]):
            return (Operand(operands[first], _perm(lq, [*batch, query, head])),
                    Operand(operands[second], _perm(lk, [*batch, key, head])))
    return Refusal(f"the scores einsum '{equation}' is not a product of queries and keys over one head dim")


def value_operand(node: Node, probs: Node, gm: torch.fx.GraphModule
                  ) -> tuple[Operand, tuple[int, ...] | None] | Refusal | None:
    """``(v, output permutation)`` when ``node`` multiplies the probabilities ``probs`` [.., L, S] by values;
    v is [.., S, Ev] and the permutation takes SDPA's [.., L, Ev] to ``node``'s layout (None: same)."""
    op = canonicalize(node, gm)
    if op is not None and op.name == "matmul":
        if op.args["input"] is not probs:
            return Refusal(f"the attention probabilities are the second operand of {node.name}, not the first")
        return Operand(op.args["other"]), None
    einsum = read_einsum(node)
    if einsum is None:
        return None
    equation, operands, letters, out = einsum
    if operands.count(probs) != 1:
        return Refusal(f"the value einsum '{equation}' takes the probabilities twice")
    index = operands.index(probs)
    lp, lv = letters[index], letters[1 - index]
    key, query, batch = lp[-1], lp[-2], lp[:-2]
    extra = set(lv) - set(lp)
    if (len(extra) != 1 or key in out or query in lv or set(lv) != {*batch, key, *extra}
            or set(out) != {*batch, query, *extra}):
        return Refusal(f"the value einsum '{equation}' does not contract the values over the softmax (key) dim")
    head = extra.pop()
    canonical = [*batch, query, head]
    return Operand(operands[1 - index], _perm(lv, [*batch, key, head])), _perm(canonical, out)


def _is_product(node: Node, gm: torch.fx.GraphModule) -> bool:
    op = canonicalize(node, gm) if node.op.startswith("call") else None
    return (op is not None and op.name == "matmul") or (node.op == "call_function" and node.target in _EINSUMS)


def _near_product(start: list[Node], gm: torch.fx.GraphModule, forward: bool, hops: int = 4) -> bool:
    """Whether a matrix product is within ``hops`` nodes of ``start`` (through users, or through inputs)."""
    frontier, seen = list(start), set(start)
    for _ in range(hops):
        if any(_is_product(n, gm) for n in frontier):
            return True
        following = [m for n in frontier for m in (n.users if forward else n.all_input_nodes)]
        frontier = [m for m in following if m not in seen]
        seen.update(frontier)
    return any(_is_product(n, gm) for n in frontier)


def looks_like_attention(softmax: Node, gm: torch.fx.GraphModule) -> bool:
    """A softmax between two matrix products: only there is a refusal worth a near miss.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.softmax(x, -1))
        >>> looks_like_attention(list(gm.graph.nodes)[1], gm)
        False
    """
    return _near_product(softmax.all_input_nodes, gm, forward=False) and _near_product([softmax], gm, forward=True)


# --------------------------------------------------------------------------------------------------
# Constants: what depends only on shapes, constants and buffers


_NOT_CONSTANT = object()
_PLAIN = (int, float, bool, str, torch.dtype, torch.device, torch.Size, type(None))
# Constructors that read only the shape, dtype and device of their first argument, never its values.
_METADATA_METHODS = {"new_ones", "new_zeros", "new_full"}
_METADATA_FUNCTIONS = {torch.zeros_like, torch.ones_like, torch.full_like, aten.new_ones.default,
                       aten.new_zeros.default, aten.new_full.default, aten.zeros_like.default, aten.ones_like.default,
                       aten.full_like.default}


_SHAPE_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "layout"}
_SHAPE_METHODS = {"size", "dim", "numel", "get_device"}
_SHAPE_FUNCTIONS = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}


def _is_shape_expression(node: Node, seen: dict[Node, bool] | None = None) -> bool:
    """Whether ``node`` computes a Python value from shapes, dtypes and devices only (``q.size(-1) ** -0.5``)
    rather than from tensor data (``x.sum().item()``, whose recorded value held for the example only)."""
    seen = {} if seen is None else seen
    if node in seen:
        return seen[node]
    seen[node] = False
    if node.op == "call_function" and node.target is getattr:
        result = node.args[1] in _SHAPE_ATTRIBUTES
    elif node.op == "call_method" and node.target in _SHAPE_METHODS:
        result = True
    elif node.op == "call_function" and (node.target in _SHAPE_FUNCTIONS
                                         or getattr(node.target, "__module__", None) in ("_operator", "math")):
        result = all(not isinstance(_tensor(n), torch.Tensor) and _is_shape_expression(n, seen)
                     for n in node.all_input_nodes)
    else:
        result = False
    seen[node] = result
    return result


def _reads_metadata_only(node: Node) -> bool:
    return _is_call(node, _METADATA_METHODS, _METADATA_FUNCTIONS) and bool(node.args) and isinstance(node.args[0], Node)


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


class Constants:
    """Values of nodes computed from shapes, Python constants and buffers only; computed once per pass.

    A graph is specialised to its input signature, so sizes are constants, and so are ``x.new_ones(...)``
    and ``torch.zeros_like(x)`` even of a graph input; parameters (which training changes), graph inputs,
    module calls and random ops are not.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x + torch.ones(2).cumsum(0))  # the sum becomes a constant
        >>> x, constant, add = list(gm.graph.nodes)[:3]
        >>> c = Constants(gm); c.value(constant).tolist(), c.is_constant(add)
        ([1.0, 2.0], False)
    """

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.cache: dict[Node, Any] = {}

    def is_constant(self, node: Any) -> bool:
        """Whether :meth:`value` can compute ``node``."""
        return self.value(node) is not _NOT_CONSTANT

    def value(self, node: Any) -> Any:
        """The value of ``node``, or ``_NOT_CONSTANT``; anything that is no node is its own value."""
        if not isinstance(node, Node):
            return node
        if node not in self.cache:
            order = self._ancestors(node)
            if order is None:
                self.cache[node] = _NOT_CONSTANT
            else:
                for n in order:
                    self.cache[n] = self._compute(n)
        return self.cache[node]

    def _leaf(self, node: Node) -> Any:
        """A value for nodes that end the search, ``_NOT_CONSTANT``, or None (search on)."""
        val = node.meta.get("val")
        if node.op in ("placeholder", "output", "call_module"):
            return _NOT_CONSTANT
        if val is not None and not isinstance(val, torch.Tensor) and _plain(val):
            # a size, dtype or device, read from the shape metadata; other Python values came from data
            return val if _is_shape_expression(node) else _NOT_CONSTANT
        if node.op == "get_attr":
            tensor = attribute_tensor(self.gm, node.target)
            if tensor is None or isinstance(tensor, nn.Parameter) or mutated_aliases(node, self.gm):
                return _NOT_CONSTANT  # parameters change in training, mutated buffers as the graph runs
            return tensor
        if is_effectful(node, self.gm) and not is_inplace(node, self.gm):
            return _NOT_CONSTANT  # random numbers
        return None

    def _ancestors(self, node: Node) -> list[Node] | None:
        order, stack, seen = [], [node], {node}
        while stack:
            current = stack.pop()
            if self.cache.get(current, None) is _NOT_CONSTANT or self._leaf(current) is _NOT_CONSTANT:
                return None
            order.append(current)
            if current in self.cache or self._leaf(current) is not None:
                continue
            parents = current.all_input_nodes
            if _reads_metadata_only(current):
                parents = [p for p in parents if p is not current.args[0]]
            for parent in parents:
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        position = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return sorted((n for n in order if n not in self.cache), key=position.__getitem__)

    def _compute(self, node: Node) -> Any:
        leaf = self._leaf(node)
        if leaf is not None:
            return leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf
        stand_in = {}
        if _reads_metadata_only(node):  # any tensor of that shape, dtype and device gives the same result
            like = _tensor(node.args[0])
            if like is None:
                return _NOT_CONSTANT
            stand_in[node.args[0]] = torch.zeros(like.shape, dtype=like.dtype, device=like.device)

        def value_of(n: Node) -> Any:
            return stand_in[n] if n in stand_in else self.cache.get(n, _NOT_CONSTANT)

        if any(value_of(n) is _NOT_CONSTANT for n in node.all_input_nodes):
            return _NOT_CONSTANT
        try:
            with torch.no_grad():
                return call_node(node, value_of)
        except Exception:  # noqa: BLE001 - a value that cannot be computed here is not a constant
            return _NOT_CONSTANT


def _number(value: Any, constants: Constants) -> float | None:
    """A Python number, or the number a constant node or one-element constant tensor holds."""
    value = constants.value(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


# --------------------------------------------------------------------------------------------------
# Steps between the scores product and the softmax


@dataclasses.dataclass(frozen=True)
class Cast:
    """``scores`` cast to another floating dtype (or copied)."""

    node: Node
    scores: Node


@dataclasses.dataclass(frozen=True)
class Scale:
    """``scores * factor`` or ``scores / factor``: a number, a node computing one, or a one-element tensor."""

    node: Node
    scores: Node
    factor: Any
    divide: bool

    @property
    def is_tensor(self) -> bool:
        return _tensor(self.factor) is not None


@dataclasses.dataclass(frozen=True)
class AddMask:
    """``scores + coefficient * mask`` with a float tensor ``mask``."""

    node: Node
    scores: Node
    mask: Node
    coefficient: float


@dataclasses.dataclass(frozen=True)
class Fill:
    """``scores`` with ``value`` where keys are masked: ``condition`` marks kept keys when ``keeps`` (a
    ``where(condition, scores, value)``), masked ones otherwise (``masked_fill(condition, value)``)."""

    node: Node
    scores: Node
    condition: Node
    keeps: bool
    value: float


Step = Cast | Scale | AddMask | Fill
Reader = Callable[[Node, torch.fx.GraphModule, Constants], "list[Step] | Refusal | None"]


def read_cast_step(node: Node, gm: torch.fx.GraphModule, constants: Constants) -> list[Step] | None:
    """A cast of the scores (``.float()``, ``.to(dtype)``, ``.type_as(x)``...)."""
    source = read_cast(node)
    return None if source is None else [Cast(node, source)]


def _scale_factor(factor: Any, scores_value: torch.Tensor) -> str | None:
    """None when ``factor`` can scale the scores; else what it is, for the refusal."""
    if isinstance(factor, (int, float)) and not isinstance(factor, bool):
        return None
    if isinstance(factor, Node):
        value = factor.meta.get("val")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return None  # a number computed from shapes
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.ndim <= scores_value.ndim:
            return None
        if isinstance(value, torch.Tensor):
            return f"{factor.name} of shape {tuple(value.shape)}"
    return repr(factor)


def read_scale(node: Node, gm: torch.fx.GraphModule, constants: Constants) -> list[Step] | Refusal | None:
    """Scores times or divided by a number, a number from shapes, or a one-element tensor."""
    op = canonicalize(node, gm)
    if op is None or op.name not in ("mul", "div") or (op.name == "div" and op.args["rounding_mode"] is not None):
        return None
    a, b, out = op.args["input"], op.args["other"], _tensor(node)
    pairs = [(a, b), (b, a)] if op.name == "mul" else [(a, b)]
    pairs = [(s, f) for s, f in pairs if _tensor(s) is not None and out is not None and _tensor(s).shape == out.shape]
    for scores, factor in pairs:
        if _scale_factor(factor, _tensor(scores)) is None:
            return [Scale(node, scores, factor, op.name == "div")]
    if not pairs:
        return None
    scores, factor = pairs[0]
    return Refusal(f"an element-wise tensor gate ({op.name} by {_scale_factor(factor, _tensor(scores))}) is applied "
                  "to the scores before softmax")


def read_additive_mask(node: Node, gm: torch.fx.GraphModule, constants: Constants) -> list[Step] | Refusal | None:
    """Scores plus (or minus) a float tensor of a shape that broadcasts to theirs."""
    op = canonicalize(node, gm)
    if op is None or op.name not in ("add", "sub") or not isinstance(op.args["alpha"], (int, float)):
        return None
    a, b, alpha = op.args["input"], op.args["other"], op.args["alpha"]
    sign = -1.0 if op.name == "sub" else 1.0
    pairs = [(a, b, sign * alpha)]
    if op.name == "add" and alpha == 1:
        pairs.append((b, a, 1.0))
    out = _tensor(node)
    if out is None:
        return None
    steps: list[Step] = []
    for scores, mask, coefficient in pairs:
        s, m = _tensor(scores), _tensor(mask)
        if s is None or m is None or s.shape != out.shape:
            continue
        if not m.is_floating_point():
            return Refusal(f"the additive mask {mask.name} is {m.dtype}, not a float tensor")
        steps.append(AddMask(node, scores, mask, float(coefficient)))
    return steps or None


_MASKED_FILLS = {torch.masked_fill, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Scalar,
                 aten.masked_fill_.Tensor}
_WHERES = {torch.where, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar}


def _fill(node: Node, scores: Any, condition: Any, keeps: bool, value: Any, constants: Constants) -> Step | Refusal | None:
    if _tensor(scores) is None or _tensor(node) is None or _tensor(scores).shape != _tensor(node).shape:
        return None
    if _tensor(condition) is None or _tensor(condition).dtype != torch.bool:
        return None
    number = _number(value, constants)
    if number is None:
        return Refusal(f"the scores are filled with {getattr(value, 'name', value)}, which is not a constant")
    number = torch.tensor(number, dtype=torch.float64).to(_tensor(node).dtype).item()  # as the scores hold it
    return Fill(node, scores, condition, keeps, number)


def read_fill(node: Node, gm: torch.fx.GraphModule, constants: Constants) -> list[Step] | Refusal | None:
    """``masked_fill(mask, value)`` (also in place) or ``where(keep, scores, value)`` with a bool mask."""
    if _is_call(node, ("masked_fill", "masked_fill_"), _MASKED_FILLS):
        bound = _bound(node, ("input", "mask", "value"))
        found = [_fill(node, bound.get("input"), bound.get("mask"), False, bound.get("value"), constants)]
    elif _is_call(node, ("where",), _WHERES):
        if node.op == "call_method":  # x.where(condition, y) is where(condition, x, y)
            bound = _bound(node, ("input", "condition", "other"))
        else:
            bound = _bound(node, ("condition", "input", "other"))
        condition, a, b = bound.get("condition"), bound.get("input"), bound.get("other")
        found = [_fill(node, a, condition, True, b, constants), _fill(node, b, condition, False, a, constants)]
    else:
        return None
    steps = [f for f in found if isinstance(f, Fill)]
    return steps or next((f for f in found if isinstance(f, Refusal)), None)


# Read top to bottom: the first reader that recognises a node says what step it is.
SCORE_STEPS: list[Reader] = [read_cast_step, read_scale, read_additive_mask, read_fill]

_NONLINEAR = {"relu", "gelu", "silu", "sigmoid", "tanh", "hardtanh", "leaky_relu", "hardswish", "exp", "log",
              "abs", "clamp", "clip", "pow", "sqrt", "rsqrt", "square", "softplus", "elu", "sin", "cos", "erf",
              "log_softmax", "softmax", "sign", "round", "floor", "ceil", "maximum", "minimum", "max", "min"}


def _unknown_step(node: Node, gm: torch.fx.GraphModule) -> Refusal:
    name = describe(node, gm)
    if name.rstrip("_").lower() in _NONLINEAR:
        return Refusal(f"a non-linear function ({name}) is applied to the scores before softmax")
    return Refusal(f"{name} between the scores product and softmax is not a scale, a mask or a cast")


@dataclasses.dataclass(frozen=True)
class Scores:
    """The scores side: the product, q and k, and the steps from the product to the softmax, in order."""

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
        if position[user] > position[consumer] or user.users or not is_inplace(user, gm) or user.args[:1] != (node,):
            continue
        found = next((r for r in (reader(user, gm, constants) for reader in SCORE_STEPS) if r is not None), None)
        step = next((s for s in found if s.scores is node), None) if isinstance(found, list) else None
        if step is None:
            return found if isinstance(found, Refusal) else _unknown_step(user, gm)
        steps.append(step)
    return steps


def walk_scores(node: Node, consumer: Node, gm: torch.fx.GraphModule, constants: Constants,
                depth: int = 0) -> Scores | Refusal:
    """Walk back from ``node`` (what ``consumer`` reads) through :data:`SCORE_STEPS` to the scores product."""
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


# --------------------------------------------------------------------------------------------------
# From the softmax to the value product


@dataclasses.dataclass(frozen=True)
class Values:
    """The values side: casts and no-op dropouts after the softmax, the value product, v, output layout."""

    between: tuple[Node, ...]
    product: Node
    v: Operand
    out_perm: tuple[int, ...] | None


def walk_probs(softmax: Node, gm: torch.fx.GraphModule) -> Values | Refusal:
    """Walk forward from the softmax through casts and dropout to the product with the values."""
    node, between = softmax, []
    while True:
        users = [u for u in node.users if not _ignorable(u, gm)]
        for user in users:
            found = value_operand(user, node, gm)
            if found is not None:
                return found if isinstance(found, Refusal) else Values(tuple(between), user, *found)
        following = [u for u in users if read_cast(u) is node or (read_dropout(u, gm) or [None])[0] is node]
        if len(following) != 1:
            others = [u for u in users if u not in following]
            name = describe(others[0], gm) if others else "nothing"
            return Refusal(f"{name} between softmax and the value product (only casts and dropout may be there)")
        dropout = read_dropout(following[0], gm)
        if dropout is not None and dropout[2]:
            return Refusal(f"dropout (p={dropout[1]}) on the attention probabilities is active in training mode: "
                          "SDPA's dropout draws different random numbers, so the result could not be verified")
        node = following[0]
        between.append(node)


# --------------------------------------------------------------------------------------------------
# One attention, its checks, and its mask


@dataclasses.dataclass
class Attention:
    """One attention found at a softmax: everything the replacement needs.

    Attributes:
        softmax: the anchor.
        scores: the scores product, q, k and the steps to the softmax.
        values: the casts/dropouts after the softmax, the value product, v and the output layout.
        gqa: ``(k, v, n)`` un-repeated when K and V repeat each head n times, else None.
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
        return _tensor(self.scores.q.node).dtype


def metadata_reads(attention: Attention, node: Node) -> list[Node]:
    """Users of ``node`` that only read its dtype or device (``scores.dtype`` in a traced graph), where q has
    the same: they read q's instead, so ``node`` can go."""
    q = _tensor(attention.scores.q.node)
    value = _tensor(node)
    return [u for u in node.users if u.op == "call_function" and u.target is getattr and u.args[0] is node
            and u.args[1] in ("dtype", "device") and value is not None
            and (value.dtype, value.device) == (q.dtype, q.device)]


def _inputs(attention: Attention) -> list[Node]:
    """The graph values the replacement reads: q, k, v and what the steps scale, add and fill with."""
    nodes = [attention.scores.q.node, attention.scores.k.node, attention.values.v.node]
    for step in attention.scores.steps:
        nodes.extend(n for n in (getattr(step, "mask", None), getattr(step, "condition", None),
                                 getattr(step, "factor", None)) if isinstance(n, Node))
    return nodes


def check_metadata(attention: Attention, gm: torch.fx.GraphModule) -> str | None:
    """Every value involved has shape metadata, and none of the replacement's inputs is a removed node."""
    tensors = [attention.scores.q.node, attention.scores.k.node, attention.values.v.node, *attention.nodes,
               *(n for s in attention.scores.steps for n in (getattr(s, "mask", None), getattr(s, "condition", None))
                 if n is not None)]
    missing = [n.name for n in tensors if _tensor(n) is None]
    if missing:
        return f"no shape metadata for {', '.join(missing)}"
    inside = set(attention.nodes)
    for node in _inputs(attention):
        if node in inside:
            return f"{node.name} is both an input of the attention and part of it"
    return None


def check_users(attention: Attention, gm: torch.fx.GraphModule) -> str | None:
    """Scores and probabilities must be used only on the way to the value product."""
    inside = set(attention.nodes)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in attention.nodes[:-1]:
        reads = metadata_reads(attention, node)
        outside = [u.name for u in node.users if u not in inside and not _ignorable(u, gm) and u not in reads]
        if not outside:
            continue
        after_softmax = position[node] >= position[attention.softmax.node]
        if after_softmax:
            return f"the attention probabilities ({node.name}) are also used by {', '.join(outside)} (returned or reused)"
        return f"the attention scores ({node.name}) are also used by {', '.join(outside)}"
    return None


def check_dtypes(attention: Attention, gm: torch.fx.GraphModule) -> str | None:
    """q, k, v and the output share one floating dtype; casts never drop below it; float masks have it."""
    scores, values = attention.scores, attention.values
    dtypes = {name: _tensor(o.node).dtype for name, o in (("q", scores.q), ("k", scores.k), ("v", values.v))}
    dtypes["output"] = _tensor(values.product).dtype
    if len(set(dtypes.values())) > 1:
        return "query, key, value and output dtypes differ (" + ", ".join(f"{k} {v}" for k, v in dtypes.items()) + ")"
    dtype = attention.dtype
    if not dtype.is_floating_point:
        return f"the attention runs in {dtype}, not a floating dtype"
    chain = [scores.product, *(s.node for s in scores.steps), attention.softmax.node, *values.between]
    for node in chain:
        if _tensor(node) is None or not _tensor(node).is_floating_point():
            return f"no floating-point shape metadata for {node.name}"
        if torch.finfo(_tensor(node).dtype).eps > torch.finfo(dtype).eps:
            return f"{node.name} casts the attention to {_tensor(node).dtype}, below the query's {dtype}"
    for step in scores.steps:
        if isinstance(step, AddMask) and _tensor(step.mask).dtype != dtype:
            return f"the additive mask {step.mask.name} is {_tensor(step.mask).dtype}, the attention {dtype}"
        if not isinstance(step, Cast) and _tensor(step.node).dtype != _tensor(step.scores).dtype:
            return f"{step.node.name} changes the scores' dtype"
    return None


def check_layout(attention: Attention, gm: torch.fx.GraphModule) -> str | None:
    """q [.., L, E], k [.., S, E] and v [.., S, Ev] with the same batch dims (SDPA does not broadcast them)."""
    q, k, v = attention.scores.q.shape, attention.scores.k.shape, attention.values.v.shape
    scores = tuple(_tensor(attention.softmax.node).shape)
    if not (len(q) == len(k) == len(v) == len(scores)) or len(q) < 2:
        return f"query, key and value have {len(q)}, {len(k)} and {len(v)} dims"
    if q[:-2] != k[:-2] or q[:-2] != v[:-2] or q[-1] != k[-1] or k[-2] != v[-2] or scores != (*q[:-1], k[-2]):
        return f"query {q}, key {k} and value {v} do not line up without broadcasting"
    return None


def check_inputs_unchanged(attention: Attention, gm: torch.fx.GraphModule) -> str | None:
    """The replacement reads its inputs at the value product: none may be changed in place meanwhile."""
    for node in _inputs(attention):
        if mutated_aliases(node, gm):
            return f"{node.name} (or a view of it) is changed in place"
    return None


# Read top to bottom: the first reason refuses.
CHECKS: list[Callable[[Attention, torch.fx.GraphModule], str | None]] = [
    check_metadata,
    check_users,
    check_dtypes,
    check_layout,
    check_inputs_unchanged,
]


def find_gqa(attention: Attention) -> tuple[Operand, Operand, int] | None:
    """Un-repeated k and v when both repeat each of their heads n times (and SDPA can take them so)."""
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


@dataclasses.dataclass
class MaskPlan:
    """How the steps' masks reach SDPA.

    Attributes:
        kind: ``"none"``, ``"float"`` (additive, or mixed with fills), ``"bool"`` (fills only),
            ``"causal"`` (proven lower-triangular) or ``"dropped"`` (proven to keep every key).
        fix: the value of rows in which every key is masked (``"mean"`` of v, ``"nan"``), or None when no
            such row can occur or SDPA already agrees.
    """

    kind: str
    fix: str | None = None


def _is_masked(value: torch.Tensor) -> torch.Tensor:
    return (value == float("-inf")) | (value <= LARGE_NEGATIVE)


def plan_mask(attention: Attention, constants: Constants) -> MaskPlan | Refusal:
    """Check the steps' masks and decide how they become SDPA's (see the module docstring)."""
    steps = attention.scores.steps
    fills = [s for s in steps if isinstance(s, Fill)]
    additive = any(isinstance(s, AddMask) for s in steps)
    if not fills and not additive:
        return MaskPlan("none")
    values = []
    for i, fill in enumerate(fills):
        value = fill.value
        for later in steps[steps.index(fill) + 1:]:
            if isinstance(later, Scale):
                factor = _number(later.factor, constants)
                if later.is_tensor or factor is None or factor <= 0 or additive:
                    return Refusal(f"the scores are scaled by {getattr(later.factor, 'name', later.factor)} after "
                                  f"the fill at {fill.node.name}")
                value = value / factor if later.divide else value * factor
        values.append(value)
    if fills and not additive:
        if any(v != values[0] for v in values):
            return Refusal(f"the masks fill different values ({values[0]} and {next(v for v in values if v != values[0])})")
        if math.isnan(values[0]) or not (values[0] == -math.inf or values[0] <= LARGE_NEGATIVE):
            return Refusal(f"the fill value {values[0]} does not mask: only -inf and values <= {LARGE_NEGATIVE:g} hide a key")
        fix = "nan" if values[0] == -math.inf else "mean"
        return _constant_plan(attention, constants, MaskPlan("bool", fix))
    exact = [-math.inf] + ([] if attention.dtype == torch.float16 else [torch.finfo(attention.dtype).min])
    for fill in fills:
        if fill.value not in exact:
            combine = "-inf" if len(exact) == 1 else f"-inf or finfo({attention.dtype}).min"
            return Refusal(f"a fill with {fill.value} combined with an additive mask has no exact SDPA mask "
                          f"(only {combine} combine in {attention.dtype})")
    fix = "nan" if any(f.value == -math.inf for f in fills) else None
    return _constant_plan(attention, constants, MaskPlan("float", fix))


def _constant_plan(attention: Attention, constants: Constants, plan: MaskPlan) -> MaskPlan:
    """For a mask computed only from constants: causal, dropped, or kept with the row fix only if needed."""
    keep = fold_keep(attention, EagerBuilder(constants)) if plan.kind == "bool" else None
    if plan.kind == "float":
        mask = fold_mask(attention, EagerBuilder(constants))
        if isinstance(mask, torch.Tensor):
            kept, masked = mask == 0, _is_masked(mask)
            keep = kept if bool((kept | masked).all()) else None
            if plan.fix and keep is not None:
                dead = ~keep.any(-1)
                plan = MaskPlan("float", plan.fix if bool(dead.any()) else None)
            return _keep_plan(attention, keep, plan)
        return plan
    if not isinstance(keep, torch.Tensor):
        return plan
    return _keep_plan(attention, keep, plan)


def _keep_plan(attention: Attention, keep: torch.Tensor | None, plan: MaskPlan) -> MaskPlan:
    if keep is None:
        return plan
    shape = tuple(_tensor(attention.softmax.node).shape)
    keep = keep.broadcast_to(shape)
    if bool(keep.all()):
        return MaskPlan("dropped")
    length, keys = shape[-2:]
    if length == keys and torch.equal(keep, torch.ones(length, keys, dtype=torch.bool).tril().broadcast_to(shape)):
        return MaskPlan("causal")
    if plan.kind == "bool" and bool(keep.any(-1).all()):
        return MaskPlan("bool")
    return plan


# --------------------------------------------------------------------------------------------------
# Building: the same folds over the steps, into graph nodes or into real tensors


class EagerBuilder:
    """Computes a mask from constants at rewrite time (:meth:`value` raises when it cannot)."""

    class NotConstant(Exception):
        """The mask depends on something other than constants."""

    def __init__(self, constants: Constants):
        self.constants = constants

    def value(self, node: Any) -> Any:
        value = self.constants.value(node)
        if value is _NOT_CONSTANT:
            raise self.NotConstant
        return value

    def call(self, name: str, *args, **kwargs) -> Any:
        return _EAGER[name](*args, **kwargs)


_EAGER: dict[str, Callable] = {
    "add": torch.add, "mul": lambda a, b: a * b, "div": lambda a, b: a / b, "where": torch.where,
    "logical_not": torch.logical_not, "logical_and": torch.logical_and, "zeros_like": torch.zeros_like,
    "masked_fill": torch.masked_fill,
}


def fold_mask(attention: Attention, builder: Any) -> Any:
    """SDPA's float mask: additive masks summed, scaled by later factors, fills as ``where``; None if none."""
    try:
        mask = None
        for step in attention.scores.steps:
            if isinstance(step, AddMask):
                term = builder.value(step.mask)
                if step.coefficient != 1:
                    term = builder.call("mul", term, step.coefficient)
                mask = term if mask is None else builder.call("add", mask, term)
            elif isinstance(step, Scale) and mask is not None:
                mask = builder.call("div" if step.divide else "mul", mask, builder.value(step.factor))
            elif isinstance(step, Fill):
                condition = builder.value(step.condition)
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
    """SDPA's bool mask (True: attend) from the fills: the AND of what each keeps; None if not constant."""
    try:
        keep = None
        for step in attention.scores.steps:
            if isinstance(step, Fill):
                condition = builder.value(step.condition)
                kept = condition if step.keeps else builder.call("logical_not", condition)
                keep = kept if keep is None else builder.call("logical_and", keep, kept)
        return keep
    except EagerBuilder.NotConstant:
        return None


# name -> (symbolic-trace target, ATen target)
_OPS: dict[str, tuple[Callable, Any]] = {
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
    "mean": (torch.mean, aten.mean.dim),
    "repeat_interleave": (torch.repeat_interleave, aten.repeat_interleave.self_int),
    "sdpa": (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default),
}


_ANDS = {operator.and_, torch.logical_and, torch.bitwise_and, aten.__and__.Tensor, aten.bitwise_and.Tensor,
         aten.logical_and.default}


class GraphBuilder:
    """Emits the replacement's nodes before ``anchor``: torch calls in traced graphs, ATen ops in exported ones.

    Masks reach SDPA narrowed (:meth:`value`): a condition AND-ed with one that constants prove all-True
    is dropped, so a ``[B, 1, 1, S]`` padding mask spread over the queries by ``q_idx >= 0``
    (transformers' mask builders) stays ``[B, 1, 1, S]`` and SDPA broadcasts it, instead of an S x S
    tensor being built.
    """

    def __init__(self, gm: torch.fx.GraphModule, anchor: Node, aten_ops: bool, constants: Constants | None = None):
        self.gm, self.graph, self.anchor, self.aten_ops = gm, gm.graph, anchor, aten_ops
        self.constants = constants
        self.nodes: list[Node] = []

    def value(self, node: Any) -> Any:
        return self._narrowed(node) if self.constants is not None else node

    def _narrowed(self, node: Any, depth: int = 0) -> Any:
        """``node``'s value up to broadcasting, without AND-ed conditions proven all-True."""
        if not isinstance(node, Node) or node.op != "call_function" or depth > 16:
            return node
        if node.target in _ANDS and getattr(_tensor(node), "dtype", None) == torch.bool and len(node.args) == 2:
            a, b = node.args
            for other, kept in ((a, b), (b, a)):
                value = self.constants.value(other)
                if isinstance(value, torch.Tensor) and value.dtype == torch.bool and bool(value.all()):
                    return self._narrowed(kept, depth + 1)
            new_a, new_b = self._narrowed(a, depth + 1), self._narrowed(b, depth + 1)
            return node if (new_a, new_b) == (a, b) else self.call("logical_and", new_a, new_b)
        if node.target in _WHERES and node.args and isinstance(node.args[0], Node):
            condition = self._narrowed(node.args[0], depth + 1)
            if condition is node.args[0]:
                return node
            return self._emit(node.target, (condition, *node.args[1:]), dict(node.kwargs))
        return node

    def _emit(self, target: Any, args: tuple, kwargs: dict) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        self.nodes.append(node)
        propagate_meta(self.gm, [node])  # later calls read its shape and whether it is a tensor
        return node

    def call(self, name: str, *args, **kwargs) -> Node:
        if name in ("mul", "div") and not isinstance(args[0], Node) and not isinstance(args[1], Node):
            return args[0] * args[1] if name == "mul" else args[0] / args[1]
        if name in ("mul", "div") and not any(isinstance(_tensor(a), torch.Tensor) for a in args):
            return self._emit(operator.mul if name == "mul" else operator.truediv, args, kwargs)  # numbers
        if name == "where":
            return self._where(*args)
        if name in ("any", "mean") and self.aten_ops:
            args = (args[0], [args[1]] if name == "mean" else args[1], *args[2:])
        return self._emit(_OPS[name][1 if self.aten_ops else 0], args, kwargs)

    def _where(self, condition: Node, a: Any, b: Any) -> Node:
        if not self.aten_ops:
            return self._emit(torch.where, (condition, a, b), {})
        numbers = (not isinstance(a, Node), not isinstance(b, Node))
        target = {(False, False): aten.where.self, (True, False): aten.where.ScalarSelf,
                  (False, True): aten.where.ScalarOther, (True, True): aten.where.Scalar}[numbers]
        return self._emit(target, (condition, a, b), {})

    def operand(self, operand: Operand) -> Node:
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


def build(attention: Attention, plan: MaskPlan, builder: GraphBuilder) -> Node:
    """Emit the SDPA call and what it needs; return the node that replaces the value product."""
    scores, values = attention.scores, attention.values
    q = builder.operand(scores.q)
    for step in scores.steps:  # one-element tensor scales multiply q, so their gradients flow
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
    while mask is not None and _tensor(mask) is not None and _tensor(mask).ndim < 2:  # SDPA wants [.., L, S]; leading 1s broadcast the same
        mask = builder.call("unsqueeze", mask, 0)
    lift = max(0, 4 - len(scores.q.shape))  # SDPA's fast kernels take 4-d inputs
    for _ in range(lift):
        q, k, v = (builder.call("unsqueeze", t, 0) for t in (q, k, v))
    kwargs: dict[str, Any] = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": plan.kind == "causal",
                              "scale": _scale(attention, builder)}
    if attention.gqa:
        kwargs["enable_gqa"] = True
    out = builder.call("sdpa", q, k, v, **kwargs)
    for _ in range(lift):
        out = builder.call("squeeze", out, 0)
    if plan.fix:
        alive = builder.call("any", keep, -1, True)
        fallback: Any = math.nan
        if plan.fix == "mean":
            fallback = builder.call("mean", builder.operand(v_operand), -2, True)
            if attention.gqa:
                fallback = builder.call("repeat_interleave", fallback, attention.gqa[2], 1)
        out = builder.call("where", alive, out, fallback)
    if values.out_perm is not None:
        out = builder.call("permute", out, list(values.out_perm))
    return out


def describe_change(attention: Attention, plan: MaskPlan) -> str:
    """The report's line for one replacement: the SDPA arguments that differ from plain attention."""
    details = []
    scale = 1.0
    for step in attention.scores.steps:
        if isinstance(step, Scale) and not step.is_tensor:
            factor = step.factor.meta.get("val") if isinstance(step.factor, Node) else step.factor
            scale = scale / factor if step.divide else scale * factor
    details.append(f"scale={scale:.4g}" if isinstance(scale, float) else "scale=<from shapes>")
    if any(isinstance(s, Scale) and s.is_tensor for s in attention.scores.steps):
        details.append("tensor scale on q")
    details.extend({"float": ["attn_mask=<float>"], "bool": ["attn_mask=<bool>"], "causal": ["is_causal=True"]}
                   .get(plan.kind, []))
    if plan.fix:
        details.append("rows with every key masked kept as eager")
    if attention.gqa:
        details.append(f"enable_gqa=True ({attention.gqa[2]} query heads per kv head)")
    return f"attention -> scaled_dot_product_attention({', '.join(details)})"


# --------------------------------------------------------------------------------------------------
# The pass


def find_attention(softmax: Softmax, gm: torch.fx.GraphModule, constants: Constants
                   ) -> tuple[Attention, MaskPlan] | Refusal:
    """The attention around ``softmax`` and how its mask reaches SDPA, or why it is not replaced."""
    ndim = _tensor(softmax.node).ndim
    if softmax.dim != ndim - 1:
        return Refusal(f"softmax over dim {softmax.dim} of {ndim}, not the last (key) dim")
    scores = walk_scores(softmax.input, softmax.node, gm, constants)
    if isinstance(scores, Refusal):
        return scores
    values = walk_probs(softmax.node, gm)
    if isinstance(values, Refusal):
        return values
    attention = Attention(softmax, scores, values)
    for check in CHECKS:
        reason = check(attention, gm)
        if reason:
            return Refusal(reason)
    attention.gqa = find_gqa(attention)
    plan = plan_mask(attention, constants)
    if isinstance(plan, Refusal):
        return plan
    return attention, plan


def _erase_dead(gm: torch.fx.GraphModule, candidates: list[Node]) -> None:
    """Erase nodes among ``candidates`` and their inputs that nothing uses any more and that have no effect."""
    stack = list(candidates)
    while stack:
        node = stack.pop()
        if node.graph is not gm.graph or getattr(node, "_erased", False) or node.users:
            continue
        if node.op in ("placeholder", "output") or is_effectful(node, gm):
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        stack.extend(inputs)


def replace(attention: Attention, plan: MaskPlan, gm: torch.fx.GraphModule, ctx: PassContext,
            constants: Constants | None = None) -> None:
    """Replace the attention's nodes with the SDPA call and report it (with the user's source line).

    Nothing changes if the replacement cannot be built; the attention is then a near miss with the error.
    """
    nodes = attention.nodes
    anchor = attention.values.product
    builder = GraphBuilder(gm, anchor, aten_ops=ctx.method == "export", constants=constants)
    try:
        result = build(attention, plan, builder)
    except Exception as error:  # noqa: BLE001 - this attention stays as it is; the others still go
        for node in reversed(builder.nodes):
            gm.graph.erase_node(node)
        ctx.refused(attention.softmax.node, f"the replacement could not be built: {first_line(error)}")
        return
    ctx.matched(describe_change(attention, plan), nodes)
    inherit_origin(builder.nodes, nodes, gm)
    anchor.replace_all_uses_with(result)
    inputs = {i for n in nodes for i in n.all_input_nodes} - set(nodes)
    for node in nodes:
        for user in metadata_reads(attention, node):
            user.replace_input_with(node, attention.scores.q.node)
        for user in [u for u in node.users if _ignorable(u, gm)]:
            gm.graph.erase_node(user)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    _erase_dead(gm, list(inputs))


def replace_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """The ``attention`` pass: every softmax that is attention becomes SDPA; near misses get a reason.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.softmax(x, -1))
        >>> ctx = PassContext("attention", False, "fx"); replace_attention(gm, ctx); ctx.matches
        []
    """
    constants = Constants(gm)
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False) or node.graph is not gm.graph:
            continue
        softmax = read_softmax(node, gm)
        if softmax is None:
            continue
        try:
            found = find_attention(softmax, gm, constants)
        except Exception as error:  # noqa: BLE001 - one unreadable softmax must not stop the others
            found = Refusal(f"the attention could not be analysed: {first_line(error)}")
        if isinstance(found, Refusal):
            if looks_like_attention(node, gm):
                ctx.refused(node, str(found))
            continue
        replace(*found, gm, ctx, constants)


ATTENTION = Pass("attention", replace_attention,
                 "hand-written softmax(q @ k^T * scale + mask) @ v -> scaled_dot_product_attention with the exact "
                 "scale and mask (causal proven, grouped kv heads)", keeps_meta=True)
