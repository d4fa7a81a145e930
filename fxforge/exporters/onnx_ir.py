"""The questions the exporters' ONNX IR passes ask of nodes and values (is this a standard ONNX op, what made
this value, is it a constant, is its shape known, which axes does this reduction take), and of the installed
ONNX Runtime (what its optimizer makes of a model: the probes behind rules that only pay where ORT fuses).

Example:
    >>> from onnxscript import ir
    >>> x = ir.Value(name="x", shape=ir.Shape([2, 3]))
    >>> relu = ir.Node("", "Relu", [x], outputs=[ir.Value(name="y", shape=ir.Shape([2, 3]))])
    >>> is_onnx_op(relu, "Relu", "Sigmoid"), producer(relu.outputs[0], "Relu") is relu, static_shape(x)
    (True, True, [2, 3])
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
from onnxscript import ir

ONNX_DOMAINS = ("", "ai.onnx")


def is_onnx_op(node: ir.Node | None, *op_types: str) -> bool:
    """Whether ``node`` is one of the standard-domain ops ``op_types`` (False for None).

    Example:
        >>> is_onnx_op(ir.Node("com.microsoft", "Gelu", []), "Gelu"), is_onnx_op(None, "Gelu")
        (False, False)
    """
    return node is not None and node.domain in ONNX_DOMAINS and node.op_type in op_types


def producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    """The node that computes ``value`` when it is one of the standard ops ``op_types``, else None.

    Example:
        >>> producer(ir.Value(name="graph_input"), "Relu") is None
        True
    """
    node = None if value is None else value.producer()
    return node if is_onnx_op(node, *op_types) else None


def constant(value: ir.Value | None) -> np.ndarray | None:
    """``value``'s array when it is a constant (an initializer or a ``Constant`` node's output), else None.

    Example:
        >>> constant(ir.Value(name="c", const_value=ir.tensor(np.array([1, 2])))).tolist()
        [1, 2]
    """
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def float_value(name: str, shape: list | None = None) -> ir.Value:
    """A float32 value named ``name`` of ``shape`` (None: unknown), for the graphs the probes and tests build.

    Example:
        >>> float_value("x", [2, 3]).shape
        Shape([2, 3])
    """
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=None if shape is None else ir.Shape(shape))


def constant_value(name: str, array: np.ndarray) -> ir.Value:
    """A value named ``name`` holding ``array`` (register it as an initializer of the graph that reads it).

    Example:
        >>> constant(constant_value("two", np.array(2.0, np.float32))).item()
        2.0
    """
    return ir.Value(name=name, const_value=ir.tensor(np.asarray(array)))


def register_constant(graph: ir.Graph, name: str, array) -> ir.Value:
    """A new initializer of ``graph`` holding ``array`` (an array as it is; a list or tuple of ints, such as a
    shape, as int64), named ``name`` or, where that name is taken, ``name`` with underscores appended.

    Example:
        >>> graph = ir.Graph([], [], nodes=[])
        >>> [register_constant(graph, "k", [1, 2]).name for _ in range(2)]
        ['k', 'k_']
    """
    while name in graph.initializers:
        name += "_"
    array = np.asarray(array, dtype=None if isinstance(array, np.ndarray) else np.int64)
    value = constant_value(name, np.ascontiguousarray(array))
    graph.register_initializer(value)
    return value


def static_shape(value: ir.Value | None) -> list[int] | None:
    """``value``'s shape as ints when every dim is known at export time, else None.

    Example:
        >>> static_shape(ir.Value(name="v", shape=ir.Shape(["batch", 3]))) is None
        True
    """
    if value is None or value.shape is None or not value.shape.is_static():
        return None
    return [int(d) for d in value.shape]


def columns_slice(graph: ir.Graph, value: ir.Value, begin: int, end: int, like: ir.Value, name: str) -> ir.Node:
    """A ``Slice`` of ``value``'s last axis, ``begin:end``, whose output is named ``name`` and typed and shaped
    like ``like`` (the value it stands for); its bounds are new initializers of ``graph``, the node is left for
    the caller to insert.

    Example:
        >>> graph = ir.Graph([], [], nodes=[])
        >>> piece = columns_slice(graph, float_value("p", [2, 6]), 1, 3, float_value("q", [2, 2]), "q_columns")
        >>> piece.op_type, [constant(v).tolist() for v in piece.inputs[1:]], piece.outputs[0].shape
        ('Slice', [[1], [3], [-1]], Shape([2, 2]))
    """
    bounds = [register_constant(graph, f"{name}_{what}", [n]) for what, n in (("start", begin), ("end", end),
                                                                               ("axis", -1))]
    return ir.Node("", "Slice", [value, *bounds], outputs=[ir.Value(name=name, type=like.type, shape=like.shape)])


def slice_ranges(node: ir.Node, shape: list[int]) -> list[tuple[int, int, int]] | None:
    """What a unit-step ``Slice`` of a value of static ``shape`` keeps: ``(axis, begin, stop)`` per axis it
    names (axes counted from 0), or None where its bounds are not constants or a step is not 1.

    Example:
        >>> starts, ends, axes = (constant_value(n, np.array(v)) for n, v in (("s", [1]), ("e", [-1]), ("a", [-1])))
        >>> slice_ranges(ir.Node("", "Slice", [ir.Value(name="x"), starts, ends, axes]), [2, 6])
        [(1, 1, 5)]
    """
    bounds = [constant(v) if v is not None else None for v in node.inputs[1:]]
    if len(bounds) < 2 or bounds[0] is None or bounds[1] is None or any(
            v is not None and b is None for v, b in zip(node.inputs[3:], bounds[2:])):
        return None
    if len(bounds) > 3 and bounds[3] is not None and np.any(bounds[3] != 1):
        return None
    starts, ends = bounds[0].reshape(-1).tolist(), bounds[1].reshape(-1).tolist()
    axes = bounds[2].reshape(-1).tolist() if len(bounds) > 2 and bounds[2] is not None else list(range(len(starts)))
    ranges = []
    for axis, start, end in zip(axes, starts, ends):
        axis %= len(shape)
        kept = range(shape[axis])[slice(start, end)]
        ranges.append((axis, kept.start, kept.stop))
    return ranges


def same_dim(a: object, b: object) -> bool:
    """Whether two dims of value shapes are known to be equal: the same int, or the same named dim.

    Example:
        >>> x = ir.Value(name="x", shape=ir.Shape(["batch", 3]))
        >>> same_dim(x.shape[0], ir.Shape(["batch"])[0]), same_dim(x.shape[1], 3), same_dim(x.shape[0], 3)
        (True, True, False)
    """
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    name = getattr(a, "value", None)  # an ir.SymbolicDim's name (None: unknown, equal to nothing)
    return name is not None and name == getattr(b, "value", None)


def shape_text(shape) -> str:
    """A shape as the exporters' reasons write it: ``[batch, 3]``.

    Example:
        >>> shape_text(ir.Shape(["batch", 3]))
        '[batch, 3]'
    """
    return "[" + ", ".join(str(d) for d in shape) + "]"


def flattened_heads(value: ir.Value | None) -> ir.Value | None:
    """The [B, N, S, H] tensor an attention input ``value`` flattens to [B, S, N*H] in the form the
    translations write (``Reshape(Transpose(t, [0, 2, 1, 3]))``), else None.

    Example:
        >>> t = ir.Value(name="t")
        >>> moved = ir.Node("", "Transpose", [t], attributes=[ir.AttrInt64s("perm", [0, 2, 1, 3])])
        >>> flat = ir.Node("", "Reshape", [moved.outputs[0], ir.Value(name="shape")])
        >>> flattened_heads(flat.outputs[0]) is t
        True
    """
    reshape = producer(value, "Reshape")
    transpose = producer(reshape.inputs[0], "Transpose") if reshape is not None else None
    if transpose is None or list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    return transpose.inputs[0]


def move_shape_reads(old: ir.Value, new: ir.Value) -> None:
    """Point the ``Shape`` nodes that read ``old`` at ``new`` (a value of the same shape that replaces it as an
    attention's input: the translations read the sequence length off the query).

    Example:
        >>> old, new = ir.Value(name="old"), ir.Value(name="new")
        >>> shape = ir.Node("", "Shape", [old])
        >>> move_shape_reads(old, new); shape.inputs[0].name
        'new'
    """
    for user, index in list(old.uses()):
        if is_onnx_op(user, "Shape"):
            user.replace_input_with(index, new)


def reduce_axes(node: ir.Node) -> np.ndarray | None:
    """The axes of a reduction ``node``: its constant ``axes`` input (opset 18+), else its ``axes``
    attribute; None where they are computed at run time or not given.

    Example:
        >>> axes = ir.Value(name="axes", const_value=ir.tensor(np.array([2, 3])))
        >>> reduce_axes(ir.Node("", "ReduceMean", [ir.Value(name="x"), axes])).tolist()
        [2, 3]
    """
    if len(node.inputs) > 1:
        return constant(node.inputs[1])
    listed = node.attributes.get_ints("axes")
    return None if listed is None else np.array(listed)


def onnxruntime_optimized(model: bytes | str) -> onnx.GraphProto:
    """The graph the installed ONNX Runtime's CPU provider runs for ``model`` (serialized bytes or a path),
    after its optimizers (default level), as the file it writes with ``optimized_model_filepath``.

    Example:
        >>> from onnx import helper, TensorProto
        >>> io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "xy"]
        >>> graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", io[:1], io[1:])
        >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
        >>> [node.op_type for node in onnxruntime_optimized(model.SerializeToString()).node]
        ['Relu']
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3  # ORT warns that a file with its NCHWc layout is specific to this machine
    with tempfile.TemporaryDirectory(prefix="fxforge-probe-") as directory:
        options.optimized_model_filepath = os.path.join(directory, "optimized.onnx")
        ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        return onnx.load(options.optimized_model_filepath).graph
