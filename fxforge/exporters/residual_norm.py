"""Residual adds before a ``LayerNormalization``, written so that ONNX Runtime's CPU provider keeps them apart.

ONNX Runtime fuses ``Add(a, b) -> LayerNormalization`` into ``com.microsoft.SkipLayerNormalization``
(its ``SkipLayerNormFusion``). On its CPU provider (1.31) that fused kernel is 3.2-4.5x slower than the
two kernels it replaces, exact to float rounding (``python -m fxforge.exporters.measure --only
residual_norm``: [1, 1024, 256] 0.73 against 0.20 ms, [1, 1024, 768] 2.19 against 0.49 ms, five shapes
from 128 to 2048 rows, hidden 256-1024). In a BERT encoder (hidden 256, S = 1024) its nine fused norms
took 6.7 of 71 ms (ORT's profiler), against 2.0 ms as ``Sum`` + ``LayerNormalization``. ORT fuses only
``Add``, so the rule below writes the same sum as ``Sum``, which computes ``a + b`` bit for bit.

The rule: **an ``Add`` whose result is a ``LayerNormalization``'s input becomes a ``Sum`` of the same
two operands**, refused (left as ``Add``, with the reason) when an operand is broadcast (its shape is not
the result's, or a shape is unknown): a bias add is not a residual. It is applied for the CPU provider
only: ORT's CUDA ``SkipLayerNormalization`` is its ``LayerNormalization`` kernel with the residual read in
(one kernel instead of two), so an export for CUDA keeps ``Add`` (not measured here: no GPU).

Example:
    >>> from onnxscript import ir
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 4]))
    >>> r = ir.Value(name="r", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 4]))
    >>> add = ir.Node("", "Add", [x, r], outputs=[ir.Value(name="s", shape=ir.Shape([2, 4]))])
    >>> norm = ir.Node("", "LayerNormalization", [add.outputs[0]], outputs=[ir.Value(name="y")])
    >>> graph = ir.Graph([x, r], norm.outputs, nodes=[add, norm])
    >>> separate_residual_adds(graph), add.op_type
    ((1, []), 'Sum')
"""

from __future__ import annotations

from typing import Any

from onnxscript import ir

from fxforge.exporters.onnx_ir import is_onnx_op, producer, shape_text

RESIDUAL_NORM = "residual Add + LayerNormalization -> Sum + LayerNormalization (ORT's CPU SkipLayerNormalization is slower)"


def residual_refusal(add: ir.Node) -> str | None:
    """Why the ``Add`` before a ``LayerNormalization`` is not written as ``Sum``, or None.

    Example:
        >>> v = ir.Value(name="v", shape=ir.Shape([3]))
        >>> b = ir.Value(name="b", shape=ir.Shape([1]))
        >>> residual_refusal(ir.Node("", "Add", [v, b], outputs=[ir.Value(name="s", shape=ir.Shape([3]))]))
        'an operand is broadcast (shape [1], result [3]): a bias, not a residual'
    """
    result = add.outputs[0].shape
    shapes = [value.shape if value is not None else None for value in add.inputs]
    if result is None or any(shape is None for shape in shapes):
        return "operand shapes not known at export time"
    for shape in shapes:
        if shape != result:
            return f"an operand is broadcast (shape {shape_text(shape)}, result {shape_text(result)}): a bias, not a residual"
    return None


def separate_residual_adds(graph: Any) -> tuple[int, list[str]]:
    """Rewrite each ``Add`` feeding a ``LayerNormalization``'s input as ``Sum`` (see the module's rule), in
    ``graph`` and its subgraphs; returns how many were rewritten and the reasons for those left as ``Add``
    (the module's example rewrites one).

    Example:
        >>> separate_residual_adds(ir.Graph([], [], nodes=[]))
        (0, [])
    """
    rewritten, refused = 0, []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if not is_onnx_op(node, "LayerNormalization") or not node.inputs:
            continue
        add = producer(node.inputs[0], "Add")
        if add is None:
            continue
        reason = residual_refusal(add)
        if reason is not None:
            refused.append(reason)
            continue
        add.op_type = "Sum"
        rewritten += 1
    return rewritten, refused
