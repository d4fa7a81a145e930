"""A tensor's rows rearranged by several data-movement ops, gathered in one ``Gather``.

Swin's shifted windows move each token twice around its attention: ``torch.roll`` (exported as two
``Slice``s and a ``Concat`` per rolled dim), the window partition (a ``Transpose`` between reshapes), a
``Pad`` that pads nothing at 224 x 224, and the same backwards after it. ONNX Runtime copies the whole
activation at each of those ops, seven or eight times per block, where the result is one permutation of
the tokens, each token's channels kept together.

The rule: **a value computed from one static-shaped tensor by data movement alone (the ops of
:mod:`~fxforge.exporters.moves`, any graph of them, including ``Concat``), through at least two copies and
with nothing else reading what is in between, whose elements are the source's last-dim rows (each row
whole, in order) becomes ``Gather(Reshape(source, [-1, C]), rows, axis=0)``**, ``rows`` a constant (and a
``Reshape`` after it where a result row holds several source rows side by side: Swin's patch merging,
which concatenates four strided ``Slice``s of the tokens along the channels), **or a ``Reshape`` of the
source where every row comes out in its own order** (the copies cancel out: BERT's head transposes at
batch 1; a result of only the first rows, as LeViT's subsampling slices keep, is a gather of them). Which
row goes where is computed by replaying the ops on an array of element indices, not matched against a
pattern, so the values are the same by construction. Refused where rows are split up (the last dim is
itself moved or cut), rows are shorter than 8 elements (a gather of few floats per index is slower than
the copies), or the source has more than 2**22 elements.

Example:
    >>> graph = _rolled_graph(tokens=6, channels=8, shift=2)
    >>> gather_moved_rows(graph) == {GATHERS: 1}
    True
    >>> sorted(node.op_type for node in graph)
    ['Gather', 'Relu', 'Reshape']
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from onnxscript import ir

from fxforge.exporters.moves import COPIES, REPLAY_LIMIT, data_inputs, is_move, replay
from fxforge.exporters.onnx_ir import constant_value, float_value, register_constant, static_shape

GATHERS = "rows moved by several copies (roll, window partition, zero Pad) -> one Gather"
CANCELLED = "data movement through several copies that moves nothing -> Reshape"
MIN_ROW = 8


def gather_moved_rows(graph: ir.Graph) -> dict[str, int]:
    """Apply the module's rule to ``graph`` (not to subgraphs); returns how many values became one Gather
    (``GATHERS``) and how many a Reshape (``CANCELLED``).

    Example:
        >>> gather_moved_rows(ir.Graph([], [], nodes=[]))
        {}
    """
    done: Counter[str] = Counter()
    for node in list(graph):
        if not is_move(node):
            continue
        for value in node.outputs:
            if _read_by_others(value) and not value.is_graph_output():
                what = _gather(graph, value)
                if what:
                    done[what] += 1
    return dict(done)


def _read_by_others(value: ir.Value) -> bool:
    """Whether something other than a data-movement op reads ``value`` (where a region of moves ends)."""
    return any(not is_move(user) for user, _ in value.uses())


def _gather(graph: ir.Graph, end: ir.Value) -> str | None:
    """Replace ``end`` as the rule says; returns what it became (None: left)."""
    region, source = _region(end)
    if region is None or source is None:
        return None
    shape = static_shape(source)
    if not shape or shape[-1] < MIN_ROW or int(np.prod(shape)) > REPLAY_LIMIT:
        return None
    if sum(node.op_type in COPIES for node in region) < 2:
        return None
    arrays = {source: np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)}
    for node in graph:  # the graph's order is topological
        if node not in region:
            continue
        inputs = [arrays.get(value) if position in data_inputs(node) else None
                  for position, value in enumerate(node.inputs)]
        for output, value in enumerate(node.outputs):
            moved = replay(node, output, inputs)
            known = static_shape(value)
            if moved is None or (known is not None and list(moved.shape) != known):
                return None  # a form not replayed, or shapes that disagree with the graph's
            arrays[value] = moved
    moved, width = arrays[end], shape[-1]
    if moved.ndim == 0 or moved.shape[-1] % width:
        return None
    rows = moved.reshape(-1, width)
    if np.any(rows[:, 0] % width) or not np.array_equal(rows, rows[:, :1] + np.arange(width)):
        return None  # the rows are not kept whole and in order
    name = end.name or "moved"
    # Nothing moves where the result holds every row of the source in order; a result that holds only some of
    # them (LeViT's subsampling slices keep the first row of four), even in order, is a gather of those rows.
    everything = moved.size == int(np.prod(shape))
    what = CANCELLED if everything and np.array_equal(rows[:, 0], np.arange(0, moved.size, width)) else GATHERS
    if what == CANCELLED:  # nothing moves: the copies cancel out
        nodes = [ir.Node("", "Reshape", [source, register_constant(graph, f"{name}_unmoved_shape", moved.shape)],
                         outputs=[ir.Value(name=f"{name}_unmoved", type=end.type, shape=ir.Shape(list(moved.shape)))])]
    else:
        group = moved.shape[-1] // width  # source rows side by side in one row of the result (a patch merge)
        picked_shape = list(moved.shape[:-1]) + ([group] if group > 1 else [])
        flat = ir.Node("", "Reshape", [source, register_constant(graph, f"{name}_rows_shape", [-1, width])], outputs=[
            ir.Value(name=f"{name}_flat", type=source.type, shape=ir.Shape([int(np.prod(shape)) // width, width]))])
        picked = register_constant(graph, f"{name}_rows", (rows[:, 0] // width).reshape(picked_shape))
        nodes = [flat, ir.Node("", "Gather", [flat.outputs[0], picked], attributes=[ir.AttrInt64("axis", 0)],
                               outputs=[ir.Value(name=f"{name}_gathered", type=end.type,
                                                 shape=ir.Shape([*picked_shape, width]))])]
        if group > 1:
            nodes.append(ir.Node("", "Reshape", [nodes[-1].outputs[0], register_constant(graph, f"{name}_merged_shape",
                                                                                 moved.shape)],
                                 outputs=[ir.Value(name=f"{name}_merged", type=end.type,
                                                   shape=ir.Shape(list(moved.shape)))]))
    graph.insert_before(end.producer(), nodes)
    end.replace_all_uses_with(nodes[-1].outputs[0])
    graph.remove([node for node in graph if node in region], safe=True)  # nothing reads them any more
    return what


def _region(end: ir.Value) -> tuple[set[ir.Node] | None, ir.Value | None]:
    """The data-movement nodes that compute ``end`` back to the one value they all start from (a value
    something else computes, or one read by other ops too); (None, None) where there are several such
    values or an intermediate result is read outside the region."""
    region: set[ir.Node] = set()
    sources: set[ir.Value] = set()
    pending = [end]
    while pending:
        value = pending.pop()
        node = value.producer()
        if value is not end and (node is None or not is_move(node) or _read_by_others(value)
                                 or value.is_graph_output()):
            sources.add(value)
            continue
        if node in region:
            continue
        region.add(node)
        pending.extend(node.inputs[position] for position in data_inputs(node) if node.inputs[position] is not None)
    if len(sources) != 1:
        return None, None
    for node in region:
        for value in node.outputs:
            if value is not end and (value.is_graph_output() or any(user not in region for user, _ in value.uses())):
                return None, None  # an intermediate result is needed elsewhere: nothing would be saved
    return region, next(iter(sources))


def _rolled_graph(tokens: int, channels: int, shift: int) -> ir.Graph:
    """``Relu(roll(x, shift, dim=0))`` of ``x`` [tokens, channels], the roll as torch.onnx writes it."""
    x = float_value("x", [tokens, channels])
    numbers = [constant_value(name, np.array(v, np.int64)) for name, v in (
        ("tail_from", [tokens - shift]), ("tail_to", [tokens]), ("head_from", [0]), ("head_to", [tokens - shift]),
        ("axis", [0]))]
    tail = ir.Node("", "Slice", [x, numbers[0], numbers[1], numbers[4]], outputs=[float_value("tail", [shift, channels])])
    head = ir.Node("", "Slice", [x, numbers[2], numbers[3], numbers[4]], outputs=[
        float_value("head", [tokens - shift, channels])])
    rolled = ir.Node("", "Concat", [tail.outputs[0], head.outputs[0]], attributes=[ir.AttrInt64("axis", 0)],
                     outputs=[float_value("rolled", [tokens, channels])])
    relu = ir.Node("", "Relu", rolled.outputs, outputs=[float_value("y", [tokens, channels])])
    return ir.Graph([x], relu.outputs, nodes=[tail, head, rolled, relu], initializers=numbers,
                    opset_imports={"": 20}, name="rolled")
