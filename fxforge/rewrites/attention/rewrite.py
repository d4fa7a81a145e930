"""The ``attention`` pass: find the attention at each softmax, check it, plan its mask, replace it, report.

Example:
    >>> from fxforge.rewrites.passes import PassContext
    >>> gm = torch.fx.symbolic_trace(lambda q, k: torch.softmax(q @ k.mT, 2) @ k)
    >>> from fxforge.core.shapes import annotate
    >>> _ = annotate(gm, (torch.randn(1, 2, 4, 4),) * 2, {})
    >>> ctx = PassContext("attention", training=False, method="fx")
    >>> replace_attention(gm, ctx); [m.reason for m in ctx.near_misses]
    ['softmax over dim 2 of 4, not the last (key) dim']
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fxforge.core.derived import read_as_constants
from fxforge.core.nodes import copy_graph_module, fake_value, is_effectful
from fxforge.core.source import first_line, inherit_origin
from fxforge.rewrites.attention.biased_scores import split_biased_scores
from fxforge.rewrites.attention.builders import SDPA_TARGETS, GraphBuilder, build, describe_change
from fxforge.rewrites.attention.checks import CHECKS, Attention, find_gqa, metadata_reads, read_attention
from fxforge.rewrites.attention.constants import Constants
from fxforge.rewrites.attention.kernel_choice import fused_kernel_refusal
from fxforge.rewrites.attention.masks import MaskPlan, plan_mask
from fxforge.rewrites.attention.operands import looks_like_attention
from fxforge.rewrites.attention.readers import Softmax, ignorable, read_softmax
from fxforge.rewrites.passes import Pass, PassContext, Refusal


def find_attention(softmax: Softmax, gm: torch.fx.GraphModule, constants: Constants
                   ) -> tuple[Attention, MaskPlan] | Refusal:
    """The attention around ``softmax`` and how its mask reaches SDPA, or why it is not replaced.

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v)
        >>> _ = annotate(gm, (torch.randn(1, 2, 4, 8),) * 3, {})
        >>> find_attention(read_softmax(list(gm.graph.nodes)[5], gm), gm, Constants(gm))[1]
        MaskPlan(kind='none', fix=None)
    """
    attention = read_attention(softmax, gm, constants)
    if isinstance(attention, Refusal):
        return attention
    for check in CHECKS:
        refusal = check(attention, gm)
        if refusal is not None:
            return refusal
    attention.gqa = find_gqa(attention)
    plan = plan_mask(attention, constants)
    if isinstance(plan, Refusal):
        return plan
    return attention, plan


def _erase_dead(gm: torch.fx.GraphModule, candidates: list[Node]) -> None:
    """Erase nodes among ``candidates`` and their inputs that nothing uses any more and that have no
    effect."""
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


def _erase_readers(gm: torch.fx.GraphModule, readers: list[Node]) -> None:
    """Erase ``readers`` and what is computed from them, last first, where nothing uses it any more."""
    closure, stack = set(), list(readers)
    while stack:
        node = stack.pop()
        if node not in closure and node.op != "output":
            closure.add(node)
            stack.extend(node.users)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted(closure, key=position.__getitem__, reverse=True):
        if not node.users and not is_effectful(node, gm):
            gm.graph.erase_node(node)


def replace(attention: Attention, plan: MaskPlan, gm: torch.fx.GraphModule, ctx: PassContext,
            constants: Constants | None = None) -> None:
    """Replace the attention's nodes with the SDPA call and report it (with the user's source line).

    Nothing changes if the replacement cannot be built; the attention is then a near miss with the error.

    Example:
        >>> from fxforge.core.shapes import annotate
        >>> gm = torch.fx.symbolic_trace(lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v)
        >>> _ = annotate(gm, (torch.randn(1, 2, 4, 8),) * 3, {})
        >>> found = find_attention(read_softmax(list(gm.graph.nodes)[5], gm), gm, Constants(gm))
        >>> ctx = PassContext("attention", False, "fx"); replace(*found, gm, ctx)
        >>> [n.name for n in gm.graph.nodes]   # with the guard of query rows with a NaN
        ['q', 'k', 'v', 'scaled_dot_product_attention', 'mul', 'sum_1', 'isnan', 'where', 'output']
    """
    nodes = attention.nodes
    anchor = attention.values.product
    builder = GraphBuilder(gm, anchor, aten_ops=ctx.method == "export", constants=constants)
    try:
        result = build(attention, plan, builder, guards_as_ops=ctx.conditions.guards_as_ops and not ctx.training)
    except Exception as error:  # noqa: BLE001 - this attention stays as it is; the others still go
        _undo(gm, builder)
        ctx.refused(attention.softmax.node, f"the replacement could not be built: {first_line(error)}")
        return
    slower = None if ctx.conditions.guards_as_ops else _slower(builder)
    if slower is not None:  # (a translation that chooses its own kernels, ONNX Runtime's, takes SDPA as it is)
        _undo(gm, builder)
        ctx.refused(attention.softmax.node, slower)
        return
    ctx.matched(describe_change(attention, plan), nodes)
    inherit_origin(builder.nodes, nodes, gm)
    anchor.replace_all_uses_with(result)
    inputs = {i for n in nodes for i in n.all_input_nodes} - set(nodes)
    for node in nodes:
        for user in metadata_reads(attention, node):
            user.replace_input_with(node, attention.scores.q.node)
        for user in [u for u in node.users if ignorable(u, gm)]:
            gm.graph.erase_node(user)
    for node in reversed(nodes):
        if getattr(node, "_erased", False):
            continue
        _erase_readers(gm, [u for u in node.users if u not in nodes])  # what read only its shape (expand_as)
        if not getattr(node, "_erased", False):
            gm.graph.erase_node(node)
    _erase_dead(gm, list(inputs))


def _undo(gm: torch.fx.GraphModule, builder: GraphBuilder) -> None:
    for node in reversed(builder.nodes):
        gm.graph.erase_node(node)


def _slower(builder: GraphBuilder) -> str | None:
    """Why the SDPA call the builder emitted would be slower than the attention as written (torch would run
    its math kernel on these inputs: :mod:`~fxforge.rewrites.attention.kernel_choice`), or None."""
    call = next((n for n in builder.nodes if n.target in SDPA_TARGETS), None)
    if call is None:
        return None
    q, k, v = (fake_value(a) for a in call.args[:3])
    mask = call.kwargs.get("attn_mask")
    mask_value = fake_value(mask) if isinstance(mask, Node) else None
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or (mask is not None and mask_value is None):
        return None
    return fused_kernel_refusal(q, k, v, mask_value, bool(call.kwargs.get("is_causal")),
                                bool(call.kwargs.get("enable_gqa")))


def replace_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """The ``attention`` pass: every softmax that is attention becomes SDPA; near misses get a reason.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.softmax(x, -1))
        >>> ctx = PassContext("attention", False, "fx"); replace_attention(gm, ctx); ctx.matches
        []
    """
    split_biased_scores(gm)  # baddbmm(alibi, q, k^T): the product, its scale and the bias as a mask
    constants, before = Constants(gm), len(ctx.matches)
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
                ctx.refused(node, found)
            continue
        replace(*found, gm, ctx, constants)
    if len(ctx.matches) > before:  # the graph now stands on the values of the buffers read (a mask proven causal)
        read_as_constants(constants.read.values())
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            _replace_in_subgraphs(node, gm, ctx)


# Higher-order ops that run their subgraphs as plain code: SDPA there computes what it does outside (a
# checkpointed region is recomputed in backward by the same subgraph; grad mode changes no value; cond runs
# one branch). An enabled autocast region would run SDPA at another precision than eager's ops.
_TRANSPARENT = {"tag_activation_checkpoint", "wrap_with_set_grad_enabled", "cond"}


def _transparent(node: Node) -> bool:
    name = node.target.name()
    if name == "wrap_with_autocast":
        return len(node.args) > 2 and node.args[2] is False  # (device, dtype, enabled, ...)
    return name in _TRANSPARENT


def _replace_in_subgraphs(node: Node, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """Run the pass inside the subgraphs a higher-order op calls (``torch.utils.checkpoint``, ``no_grad`` and
    ``autocast`` regions, ``torch.cond``), on a copy registered in their place only when something was
    replaced (the graph before the pass shares the originals, for verification and rollback). Attention in
    a subgraph the pass cannot rewrite exactly is a near miss, never skipped silently.
    """
    for arg in node.args:
        if not (isinstance(arg, Node) and arg.op == "get_attr"):
            continue
        sub = getattr(gm, arg.target, None)
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        if not _transparent(node):
            for inner in sub.graph.nodes:
                if read_softmax(inner, sub) is not None and looks_like_attention(inner, sub):
                    ctx.refused(inner, f"the attention is inside a {node.target.name()} subgraph "
                                       f"({arg.target}), which could change its precision or semantics")
            continue
        copy = copy_graph_module(sub)
        before = len(ctx.matches)
        replace_attention(copy, ctx)
        if len(ctx.matches) > before:
            copy.graph.lint()
            copy.recompile()
            setattr(gm, arg.target, copy)


# The pass as the registry lists it (see :mod:`fxforge.rewrites.attention` for what it reads and keeps).
ATTENTION = Pass("attention", replace_attention,
                 "hand-written softmax(q @ k^T * scale + mask) @ v -> scaled_dot_product_attention with the "
                 "exact scale and mask (causal proven, grouped kv heads)", keeps_meta=True)
