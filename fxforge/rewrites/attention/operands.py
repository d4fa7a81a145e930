"""Operands: q and k of the scores product, v of the value product, in the layout SDPA takes them.

A product reads its operands in whatever layout the user wrote: K swapped by ``transpose``/``permute``/
``mT`` or not, an ``einsum`` in any layout, K and V repeated per head for grouped-query attention. Each
is read here as an :class:`Operand`: a graph value and the permutation and swap that bring it to SDPA's.

Example:
    >>> from fxforge.core.shapes import annotate
    >>> gm = torch.fx.symbolic_trace(lambda q, k: q @ k.transpose(-2, -1))
    >>> _ = annotate(gm, (torch.ones(1, 2, 4, 8),) * 2, {})
    >>> q, k, kt, scores = list(gm.graph.nodes)[:4]
    >>> scores_operands(scores, gm) == (Operand(q), Operand(k))
    True
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import fake_value
from fxforge.core.vocabulary import argument, calls
from fxforge.rewrites.canonical import canonicalize
from fxforge.rewrites.passes import Refusal


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
        """The shape SDPA sees: ``node``'s, permuted, then its last two dims swapped."""
        shape = list(fake_value(self.node).shape)
        if self.perm is not None:
            shape = [shape[i] for i in self.perm]
        if self.swap:
            shape[-2:] = shape[-1], shape[-2]
        return tuple(shape)

    @property
    def plain(self) -> bool:
        """Whether SDPA takes ``node`` as it is (neither permuted nor swapped)."""
        return self.perm is None and not self.swap


def swapped_source(node: Any) -> Node | None:
    """x when ``node`` is x with its last two dims swapped (``transpose``, ``permute``, ``mT``, ``.t()``).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); x.meta["val"] = torch.ones(2, 3, 4)
        >>> t = g.call_method("transpose", (x, 2, 1)); t.meta["val"] = torch.ones(2, 4, 3)
        >>> swapped_source(t) is x
        True
    """
    value = fake_value(node)
    if value is None or value.ndim < 2 or not node.args or not isinstance(node.args[0], Node):
        return None
    n, source = value.ndim, node.args[0]
    last_two = {n - 2, n - 1}
    if calls(node, "transpose"):
        dims = node.args[1:3]
        if len(dims) == 2 and all(isinstance(d, int) for d in dims) and {d % n for d in dims} == last_two:
            return source
    if calls(node, "permute"):
        listed = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))  # permute(x, [0, 2, 1])
        dims = node.args[1] if listed else node.args[1:]
        if all(isinstance(d, int) for d in dims) and [d % n for d in dims] == [*range(n - 2), n - 1, n - 2]:
            return source
    attribute = node.op == "call_function" and node.target is getattr
    if attribute and node.args[1:] in (("mT",), ("T",) * (n == 2)):
        return source
    if (calls(node, "t") and n == 2) or calls(node, "mT"):
        return source
    return None


def untransposed(node: Node) -> Operand:
    """K ([.., S, E]) for a product ``q @ node``: the tensor ``node`` swaps, or ``node`` to be swapped.

    Example:
        >>> g = torch.fx.Graph(); k = g.placeholder("k"); k.meta["val"] = torch.ones(2, 3, 4)
        >>> untransposed(k)
        Operand(node=k, perm=None, swap=True)
    """
    source = swapped_source(node)
    return Operand(source) if source is not None else Operand(node, swap=True)


def _reshape_source(node: Any) -> Node | None:
    """x when ``node`` is a reshape of x (view, reshape, flatten, unsqueeze, or indexing with only ``:``
    and ``None``): its values in the same order under another shape."""
    if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
        return None
    if calls(node, "view", "reshape", "flatten", "unsqueeze"):
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
    out = fake_value(node)
    if out is None or out.ndim != 4:
        return None
    if calls(node, "repeat_interleave"):
        source, n, dim = node.args[0], argument(node, 1, "repeats"), argument(node, 2, "dim")
        x = fake_value(source)
        if (isinstance(n, int) and isinstance(dim, int) and dim % 4 == 1 and x is not None and x.ndim == 4
                and tuple(out.shape) == (x.shape[0], x.shape[1] * n, *x.shape[2:])):
            return source, n
        return None
    expanded = _reshape_source(node)
    if not calls(expanded, "expand"):
        return None
    source = _reshape_source(expanded.args[0])
    x, e = fake_value(source), fake_value(expanded)
    if x is None or e is None or x.ndim != 4:
        return None
    if fake_value(expanded.args[0]).shape != (*x.shape[:2], 1, *x.shape[2:]):
        return None
    n = e.shape[2]
    if tuple(e.shape) == (*x.shape[:2], n, *x.shape[2:]) and tuple(out.shape) == (x.shape[0], x.shape[1] * n,
                                                                                 *x.shape[2:]):
        return source, n
    return None


def read_einsum(node: Node) -> tuple[str, list[Node], list[list[str]], list[str]] | None:
    """``(equation, operands, letters of each operand, output letters)`` of a two-operand einsum; an
    ellipsis becomes numbered letters.

    Example:
        >>> g = torch.fx.Graph(); a, b = g.placeholder("a"), g.placeholder("b")
        >>> a.meta["val"] = b.meta["val"] = torch.ones(2, 3, 4)
        >>> read_einsum(g.call_function(torch.einsum, ("...qd,...kd->...qk", a, b)))[2:]
        ([['.0', 'q', 'd'], ['.0', 'k', 'd']], ['.0', 'q', 'k'])
    """
    if not calls(node, "einsum") or not node.args:
        return None
    equation, operands = node.args[0], list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    values = [fake_value(o) for o in operands]
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
    """``(q, k)`` with q [.., L, E] and k [.., S, E] when ``node`` is a product giving scores [.., L, S].

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(lambda q, k: torch.einsum("bqhd,bkhd->bhqk", q, k))
        >>> _ = annotate(gm, (torch.ones(1, 4, 2, 8),) * 2, {})
        >>> q, k, scores = list(gm.graph.nodes)[:3]
        >>> scores_operands(scores, gm)[1]
        Operand(node=k, perm=(0, 2, 1, 3), swap=False)
    """
    op = canonicalize(node, gm)
    if op is not None and op.name == "matmul":
        a, b = op.args["input"], op.args["other"]
        va, vb = fake_value(a), fake_value(b)
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
        return Refusal(f"the scores einsum '{equation}' contracts over {len(contracted)} dims, "
                       "not one head dim")
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
    v is [.., S, Ev] and the permutation takes SDPA's [.., L, Ev] to ``node``'s layout (None: same).

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(lambda p, v: p @ v)
        >>> _ = annotate(gm, (torch.ones(1, 2, 4, 4),) * 2, {})
        >>> p, v, out = list(gm.graph.nodes)[:3]
        >>> value_operand(out, p, gm)
        (Operand(node=v, perm=None, swap=False), None)
        >>> print(value_operand(out, v, gm))
        the attention probabilities are the second operand of matmul, not the first
    """
    op = canonicalize(node, gm)
    if op is not None and op.name == "matmul":
        if op.args["input"] is not probs:
            return Refusal(f"the attention probabilities are the second operand of {node.name}, "
                           "not the first")
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
        return Refusal(f"the value einsum '{equation}' does not contract the values over the softmax "
                       "(key) dim")
    head = extra.pop()
    canonical = [*batch, query, head]
    return Operand(operands[1 - index], _perm(lv, [*batch, key, head])), _perm(canonical, out)


def _is_product(node: Node, gm: torch.fx.GraphModule) -> bool:
    op = canonicalize(node, gm) if node.op.startswith("call") else None
    return (op is not None and op.name == "matmul") or calls(node, "einsum")


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
    return (_near_product(softmax.all_input_nodes, gm, forward=False, hops=8)  # (a soft cap: 4 steps, a mask, a view)
            and _near_product([softmax], gm, forward=True))
