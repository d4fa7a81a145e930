"""Guards the attention rewrite adds for torch's SDPA, dropped from an ONNX graph where ONNX Runtime's kernel
already gives eager's value.

The attention rewrite (:mod:`fxforge.rewrites.attention`) patches two places where torch's fused CPU SDPA
differs from eager: a query row holding a NaN or an infinity (eager: NaN, SDPA: 0), written
``where(isnan(sum(q * 0, -1)), NaN, out)``, and a row an additive mask hides with ``-inf`` everywhere
(eager: NaN), written ``where(all(mask == -inf, -1), NaN, out)``. An export for ONNX Runtime translates
that SDPA into ``com.microsoft.MultiHeadAttention``, whose CPU kernel gives NaN in both rows itself, so the
guards only cost passes over q and the output: in torchvision's swin_t the 24 ``Where`` and their
``Mul``/``ReduceSum``/``IsNaN`` took 3.1 of 54 ms under ORT's profiler.

The rules, each exact:

- **A NaN-row guard on a MultiHeadAttention is dropped**: ``Where(IsNaN(ReduceSum(Mul(q, 0), [-1])), NaN,
  y)`` where ``y`` is that attention's output (through layout ops, an ``If`` whose branches all run
  MultiHeadAttention, or another ``Where`` that writes NaN) and ``q`` is its query (through layout ops).
  Only when :func:`multi_head_attention_keeps_nan_rows` finds that the installed ONNX Runtime gives NaN in
  those rows (with and without ``attention_bias``, short and long sequences); ``GroupQueryAttention``'s
  CPU kernel does not (it answers a number), so its guards stay.
- **A ``Where`` whose condition is a constant, all False (all True) becomes its other (first) value** when
  that value has the output's shape: the ``-inf`` row guard of a mask computed from weights and shapes
  (swin's relative position bias plus its shifted-window mask) is a constant, and ORT still runs the
  ``Where``. The exporter's optimizer leaves masks built by ``ConstantOfShape`` and ``ScatterND`` (swin's
  ``new_zeros`` and slice assignments) unfolded; :func:`fold_mask_constants` folds them first.

Example:
    >>> from onnxscript import ir
    >>> import numpy as np
    >>> y = ir.Value(name="y", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    >>> never = ir.Value(name="never", const_value=ir.tensor(np.zeros((2, 1), dtype=bool)))
    >>> nan = ir.Value(name="nan", const_value=ir.tensor(np.array(np.nan, dtype=np.float32)))
    >>> where = ir.Node("", "Where", [never, nan, y], outputs=[ir.Value(name="w", shape=ir.Shape([2, 3]))])
    >>> out = ir.Node("", "Relu", [where.outputs[0]], outputs=[ir.Value(name="o")])
    >>> graph = ir.Graph([y], out.outputs, nodes=[where, out], initializers=[never, nan])
    >>> drop_attention_guards(graph)
    {'constant Where condition': 1}
    >>> out.inputs[0].name
    'y'
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
from onnxscript import ir

from fxforge.exporters.onnx_ir import constant, is_onnx_op, producer, static_shape

LAYOUT_OPS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity"})
NAN_GUARD = "NaN-row guard of a MultiHeadAttention (ORT's kernel gives NaN there itself)"
CONSTANT_WHERE = "constant Where condition"


def drop_attention_guards(graph: ir.Graph, *, nan_rows_kept: bool | None = None) -> dict[str, int]:
    """Drop the guards of the module's rules from ``graph`` (subgraphs included); returns how many of each.
    ``nan_rows_kept`` says whether ORT's MultiHeadAttention gives NaN in NaN query rows (default: probe the
    installed ONNX Runtime once, :func:`multi_head_attention_keeps_nan_rows`).

    Example:
        >>> drop_attention_guards(ir.Graph([], [], nodes=[]))
        {}
    """
    dropped: Counter[str] = Counter()
    for node in list(ir.traversal.RecursiveGraphIterator(graph)):
        if not is_onnx_op(node, "Where") or len(node.inputs) != 3:
            continue
        out = node.outputs[0]
        if out.is_graph_output() or node.graph is None:
            continue
        kept = _constant_choice(node)
        why = CONSTANT_WHERE
        if kept is None and _is_nan_row_guard(node):
            if nan_rows_kept is None:
                nan_rows_kept = multi_head_attention_keeps_nan_rows()
            kept, why = (node.inputs[2] if nan_rows_kept else None), NAN_GUARD
        if kept is None:
            continue
        out.replace_all_uses_with(kept)
        node.graph.remove(node, safe=True)
        dropped[why] += 1
    return dict(dropped)


def _same_shape(value: ir.Value | None, out: ir.Value) -> bool:
    shape = static_shape(value)
    return shape is not None and shape == static_shape(out)


def _constant_choice(where: ir.Node) -> ir.Value | None:
    """The value a Where with a constant, uniform condition always picks, where it has the output's shape."""
    condition = constant(where.inputs[0])
    if condition is None or condition.dtype != np.bool_ or condition.size == 0:
        return None
    picked = where.inputs[1] if condition.all() else where.inputs[2] if not condition.any() else None
    return picked if _same_shape(picked, where.outputs[0]) else None


def _is_nan_scalar(value: ir.Value | None) -> bool:
    array = constant(value)
    return array is not None and array.size == 1 and bool(np.isnan(array).all())


def _is_nan_row_guard(where: ir.Node) -> bool:
    """``Where(IsNaN(ReduceSum(Mul(q, 0), [-1], keepdims=1)), NaN, y)`` with ``y`` the output of
    MultiHeadAttention calls whose query is ``q`` (through layout ops)."""
    condition, fill, guarded = where.inputs
    if not _is_nan_scalar(fill):
        return False
    isnan = producer(condition, "IsNaN")
    reduce = producer(isnan.inputs[0], "ReduceSum") if isnan is not None else None
    if reduce is None or len(reduce.inputs) < 2 or reduce.attributes.get_int("keepdims", 1) != 1:
        return False
    axes, rows = constant(reduce.inputs[1]), reduce.inputs[0]
    rank = None if rows is None or rows.shape is None else len(rows.shape)
    if axes is None or axes.size != 1 or rank is None or int(axes.reshape(-1)[0]) not in (-1, rank - 1):
        return False
    mul = producer(rows, "Mul")
    if mul is None:
        return False
    zeros = [i for i, operand in enumerate(mul.inputs) if (c := constant(operand)) is not None and c.size == 1
             and float(c.reshape(-1)[0]) == 0.0]
    if len(zeros) != 1:
        return False
    q = mul.inputs[1 - zeros[0]]
    attentions = _attentions_behind(guarded)
    return bool(attentions) and all(q in _layout_sources(a.inputs[0]) for a in attentions)


def _attentions_behind(value: ir.Value | None) -> list[ir.Node] | None:
    """The MultiHeadAttention nodes ``value`` is the output of (through layout ops, NaN-writing Wheres and
    ``If`` branches), or None where it is anything else."""
    node = None if value is None else value.producer()
    if node is None:
        return None
    if node.domain == "com.microsoft" and node.op_type == "MultiHeadAttention":
        return [node]
    if not is_onnx_op(node, *LAYOUT_OPS, "Where", "If"):
        return None
    if node.op_type in LAYOUT_OPS:
        return _attentions_behind(node.inputs[0])
    if node.op_type == "Where" and _is_nan_scalar(node.inputs[1]):
        return _attentions_behind(node.inputs[2])
    if node.op_type == "If":
        index = node.outputs.index(value)
        found: list[ir.Node] = []
        for attribute in ("then_branch", "else_branch"):
            branch = node.attributes.get_graph(attribute)
            behind = None if branch is None else _attentions_behind(branch.outputs[index])
            if not behind:
                return None
            found += behind
        return found
    return None


def _layout_sources(value: ir.Value | None) -> set[ir.Value]:
    """``value`` and what it was computed from by layout ops alone."""
    seen: set[ir.Value] = set()
    while value is not None and value not in seen:
        seen.add(value)
        node = value.producer()
        value = node.inputs[0] if is_onnx_op(node, *LAYOUT_OPS) else None
    return seen


MASK_FOLD_LIMIT = 1 << 18  # elements (1 MiB of float32): the largest constant mask folded into the file


def fold_mask_constants(model: ir.Model) -> None:
    """Fold what ``model`` computes from constants alone, ``ConstantOfShape`` and ``ScatterND`` included (the
    exporter's optimizer leaves those), for tensors of up to :data:`MASK_FOLD_LIMIT` elements: a mask built
    from shapes becomes an initializer, and the guards on it constants :func:`drop_attention_guards` can
    drop. ONNX Runtime folds the same nodes when it loads the file, so nothing else changes.

    Example:
        >>> fold_mask_constants(ir.Model(ir.Graph([], [], nodes=[], opset_imports={"": 20}), ir_version=10))
    """
    from onnxscript.optimizer import fold_constants

    def should_fold(node: ir.Node) -> bool | None:
        if not is_onnx_op(node, "ConstantOfShape", "ScatterND"):
            return None
        shape = constant(node.inputs[0]) if node.op_type == "ConstantOfShape" else static_shape(node.outputs[0])
        size = None if shape is None else int(np.prod(shape))
        return True if size is not None and size <= MASK_FOLD_LIMIT else None

    fold_constants(model, input_size_limit=MASK_FOLD_LIMIT, output_size_limit=MASK_FOLD_LIMIT, should_fold=should_fold)


@functools.cache
def multi_head_attention_keeps_nan_rows() -> bool:
    """Whether the installed ONNX Runtime's CPU ``MultiHeadAttention`` gives NaN in every query row holding a
    NaN or an infinity and in every row an ``attention_bias`` of ``-inf`` hides entirely, as eager attention
    does: probed once per process on small models (with a bias, 6 keys; without, 520 keys: its flash path;
    ``unidirectional``, 6 keys).

    Example:
        >>> multi_head_attention_keeps_nan_rows()  # ONNX Runtime 1.31
        True
    """
    try:
        return all(_probe(length, bias, causal) for length, bias, causal in ((6, True, False), (520, False, False),
                                                                            (6, False, True)))
    except Exception:  # noqa: BLE001 - an ONNX Runtime that cannot run the probe keeps every guard
        return False


def _probe(length: int, bias: bool, causal: bool) -> bool:
    """One MultiHeadAttention session of the probe's configuration, run with a NaN, +inf and -inf in a query row."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    heads, size = 2, 8
    names = ["q", "k", "v", "b"] if bias else ["q", "k", "v"]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in names]
    node = helper.make_node("MultiHeadAttention", names[:3] + (["", "", "b"] if bias else []), ["o"],
                            domain="com.microsoft", num_heads=heads, scale=0.25, unidirectional=int(causal))
    graph = helper.make_graph([node], "probe", inputs, [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 20),
                                                                    helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((1, length, heads * size)).astype(np.float32) for name in ("q", "k", "v")}
    if bias:
        feeds["b"] = rng.standard_normal((1, heads, length, length)).astype(np.float32)
        feeds["b"][0, 1, 4, :] = -np.inf  # row 4 of head 1: every key hidden
    expected = {(0, 2, 0)} | ({(0, 4, 1)} if bias else set())
    for bad in (np.nan, np.inf, -np.inf):
        feeds["q"][0, 2, 3] = bad  # query row 2 of head 0
        out = session.run(None, feeds)[0].reshape(1, length, heads, size)
        nan_rows = np.isnan(out).all(-1)
        if {tuple(row) for row in np.argwhere(nan_rows)} != expected or np.isnan(out[~nan_rows]).any():
            return False
    return True
