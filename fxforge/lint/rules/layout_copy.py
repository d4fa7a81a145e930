"""``layout-copy``: copies the memory layout forces, with their bytes per call: ``.contiguous()`` of a permuted or
transposed tensor, ``reshape`` of one that a view cannot serve, and channels-last <-> contiguous ping-pong
(a tensor converted to one memory format and back: two copies that cancel).

Example:
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.transpose(1, 2).reshape(4, -1)
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(4, 64, 32),), rules=[RULE])]
    ['layout-copy']
"""

from __future__ import annotations

import torch

from fxforge.lint.graph import LintGraph, format_bytes
from fxforge.lint.rule import Rule

FORMATS = {torch.channels_last: "channels_last", torch.contiguous_format: "contiguous",
           torch.channels_last_3d: "channels_last_3d"}


def _layout(value: torch.Tensor) -> str:
    if value.dim() == 4 and value.is_contiguous(memory_format=torch.channels_last) and not value.is_contiguous():
        return "channels_last"
    return "contiguous" if value.is_contiguous() else "strided"


def _copies_on_reshape(before: torch.Tensor, after: torch.Tensor) -> bool:
    try:
        torch.empty_strided(before.shape, before.stride(), device="meta").view(after.shape)
    except RuntimeError:
        return True
    return False


def _format_of(graph: LintGraph, node: torch.fx.Node) -> object:
    fmt = node.kwargs.get("memory_format", graph.arg(node, 1, "memory_format"))
    return fmt if isinstance(fmt, torch.memory_format) else None


def check(graph: LintGraph):
    converted: dict[torch.fx.Node, tuple[str, torch.fx.Node]] = {}  # node -> (format, the tensor converted)
    for node in graph.calls("contiguous", "reshape", "clone", "to", "_to_copy"):
        source = graph.tensor_args(node)[:1]
        before, after = (graph.value(source[0]) if source else None), graph.value(node)
        if before is None or after is None:
            continue
        op, size = graph.op(node), graph.nbytes(node)
        fmt = _format_of(graph, node) if op != "reshape" else None
        if op == "contiguous" and fmt is None:
            fmt = torch.contiguous_format
        if op in ("clone", "to", "_to_copy") and fmt not in FORMATS:
            continue
        if fmt in FORMATS and _layout(before) != _layout(after):
            converted[node] = (FORMATS[fmt], source[0])
            origin = converted.get(source[0]) or _converted_upstream(source[0], converted)
            if origin is not None and origin[0] != FORMATS[fmt]:
                yield graph.finding(
                    node, f"{source[0].name} is converted to {origin[0]} and back to {FORMATS[fmt]}: two "
                          f"layout copies of {format_bytes(size)} each that cancel, every call",
                    "keep one memory format through the block (convert the model and its inputs once: "
                    "model.to(memory_format=torch.channels_last))", severity="warning",
                    involved=f"{graph.describe(source[0])}, {_layout(before)} -> {_layout(after)}", bytes=2 * size)
                continue
        if op == "contiguous" and not before.is_contiguous():
            yield graph.finding(
                node, f".contiguous() of {source[0].name} (strides {list(before.stride())}) copies "
                      f"{format_bytes(size)} every call",
                "let the next op take the strided tensor where it can (matmul, elementwise ops, sdpa), or keep the "
                "layout the consumer wants from the start (permute the weights once instead of the activations)",
                involved=graph.describe(node), bytes=size)
        elif op == "reshape" and _copies_on_reshape(before, after):
            yield graph.finding(
                node, f"reshape of {source[0].name} (strides {list(before.stride())}, from a permute or transpose) "
                      f"cannot be a view: it copies {format_bytes(size)} every call",
                "reorder so the reshape comes before the permute, or keep the dims apart (einsum, flatten at the end)",
                involved=f"{graph.describe(source[0])} -> {list(after.shape)}", bytes=size)


def _converted_upstream(node: torch.fx.Node, converted: dict, depth: int = 8) -> tuple[str, torch.fx.Node] | None:
    """The last layout conversion on ``node``'s way back through single-input ops (conv, relu, add...)."""
    for _ in range(depth):
        if node in converted:
            return converted[node]
        inputs = [a for a in node.all_input_nodes if a.op not in ("get_attr", "placeholder")]
        if not inputs:
            return None
        node = inputs[0]
    return None


RULE = Rule("layout-copy", "info", check,
            "a copy the memory layout forces (.contiguous() of a permuted tensor, a reshape that cannot be a view); "
            "channels-last <-> contiguous ping-pong is a warning")
