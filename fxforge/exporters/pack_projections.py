"""Projections of one input, computed as one product.

BERT, T5 and LLaMA project q, k and v with three linear layers of the same hidden states (LLaMA also its
MLP's gate and up projections). ONNX Runtime runs each as its own GEMM, and a narrow one keeps the kernel's
tiles poorly filled: at BERT's hidden size 256 and 128 tokens, three [128, 256] x [256, 256] products take
1.14x the time of one [128, 256] x [256, 768] product and a ``Split`` of its thirds (ONNX Runtime's CPU
provider, 2 threads). The ``Split`` copies every output once, and over more rows the copies cost what the
fuller tiles save: whole BERT and LLaMA files (hidden 256, 4 layers, interleaved timings) ran 1.014x and
1.026x at 128 tokens and 1.004x at 256, but 0.975x at 512 (BERT), 0.98x and 0.965x at 1024.

The rule: **where two or more ``MatMul(x, W_i) [+ b_i]`` read the same x, with every W_i (and b_i) a
constant of one dtype and one row count, all of them or none with a bias, and x has a static shape of at
most** :data:`MAX_ROWS` **rows (the product of its leading dims), they become one
``MatMul(x, [W_1 | ... | W_n]) [+ [b_1 | ... | b_n]]`` and a ``Split`` of its last axis into each
product**; a product read only by ``Slice``s of whole rows reads its columns from the packed product
instead (q next to a packed kv projection). Each output element is the same dot product over the same weights, so the values are the same up
to the order the kernel sums in. ``Gemm`` (2-d, ``transB`` = 1, alpha and beta 1) is read the same way, as
:mod:`~fxforge.exporters.split_projections` reads it. Products that are graph outputs, and biases of
different ranks (which broadcast the product to different shapes), are left as they are.

Example:
    >>> graph = _projections_graph(tokens=4, width=8, outputs=[8, 8, 4], bias=True)
    >>> pack_projections(graph)
    1
    >>> sorted(node.op_type for node in graph if node.op_type != "Identity")
    ['Add', 'MatMul', 'Split']
"""

from __future__ import annotations

import numpy as np
from onnxscript import ir

from fxforge.exporters.onnx_ir import (
    columns_slice,
    constant_value,
    float_value,
    register_constant,
    static_shape,
)
from fxforge.exporters.split_projections import read_projection, sliced_blocks

PACK_PROJECTIONS = "projections of one input -> one MatMul and a Split"
MAX_ROWS = 256  # measured break-even: 1.004x at 256 rows, 0.975x at 512 (see the module's docstring)


def pack_projections(graph: ir.Graph) -> int:
    """Apply the module's rule to ``graph`` (not to its subgraphs); returns how many packed products it made.

    Example:
        >>> pack_projections(ir.Graph([], [], nodes=[]))
        0
    """
    groups: dict[tuple, list[tuple]] = {}
    for node in list(graph):
        found = read_projection(node)
        if found is None:
            continue
        x, weight, bias, product, _ = found
        shape = static_shape(x)
        if product.is_graph_output() or shape is None or int(np.prod(shape[:-1])) > MAX_ROWS:
            continue
        key = (id(x), weight.dtype.str, weight.shape[0], None if bias is None else (bias.dtype.str, bias.ndim))
        groups.setdefault(key, []).append(found)
    packed = 0
    for members in groups.values():
        if len(members) >= 2:
            _pack(graph, members)
            packed += 1
    return packed


def _pack(graph: ir.Graph, members: list[tuple]) -> None:
    """One product of ``members``' concatenated weights, before the first of them. A member read only by
    column ``Slice``s has them read the packed product's columns; the others read a ``Split`` of it (where
    no member is sliced) or a ``Slice`` of their columns."""
    x = members[0][0]
    first = min((node for *_, computed in members for node in computed), key=_position(graph))
    products = [product for _, _, _, product, _ in members]
    name = f"{products[0].name or 'projection'}_packed"
    widths = [weight.shape[1] for _, weight, _, _, _ in members]
    kind = products[0].type
    shape = _packed_shape(products, sum(widths))
    weight = np.concatenate([weight for _, weight, _, _, _ in members], axis=1)
    nodes = [ir.Node("", "MatMul", [x, register_constant(graph, f"{name}_weight", weight)],
                     outputs=[ir.Value(name=f"{name}_product", type=kind, shape=shape)])]
    if members[0][2] is not None:
        bias = np.concatenate([bias for _, _, bias, _, _ in members], axis=-1)
        nodes.append(ir.Node("", "Add", [nodes[-1].outputs[0], register_constant(graph, f"{name}_bias", bias)],
                             outputs=[ir.Value(name=f"{name}_projected", type=kind, shape=shape)]))
    graph.insert_before(first, nodes)
    packed, offset, parts = nodes[-1].outputs[0], 0, []
    for (_, _, _, product, _), width in zip(members, widths):
        blocks = sliced_blocks(product, width)
        if blocks and not any(rows for _, rows, _ in blocks):  # column slices: read the packed product's
            for piece, _, (begin, end) in blocks:
                columns = columns_slice(graph, packed, offset + begin, offset + end, piece.outputs[0],
                                        f"{piece.outputs[0].name}_packed")
                graph.insert_before(piece, [columns])
                piece.outputs[0].replace_all_uses_with(columns.outputs[0])
                graph.remove(piece, safe=True)
        else:
            parts.append((product, offset, width))
        offset += width
    if len(parts) == len(members):  # every product whole: one Split
        split = ir.Node("", "Split", [packed, register_constant(graph, f"{name}_widths", widths)],
                        attributes=[ir.AttrInt64("axis", -1)],
                        outputs=[ir.Value(name=f"{product.name or 'projection'}_part", type=kind, shape=product.shape)
                                 for product, *_ in parts])
        graph.insert_after(nodes[-1], [split])
        outputs = split.outputs
    else:  # the others' columns, one Slice each
        pieces = [columns_slice(graph, packed, begin, begin + width, product, f"{product.name or 'projection'}_part")
                  for product, begin, width in parts]
        graph.insert_after(nodes[-1], pieces)
        outputs = [piece.outputs[0] for piece in pieces]
    for (product, *_), part in zip(parts, outputs):
        product.replace_all_uses_with(part)
    for *_, computed in members:
        graph.remove(computed, safe=True)


def _position(graph: ir.Graph):
    """A key that orders ``graph``'s nodes as the graph does."""
    order = {id(node): index for index, node in enumerate(graph)}
    return lambda node: order[id(node)]


def _packed_shape(products: list[ir.Value], width: int) -> ir.Shape | None:
    """The packed product's shape: the members' (all the same but the last dim) with ``width`` last, or None
    where a member's shape is unknown or they disagree."""
    shapes = [product.shape for product in products]
    if any(shape is None or len(shape) == 0 for shape in shapes):
        return None
    leading = [list(shape)[:-1] for shape in shapes]
    if any(dims != leading[0] for dims in leading):
        return None
    return ir.Shape([*leading[0], width])


def _projections_graph(tokens: int, width: int, outputs: list[int], bias: bool) -> ir.Graph:
    """``MatMul(x, W_i) [+ b_i]`` of ``x`` [1, tokens, width] for each width in ``outputs``, each followed by
    an ``Identity`` whose output is a graph output."""
    rng = np.random.default_rng(0)
    x = float_value("x", [1, tokens, width])
    nodes, numbers = [], []
    for k, n in enumerate(outputs):
        weight = constant_value(f"w{k}", rng.standard_normal((width, n)).astype(np.float32))
        numbers.append(weight)
        nodes.append(ir.Node("", "MatMul", [x, weight], outputs=[float_value(f"xw{k}", [1, tokens, n])]))
        if bias:
            b = constant_value(f"b{k}", rng.standard_normal(n).astype(np.float32))
            numbers.append(b)
            nodes.append(ir.Node("", "Add", [nodes[-1].outputs[0], b], outputs=[float_value(f"p{k}", [1, tokens, n])]))
        nodes.append(ir.Node("", "Identity", nodes[-1].outputs, outputs=[float_value(f"y{k}", [1, tokens, n])]))
    return ir.Graph([x], [node.outputs[0] for node in nodes if node.op_type == "Identity"], nodes=nodes,
                    initializers=numbers, opset_imports={"": 20}, name="projections")
