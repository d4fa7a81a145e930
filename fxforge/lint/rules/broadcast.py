"""``broadcast-blowup``: an elementwise op whose result is larger than both operands, where neither operand's
size-1 dim was made for broadcasting: ``[B] - [B, 1]`` gives ``[B, B]``, and a loss over it is silently wrong.

Example:
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.head = torch.nn.Linear(8, 1)
    ...     def forward(self, x, y):
    ...         return ((self.head(x) - y) ** 2).mean()
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(4, 8), torch.randn(4)), rules=[RULE])]
    ['broadcast-blowup']
"""

from __future__ import annotations

import math

import torch

from fxforge.lint.graph import LintGraph, format_bytes
from fxforge.lint.rule import Rule

ELEMENTWISE = {"add", "sub", "mul", "div", "pow", "rsub", "maximum", "minimum", "eq", "ne", "lt", "gt", "le", "ge",
               "atan2", "where", "add_", "sub_", "mul_", "div_", "remainder", "fmod", "floor_divide", "true_divide"}
# Losses that broadcast their input against their target before reducing (torch only warns).
LOSSES = {"broadcast_tensors", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
          "binary_cross_entropy_with_logits"}
# Ops that make a size-1 dim on purpose: an unsqueeze, a view or reshape, x[:, None], an expand.
SHAPING = {"unsqueeze", "view", "reshape", "_unsafe_view", "expand", "expand_as", "view_as", "broadcast_to",
           "getitem", "unflatten", "index", "slice", "select", "repeat", "arange", "full", "ones", "zeros",
           "new_ones", "new_zeros", "new_full", "tensor", "linspace", "reshape_as"}
REDUCTIONS_KEEPDIM = {"sum", "mean", "amax", "amin", "max", "min", "norm", "std", "var", "logsumexp", "prod",
                      "linalg_vector_norm"}


def _designed(graph: LintGraph, node: object, rank: int, depth: int = 6) -> bool:
    """Whether the operand's broadcast dims were made on purpose: it has all ``rank`` dims (none added by
    broadcasting's rule) and its size-1 ones come from a shaping op (or a keepdim reduction) on its way from its
    source through ops that keep its shape, or it is an input or constant that has them."""
    shape = graph.shape(node)
    if shape is not None and len(shape) < rank:
        return False  # broadcast along dims it does not have: nothing made them
    for _ in range(depth):
        if not isinstance(node, torch.fx.Node):
            return True  # a Python scalar
        if node.op in ("placeholder", "get_attr"):
            return True
        op = graph.op(node)
        if op in SHAPING:
            return True
        if op in REDUCTIONS_KEEPDIM and graph.arg(node, 2, "keepdim", default=False):
            return True
        sources = [a for a in graph.tensor_args(node) if graph.shape(a) == graph.shape(node)]
        if not sources:
            return False
        node = sources[0]
    return False


def _operands(graph: LintGraph, node: torch.fx.Node) -> list[torch.fx.Node]:
    args = graph.tensor_args(node)
    return args[:3] if graph.op(node) in ("where", "broadcast_tensors") else args[:2]


def check(graph: LintGraph):
    for node in graph.calls(*ELEMENTWISE, *LOSSES):
        operands = _operands(graph, node)
        shapes = [graph.shape(a) for a in operands]
        if len(operands) < 2 or any(s is None for s in shapes) or len(set(shapes)) == 1:
            continue
        try:
            out = tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            continue
        sizes = [math.prod(s) for s in shapes]
        if math.prod(out) <= max(sizes) or any(len(s) == 0 for s in shapes):
            continue
        if any(_designed(graph, a, len(out)) for a in operands):
            continue
        value = graph.value(operands[0])
        itemsize = value.element_size() if value is not None else 4
        grown = math.prod(out) * itemsize
        parts = " and ".join(f"{a.name} {list(s)}" for a, s in zip(operands, shapes))
        kind = "the loss's input and target" if graph.op(node) in LOSSES else "the operands"
        yield graph.finding(
            node, f"{graph.op(node)} broadcasts {parts} to {list(out)}, larger than both "
                  f"({math.prod(out):,} elements from {' and '.join(f'{s:,}' for s in sizes)}); neither side's size-1 or "
                  f"missing dim was made for broadcasting, so {kind} likely meant the same shape "
                  "([B] op [B, 1] gives [B, B])",
            "make the shapes equal: squeeze the size-1 dim (p.squeeze(-1)) or add the missing one (y.unsqueeze(-1)); "
            "for an intended outer op, write it explicitly (a[:, None] * b[None, :])",
            involved=f"{parts} -> {list(out)} ({format_bytes(grown)})", bytes=grown)


RULE = Rule("broadcast-blowup", "error", check,
            "an elementwise op or loss whose operands broadcast each other to a result larger than both, where no "
            "size-1 dim was made for it: a [B] and a [B, 1] become [B, B]")
