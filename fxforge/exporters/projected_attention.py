"""Attention over q, k and v projected from one input, as ONNX Runtime's ``Attention`` (which projects them).

After the translation, an attention layer is a projection of its input x into q, k and v (one ``MatMul``
per projection, or one packed ``MatMul`` whose columns are split), then ``com.microsoft.MultiHeadAttention``
over the three. ORT's CPU kernel for that copies q, k and v out of the packed product (``Split``) and again
into [batch, heads, tokens, head] (its own transposes). ORT's older contrib op ``com.microsoft.Attention``
takes x and the packed weights and writes each head's q, k and v straight into that layout with one GEMM
per head on weights it prepacks. Measured on this machine (CPU provider, 2 threads; the projection and the
attention alone, interleaved): 1.23x (197 tokens, hidden 384, 6 heads: vit_small), 1.12x (197, 768, 12
heads), 2.12x (64 windows of 49 tokens, hidden 96: Swin's first stage), 1.23x (128 tokens, hidden 256:
BERT), 1.22x (1024 tokens), with the same values (errors against float64 6e-7 to 2e-6 for both forms) and
NaN in the same places (a NaN or an infinity in a token, an ``attention_bias`` row of ``-inf``: probed
once per process, :func:`attention_matches_multi_head`). In whole files the gain is smaller (a call's other
work shares the cache): BERT 1.084x at 128 tokens, 1.04x at 256, 1.025x at 512; vit_small 1.034x, vit_b_16
1.013x, swin_t 1.064x; and BERT at 1024 tokens ran 0.90-0.96x, hence :data:`MAX_KEYS`.

The rule: **a ``MultiHeadAttention`` whose q, k and v are each a projection ``MatMul(x, W) [+ b]`` of one
x, or a block of the columns of one (an output of a ``Split`` of its last axis, or a unit-step ``Slice``
of it), through reshapes that keep the last dim, with constant weights and one width, over at most**
:data:`MAX_KEYS` **keys (static), that takes no bias, key padding mask or past and whose other outputs
are not read, becomes ``Attention(x, [W_q | W_k | W_v], [b_q | b_k | b_v])``
with its ``attention_bias`` and its attributes (``num_heads``, ``scale``, ``mask_filter_value``,
``unidirectional``)**; where the reshapes regroup rows (torchvision's [tokens, batch, C] at batch 1 read as
[batch, tokens, C]; static shapes only), x is read through the same regrouping (a ``Reshape``, which moves
no data). A projection without a bias adds zeros. ``MultiHeadAttention`` nodes inside an
``If`` (the run-time mask check) are rewritten too, both branches reading one packed weight. The
projections and splits nothing reads any more are removed by the export's unused-node pass.

Example:
    >>> graph = _split_attention_graph(tokens=5, width=8, heads=2)
    >>> project_attention(graph)
    1
    >>> sorted(node.op_type for node in graph if node.op_type != "Identity")
    ['Add', 'Attention', 'MatMul', 'Split']
"""

from __future__ import annotations

import functools

import numpy as np
from onnxscript import ir

from fxforge.exporters.onnx_ir import (
    constant,
    constant_value,
    float_value,
    is_onnx_op,
    register_constant,
    same_dim,
    slice_ranges,
    static_shape,
)
from fxforge.exporters.split_projections import read_projection

PROJECTED_ATTENTION = "MultiHeadAttention over q, k, v projected from one input -> com.microsoft.Attention"
_MSFT = "com.microsoft"
_ATTRIBUTES = ("num_heads", "scale", "mask_filter_value", "unidirectional")
# At most this many keys (static): whole BERT files (hidden 256) ran 1.084x at 128 tokens, 1.04x at 256,
# 1.025x at 512, but 0.90-0.96x at 1024, where MultiHeadAttention's flash kernel keeps its S x S scores in
# cache and Attention's do not.
MAX_KEYS = 512


def project_attention(graph: ir.Graph) -> int:
    """Apply the module's rule to ``graph`` and its subgraphs; returns how many attentions it rewrote.

    Example:
        >>> project_attention(ir.Graph([], [], nodes=[]))
        0
    """
    return _apply(graph) if attention_matches_multi_head() else 0


def _apply(graph: ir.Graph) -> int:
    """The rule on ``graph`` and its subgraphs, without asking the probe (which runs it)."""
    packed: dict[tuple, tuple[ir.Value, ir.Value]] = {}  # one weight and bias per (x, q, k, v) projections
    done = 0
    for node in list(ir.traversal.RecursiveGraphIterator(graph)):
        if node.domain != _MSFT or node.op_type != "MultiHeadAttention" or not _plain(node):
            continue
        keys = node.inputs[1].shape
        if keys is None or len(keys) != 3 or not isinstance(keys[1], int) or keys[1] > MAX_KEYS:
            continue
        sources = [_columns(value) for value in node.inputs[:3]]
        if any(source is None for source in sources):
            continue
        xs = {id(x) for x, *_ in sources}
        widths = {weight.shape[1] for _, weight, _, _, _ in sources}
        x = sources[0][0]
        rows = _rows(node.inputs[0], x, any(moved for *_, moved in sources))
        if len(xs) != 1 or len(widths) != 1 or rows is None:
            continue
        key = (id(x), *(identity for *_, identity, _ in sources))
        if key not in packed:
            weight = np.concatenate([w for _, w, _, _, _ in sources], axis=1)
            bias = np.concatenate([b if b is not None else np.zeros(w.shape[1], w.dtype) for _, w, b, _, _ in sources])
            packed[key] = (register_constant(graph, f"{node.name or 'attention'}_qkv_weight", weight),
                           register_constant(graph, f"{node.name or 'attention'}_qkv_bias", bias.astype(weight.dtype)))
        owner = node.graph
        if rows is not True:  # x's rows as [batch, tokens]: a reshape, which moves no data
            name = f"{x.name}_as_batch_tokens_{done}"
            reshape = ir.Node("", "Reshape", [x, register_constant(graph, f"{name}_shape", rows)],
                              outputs=[ir.Value(name=name, type=x.type, shape=ir.Shape(rows))])
            owner.insert_before(node, [reshape])
            x = reshape.outputs[0]
        weight, bias = packed[key]
        attention_bias = node.inputs[5] if len(node.inputs) > 5 else None
        inputs = [x, weight, bias] + ([None, None, attention_bias] if attention_bias is not None else [])
        attributes = [node.attributes[name] for name in _ATTRIBUTES if name in node.attributes]
        out = node.outputs[0]
        fused = ir.Node(_MSFT, "Attention", inputs, attributes=attributes,
                        outputs=[ir.Value(name=f"{out.name}_projected", type=out.type, shape=out.shape)],
                        name=f"{node.name}_projected" if node.name else None)
        owner.insert_before(node, [fused])
        out.replace_all_uses_with(fused.outputs[0], replace_graph_outputs=True)
        owner.remove(node, safe=True)
        done += 1
    return done


def _plain(node: ir.Node) -> bool:
    """Whether a ``MultiHeadAttention`` takes only q, k, v and an ``attention_bias`` (no bias, key padding mask,
    past or cache inputs) and only its first output is read."""
    inputs = list(node.inputs)
    extra = [v for i, v in enumerate(inputs[3:], start=3) if v is not None and i != 5]
    if len(inputs) < 3 or any(v is None for v in inputs[:3]) or extra:
        return False
    return all(not output.uses() and not output.is_graph_output() for output in node.outputs[1:])


def _columns(value: ir.Value) -> tuple[ir.Value, np.ndarray, np.ndarray | None, tuple, bool] | None:
    """``value`` as columns of a projection: (x, its weight columns [K, n], bias columns or None, an identity of
    the projection and block, whether reshapes between them regroup its rows), when it is a whole projection
    or a ``Split`` output / unit-step ``Slice`` of one's last axis, through ``Reshape``s that keep its last dim;
    else None."""
    source = value
    while is_onnx_op(source.producer(), "Reshape", "Identity"):
        source = source.producer().inputs[0]
    if value.shape is None or source.shape is None or value.shape[-1] != source.shape[-1] or not isinstance(
            value.shape[-1], int):
        return None  # a reshape that regroups columns is not a projection's block
    moved = len(value.shape) != len(source.shape) or not all(same_dim(a, b) for a, b in zip(value.shape, source.shape))
    node = source.producer()
    if node is None:
        return None
    found = read_projection(node)
    if found is not None and found[3] is source:
        x, weight, bias, _, _ = found
        return (x, weight, bias, (id(source), 0, weight.shape[1]), moved) if _row_bias(bias) else None
    if not is_onnx_op(node, "Split", "Slice") or node.inputs[0] is None or node.inputs[0].producer() is None:
        return None
    found = read_projection(node.inputs[0].producer())
    if found is None or found[3] is not node.inputs[0] or not _row_bias(found[2]):
        return None
    x, weight, bias, product, _ = found
    block = _split_block(node, source, weight.shape[1]) if node.op_type == "Split" else _slice_block(node, product)
    if block is None:
        return None
    begin, end = block
    return (x, weight[:, begin:end], None if bias is None else bias.reshape(-1)[begin:end], (id(product), begin, end),
            moved)


def _rows(query: ir.Value, x: ir.Value, moved: bool) -> list[int] | bool | None:
    """How x feeds ``Attention`` (its input is [batch, tokens, K]): True as it is (3-d, and no reshape between
    the projections and the attention), the static shape to reshape it to, or None where neither is known."""
    if not moved:
        return True if x.shape is not None and len(x.shape) == 3 else None
    shape, source = static_shape(query), static_shape(x)
    if shape is None or source is None or len(shape) != 3 or int(np.prod(source[:-1])) != shape[0] * shape[1]:
        return None
    return [shape[0], shape[1], source[-1]]


def _row_bias(bias: np.ndarray | None) -> bool:
    """A bias of one row (``[n]`` or ``[1, ..., n]``): Attention's bias input is 1-d."""
    return bias is None or all(d == 1 for d in bias.shape[:-1])


def _split_block(split: ir.Node, value: ir.Value, width: int) -> tuple[int, int] | None:
    """The columns ``value`` holds as an output of a ``Split`` of the product's last axis (constant sizes)."""
    rank = len(split.inputs[0].shape) if split.inputs[0].shape is not None else None
    axis = split.attributes.get_int("axis", 0)
    if rank is None or axis % rank != rank - 1:
        return None
    sizes = constant(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
    if sizes is None:
        count = len(split.outputs)
        if width % count:
            return None
        sizes = np.full(count, width // count)
    if int(np.sum(sizes)) != width or len(sizes) != len(split.outputs):
        return None
    index = next(i for i, output in enumerate(split.outputs) if output is value)
    begin = int(np.sum(sizes[:index]))
    return begin, begin + int(sizes[index])


def _slice_block(piece: ir.Node, product: ir.Value) -> tuple[int, int] | None:
    """The columns a unit-step ``Slice`` of the product's last axis holds (every other axis whole)."""
    shape = static_shape(product)
    ranges = None if shape is None else slice_ranges(piece, shape)
    if ranges is None:
        return None
    columns = None
    for axis, begin, stop in ranges:
        if axis == len(shape) - 1:
            columns = (begin, stop)
        elif (begin, stop) != (0, shape[axis]):
            return None
    return columns if columns is not None and columns[1] > columns[0] else None


@functools.cache
def attention_matches_multi_head() -> bool:
    """Whether the installed ONNX Runtime's CPU ``Attention`` gives what ``MultiHeadAttention`` gives over the
    same projections, NaN included: probed once per process on random projections with a NaN, +inf and -inf
    in one token, with and without an ``attention_bias`` (one of its rows all ``-inf``), with 6 and 500 keys.

    Example:
        >>> attention_matches_multi_head()  # ONNX Runtime 1.31
        True
    """
    try:
        return all(_probe(batch, length, bias) for batch, length, bias in ((2, 6, True), (1, MAX_KEYS - 12, False), (1, 6, False)))
    except Exception:  # noqa: BLE001 - an ONNX Runtime that cannot run the probe keeps MultiHeadAttention
        return False


def _probe(batch: int, length: int, bias: bool) -> bool:
    """One graph of both forms over one projection, run on a token with a NaN, +inf and -inf."""
    import onnxruntime as ort

    graph = _split_attention_graph(tokens=length, width=16, heads=2, bias=bias, batch=batch)
    before = ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString()
    rewritten = _split_attention_graph(tokens=length, width=16, heads=2, bias=bias, batch=batch)
    if _apply(rewritten) != 1:
        return False
    after = ir.serde.serialize_model(ir.Model(rewritten, ir_version=10)).SerializeToString()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sessions = [ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]) for model in (before, after)]
    rng = np.random.default_rng(0)
    for bad in (None, np.nan, np.inf, -np.inf):
        feeds = {"x": rng.standard_normal((batch, length, 16)).astype(np.float32)}
        if bias:
            feeds["attention_bias"] = rng.standard_normal((batch, 2, length, length)).astype(np.float32)
            feeds["attention_bias"][0, 1, 3, :] = -np.inf
        if bad is not None:
            feeds["x"][0, 2, 5] = bad
        want, got = (session.run(None, feeds)[0] for session in sessions)
        if not np.array_equal(np.isnan(want), np.isnan(got)) or not np.allclose(
                got[~np.isnan(want)], want[~np.isnan(want)], rtol=1e-4, atol=1e-5):
            return False
    return True


def _split_attention_graph(tokens: int, width: int, heads: int, *, bias: bool = False, batch: int = 1) -> ir.Graph:
    """``MultiHeadAttention`` over the thirds (``Split``) of ``Add(MatMul(x, W), b)`` of ``x`` [batch, tokens,
    width], with an ``attention_bias`` graph input when ``bias``; its output through an ``Identity``."""
    rng = np.random.default_rng(0)
    x = float_value("x", [batch, tokens, width])
    weight = constant_value("w", (rng.standard_normal((width, 3 * width)) * width ** -0.5).astype(np.float32))
    b = constant_value("b", (rng.standard_normal(3 * width) * 0.1).astype(np.float32))
    sizes = constant_value("sizes", np.array([width] * 3, np.int64))
    matmul = ir.Node("", "MatMul", [x, weight], outputs=[float_value("xw", [batch, tokens, 3 * width])])
    add = ir.Node("", "Add", [matmul.outputs[0], b], outputs=[float_value("qkv", [batch, tokens, 3 * width])])
    split = ir.Node("", "Split", [add.outputs[0], sizes], attributes=[ir.AttrInt64("axis", -1)],
                    outputs=[float_value(name, [batch, tokens, width]) for name in "qkv"])
    inputs = [x]
    attention_inputs = list(split.outputs)
    if bias:
        inputs.append(float_value("attention_bias", [batch, heads, tokens, tokens]))
        attention_inputs += [None, None, inputs[-1]]
    attention = ir.Node(_MSFT, "MultiHeadAttention", attention_inputs, attributes=[ir.AttrInt64("num_heads", heads)],
                        outputs=[float_value("o", [batch, tokens, width])])
    identity = ir.Node("", "Identity", attention.outputs, outputs=[float_value("y", [batch, tokens, width])])
    return ir.Graph(inputs, identity.outputs, nodes=[matmul, add, split, attention, identity],
                    initializers=[weight, b, sizes], opset_imports={"": 20, _MSFT: 1}, name="split_attention")
