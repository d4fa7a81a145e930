"""The questions the exporters' ONNX IR passes ask of nodes and values: is this a standard ONNX op, what made
this value, is it a constant, is its shape known.

Example:
    >>> from onnxscript import ir
    >>> x = ir.Value(name="x", shape=ir.Shape([2, 3]))
    >>> relu = ir.Node("", "Relu", [x], outputs=[ir.Value(name="y", shape=ir.Shape([2, 3]))])
    >>> is_onnx_op(relu, "Relu", "Sigmoid"), producer(relu.outputs[0], "Relu") is relu, static_shape(x)
    (True, True, [2, 3])
"""

from __future__ import annotations

import numpy as np
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


def static_shape(value: ir.Value | None) -> list[int] | None:
    """``value``'s shape as ints when every dim is known at export time, else None.

    Example:
        >>> static_shape(ir.Value(name="v", shape=ir.Shape(["batch", 3]))) is None
        True
    """
    if value is None or value.shape is None or not value.shape.is_static():
        return None
    return [int(d) for d in value.shape]
