"""A projection that is only read in blocks, computed as one projection per block.

timm's ViT, Swin and torchvision's ``nn.MultiheadAttention`` project q, k and v with one linear layer of 3C
outputs; after :mod:`~fxforge.exporters.qkv_slices` the attention reads three ``Slice``s of it, which ONNX
Runtime runs as one [tokens, 3C] product and a ``Split`` that copies each third out. Where cleanup's dead
rows cut the last block's query to one token, its slice also takes one row of the product, and the other
rows of q's third were computed for nothing.

The rule: **where every reader of ``MatMul(x, W) [+ b]`` is a unit-step ``Slice``, the column ranges do not
overlap, W (and b) are constants and some slice reads only some rows, each such slice becomes
``MatMul(Slice(x, rows), W[:, columns]) [+ b[columns]]``, and the slices that read every row read one
product of the columns they span**. Each output element is the same dot product over the same weights, so
the values are the same up to the order the kernel sums in; the weights are stored once where the blocks
partition what was read (they may not overlap). ``Gemm`` (2-d, ``transB`` = 1, alpha and beta 1) is read
the same way. Applied for ONNX Runtime's CPU provider: the last block of vit_b_16 computes its query for
one token (0.23 GFLOPs fewer) and its keys and values from a [768, 1536] product.

Splitting a product all of whose rows are read was measured and is not done: the three smaller products
took what the ``Split`` they saved had taken (ORT's kernel sums, vit_small, vit_b_16 and swin_t, two
profiles each: -1.0 to +1.2 %, -0.7 to -4.3 %, +0.7 to +3.2 %).

Example:
    >>> graph = _packed_projection_graph(tokens=4, width=8, slices=[((0, 1), (0, 8)), ((0, 4), (8, 16))])
    >>> split_projections(graph)
    1
    >>> sorted(node.op_type for node in graph if node.op_type != "Identity")
    ['Add', 'Add', 'MatMul', 'MatMul', 'Slice', 'Slice']
"""

from __future__ import annotations

import numpy as np
from onnxscript import ir

from fxforge.exporters.onnx_ir import (
    columns_slice,
    constant,
    constant_value,
    float_value,
    is_onnx_op,
    producer,
    register_constant,
    slice_ranges,
    static_shape,
)

SPLIT_PROJECTIONS = "block of a projection that reads some rows -> its own MatMul on those rows"


def split_projections(graph: ir.Graph) -> int:
    """Apply the module's rule to each product of ``graph`` (not of subgraphs); returns how many slices
    that read some rows only became their own projection.

    Example:
        >>> split_projections(ir.Graph([], [], nodes=[]))
        0
    """
    done = 0
    for node in list(graph):
        found = read_projection(node)
        if found is None:
            continue
        x, weight, bias, product, computed = found
        blocks = sliced_blocks(product, weight.shape[1])
        if blocks is None or not any(rows for _, rows, _ in blocks):
            continue  # every row is read: one product and a Split measured the same as one product per block
        whole = [(piece, columns) for piece, rows, columns in blocks if not rows]
        for piece, rows, (begin, end) in blocks:
            if not rows:
                continue
            name = piece.outputs[0].name or f"{product.name}_block"
            bounds = [register_constant(graph, f"{name}_rows_{what}", [r[k] for r in rows])
                      for k, what in enumerate(("axes", "starts", "ends"))]
            cut = ir.Node("", "Slice", [x, bounds[1], bounds[2], bounds[0]], outputs=[ir.Value(
                name=f"{name}_rows", type=x.type)])
            graph.insert_before(piece, [cut])
            _replace(graph, piece, _project(graph, piece, cut.outputs[0], weight, bias, begin, end))
            done += 1
        if whole:  # the blocks that read every row, from one product of the columns they span
            low, high = min(b for _, (b, _) in whole), max(e for _, (_, e) in whole)
            first = whole[0][0]
            if (low, high) == (0, weight.shape[1]):
                continue
            rest = _project(graph, first, x, weight, bias, low, high)
            for piece, (begin, end) in whole:
                columns = columns_slice(graph, rest, begin - low, end - low, piece.outputs[0],
                                        f"{piece.outputs[0].name}_columns")
                graph.insert_before(piece, [columns])
                _replace(graph, piece, columns.outputs[0])
        graph.remove(computed, safe=True)  # the whole product, which nothing reads any more
    return done


def _project(graph: ir.Graph, before: ir.Node, x: ir.Value, weight: np.ndarray, bias: np.ndarray | None,
             begin: int, end: int) -> ir.Value:
    """``MatMul(x, weight[:, begin:end]) [+ bias[begin:end]]``, inserted before ``before``."""
    name = before.outputs[0].name or "projection"
    kind = before.outputs[0].type
    nodes = [ir.Node("", "MatMul", [x, register_constant(graph, f"{name}_weight", weight[:, begin:end])],
                     outputs=[ir.Value(name=f"{name}_product", type=kind)])]
    if bias is not None:
        nodes.append(ir.Node("", "Add", [nodes[-1].outputs[0], register_constant(graph, f"{name}_bias", bias[..., begin:end])],
                             outputs=[ir.Value(name=f"{name}_projected", type=kind)]))
    graph.insert_before(before, nodes)
    return nodes[-1].outputs[0]


def _replace(graph: ir.Graph, piece: ir.Node, value: ir.Value) -> None:
    """Let ``value`` (same shape) stand for the slice ``piece``'s output, and drop ``piece``."""
    if value.shape is None:
        value.shape = piece.outputs[0].shape
    piece.outputs[0].replace_all_uses_with(value)
    graph.remove(piece, safe=True)


def read_projection(node: ir.Node) -> tuple[ir.Value, np.ndarray, np.ndarray | None, ir.Value, list[ir.Node]] | None:
    """For a projection ending at ``node`` (``MatMul(x, W)``, its ``Add`` of a constant bias, or a ``Gemm`` with
    ``transB`` = 1): x, W as [K, N], b (or None), the product's value and the nodes that compute it (readers
    first); else None. A ``MatMul`` whose only reader is an ``Add`` ends at that ``Add``.

    Example:
        >>> graph = _packed_projection_graph(tokens=4, width=8, slices=[((0, 4), (0, 24))])
        >>> x, weight, bias, product, computed = read_projection(graph.node(1))
        >>> weight.shape, bias.shape, [node.op_type for node in computed]
        ((8, 24), (24,), ['Add', 'MatMul'])
    """
    if is_onnx_op(node, "Gemm"):
        attributes = node.attributes
        if (attributes.get_int("transA", 0) or not attributes.get_int("transB", 0)
                or attributes.get_float("alpha", 1.0) != 1.0 or attributes.get_float("beta", 1.0) != 1.0):
            return None
        weight = constant(node.inputs[1])
        bias = constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
        if weight is None or weight.ndim != 2 or (len(node.inputs) > 2 and node.inputs[2] is not None and bias is None):
            return None
        return node.inputs[0], weight.T, bias, node.outputs[0], [node]
    if not is_onnx_op(node, "Add", "MatMul"):
        return None
    if node.op_type == "Add":
        for at in (0, 1):
            matmul = producer(node.inputs[at], "MatMul")
            bias = constant(node.inputs[1 - at])
            if matmul is not None and bias is not None and len(matmul.outputs[0].uses()) == 1:
                break
        else:
            return None
    else:
        matmul, bias = node, None
        if len(node.outputs[0].uses()) == 1 and is_onnx_op(node.outputs[0].uses()[0][0], "Add"):
            return None  # the Add is the product's end: taken from there
    weight = constant(matmul.inputs[1])
    if weight is None or weight.ndim != 2 or (bias is not None and bias.shape[-1:] != weight.shape[1:]):
        return None
    if bias is not None and any(d != 1 for d in bias.shape[:-1]):
        return None  # a bias that varies along rows: not a projection's
    return matmul.inputs[0], weight, bias, node.outputs[0], [node] if node is matmul else [node, matmul]


def sliced_blocks(product: ir.Value, width: int) -> list[tuple[ir.Node, list[tuple[int, int, int]], tuple[int, int]]] | None:
    """Each reader of ``product`` as (the Slice, its row cuts as (axis, start, end), its column range), when
    all readers are unit-step Slices of a static-shaped product whose column ranges do not overlap; else None.

    Example:
        >>> graph = _packed_projection_graph(tokens=4, width=8, slices=[((0, 1), (0, 8)), ((0, 4), (8, 24))])
        >>> [(rows, columns) for _, rows, columns in sliced_blocks(graph.node(1).outputs[0], 24)]
        [([(1, 0, 1)], (0, 8)), ([], (8, 24))]
    """
    shape = static_shape(product)
    if shape is None or product.is_graph_output() or not product.uses():
        return None
    blocks, taken = [], np.zeros(width, dtype=bool)
    for user, index in product.uses():
        if not is_onnx_op(user, "Slice") or index != 0 or user.outputs[0].is_graph_output():
            return None
        ranges = slice_ranges(user, shape)
        if ranges is None:
            return None
        rows, columns = [], (0, width)
        for axis, begin, stop in ranges:
            if stop <= begin:
                return None
            if axis == len(shape) - 1:
                columns = (begin, stop)
            elif (begin, stop) != (0, shape[axis]):
                rows.append((axis, begin, stop))
        if taken[columns[0]:columns[1]].any():
            return None  # overlapping blocks would store weights twice
        taken[columns[0]:columns[1]] = True
        blocks.append((user, rows, columns))
    return blocks


def _packed_projection_graph(tokens: int, width: int, slices: list) -> ir.Graph:
    """``Add(MatMul(x, W), b)`` of ``x`` [1, tokens, width] and W [width, 3 * width], read by one ``Slice``
    per ``((row start, row end), (column start, column end))``, each followed by an ``Identity`` whose output is
    a graph output."""
    rng = np.random.default_rng(0)
    x = float_value("x", [1, tokens, width])
    weight = constant_value("w", rng.standard_normal((width, 3 * width)).astype(np.float32))
    bias = constant_value("b", rng.standard_normal(3 * width).astype(np.float32))
    matmul = ir.Node("", "MatMul", [x, weight], outputs=[float_value("xw", [1, tokens, 3 * width])])
    add = ir.Node("", "Add", [matmul.outputs[0], bias], outputs=[float_value("p", [1, tokens, 3 * width])])
    nodes, numbers = [matmul, add], [weight, bias]
    for k, ((r0, r1), (c0, c1)) in enumerate(slices):
        bounds = [constant_value(f"{what}{k}", np.array(v, np.int64))
                  for what, v in (("s", [r0, c0]), ("e", [r1, c1]), ("a", [1, 2]))]
        numbers += bounds
        nodes.append(ir.Node("", "Slice", [add.outputs[0], *bounds], outputs=[
            float_value(f"piece{k}", [1, r1 - r0, c1 - c0])]))
        nodes.append(ir.Node("", "Identity", nodes[-1].outputs, outputs=[float_value(f"y{k}", [1, r1 - r0, c1 - c0])]))
    return ir.Graph([x], [node.outputs[0] for node in nodes if node.op_type == "Identity"], nodes=nodes,
                    initializers=numbers, opset_imports={"": 20}, name="packed_projection")
