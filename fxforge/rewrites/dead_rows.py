"""``cleanup``'s dead rows: the rows of a value that nothing reads are not computed.

A classifier often reads one token of its last hidden states: ViT's and BERT's class token (``x[:, 0]``), a
decoder's last position (``x[:, -1]``). Eager computes the whole last block for every token all the same: its
MLP, its attention's output projection, its norms. Each of those ops computes a row of its result from the
same row of its inputs, so one row of the result is the op of one row of the inputs. The rule moves a
one-row read up through such an op while every reader of the op's value reads that same row, and stops at a
value something reads whole (the keys and values of the last attention, a hidden state the model returns).

Rows move through the ops that compute a row of their result from the same row of their inputs, on a
dimension they keep row by row (:mod:`fxforge.rewrites.row_lifting` lists them).

It refuses (the row stays where it is) an op that mixes rows along the dimension, a value read whole by
anything else (a read of its size along the dimension included: it would see one row; sizes of other
dimensions may be read), ops that mutate, draw random numbers or call opaque modules, and anything without
shape metadata. It leaves the rows in training mode and in graphs for calls that record gradients: eager's
backward multiplies each unread row by a zero gradient, and a NaN or an infinity in that row makes the
parameters' gradients NaN, which computing one row would not. The results are the same numbers: each kept row is
computed by the same op from the same inputs; only rows no output reads are left out.

Example:
    >>> import torch
    >>> from fxforge.core.shapes import annotate
    >>> from fxforge.rewrites.passes import PassContext
    >>> class Head(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__(); self.mlp = torch.nn.Linear(8, 8); self.norm = torch.nn.LayerNorm(8)
    ...     def forward(self, x):
    ...         return self.norm(torch.relu(self.mlp(x)))[:, 0]
    >>> gm = torch.fx.symbolic_trace(Head().eval()); _ = annotate(gm, (torch.randn(2, 5, 8),), {})
    >>> ctx = PassContext("cleanup", training=False, method="fx")
    >>> remove_dead_rows(gm, ctx); _ = gm.recompile(); len(ctx.matches), tuple(gm(torch.randn(2, 5, 8)).shape)
    (3, (2, 8))
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from fxforge.core.nodes import fake_value, is_effectful, mutated_aliases
from fxforge.core.plan import CallConditions
from fxforge.core.shapes import propagate_meta
from fxforge.core.vocabulary import argument
from fxforge.rewrites.passes import PassContext, Refusal
from fxforge.rewrites.row_lifting import Row, SizesWithRow, Sliced, _known_equal, lift, read_row

aten = torch.ops.aten

WHAT = "rows no output reads not computed"


def _reads_other_sizes(user: Node, node: Node, dim: int, rank: int) -> bool:
    """Whether ``user`` reads only metadata of ``node`` that one row of ``dim`` leaves as it is: dtype, device,
    rank, or the sizes of other dimensions (``x.shape[0]``, ``x.size(2)``)."""
    if user.op == "call_function" and user.target is getattr and user.args[1] in ("dtype", "device", "ndim"):
        return True
    whole = (user.op == "call_function" and user.target is getattr and user.args[1] == "shape") or \
        (user.op == "call_method" and user.target == "size" and len(user.args) == 1 and not user.kwargs)
    if whole:
        return all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                   and u.args[1] % rank != dim for u in user.users)
    sized = (user.op == "call_method" and user.target == "size") or \
        (user.op == "call_function" and user.target is aten.sym_size.int)
    index = argument(user, 1, "dim")
    return sized and isinstance(index, int) and index % rank != dim


def _readers(node: Node) -> tuple[Row, list[tuple[Node, bool]]] | Refusal:
    """The one row every user of ``node`` reads, with the readers (and whether each keeps the dimension);
    users that read only sizes of other dimensions are left as they are."""
    rows, readers, others = set(), [], []
    for user in node.users:
        read = read_row(user) if user.op != "output" else None
        if read is None or read[0] is not node or user.args[0] is not node:
            others.append(user)
            continue
        rows.add(read[1])
        readers.append((user, read[2]))
    if len(rows) != 1:
        return Refusal(f"{node.name}'s users read different rows" if rows else f"{node.name} is read whole")
    row = rows.pop()
    rank = fake_value(node).dim()
    whole = next((u for u in others if not _reads_other_sizes(u, node, row.dim, rank)), None)
    if whole is not None:
        return Refusal(f"{node.name} is read whole by {whole.name}")
    return row, readers


def _movable(node: Node, gm: torch.fx.GraphModule) -> Refusal | None:
    if node.op not in ("call_function", "call_method", "call_module"):
        return Refusal(f"{node.name} is an input or a parameter")
    if is_effectful(node, gm) or mutated_aliases(node, gm):
        return Refusal(f"{node.name} mutates, draws random numbers or calls an opaque module")
    return None


def _slice(graph: torch.fx.Graph, operand: Sliced, index: int, before: Node) -> Node:
    start, end = Row(operand.dim, index).bounds()
    with graph.inserting_before(before):
        return graph.call_function(aten.slice.Tensor, (operand.value, operand.dim, start, end))


def _move_above(node: Node, row: Row, readers: list[tuple[Node, bool]], lifted: tuple[tuple, dict],
                gm: torch.fx.GraphModule) -> list[Node]:
    """Make ``node`` compute only ``row`` (its operands sliced), point its readers at it; returns the slices."""
    graph = gm.graph
    made: list[Node] = []

    def place(arg: Any) -> Any:
        if isinstance(arg, Sliced):
            made.append(_slice(graph, arg, row.index, node))
            return made[-1]
        if isinstance(arg, SizesWithRow):
            with graph.inserting_before(node):
                return [1 if i == arg.dim else graph.call_function(operator.getitem, (arg.sizes, i))
                        for i in range(arg.rank)]
        return arg

    args, kwargs = lifted
    before = node.all_input_nodes
    node.args = tuple(place(a) for a in args)
    node.kwargs = {k: place(a) for k, a in kwargs.items()}
    _erase_unused_size_reads(graph, before)
    for reader, keeps_dim in readers:
        if keeps_dim:
            reader.replace_all_uses_with(node)
            graph.erase_node(reader)
        else:
            reader.args = (node, row.dim, 0)
            reader.kwargs = {}
            if reader.target is operator.getitem or reader.op == "call_method":
                reader.target, reader.op = aten.select.int, "call_function"
    changed = [*made, node, *(r for r, keeps in readers if not keeps)]
    for stale in changed:  # propagate_meta renews 'val' (or drops it); the pipeline refills tensor_meta
        stale.meta.pop("tensor_meta", None)
    propagate_meta(gm, changed)
    return made


def _erase_unused_size_reads(graph: torch.fx.Graph, nodes: list[Node]) -> None:
    """Erase the size reads (``x.shape[1]``, ``x.size(1)``) a lifted op no longer uses, so that they do not
    keep the next value up read whole."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        size_read = node.op in ("call_function", "call_method") and (
            node.target in (getattr, operator.getitem, "size", aten.sym_size.int))
        if size_read and not node.users and node.graph is graph:
            stack.extend(node.all_input_nodes)
            graph.erase_node(node)


def _merge_equal_slices(graph: torch.fx.Graph, slices: set[Node]) -> None:
    """One node for each row read of a value several lifted ops read (a residual's input and its branch):
    the first in graph order, which precedes every reader of the others."""
    first: dict[tuple, Node] = {}
    for node in graph.nodes:
        if node in slices:
            key = node.args
            if key in first:
                node.replace_all_uses_with(first[key])
                graph.erase_node(node)
            else:
                first[key] = node


def _not_for(ctx: PassContext) -> Refusal | None:
    """Why the rows stay for the calls this graph serves, or None: eager's backward multiplies each unread
    row's values by a zero gradient, so a NaN or an infinity there makes the parameters' gradients NaN, and
    gradients must be eager's."""
    if ctx.training:
        return Refusal("in training mode every row is kept: eager's gradients multiply the unread rows by zero, "
                       "and a NaN or an infinity there reaches the parameters' gradients")
    if ctx.conditions.gradients:
        return Refusal("every row is kept: eager's gradients multiply the unread rows by zero, and a NaN or an "
                       f"infinity there reaches the parameters' gradients: {CallConditions.FOR_GRADIENTS}")
    return None


def remove_dead_rows(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """Move every one-row read of the graph up through the ops that compute rows independently (see the module
    docstring); each op that now computes one row is one match in ``ctx``. Where a row stops is not reported:
    most values are read whole by design, and a near miss for each would bury the report.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Identity())
        >>> remove_dead_rows(gm, PassContext("cleanup", False, "fx"))
    """
    reads = {n: read_row(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    readers = [n for n, read in reads.items() if read is not None]
    refusal = _not_for(ctx)
    if refusal is not None:
        if readers:
            ctx.refused(readers[0], refusal)
        return
    pending = [reads[n][0] for n in readers]
    seen: set[Node] = set()
    slices: set[Node] = set()
    while pending:
        node = pending.pop()
        if node in seen or node.graph is not gm.graph:
            continue
        seen.add(node)
        readers = _readers(node)
        if isinstance(readers, Refusal) or _movable(node, gm) is not None:
            continue
        row, users = readers
        value = fake_value(node)
        if value is None or _known_equal(value.shape[row.dim], 1):
            continue
        lifted = lift(node, row, gm)
        if isinstance(lifted, Refusal):
            continue
        ctx.matched(f"{WHAT}: row {row.index} of dim {row.dim} computed alone", [node])
        made = _move_above(node, row, users, lifted, gm)
        slices.update(made)
        pending.extend(s.args[0] for s in made)
        seen.difference_update(s.args[0] for s in made)
    _merge_equal_slices(gm.graph, {s for s in slices if s.graph is gm.graph})
