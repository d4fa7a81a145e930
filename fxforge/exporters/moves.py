"""What data-movement ops do to the elements of a tensor, replayed on arrays of element indices.

A chain of ``Reshape``, ``Transpose``, ``Slice``, ``Concat``, ``Gather``... with constant operands moves the
elements of its source without computing anything: replaying it with numpy on ``arange(source.size)``
shaped like the source gives, for each element of the result, the index of the source element it holds.
The passes that read such results (:mod:`~fxforge.exporters.qkv_slices`, :mod:`~fxforge.exporters.gathers`)
then ask what the whole chain is (a slice, one gather of rows) instead of matching the chain's ops against
a pattern.

Example:
    >>> from onnxscript import ir
    >>> t = ir.Node("", "Transpose", [ir.Value(name="x")], attributes=[ir.AttrInt64s("perm", [1, 0])])
    >>> replay(t, 0, [np.arange(6).reshape(2, 3)]).tolist()
    [[0, 3], [1, 4], [2, 5]]
"""

from __future__ import annotations

import numpy as np
from onnxscript import ir

from fxforge.exporters.onnx_ir import constant, is_onnx_op

MOVES = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Gather", "Split", "Slice",
         "Concat", "Pad")
COPIES = ("Transpose", "Gather", "Split", "Slice", "Concat", "Pad")  # what ORT runs as a copy of the data
REPLAY_LIMIT = 2**22  # elements of a source replayed as int64 indices (32 MiB)


def data_inputs(node: ir.Node) -> list[int]:
    """The positions of ``node``'s inputs that carry the moved data (the others are its constant operands).

    Example:
        >>> data_inputs(ir.Node("", "Concat", [ir.Value(name="a"), ir.Value(name="b")]))
        [0, 1]
    """
    return list(range(len(node.inputs))) if node.op_type == "Concat" else [0]


def is_move(node: ir.Node | None) -> bool:
    """Whether ``node`` is a data-movement op whose operands other than the moved data are constants.

    Example:
        >>> is_move(ir.Node("", "Relu", [ir.Value(name="x")]))
        False
    """
    if not is_onnx_op(node, *MOVES):
        return False
    data = data_inputs(node)
    return all(value is None or constant(value) is not None
               for position, value in enumerate(node.inputs) if position not in data)


def replay(node: ir.Node, output: int, arrays: list[np.ndarray | None]) -> np.ndarray | None:
    """What data-movement ``node`` puts in its output ``output`` when its data inputs hold ``arrays`` (one per
    input; the constant operands' entries are ignored), or None where the form is not replayed (a Slice with
    a negative step, a Pad that adds elements).

    Example:
        >>> concat = ir.Node("", "Concat", [ir.Value(name="a"), ir.Value(name="b")], attributes=[ir.AttrInt64("axis", 0)])
        >>> replay(concat, 0, [np.array([4, 5]), np.array([0])]).tolist()
        [4, 5, 0]
    """
    operands = [constant(v) if v is not None else None for v in node.inputs[1:]]
    attribute = node.attributes
    op, array = node.op_type, arrays[0]
    if op == "Concat":
        return None if any(a is None for a in arrays) else np.concatenate(arrays, axis=attribute.get_int("axis", 0))
    if op == "Identity":
        return array
    if op == "Pad":  # only a Pad that pads nothing moves nothing
        return array if operands and operands[0] is not None and not np.any(operands[0]) else None
    if op == "Transpose":
        perm = attribute.get_ints("perm")
        return np.transpose(array, None if perm is None else list(perm))
    if op == "Flatten":
        axis = attribute.get_int("axis", 1) % (array.ndim or 1)
        return array.reshape(int(np.prod(array.shape[:axis])), -1)
    if op == "Reshape":
        if operands[0] is None:
            return None
        copies = not attribute.get_int("allowzero", 0)  # a 0 copies the input's dim, else it is a 0
        target = [array.shape[i] if d == 0 and copies else int(d) for i, d in enumerate(operands[0].reshape(-1).tolist())]
        return array.reshape(target)
    if op in ("Squeeze", "Unsqueeze"):
        axes = operands[0] if operands else None
        if axes is None:
            return np.squeeze(array) if op == "Squeeze" else None
        axes = tuple(int(a) for a in axes.reshape(-1))
        return np.squeeze(array, axis=axes) if op == "Squeeze" else np.expand_dims(array, axes)
    if op == "Gather":
        return np.take(array, operands[0], axis=attribute.get_int("axis", 0))
    if op == "Split":
        axis = attribute.get_int("axis", 0)
        count = len(node.outputs)
        sizes = operands[0] if operands and operands[0] is not None else None
        if sizes is None:
            step = -(-array.shape[axis] // count)
            sizes = [min(step, array.shape[axis] - i * step) for i in range(count)]
        return np.split(array, np.cumsum(np.asarray(sizes).reshape(-1))[:-1], axis=axis)[output]
    if op == "Slice":
        starts, ends = operands[0].reshape(-1), operands[1].reshape(-1)
        axes = operands[2].reshape(-1) if len(operands) > 2 and operands[2] is not None else range(len(starts))
        steps = operands[3].reshape(-1) if len(operands) > 3 and operands[3] is not None else [1] * len(starts)
        if any(step < 1 for step in steps):
            return None  # ONNX clamps reversed slices differently from Python
        index = [slice(None)] * array.ndim
        for axis, begin, end, step in zip(axes, starts, ends, steps):
            index[int(axis)] = slice(int(begin), int(min(end, array.shape[int(axis)])), int(step))
        return array[tuple(index)]
    return None
