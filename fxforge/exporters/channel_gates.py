"""Squeeze-and-excitation gates written in forms ONNX Runtime's CPU provider keeps in its blocked layout.

ORT's CPU provider runs convolutions in a blocked channel layout (NCHWc: channels in blocks of 8 or 16) and
keeps a tensor blocked through the ops its layout pass knows: ``GlobalAveragePool``, ``Mul`` of two tensors
of the same shape, nearest ``Resize``, activations. A squeeze-and-excitation block (EfficientNet,
MobileNetV3, RegNet) as torch exports it meets two ops it does not know: the squeeze, ``ReduceMean`` over
H and W, and the excitation, ``Mul`` of [N, C, H, W] by the gate [N, C, 1, 1]. Each converts the full
activation back to NCHW and, after the ``Mul``, into blocks again: three copies of the block's largest
tensor. In torchvision's efficientnet_b0 (16 such blocks) that was 13 % of ORT's kernel time.

The rules, on float tensors with static H and W:

- **``ReduceMean(x, axes=[2, 3], keepdims=1)`` of a 4-D x becomes ``GlobalAveragePool(x)``**: the same
  mean (ORT sums in another order: differences of a few ulps).
- **``Mul(x, g)``, with x [N, C, H, W] and the gate g [N, C, 1, 1] each computed by a ``Conv`` (through
  activations), C a multiple of 16, becomes ``Mul(x, Resize(g, scales=[1, 1, H, W], nearest))``**: the
  nearest resize is the broadcast written out (exact), and both operands of the ``Mul`` now have one shape.
  The refusals (another C, a gate not from a convolution, a gate shared across the batch) are the cases
  where ORT could not keep the product blocked, so the resize would only add a pass.

Both apply only when :func:`onnxruntime_keeps_gates_blocked` finds that the installed ONNX Runtime keeps
such a gate in its blocked layout (x86 builds do; elsewhere the rules would only add work).

Example:
    >>> from onnxscript import ir
    >>> import numpy as np
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 16, 7, 7]))
    >>> axes = ir.Value(name="axes", const_value=ir.tensor(np.array([2, 3], dtype=np.int64)))
    >>> mean = ir.Node("", "ReduceMean", [x, axes], outputs=[ir.Value(name="m", shape=ir.Shape([1, 16, 1, 1]))])
    >>> out = ir.Node("", "Relu", mean.outputs, outputs=[ir.Value(name="y")])
    >>> graph = ir.Graph([x], out.outputs, nodes=[mean, out], initializers=[axes])
    >>> keep_gates_blocked(graph, blocked=True), out.inputs[0].producer().op_type
    (({'ReduceMean over H, W -> GlobalAveragePool': 1}, []), 'GlobalAveragePool')
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
from onnxscript import ir

from fxforge.exporters.onnx_ir import (
    constant,
    constant_value,
    is_onnx_op,
    onnxruntime_optimized,
    producer,
    reduce_axes,
    shape_text,
)

SPATIAL_MEAN = "ReduceMean over H, W -> GlobalAveragePool"
CHANNEL_GATE = "Mul by an [N, C, 1, 1] gate -> Mul by its nearest Resize to [N, C, H, W]"
BLOCK = 16  # ORT's largest NCHWc block (AVX-512); a multiple of it is a multiple of every block size
ACTIVATIONS = frozenset({"Relu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Clip", "LeakyRelu",
                         "BatchNormalization"})


def keep_gates_blocked(graph: ir.Graph, *, blocked: bool | None = None) -> tuple[dict[str, int], list[str]]:
    """Apply the module's rules in ``graph`` (not in subgraphs); returns how many of each, and why each
    gate left as torch wrote it was left. ``blocked`` says whether ORT keeps the rewritten gate in its
    blocked layout (default: probe the installed ONNX Runtime once, :func:`onnxruntime_keeps_gates_blocked`);
    False changes nothing.

    Example:
        >>> keep_gates_blocked(ir.Graph([], [], nodes=[]), blocked=True)
        ({}, [])
    """
    means = [node for node in graph if _is_spatial_mean(node)]
    gates = [(node, _gate(node)) for node in graph if _looks_like_gate(node)]
    if not means and not gates:
        return {}, []
    if blocked is None:
        blocked = onnxruntime_keeps_gates_blocked()
    if not blocked:
        return {}, []
    done: Counter[str] = Counter()
    for node in means:
        old = node.outputs[0]
        new = ir.Node("", "GlobalAveragePool", [node.inputs[0]], outputs=[
            ir.Value(name=f"{old.name}_pooled", type=old.type, shape=old.shape)])
        ir.convenience.replace_nodes_and_values(graph, node, [node], [new], [old], new.outputs)
        done[SPATIAL_MEAN] += 1
    refused = []
    for node, gate in gates:
        if isinstance(gate, str):
            refused.append(gate)
            continue
        index, full = gate
        g = node.inputs[index]
        height, width = (int(d) for d in full[2:])
        scales = constant_value(f"{node.name or g.name}_gate_scales", np.array([1, 1, height, width], np.float32))
        graph.register_initializer(scales)
        resize = ir.Node("", "Resize", [g, None, scales], attributes=[
            ir.AttrString("mode", "nearest"), ir.AttrString("coordinate_transformation_mode", "asymmetric"),
            ir.AttrString("nearest_mode", "floor")],
            outputs=[ir.Value(name=f"{g.name}_spread", type=g.type, shape=full)])
        graph.insert_before(node, resize)
        node.replace_input_with(index, resize.outputs[0])
        done[CHANNEL_GATE] += 1
    return dict(done), refused


def _is_spatial_mean(node: ir.Node) -> bool:
    """``ReduceMean`` of a float 4-D tensor over axes 2 and 3, keeping them."""
    if not is_onnx_op(node, "ReduceMean") or node.attributes.get_int("keepdims", 1) != 1:
        return False
    x = node.inputs[0]
    if x is None or x.shape is None or len(x.shape) != 4 or x.dtype != ir.DataType.FLOAT:
        return False
    axes = reduce_axes(node)
    return axes is not None and sorted(int(a) % 4 for a in axes.reshape(-1)) == [2, 3]


def _looks_like_gate(node: ir.Node) -> bool:
    """A float ``Mul`` of a 4-D tensor with spatial dims by one whose spatial dims are 1 x 1."""
    if not is_onnx_op(node, "Mul") or len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return False
    shapes = [v.shape for v in node.inputs]
    if any(s is None or len(s) != 4 for s in shapes) or any(v.dtype != ir.DataType.FLOAT for v in node.inputs):
        return False
    return any(list(shapes[i][2:]) == [1, 1] and list(shapes[1 - i][2:]) != [1, 1] for i in (0, 1))


def _gate(node: ir.Node) -> tuple[int, ir.Shape] | str:
    """For a ``Mul`` that looks like a gate: which input is the gate and the shape its resize takes, or why
    the rule leaves it."""
    index = 0 if list(node.inputs[0].shape[2:]) == [1, 1] else 1
    gate, full = node.inputs[index].shape, node.inputs[1 - index].shape
    where = f"gate {shape_text(gate)} on {shape_text(full)}"
    if not all(isinstance(d, int) for d in full[1:]):
        return f"{where}: channels or H, W not known at export time"
    if full[1] % BLOCK:
        return f"{where}: {full[1]} channels, not a multiple of {BLOCK} (whole NCHWc blocks on every x86 ORT)"
    if gate[0] != full[0] or gate[1] != full[1]:
        return f"{where}: the gate is broadcast over the batch or the channels"
    if not (_from_conv(node.inputs[index]) and _from_conv(node.inputs[1 - index])):
        return f"{where}: an operand is not computed by a Conv (ORT keeps it in NCHW)"
    return index, full


def _from_conv(value: ir.Value | None, steps: int = 6) -> bool:
    """Whether ``value`` is a ``Conv`` with constant weights, through up to ``steps`` activations (SiLU as
    ``Mul(a, Sigmoid(a))`` included)."""
    for _ in range(steps):
        node = producer(value, "Conv", "Mul", *ACTIVATIONS)
        if node is None:
            return False
        if node.op_type == "Conv":
            return len(node.inputs) > 1 and constant(node.inputs[1]) is not None
        if node.op_type == "Mul":
            value = _silu_input(node)
        else:
            value = node.inputs[0]
    return False


def _silu_input(mul: ir.Node) -> ir.Value | None:
    """``a`` where ``mul`` is ``Mul(a, Sigmoid(a))`` (either order), else None."""
    if len(mul.inputs) != 2:
        return None
    for index in (0, 1):
        sigmoid = producer(mul.inputs[index], "Sigmoid")
        if sigmoid is not None and sigmoid.inputs[0] is mul.inputs[1 - index]:
            return mul.inputs[1 - index]
    return None


@functools.cache
def onnxruntime_keeps_gates_blocked() -> bool:
    """Whether the installed ONNX Runtime's CPU provider keeps a gate written by this module's rules in its
    blocked layout: probed once per process by optimizing a small squeeze-and-excitation block (16 channels,
    8x8) and looking for a layout conversion next to its ``Mul``.

    Example:
        >>> onnxruntime_keeps_gates_blocked()  # ONNX Runtime 1.31 on x86-64
        True
    """
    try:
        return _gate_stays_blocked(spread=True)
    except Exception:  # noqa: BLE001 - an ONNX Runtime that cannot run the probe keeps torch's form
        return False


def _gate_stays_blocked(spread: bool) -> bool:
    """Optimize the probe's block in the installed ORT, its gate spread by a ``Resize`` (``spread``) or
    broadcast as torch writes it, and check that the ``Mul`` reads and writes blocked tensors."""
    from onnx import TensorProto, helper, numpy_helper

    channels, size = BLOCK, 8
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((channels, channels, 1, 1)).astype(np.float32), f"w{i}")
               for i in range(3)]
    scales = numpy_helper.from_array(np.array([1, 1, size, size], dtype=np.float32), "scales")
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"]),
             helper.make_node("GlobalAveragePool", ["a"], ["m"]),
             helper.make_node("Conv", ["m", "w1"], ["s"]),
             helper.make_node("Sigmoid", ["s"], ["g"]),
             helper.make_node("Resize", ["g", "", "scales"], ["r"], mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             helper.make_node("Mul", ["a", "r" if spread else "g"], ["p"]),
             helper.make_node("Conv", ["p", "w2"], ["y"])]
    shape = [1, channels, size, size]
    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              initializer=[*weights, scales])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 20)])
    optimized = onnxruntime_optimized(model.SerializeToString())
    made = {output: node.op_type for node in optimized.node for output in node.output}
    read = {name: node.op_type for node in optimized.node for name in node.input}
    muls = [node for node in optimized.node if node.op_type == "Mul"]
    blocked = any(node.domain.endswith("nchwc") for node in optimized.node)
    return (blocked and len(muls) == 1 and read.get(muls[0].output[0]) != "ReorderInput"
            and all(made.get(name) != "ReorderOutput" for name in muls[0].input))
