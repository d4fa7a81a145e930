"""Residual adds before a ``LayerNormalization``, written so that ONNX Runtime's CPU provider keeps them apart.

ONNX Runtime fuses ``Add(a, b) -> LayerNormalization`` into ``com.microsoft.SkipLayerNormalization``
(its ``SkipLayerNormFusion``). On its CPU provider (1.31) that fused kernel is 3.2-4.5x slower than the
two kernels it replaces, exact to float rounding (``python -m benchmarks --suite onnx-forms --only
residual_norm``: [1, 1024, 256] 0.73 against 0.20 ms, [1, 1024, 768] 2.19 against 0.49 ms, five shapes
from 128 to 2048 rows, hidden 256-1024). In a BERT encoder (hidden 256, S = 1024) its nine fused norms
took 6.7 of 71 ms (ORT's profiler), against 2.0 ms as ``Sum`` + ``LayerNormalization``. ORT fuses only
``Add``, so the rule below writes the same sum as ``Sum``, which computes ``a + b`` bit for bit.

The rule (:class:`ResidualSum`, an onnxscript rewrite rule): **an ``Add`` whose result is a
``LayerNormalization``'s input becomes a ``Sum`` of the same two operands**, refused (left as ``Add``, with the reason) when an operand is broadcast (its shape is not
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
    >>> separate_residual_adds(graph), norm.inputs[0].producer().op_type, norm.inputs[0].name
    ((1, []), 'Sum', 's')
"""

from __future__ import annotations

from onnxscript import ir

from fxforge.exporters.onnx_engine import NOT_HERE, PatternRule, apply_to_graph, pattern_pass
from fxforge.exporters.onnx_ir import is_onnx_op, shape_text

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


class ResidualSum(PatternRule):
    """The module's rule as an onnxscript rule: ``Add(a, b)`` read by a ``LayerNormalization`` as its input
    becomes ``Sum(a, b)``; an ``Add`` no ``LayerNormalization`` reads is not this rule's business, a
    broadcast one is refused with :func:`residual_refusal`'s reason.

    Example:
        >>> ResidualSum().what == RESIDUAL_NORM
        True
    """

    what = RESIDUAL_NORM

    def pattern(self, op, a, b):
        return op.Add(a, b)

    def refusal(self, context, a, b):
        add = context.root
        if not any(is_onnx_op(user, "LayerNormalization") and index == 0 for user, index in add.outputs[0].uses()):
            return NOT_HERE
        return residual_refusal(add)

    def rewrite(self, op, a, b):
        return op.Sum(a, b)


residual_norm = pattern_pass(ResidualSum)


def separate_residual_adds(graph: ir.Graph) -> tuple[int, list[str]]:
    """:class:`ResidualSum` applied to ``graph`` and its subgraphs outside an export; returns how many ``Add``
    were rewritten and the reasons for those left as ``Add`` (the module's example rewrites one).

    Example:
        >>> separate_residual_adds(ir.Graph([], [], nodes=[]))
        (0, [])
    """
    ctx = apply_to_graph(residual_norm, graph, "residual_norm")
    return sum(ctx.counts().values()), ctx.reasons()
