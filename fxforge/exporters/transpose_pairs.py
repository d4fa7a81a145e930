"""Two transposes around a reshape that only adds or drops dims of size 1, written as one data movement.

torchvision's attention keeps q, k and v as [L, B·H, E] and transposes them to [B·H, L, E], reshapes to
[B, H, L, E]; the ``MultiHeadAttention`` translation then transposes to [B, L, H, E] for the kernel. ONNX
Runtime's transpose optimizer cancels transposes that meet, but not across the ``Reshape`` between them, so
in vit_b_16 (batch 1) each of the 12 layers ran three pairs of transposes whose product moves nothing.

The rule (:class:`TransposePair`, an onnxscript rewrite rule): **``Transpose(Reshape(Transpose(x)))``, where the reshape only inserts or removes dims of size 1
and shapes are static, becomes ``Reshape(x)`` when the dims of x larger than 1 come out in their own order,
else ``Reshape(Transpose(x))`` with one transpose**. Only values (no arithmetic) move, so the result is
exact. The first transpose and the reshape stay where something else reads them.

A lone transpose is the same case with nothing around it: **``Transpose(x)``, where x's shape is static and
its dims larger than 1 keep their order, becomes ``Reshape(x)``** (:class:`UnitTranspose`, an onnxscript
rewrite rule). ONNX
Runtime copies the tensor for a ``Transpose`` and only relabels it for a ``Reshape``; vit_b_16 at batch 1
kept 24 such copies (``[1, 197, 768] -> [197, 1, 768]`` around torchvision's attention) after its own
optimizer ran.

Example:
    >>> from onnxscript import ir
    >>> def value(name, shape):
    ...     return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(shape))
    >>> x = value("x", [197, 12, 64])
    >>> t1 = ir.Node("", "Transpose", [x], attributes=[ir.AttrInt64s("perm", [1, 0, 2])],
    ...              outputs=[value("t1", [12, 197, 64])])
    >>> shape = ir.Value(name="s", const_value=ir.tensor([1, 12, 197, 64]))
    >>> r = ir.Node("", "Reshape", [t1.outputs[0], shape], outputs=[value("r", [1, 12, 197, 64])])
    >>> t2 = ir.Node("", "Transpose", [r.outputs[0]], attributes=[ir.AttrInt64s("perm", [0, 2, 1, 3])],
    ...              outputs=[value("t2", [1, 197, 12, 64])])
    >>> out = ir.Node("", "Relu", [t2.outputs[0]], outputs=[value("y", [1, 197, 12, 64])])
    >>> graph = ir.Graph([x], out.outputs, nodes=[t1, r, t2, out], initializers=[shape])
    >>> fold_transpose_pairs(graph), out.inputs[0].producer().op_type
    (1, 'Reshape')
"""

from __future__ import annotations

from onnxscript import ir

from fxforge.exporters.onnx_engine import NOT_HERE, PatternRule, apply_to_graph, pattern_pass
from fxforge.exporters.onnx_ir import is_onnx_op, producer, register_constant, static_shape

TRANSPOSE_PAIRS = "Transpose + Reshape (size-1 dims) + Transpose -> one Reshape or one Transpose"
UNIT_TRANSPOSES = "Transpose that moves only size-1 dims -> Reshape"


class TransposePair(PatternRule):
    """The module's rule as an onnxscript rule: ``Transpose(Reshape(Transpose(x)))`` of the main graph, where
    :func:`_order` finds the reshape only adds or drops size-1 dims of static shapes, becomes ``Reshape(x)``
    or ``Reshape(Transpose(x))`` (to the second transpose's output shape, an initializer ``<output>_shape``).
    The first transpose and the reshape are left where they are (``remove_nodes=False``): read elsewhere,
    they stay; read by nothing, the export drops them with every unused node.

    Example:
        >>> TransposePair().remove_nodes
        False
    """

    what = TRANSPOSE_PAIRS

    def __init__(self) -> None:
        super().__init__()
        self.remove_nodes = False

    def pattern(self, op, x, shape):
        first = op.Transpose(x, _allow_other_attributes=True)
        return op.Transpose(op.Reshape(first, shape, _allow_other_attributes=True), _allow_other_attributes=True)

    def refusal(self, context, x, shape):
        second = context.root
        order = _order(second) if context.graph_or_function is context.model.graph else None
        if order is None:
            return NOT_HERE
        self._target = (context.graph_or_function, second.outputs[0], order)
        return None

    def rewrite(self, op, x, shape):
        graph, target, (x, perm, moved) = self._target
        source = x
        if moved:
            source = op.Transpose(x, perm=perm)
            source.name, source.type, source.shape = f"{target.name}_once", x.type, ir.Shape([x.shape[d] for d in perm])
        out = op.Reshape(source, register_constant(graph, f"{target.name}_shape", [int(d) for d in target.shape]))
        out.shape, out.type = target.shape, target.type
        return out


transpose_pairs = pattern_pass(TransposePair)


def fold_transpose_pairs(graph: ir.Graph) -> int:
    """:class:`TransposePair` applied to ``graph`` outside an export; returns how many pairs were folded.

    Example:
        >>> fold_transpose_pairs(ir.Graph([], [], nodes=[]))
        0
    """
    return sum(apply_to_graph(transpose_pairs, graph, "transpose_pairs").counts().values())


class UnitTranspose(PatternRule):
    """The lone-transpose rule as an onnxscript rule: a ``Transpose`` of the main graph (not of subgraphs)
    whose input has a static shape and whose dims larger than 1 keep their order becomes a ``Reshape`` to its
    output shape (an initializer ``<output>_shape``); one that moves a dim larger than 1 past another is not
    this rule's business.

    Example:
        >>> UnitTranspose().what == UNIT_TRANSPOSES
        True
    """

    what = UNIT_TRANSPOSES

    def pattern(self, op, x):
        return op.Transpose(x, _allow_other_attributes=True)

    def refusal(self, context, x):
        node = context.root
        perm = _transpose(node)
        shape = None if perm is None else static_shape(x)
        if context.graph_or_function is not context.model.graph or shape is None or len(perm) != len(shape) \
                or node.outputs[0].is_graph_output():
            return NOT_HERE
        big = [axis for axis in perm if shape[axis] != 1]
        if big != sorted(big):
            return NOT_HERE  # a dim larger than 1 moves past another: the data moves
        self._target = (context.graph_or_function, node.outputs[0].name, [shape[axis] for axis in perm])
        return None

    def rewrite(self, op, x):
        graph, name, shape = self._target
        out = op.Reshape(x, register_constant(graph, f"{name}_shape", shape))
        out.shape, out.type = ir.Shape(shape), x.type
        return out


unit_transposes = pattern_pass(UnitTranspose)


def fold_unit_transposes(graph: ir.Graph) -> int:
    """:class:`UnitTranspose` applied to ``graph`` outside an export; returns how many transposes became
    a ``Reshape``.

    Example:
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 197, 768]))
        >>> t = ir.Node("", "Transpose", [x], attributes=[ir.AttrInt64s("perm", [1, 0, 2])],
        ...             outputs=[ir.Value(name="t", type=x.type, shape=ir.Shape([197, 1, 768]))])
        >>> out = ir.Node("", "Relu", [t.outputs[0]], outputs=[ir.Value(name="y", type=x.type)])
        >>> graph = ir.Graph([x], out.outputs, nodes=[t, out])
        >>> fold_unit_transposes(graph), out.inputs[0].producer().op_type, out.inputs[0].shape
        (1, 'Reshape', Shape([197, 1, 768]))
    """
    return sum(apply_to_graph(unit_transposes, graph, "unit_transposes").counts().values())


def _transpose(node: ir.Node | None) -> list[int] | None:
    if not is_onnx_op(node, "Transpose"):
        return None
    perm = node.attributes.get_ints("perm")
    return None if perm is None else list(perm)


def _order(second: ir.Node) -> tuple[ir.Value, list[int], bool] | None:
    """For a foldable ``second`` transpose: its source x, a permutation of x's dims that puts x's dims larger
    than 1 in the order they leave ``second``, and whether that permutation moves any of them."""
    p2 = _transpose(second)
    reshape = None if p2 is None else producer(second.inputs[0], "Reshape")
    if reshape is None:
        return None
    first = reshape.inputs[0].producer()
    p1 = _transpose(first)
    if p1 is None or second.outputs[0].is_graph_output():
        return None
    x = first.inputs[0]
    shapes = [static_shape(v) for v in (x, first.outputs[0], reshape.outputs[0], second.outputs[0])]
    if any(s is None for s in shapes) or len(p1) != len(shapes[0]) or len(p2) != len(shapes[2]):
        return None
    sx, sy, sz, _ = shapes
    big_y = [d for d in sy if d != 1]
    if big_y != [d for d in sz if d != 1]:
        return None  # the reshape merges or splits dims
    # x's dims larger than 1, in the order they sit in y (after the first transpose) ...
    x_dims_in_y = [p1[i] for i in range(len(sy)) if sy[i] != 1]
    # ... z holds them in the same order; the second transpose reorders z's dims
    z_big = [i for i in range(len(sz)) if sz[i] != 1]
    rank_in_z = {axis: k for k, axis in enumerate(z_big)}
    out_order = [x_dims_in_y[rank_in_z[axis]] for axis in p2 if sz[axis] != 1]
    ones = [d for d in range(len(sx)) if sx[d] == 1]
    moved = out_order != sorted(out_order)
    return x, out_order + ones, moved
