"""Queries, keys and values unpacked from one projection, read by ``MultiHeadAttention`` as slices of it.

Swin and timm's ViT project q, k and v with one linear layer of 3C outputs, then unpack it with
``qkv.reshape(B, N, 3, heads, d).permute(2, 0, 3, 1, 4)`` and ``qkv[i]`` (or ``unbind(0)``); the
translation to ``com.microsoft.MultiHeadAttention`` then puts each of q, k, v back into [B, N, heads * d]
with ``Transpose(0, 2, 1, 3)`` and ``Reshape``. ORT runs that as a five-dimensional transpose of the whole
projection, a split and three more transposes: copies that give back, for q, the projection's columns
``0:C``, for k ``C:2C`` and for v ``2C:3C``. Swin also scales q by ``d ** -0.5`` with a ``Mul`` before the
attention, which then runs with scale 1.

The rules, on the inputs of each ``MultiHeadAttention`` (not in subgraphs):

- **``Reshape(Transpose(part_i(Transpose(Reshape(qkv, [B, N, 3, h, d]), [2, 0, 3, 1, 4])), [0, 2, 1, 3]),
  [B, N, h * d])`` becomes ``qkv[..., i*h*d : (i+1)*h*d]``** (one ``Slice``), where ``part_i`` is
  ``Gather(., i, axis=0)``, or ``Slice(., [i], [i + 1], axes=[0])`` (``unbind``) or output ``i`` of
  ``Split(., axis=0)`` into ones, ``Squeeze``d: the same values in the same order, by construction of the
  index arithmetic. Refused (left as it is) where the reshapes regroup batch and tokens, or the widths are
  not known at export time.
- **Any other input of an attention (``MultiHeadAttention`` or ``GroupQueryAttention``) that is computed
  from one static-shaped tensor by data movement alone (``Reshape``, ``Transpose``, ``Squeeze``,
  ``Unsqueeze``, ``Flatten``, ``Identity``, and ``Gather``, ``Split`` and unit-step ``Slice`` with constant
  indices) and holds a block of it (a range of each dim) in its order becomes that ``Slice`` (and a
  ``Reshape``)**. Whether it does is not matched against a pattern but computed: the chain is replayed on
  an array of element indices, and the result is compared with the block's. This reads torchvision's
  ``nn.MultiheadAttention`` (``proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2)``,
  ``proj[i]``, per-head views and transposes): vit_b_16 at batch 1 loses a transpose of the whole [197, 2304]
  projection and a split per layer; a query that cleanup's dead rows cut to one token is a block of one row.
  Inputs whose source has more than 2**22 elements are left.
- **A ``Mul`` of q (or k) by a constant scalar between the two becomes a factor of the attention's
  ``scale``** (MultiHeadAttention scales q @ k^T: the product rounds differently in the last bits; the
  file is validated against the model as every export is). A factor of v is left.

Applied for ONNX Runtime's CPU provider (what was measured): torchvision's swin_t file loses 48 Transpose, 48
Reshape, 36 Gather and 12 Mul; ORT's kernel sum 42.5 -> 41.1 ms, the file 1.008-1.014x faster interleaved.

Example:
    >>> graph = _unpacked_attention_graph(tokens=4, heads=2, head=8, scale_q=0.25)
    >>> read_qkv_as_slices(graph)
    {'q, k, v read as slices of their packed projection': 3, 'scalar factor of q or k folded into the attention scale': 1}
    >>> attention = next(node for node in graph if node.op_type == "MultiHeadAttention")
    >>> [node.op_type for node in (value.producer() for value in attention.inputs[:3])], attention.attributes.get_float("scale")
    (['Slice', 'Slice', 'Slice'], 0.25)
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from onnxscript import ir

from fxforge.exporters.moves import REPLAY_LIMIT, data_inputs, is_move, replay
from fxforge.exporters.onnx_ir import (
    constant,
    constant_value,
    flattened_heads,
    float_value,
    move_shape_reads,
    producer,
    register_constant,
    same_dim,
    static_shape,
)

SLICES = "q, k, v read as slices of their packed projection"
SCALE = "scalar factor of q or k folded into the attention scale"
_MSFT = "com.microsoft"


def read_qkv_as_slices(graph: ir.Graph) -> dict[str, int]:
    """Apply the module's rules to each ``MultiHeadAttention`` of ``graph``; returns how many inputs became
    slices and how many scalar factors were folded into a scale.

    Example:
        >>> read_qkv_as_slices(ir.Graph([], [], nodes=[]))
        {}
    """
    done: Counter[str] = Counter()
    for node in list(graph):
        if node.domain != _MSFT or node.op_type not in ("MultiHeadAttention", "GroupQueryAttention"):
            continue
        for index in range(min(3, len(node.inputs))):
            found = _unpacked(node.inputs[index]) if node.op_type == "MultiHeadAttention" else None
            if found is None:
                read = _read_moved_block(graph, node, index)
                if read:
                    done[SLICES] += read
                continue
            packed, part, width, factor = found
            if factor is not None and (index == 2 or node.attributes.get_float("scale") is None):
                continue  # a factor of v, or no scale attribute to fold it into
            old = node.inputs[index]
            bounds = [register_constant(graph, f"{old.name}_slice_{what}", [n])
                      for what, n in (("start", part * width), ("end", (part + 1) * width), ("axis", -1))]
            piece = ir.Node("", "Slice", [packed, *bounds], outputs=[
                ir.Value(name=f"{old.name}_sliced", type=old.type, shape=old.shape)])
            graph.insert_after(old.producer(), [piece])
            node.replace_input_with(index, piece.outputs[0])
            move_shape_reads(old, piece.outputs[0])
            done[SLICES] += 1
            if factor is not None:
                node.attributes["scale"] = ir.AttrFloat32("scale", node.attributes.get_float("scale") * factor)
                done[SCALE] += 1
    return dict(done)


def _unpacked(value: ir.Value | None) -> tuple[ir.Value, int, int, float | None] | None:
    """For an attention input of the first rule: the packed projection, which third of it, the third's
    width, and the scalar factor in between (or None)."""
    part_value, factor = flattened_heads(value), None
    if part_value is None:
        return None
    scaled = producer(part_value, "Mul")
    if scaled is not None and len(scaled.inputs) == 2:
        for at in (0, 1):
            number = constant(scaled.inputs[1 - at])
            if number is not None and number.size == 1 and number.dtype == np.float32:
                part_value, factor = scaled.inputs[at], float(number.item())
                break
        else:
            return None
    found = _part(part_value)
    if found is None:
        return None
    permuted, part = found
    permute = producer(permuted, "Transpose")
    if permute is None or list(permute.attributes.get_ints("perm", [])) != [2, 0, 3, 1, 4]:
        return None
    split_heads = producer(permute.inputs[0], "Reshape")
    packed = split_heads.inputs[0] if split_heads is not None else None
    five, three, out = _dims(permute.inputs[0]), _dims(packed), _dims(value)
    if five is None or three is None or out is None or len(five) != 5 or len(three) != 3 or len(out) != 3:
        return None
    if not all(isinstance(d, int) for d in (*five[2:], three[2], out[2])):
        return None  # batch and token counts may be dynamic; the packed widths must be known
    if not all(same_dim(a, b) and same_dim(a, c) for a, b, c in zip(three[:2], five[:2], out[:2])):
        return None  # the reshapes regroup batch and tokens: not one row of the projection per token
    width = five[3] * five[4]
    if five[2] != 3 or three[2] != 3 * width or out[2] != width:
        return None
    return packed, part, width, factor


def _read_moved_block(graph: ir.Graph, attention: ir.Node, index: int) -> int:
    """The third rule on ``attention``'s input ``index``: replace it (at each of q, k, v where it is read)
    by a slice of the tensor it was moved out of, where the replay shows it is one; returns how many inputs
    it replaced."""
    value = attention.inputs[index]
    shape = static_shape(value)
    chain, source = [], value
    while (node := source.producer()) is not None and is_move(node) and data_inputs(node) == [0]:
        chain.append((node, list(node.outputs).index(source)))
        source = node.inputs[0]
    origin = static_shape(source)
    if shape is None or origin is None or not origin or not chain or int(np.prod(origin)) > REPLAY_LIMIT:
        return 0
    if not any(node.op_type in ("Transpose", "Gather", "Split") for node, _ in chain):
        return 0  # nothing is copied on the way but (at most) one slice: nothing to gain
    indices = np.arange(int(np.prod(origin)), dtype=np.int64).reshape(origin)
    moved = indices
    for node, output in reversed(chain):
        moved = replay(node, output, [moved])
        known = static_shape(node.outputs[output])
        if moved is None or (known is not None and list(moved.shape) != known):
            return 0  # a form not replayed, or shapes that disagree with the graph's
    block = _block(indices, moved)
    if block is None or list(moved.shape) != shape:
        return 0
    name = value.name
    cut = [axis for axis, (begin, end) in enumerate(block) if (begin, end) != (0, origin[axis])]
    bounds = [register_constant(graph, f"{name}_block_{what}", numbers) for what, numbers in (
        ("starts", [block[axis][0] for axis in cut]), ("ends", [block[axis][1] for axis in cut]), ("axes", cut))]
    sliced = [end - begin for begin, end in block]
    nodes = [ir.Node("", "Slice", [source, *bounds], outputs=[
        ir.Value(name=f"{name}_block", type=value.type, shape=ir.Shape(sliced))])]
    if sliced != shape:
        target = register_constant(graph, f"{name}_block_shape", shape)
        nodes.append(ir.Node("", "Reshape", [nodes[-1].outputs[0], target], outputs=[
            ir.Value(name=f"{name}_sliced", type=value.type, shape=value.shape)]))
    graph.insert_before(attention, nodes)
    reads = [i for i in range(index, min(3, len(attention.inputs))) if attention.inputs[i] is value]
    for i in reads:
        attention.replace_input_with(i, nodes[-1].outputs[0])
    move_shape_reads(value, nodes[-1].outputs[0])
    return len(reads)


def _block(indices: np.ndarray, moved: np.ndarray) -> list[tuple[int, int]] | None:
    """The ``[begin, end)`` range per axis of ``indices`` whose elements, in order, are ``moved``'s; None
    where ``moved`` is no such block, or is all of ``indices`` (a reshape: the transposes' rule's case)."""
    if moved.size == 0 or moved.size == indices.size:
        return None
    corners = np.unravel_index(np.array([moved.min(), moved.max()]), indices.shape)
    block = [(int(low), int(high) + 1) for low, high in corners]
    piece = indices[tuple(slice(begin, end) for begin, end in block)]
    return block if np.array_equal(piece.reshape(-1), moved.reshape(-1)) else None


def _dims(value: ir.Value | None) -> list | None:
    return None if value is None or value.shape is None else list(value.shape)


def _part(value: ir.Value | None) -> tuple[ir.Value, int] | None:
    """``(t, i)`` for ``Gather(t, i, axis=0)`` with a scalar constant ``i`` in 0..2, or ``Squeeze(., [0])`` of
    ``Slice(t, [i], [i + 1], [0])`` (``unbind(0)``) or of output ``i`` of ``Split(t, axis=0)`` into ones."""
    gather = producer(value, "Gather")
    if gather is not None:
        index = constant(gather.inputs[1])
        if gather.attributes.get_int("axis", 0) == 0 and index is not None and index.shape == () and 0 <= int(index) < 3:
            return gather.inputs[0], int(index)
        return None
    squeeze = producer(value, "Squeeze")
    axes = constant(squeeze.inputs[1]) if squeeze is not None and len(squeeze.inputs) > 1 else None
    if axes is None or axes.reshape(-1).tolist() != [0]:
        return None
    piece = squeeze.inputs[0]
    one = producer(piece, "Slice")
    if one is not None:
        bounds = [constant(one.inputs[i]) if len(one.inputs) > i and one.inputs[i] is not None else None
                  for i in (1, 2, 3, 4)]
        starts, ends, slice_axes, steps = (None if b is None else b.reshape(-1).tolist() for b in bounds)
        if starts is None or ends is None or slice_axes != [0] or steps not in (None, [1]) or len(starts) != 1:
            return None
        return (one.inputs[0], starts[0]) if 0 <= starts[0] < 3 and ends == [starts[0] + 1] else None
    split = producer(piece, "Split")
    if split is None or split.attributes.get_int("axis", 0) != 0 or len(split.outputs) != 3:
        return None
    sizes = constant(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else np.ones(3)
    if sizes is None or sizes.reshape(-1).tolist() != [1, 1, 1]:
        return None
    return split.inputs[0], list(split.outputs).index(piece)


def _unpacked_attention_graph(tokens: int, heads: int, head: int, scale_q: float | None = None,
                              form: str = "gather") -> ir.Graph:
    """MultiHeadAttention (scale 1 when q is scaled, else d ** -0.5) on q, k, v unpacked from a graph input
    ``qkv`` [1, tokens, 3 * heads * head] as torch.onnx writes Swin's ``qkv[i]`` (``form="gather"``) or
    ``unbind(0)`` (``"slice"``: ``Slice`` + ``Squeeze``; ``"split"``: ``Split`` + ``Squeeze``), translated as
    fxforge's export writes it."""
    width, numbers, nodes = heads * head, [], []

    def number(name, array):
        numbers.append(constant_value(name, array))
        return numbers[-1]

    def node(op_type, inputs, shape=None, name=None, **attributes):
        outputs = None if shape is None else [float_value(name, shape)]
        nodes.append(ir.Node("", op_type, inputs, outputs=outputs, num_outputs=attributes.get("num_outputs", 1),
                             attributes=[ir.convenience.convert_attribute(k, v) for k, v in attributes.items()]))
        return nodes[-1].outputs[0] if len(nodes[-1].outputs) == 1 else list(nodes[-1].outputs)

    qkv = float_value("qkv", [1, tokens, 3 * width])
    five = [1, tokens, 3, heads, head]
    five_d = node("Reshape", [qkv, number("five", np.array(five, np.int64))], five, "five_d")
    permuted = node("Transpose", [five_d], [3, 1, heads, tokens, head], "permuted", perm=[2, 0, 3, 1, 4])
    part_shape, zero = [1, heads, tokens, head], number("zero", np.array([0], np.int64))
    if form == "gather":
        parts = [node("Gather", [permuted, number(f"i{i}", np.array(i, np.int64))], part_shape, f"part{i}", axis=0)
                 for i in range(3)]
    else:
        pieces = node("Split", [permuted], axis=0, num_outputs=3) if form == "split" else [
            node("Slice", [permuted, number(f"from{i}", np.array([i], np.int64)),
                           number(f"to{i}", np.array([i + 1], np.int64)), zero]) for i in range(3)]
        parts = [node("Squeeze", [piece, zero], part_shape, f"part{i}") for i, piece in enumerate(pieces)]
    if scale_q is not None:
        parts[0] = node("Mul", [parts[0], number("factor", np.array(scale_q, np.float32))], part_shape, "scaled_q")
    flat = [node("Reshape", [node("Transpose", [part], perm=[0, 2, 1, 3]), number(f"three{i}", np.array(
        [0, 0, -1], np.int64))], [1, tokens, width], f"flat{i}") for i, part in enumerate(parts)]
    output = float_value("y", [1, tokens, width])
    nodes.append(ir.Node(_MSFT, "MultiHeadAttention", flat, outputs=[output], attributes=[
        ir.AttrInt64("num_heads", heads), ir.AttrFloat32("scale", 1.0 if scale_q is not None else head ** -0.5)]))
    return ir.Graph([qkv], [output], nodes=nodes, initializers=numbers, opset_imports={"": 20, _MSFT: 1},
                    name="unpacked_attention")
