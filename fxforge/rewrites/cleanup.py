"""``cleanup``: remove what cannot change a result.

The rules, top to bottom — each names the node it removes and the value that replaces it:

- dropout in eval mode (or with p = 0) → its input
- identity modules and ``aten.alias`` → their input
- ``contiguous()`` of a value that is already contiguous → the value
- ``to``/``type``/``float``... to the dtype, device and layout the value already has → the value
- ``view``/``reshape``/``flatten``/``expand`` to the shape the value already has → the value
- export's ``_assert_tensor_metadata`` checks that the shape metadata already proves → nothing
- rows of a value that no output reads: a one-row read (``x[:, 0]``) moved up through the ops that compute
  rows independently, so the rows nobody reads are not computed (:mod:`fxforge.rewrites.dead_rows`)
- values computed from constants alone (a relative-position index eager caches) computed once, as buffers
  (:mod:`fxforge.rewrites.constant_subgraphs`)
- then dead code: nodes whose results nobody uses and which have no effect (no mutation, no RNG,
  no opaque module call).

A rule that cannot prove its condition (no shape metadata, a copy whose result is mutated later)
leaves the node alone; in training mode dropout is kept and reported as a near miss.

Example:
    >>> import torch
    >>> from fxforge.rewrites.passes import PassContext
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Dropout(), torch.nn.ReLU()).eval())
    >>> ctx = PassContext("cleanup", training=False, method="fx")
    >>> run_cleanup(gm, ctx); [m.what for m in ctx.matches]
    ['dropout in eval removed']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from fxforge.core.nodes import CALL_OPS, fake_value, is_effectful, mutated_aliases
from fxforge.core.vocabulary import argument, calls, read_dropout
from fxforge.rewrites.constant_subgraphs import fold_constant_subgraphs
from fxforge.rewrites.dead_rows import remove_dead_rows
from fxforge.rewrites.passes import Pass, PassContext, Refusal

aten = torch.ops.aten


# A rule's check returns the node that replaces the matched one, a Refusal, or None (no match).
Check = Callable[[torch.fx.Node, torch.fx.GraphModule, PassContext], "torch.fx.Node | Refusal | None"]


@dataclasses.dataclass(frozen=True)
class NoOpRule:
    """A node that returns its input unchanged under a condition: ``what`` names it in the report.

    Example:
        >>> NoOpRule("identity removed", lambda n, gm, ctx: None).what
        'identity removed'
    """

    what: str
    check: Check


def _input(node: torch.fx.Node) -> torch.fx.Node | None:
    first = node.args[0] if node.args else next(iter(node.kwargs.values()), None)
    return first if isinstance(first, torch.fx.Node) else None


def dropout_in_eval(node, gm, ctx):
    """Dropout that does not drop: eval mode, ``training=False``, or p = 0."""
    dropout = read_dropout(node, gm)
    if dropout is None or not isinstance(dropout.input, torch.fx.Node):
        return None
    if dropout.drops:
        return Refusal(f"dropout (p={dropout.p}) is active in training mode")
    return dropout.input


def identity(node, gm, ctx):
    """``nn.Identity`` and ``aten.alias``."""
    return _input(node) if calls(node, "identity", gm=gm) else None


def _same_tensor_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
            and a.layout == b.layout)


def contiguous_of_contiguous(node, gm, ctx):
    """``x.contiguous()`` where x is already contiguous returns x itself."""
    if not calls(node, "contiguous"):
        return None
    source = _input(node)
    value = fake_value(source)
    if value is None:
        return Refusal("no shape metadata for the input")
    memory_format = argument(node, 1, "memory_format", torch.contiguous_format)
    if not value.is_contiguous(memory_format=memory_format):
        return None
    return source


def conversion_to_same(node, gm, ctx):
    """A dtype/device conversion to what the value already is."""
    if not calls(node, "to"):
        return None
    if node.kwargs.get("copy") is True or (node.target == "type" and len(node.args) < 2 and not node.kwargs):
        return None  # an explicit copy, or x.type() returning a type name
    source, value, result = _input(node), fake_value(_input(node)), fake_value(node)
    if value is None or result is None:
        return Refusal("no shape metadata")
    if not _same_tensor_layout(value, result):
        return None
    if node.target is aten._to_copy.default and (mutated_aliases(node, gm) or mutated_aliases(source, gm)):
        return Refusal("the copy or its source is mutated in place later")
    return source


def reshape_to_same(node, gm, ctx):
    """A view/reshape/flatten/expand whose result has the input's shape, dtype and strides."""
    if not calls(node, "view", "reshape", "flatten", "expand"):
        return None
    source, value, result = _input(node), fake_value(_input(node)), fake_value(node)
    if value is None or result is None:
        return Refusal("no shape metadata")
    if not _same_tensor_layout(value, result):
        return None
    if node.target is aten._unsafe_view.default and mutated_aliases(node, gm):
        return Refusal("the result is mutated in place later")
    return source


def proven_assertion(node, gm, ctx):
    """``aten._assert_tensor_metadata`` whose dtype/device/layout the shape metadata already proves.

    Graphs are specialised to their input signature (dtypes and devices included), so such a check
    can never fail at run time.
    """
    if node.target is not aten._assert_tensor_metadata.default:
        return None
    value = fake_value(_input(node))
    if value is None:
        return Refusal("no shape metadata")
    expected = {"dtype": value.dtype, "device": value.device, "layout": value.layout}
    for key, actual in expected.items():
        wanted = node.kwargs.get(key)
        if wanted is None:
            continue
        if (torch.device(wanted) if key == "device" else wanted) != actual:
            return None  # the assertion would fail: leave it to fail at run time as it should
    return _input(node)


RULES: list[NoOpRule] = [
    NoOpRule("dropout in eval removed", dropout_in_eval),
    NoOpRule("identity removed", identity),
    NoOpRule("contiguous() of a contiguous value removed", contiguous_of_contiguous),
    NoOpRule("conversion to the same dtype/device removed", conversion_to_same),
    NoOpRule("reshape to the same shape removed", reshape_to_same),
    NoOpRule("dtype/device assertion proven by the shapes removed", proven_assertion),
]


def remove_no_ops(gm: torch.fx.GraphModule, ctx: PassContext, rules: list[NoOpRule] = RULES) -> None:
    """Replace each node a rule proves to be a no-op by its input.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Identity())
        >>> remove_no_ops(gm, PassContext("cleanup", False, "fx"))
    """
    for node in list(gm.graph.nodes):
        if node.op not in CALL_OPS:
            continue
        for rule in rules:
            outcome = rule.check(node, gm, ctx)
            if outcome is None:
                continue
            if isinstance(outcome, Refusal):
                ctx.refused(node, outcome)
                break
            ctx.matched(rule.what, [node])
            node.replace_all_uses_with(outcome)
            gm.graph.erase_node(node)
            break


def remove_dead_code(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """Erase nodes whose results are unused and which have no effect (see ``is_effectful``).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); _ = g.call_method("relu", (x,)); _ = g.output(x)
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), g)
        >>> remove_dead_code(gm, PassContext("cleanup", False, "fx")); len(gm.graph.nodes)
        2
    """
    for node in reversed(list(gm.graph.nodes)):
        if node.users or is_effectful(node, gm):
            continue
        if node.op != "get_attr":
            ctx.matched("dead code removed", [node])
        gm.graph.erase_node(node)


def run_cleanup(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """The ``cleanup`` pass: no-op removal, dead rows, then dead-code elimination.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Flatten())
        >>> run_cleanup(gm, PassContext("cleanup", False, "fx"))
    """
    remove_no_ops(gm, ctx)
    remove_dead_rows(gm, ctx)
    fold_constant_subgraphs(gm, ctx)
    remove_dead_code(gm, ctx)


CLEANUP = Pass("cleanup", run_cleanup, "remove dead code, rows no output reads, eval-mode dropout, identities, "
               "same-dtype/shape/layout no-ops",
               keeps_meta=True)
