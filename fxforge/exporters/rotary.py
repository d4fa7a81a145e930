"""Rotary position embeddings of a causal self-attention handed to ``GroupQueryAttention``, which applies them
itself.

LLaMA, Mistral and Qwen rotate q and k before attention with ``x * cos + rotate_half(x) * sin``, where
``rotate_half(x) = cat(-x[..., h:], x[..., :h])`` and ``cos``/``sin`` repeat their first half
(``cat(freqs, freqs)``). torch.onnx writes that as two ``Slice``, a ``Neg``, a ``Concat``, two ``Mul`` and an
``Add`` for q and again for k, each a pass over the whole [B, N, S, H] tensor. ONNX Runtime's
``GroupQueryAttention`` (what :mod:`fxforge.exporters.translations` makes of a causal SDPA) rotates q and k
in its own packing pass when given ``do_rotary`` and cos/sin tables of [max positions, H / 2]. In a LLaMA
decoder at S = 1024 (ORT's CPU provider, 2 threads) the file ran 1.06-1.07x faster with the rotation
inside the attention (interleaved medians, three runs).

The rule: **``GroupQueryAttention(Reshape(Transpose(rope(q))), Reshape(Transpose(rope(k))), ...)`` becomes
``GroupQueryAttention(Reshape(Transpose(q)), Reshape(Transpose(k)), ..., cos[:, :H/2], sin[:, :H/2],
do_rotary=1)``**, where ``rope`` is the rotate-half form above on [B, N, S, H] and q and k are rotated by
the same ``cos`` and ``sin`` tables. GroupQueryAttention (no past: positions 0 to S - 1) reads row ``s`` of
its tables for position ``s``, so each table must hold one row per position of the sequence; the rule
passes it the first half of the model's own table (an initializer when the table is a constant, a
``Slice`` of it otherwise: a file with a dynamic sequence length computes its tables at run time). A head
repeat of k (transformers' ``repeat_kv``) between the rotation and the attention is kept, on the un-rotated
k: it moves whole rows and keeps their positions, so it commutes with the rotation. It is
refused (the attention keeps its inputs, the reason is recorded) when:

- a table does not hold one row per position (it broadcasts over the sequence, or its length may differ
  from the sequence's), or it differs across the batch or the heads;
- a constant table's second half is not its first, or it holds a NaN or an infinity; a table computed at
  run time that is not, through elementwise ops (cos, sin, casts, a scalar factor), ``Concat(t, t)`` on its
  last axis;
- only one of q and k is rotated, or they are rotated by different tables;
- the head size is not a multiple of 16 (GroupQueryAttention rotates only those);
- :func:`group_query_attention_rotates` finds the installed ONNX Runtime does not rotate as eager does.

Where the model also returns the rotated k (its KV cache), the file reads it from the attention's
``present_key`` (the key it rotated) when no head repeat lies between them, rather than rotating k twice.

The attention rewrite's NaN-row guard (:mod:`fxforge.exporters.attention_guards`) read the rotated q; it
now reads q. With finite tables a row of q holds a NaN or an infinity exactly when its rotation does, save
rotations that overflow float32 (entries of q above ~1e38), which that guard never covered in q @ k^T
either (tables computed at run time are cosines and sines: finite unless their angles are not). ONNX
Runtime rotates with its own kernel: results differ from eager's in the last bits (the file is validated
against the model as every export is).

Example:
    >>> import numpy as np
    >>> graph = _rotary_attention_graph(np.ones((4, 16), np.float32), np.zeros((4, 16), np.float32))
    >>> fuse_rotary_embeddings(graph, rotates=True)
    (1, [])
    >>> attention = next(node for node in graph if node.op_type == "GroupQueryAttention")
    >>> attention.attributes.get_int("do_rotary"), [value.name for value in attention.inputs[7:]]
    (1, ['rotary_cos_cache_0', 'rotary_sin_cache_1'])
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from onnxscript import ir

from fxforge.exporters.onnx_ir import (
    constant,
    constant_value,
    flattened_heads,
    float_value,
    is_onnx_op,
    move_shape_reads,
    producer,
    same_dim,
    shape_text,
)

ROTARY = "rotary embedding of q and k -> GroupQueryAttention's own (do_rotary)"
NOT_ROTATING = "rotary embedding kept: the installed ONNX Runtime's GroupQueryAttention does not rotate as eager does"
_MSFT = "com.microsoft"
ELEMENTWISE = frozenset({"Cos", "Sin", "Cast", "Identity"})


@dataclasses.dataclass
class _Rotation:
    """One rotated input of an attention: ``x`` (the un-rotated [B, N, S, H] tensor), the cos and sin tables
    it is rotated by, and the value the rotation computes."""

    x: ir.Value
    cos: ir.Value
    sin: ir.Value
    rotated: ir.Value


def fuse_rotary_embeddings(graph: ir.Graph, *, rotates: bool | None = None) -> tuple[int, list[str]]:
    """Apply the module's rule to each ``GroupQueryAttention`` of ``graph`` (not in subgraphs); returns how
    many attentions now rotate their inputs themselves, and the reasons for those left as they were.
    ``rotates`` says whether the installed ORT rotates as eager does (default: probe it once,
    :func:`group_query_attention_rotates`); False changes nothing.

    Example:
        >>> fuse_rotary_embeddings(ir.Graph([], [], nodes=[]), rotates=True)
        (0, [])
    """
    found = []
    for node in list(graph):
        if node.domain != _MSFT or node.op_type != "GroupQueryAttention" or node.attributes.get_int("do_rotary", 0):
            continue
        q, k = (_rotation(node.inputs[index]) if len(node.inputs) > index else None for index in (0, 1))
        if q is None and k is None:
            continue  # no rotary embedding in sight
        found.append((node, q, k))
    if not found:
        return 0, []
    if rotates is None:
        rotates = group_query_attention_rotates()
    if not rotates:
        return 0, [NOT_ROTATING]
    done, refused, caches = 0, [], {}
    for node, q, k in found:
        reason = _refusal(q, k)
        if reason is not None:
            refused.append(f"rotary embedding kept before {node.name or 'GroupQueryAttention'}: {reason}")
            continue
        tables = [_cache(graph, node, caches, table, name) for table, name in ((q.cos, "rotary_cos_cache"),
                                                                              (q.sin, "rotary_sin_cache"))]
        inputs = [_unrotated(graph, node.inputs[0], q), _unrotated(graph, node.inputs[1], k),
                  *node.inputs[2:]]
        inputs += [None] * (7 - len(inputs)) + tables
        fused = ir.Node(_MSFT, "GroupQueryAttention", inputs, name=node.name, num_outputs=len(node.outputs),
                        attributes=[*node.attributes.values(), ir.AttrInt64("do_rotary", 1),
                                    ir.AttrInt64("rotary_interleaved", 0)])
        # the new outputs take the old ones' names, types and shapes
        ir.convenience.replace_nodes_and_values(graph, node, [node], [fused], list(node.outputs), list(fused.outputs))
        for rotation in (q, k):
            _guard_reads_unrotated(rotation)
        _cache_from_present_key(graph, fused, k)
        done += 1
    return done, refused


def _cache_from_present_key(graph: ir.Graph, attention: ir.Node, key: _Rotation) -> None:
    """Where the rotated key is also a graph output (the model returns its KV cache), read it from the
    attention's ``present_key`` (the key it rotated, [B, kv heads, S, H] without a past) when the shapes agree,
    so that the file does not rotate the key a second time for the cache."""
    present = attention.outputs[1] if len(attention.outputs) > 1 else None
    cached, shape, query = key.rotated, key.rotated.shape, attention.inputs[0].shape
    if present is None or not cached.is_graph_output() or present.is_graph_output() or shape is None \
            or query is None or len(shape) != 4 or len(query) != 3 or not isinstance(query[2], int):
        return
    heads, kv_heads = attention.attributes.get_int("num_heads"), attention.attributes.get_int("kv_num_heads")
    expected = [query[0], kv_heads, query[1], query[2] // heads]  # GroupQueryAttention's present_key, no past
    if not all(same_dim(a, b) for a, b in zip(shape, expected)):
        return
    name = cached.name
    for index, output in enumerate(graph.outputs):
        if output is cached:
            graph.outputs[index] = present
    cached.name, present.name = f"{name}_unused" if name else None, name
    present.type, present.shape = cached.type, shape


def _refusal(q: _Rotation | None, k: _Rotation | None) -> str | None:
    """Why the rule does not apply to this attention's rotations, or None."""
    if q is None or k is None:
        return f"only the {'key' if q is None else 'query'} is rotated"
    for name, mine, theirs in (("cos", q.cos, k.cos), ("sin", q.sin, k.sin)):
        same = mine is theirs or (constant(mine) is not None and constant(theirs) is not None
                                  and np.array_equal(constant(mine), constant(theirs)))
        if not same:
            return f"query and key are rotated by different {name} tables"
    for name, table in (("cos", q.cos), ("sin", q.sin)):
        reason = _table_refusal(name, table, q.x)
        if reason is not None:
            return reason
    return None


def _table_refusal(name: str, table: ir.Value, x: ir.Value) -> str | None:
    """Why ``table`` is not one GroupQueryAttention can read for ``x`` [B, N, S, H] (one row per position,
    its second half its first), or None."""
    array = constant(table)
    shape = list(array.shape) if array is not None else None if table.shape is None else list(table.shape)
    length, head = (x.shape[2], x.shape[3]) if x.shape is not None and len(x.shape) == 4 else (None, None)
    if shape is None or not isinstance(head, int):
        return "the table's shape or the head size is not known at export time"
    if head % 16:
        return f"head size {head} is not a multiple of 16 (GroupQueryAttention rotates only those)"
    if len(shape) < 2 or any(d != 1 for d in shape[:-2]):
        return f"the {name} table {shape_text(shape)} differs across the batch or the heads"
    if shape[-1] != head or not same_dim(shape[-2], length):
        return (f"the {name} table {shape_text(shape)} does not hold one row of {head} per position of the sequence "
                f"({length})")
    if array is not None:
        if not np.isfinite(array).all():
            return f"the {name} table holds a NaN or an infinity"
        if not np.array_equal(array[..., : head // 2], array[..., head // 2:]):
            return f"the {name} table's second half is not its first (not cat(freqs, freqs))"
    elif not _repeats_halves(table):
        return (f"the {name} table is computed at run time and not seen to be an elementwise function of "
                f"cat(freqs, freqs)")
    return None


def _repeats_halves(table: ir.Value) -> bool:
    """Whether ``table`` is, through elementwise ops (cos, sin, casts, a product with a scalar constant) and
    unsqueezes of other axes, ``Concat(t, t)`` on its last axis: so its second half is its first."""
    value = table
    for _ in range(8):
        node = value.producer()
        if node is None:
            return False
        if is_onnx_op(node, "Concat"):
            rank = None if value.shape is None else len(value.shape)
            return (len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]
                    and node.attributes.get_int("axis", 0) in (-1, None if rank is None else rank - 1))
        if is_onnx_op(node, *ELEMENTWISE) or (is_onnx_op(node, "Mul", "Div") and len(node.inputs) == 2
                                                and _scalar(node.inputs[1])):
            value = node.inputs[0]
        elif is_onnx_op(node, "Mul") and len(node.inputs) == 2 and _scalar(node.inputs[0]):
            value = node.inputs[1]
        elif is_onnx_op(node, "Unsqueeze") and _unsqueezes_before_last(node):
            value = node.inputs[0]
        else:
            return False
    return False


def _scalar(value: ir.Value | None) -> bool:
    array = constant(value)
    return array is not None and array.size == 1


def _unsqueezes_before_last(node: ir.Node) -> bool:
    """An ``Unsqueeze`` whose new axes all come before the last axis of its output."""
    axes = constant(node.inputs[1]) if len(node.inputs) > 1 else None
    rank = None if node.outputs[0].shape is None else len(node.outputs[0].shape)
    return axes is not None and rank is not None and all(int(a) % rank != rank - 1 for a in axes.reshape(-1))


def _rotation(value: ir.Value | None) -> _Rotation | None:
    """The rotation read by an attention input: ``Reshape(Transpose(rope, [0, 2, 1, 3]))`` (the translation's
    [B, N, S, H] -> [B, S, N*H]) of ``rope = x * cos + rotate_half(x) * sin``, or of ``rope``'s heads
    repeated first (transformers' ``repeat_kv``: ``Reshape(Expand(Unsqueeze(rope, [2])))`` back to [B, N, S,
    H]); else None. Both move whole rows of H and keep each row's position, so they commute with the rotation."""
    heads = flattened_heads(value)
    add = producer(_through_head_repeat(heads), "Add") if heads is not None else None
    if add is None or len(add.inputs) != 2:
        return None
    for first in (0, 1):
        straight, turned = (producer(add.inputs[i], "Mul") for i in (first, 1 - first))
        if straight is None or turned is None:
            continue
        for x_at in (0, 1):
            x, cos = straight.inputs[x_at], straight.inputs[1 - x_at]
            for half_at in (0, 1):
                sin = turned.inputs[1 - half_at]
                if cos is not None and sin is not None and _rotates_half(turned.inputs[half_at], x):
                    return _Rotation(x, cos, sin, add.outputs[0])
    return None


def _through_head_repeat(value: ir.Value | None) -> ir.Value | None:
    """The tensor whose heads ``value`` repeats (``Reshape(Expand(Unsqueeze(t, [2])))`` to a [B, N, S, H]
    with t's S and H), else ``value`` itself."""
    reshape = producer(value, "Reshape")
    expand = producer(reshape.inputs[0], "Expand") if reshape is not None else None
    unsqueeze = producer(expand.inputs[0], "Unsqueeze") if expand is not None else None
    if unsqueeze is None or len(unsqueeze.inputs) < 2:
        return value
    axes, t = constant(unsqueeze.inputs[1]), unsqueeze.inputs[0]
    if axes is None or axes.reshape(-1).tolist() != [2] or t is None or t.shape is None or value.shape is None:
        return value
    if len(t.shape) != 4 or len(value.shape) != 4 or any(
            not same_dim(a, b) for a, b in zip(t.shape[2:], value.shape[2:])):
        return value
    return t


def _rotates_half(value: ir.Value | None, x: ir.Value | None) -> bool:
    """Whether ``value`` is ``Concat(Neg(x[..., h:]), x[..., :h], axis=-1)`` with h half of x's last dim."""
    concat = producer(value, "Concat")
    if concat is None or len(concat.inputs) != 2 or x is None or x.shape is None or len(x.shape) != 4:
        return False
    width = x.shape[3]
    if not isinstance(width, int) or concat.attributes.get_int("axis", 0) not in (-1, 3):
        return False
    negated = producer(concat.inputs[0], "Neg")
    return negated is not None and _slice_of(negated.inputs[0], x, width // 2, width, width) and _slice_of(
        concat.inputs[1], x, 0, width // 2, width)


def _slice_of(value: ir.Value | None, x: ir.Value, start: int, end: int, width: int) -> bool:
    """Whether ``value`` is ``x[..., start:end]`` (a ``Slice`` of the last axis, ``width`` wide, step 1,
    constant bounds; an end past the last column counts as the last)."""
    node = producer(value, "Slice")
    if node is None or node.inputs[0] is not x or len(node.inputs) < 4:
        return False
    starts, ends, axes = (constant(node.inputs[i]) for i in (1, 2, 3))
    steps = constant(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else np.array([1])
    if any(a is None or a.size != 1 for a in (starts, ends, axes, steps)):
        return False
    stop = int(ends.item())
    return (int(axes.item()) in (-1, 3) and int(steps.item()) == 1 and int(starts.item()) == start
            and (stop == end or (end == width and stop > width)))


def _unrotated(graph: ir.Graph, value: ir.Value, rotation: _Rotation) -> ir.Value:
    """The attention input ``value`` (see :func:`_rotation`) rebuilt on the un-rotated tensor: its layout ops
    copied, from the rotation's output to ``value``, reading ``rotation.x`` in place of the rotation. The
    ``Shape`` nodes that read ``value`` read the copy (same shape), so the rotation is not kept for them."""
    chain, node = [], value.producer()
    while node is not None and rotation.rotated not in node.inputs:
        chain.append(node)
        node = node.inputs[0].producer()
    chain.append(node)
    previous, source, copies = rotation.rotated, rotation.x, []
    for original in reversed(chain):
        inputs = [source if v is previous else v for v in original.inputs]
        copies.append(ir.Node("", original.op_type, inputs, attributes=list(original.attributes.values())))
        previous, source = original.outputs[0], copies[-1].outputs[0]
    source.name, source.type, source.shape = f"{value.name}_unrotated", value.type, value.shape
    graph.insert_after(value.producer(), copies)  # before the readers of value's shape
    move_shape_reads(value, source)
    return source


def _guard_reads_unrotated(rotation: _Rotation) -> None:
    """Point the attention rewrite's NaN-row guard (``Mul(rotated, 0)``) at the un-rotated tensor."""
    for user, index in list(rotation.rotated.uses()):
        other = user.inputs[1 - index] if is_onnx_op(user, "Mul") and len(user.inputs) == 2 else None
        zero = constant(other)
        if zero is not None and zero.size == 1 and float(zero.item()) == 0.0:
            user.replace_input_with(index, rotation.x)


def _cache(graph: ir.Graph, before: ir.Node, caches: dict, table: ir.Value, name: str) -> ir.Value:
    """GroupQueryAttention's [positions, H / 2] table for a rule's ``table`` [1, ..., S, H]: its first half,
    an initializer when it is a constant, else computed before the attention ``before``. One per table: the
    layers of a model share theirs."""
    array = constant(table)
    key = ("constant", array.shape, array.tobytes()) if array is not None else ("value", id(table))
    if key in caches:
        return caches[key]
    half = (array.shape[-1] if array is not None else table.shape[-1]) // 2
    if array is not None:
        cache = constant_value(f"{name}_{len(caches)}", np.ascontiguousarray(array.reshape(-1, 2 * half)[:, :half]))
        graph.register_initializer(cache)
    else:
        bounds = [constant_value(f"{name}_{len(caches)}_{what}", np.array(numbers, np.int64))
                  for what, numbers in (("start", [0]), ("end", [half]), ("axis", [-1]), ("shape", [-1, half]))]
        for bound in bounds:
            graph.register_initializer(bound)
        first = ir.Node("", "Slice", [table, *bounds[:3]])
        flat = ir.Node("", "Reshape", [first.outputs[0], bounds[3]], outputs=[ir.Value(
            name=f"{name}_{len(caches)}", type=table.type, shape=ir.Shape([None, half]))])
        graph.insert_before(before, [first, flat])
        cache = flat.outputs[0]
    caches[key] = cache
    return cache


# ---------------------------------------------------------------------------------------------------- probe

@functools.cache
def group_query_attention_rotates() -> bool:
    """Whether the installed ONNX Runtime's CPU ``GroupQueryAttention`` with ``do_rotary`` answers as the same
    attention given q and k rotated the rule's way beforehand: probed once per process on a small model.

    Example:
        >>> group_query_attention_rotates()  # ONNX Runtime 1.31
        True
    """
    try:
        return _rotates_as_eager()
    except Exception:  # noqa: BLE001 - an ONNX Runtime that cannot run the probe keeps the rotations
        return False


def _rotary_attention_graph(cos: np.ndarray, sin: np.ndarray, heads: int = 2, kv_heads: int = 1) -> ir.Graph:
    """Causal GroupQueryAttention of q [1, heads, S, H], k and v [1, kv_heads, S, H] (graph inputs), q and k
    rotated the rule's way by ``cos``/``sin`` [S, H], as the translation writes it."""
    length, head = cos.shape
    shared = {"cos": constant_value("cos", cos[None, None]), "sin": constant_value("sin", sin[None, None]),
              "flat": constant_value("flat", np.array([0, 0, -1], np.int64)),
              "axis": constant_value("axis", np.array([-1], np.int64))}
    halves = [constant_value(f"bound{i}", np.array([b], np.int64)) for i, b in enumerate((0, head // 2, head))]
    nodes, inputs = [], []

    def rope_flat(name, n):
        x = float_value(name, [1, n, length, head])
        inputs.append(x)
        low = ir.Node("", "Slice", [x, halves[0], halves[1], shared["axis"]])
        high = ir.Node("", "Slice", [x, halves[1], halves[2], shared["axis"]])
        neg = ir.Node("", "Neg", high.outputs)
        turned = ir.Node("", "Concat", [neg.outputs[0], low.outputs[0]], attributes=[ir.AttrInt64("axis", -1)])
        straight = ir.Node("", "Mul", [x, shared["cos"]])
        turned_sin = ir.Node("", "Mul", [turned.outputs[0], shared["sin"]])
        add = ir.Node("", "Add", [straight.outputs[0], turned_sin.outputs[0]],
                      outputs=[float_value(f"{name}_rotated", [1, n, length, head])])
        nodes.extend([low, high, neg, turned, straight, turned_sin, add])
        return flat_of(add.outputs[0], n)

    def flat_of(x, n):
        transpose = ir.Node("", "Transpose", [x], attributes=[ir.AttrInt64s("perm", [0, 2, 1, 3])])
        reshape = ir.Node("", "Reshape", [transpose.outputs[0], shared["flat"]],
                          outputs=[float_value(f"{x.name}_flat", [1, length, n * head])])
        nodes.extend([transpose, reshape])
        return reshape.outputs[0]

    query, key = rope_flat("q", heads), rope_flat("k", kv_heads)
    v = float_value("v", [1, kv_heads, length, head])
    inputs.append(v)
    seqlens = constant_value("seqlens_k", np.array([length - 1], np.int32))
    total = constant_value("total", np.array(length, np.int32))
    output = float_value("y", [1, length, heads * head])
    nodes.append(ir.Node(_MSFT, "GroupQueryAttention", [query, key, flat_of(v, kv_heads), None, None, seqlens, total],
                         attributes=[ir.AttrInt64("num_heads", heads), ir.AttrInt64("kv_num_heads", kv_heads)],
                         outputs=[output, float_value("present_k", [1, kv_heads, length, head]),
                                  float_value("present_v", [1, kv_heads, length, head])], name="attention"))
    graph = ir.Graph(inputs, [output], nodes=nodes, opset_imports={"": 20, _MSFT: 1}, name="rotary_attention")
    for number in [*shared.values(), *halves, seqlens, total]:
        graph.register_initializer(number)
    return graph


def _rotates_as_eager() -> bool:
    """Run the probe's attention with and without the rule on random q, k, v; compare."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    length, head = 6, 16
    angles = np.arange(length)[:, None] * (10000.0 ** (-np.arange(head // 2) / (head // 2)))[None]
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    feeds = {name: rng.standard_normal((1, n, length, head)).astype(np.float32) for name, n in (("q", 2), ("k", 1),
                                                                                               ("v", 1))}
    answers = []
    for fused in (False, True):
        graph = _rotary_attention_graph(cos, sin)
        if fused and fuse_rotary_embeddings(graph, rotates=True)[0] != 1:
            return False
        model = ir.serde.serialize_model(ir.Model(graph, ir_version=10))
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        answers.append(session.run(None, feeds)[0])
    return bool(np.allclose(answers[0], answers[1], rtol=1e-5, atol=1e-5))
