"""RMS norms written in the form ONNX Runtime fuses into one ``SimplifiedLayerNormalization`` kernel.

LLaMA, Mistral, Qwen and T5 normalize with ``weight * (x * rsqrt(mean(x**2, -1) + eps))``; torch.onnx writes
``rsqrt`` as ``Reciprocal(Sqrt(.))`` and the scaling as a ``Mul``. ONNX Runtime's fusion of this norm
(``SimplifiedLayerNormFusion``) looks for ``Div(x, Sqrt(.))``, so with torch's form each norm ran as seven
kernels, three of them over the whole [B, S, hidden] tensor. In LLaMA at S = 1024 (ORT's CPU provider)
the fused form measured 1.02-1.03x on the whole model.

The rule (:class:`DividedRmsNorm`, an onnxscript rewrite rule): **``Mul(x, Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps))))`` whose result is scaled by
a 1-D weight becomes ``Div(x, Sqrt(...))``**, only when :func:`onnxruntime_fuses_rms_norm` finds that the
installed ONNX Runtime fuses that form (so the file never trades a ``Mul`` for a slower ``Div``). The
fused kernel divides where eager multiplies by ``rsqrt``: results differ in the last bits (the file is
validated against the model as every export is).

Example:
    >>> from onnxscript import ir
    >>> graph = _norm_graph(hidden=8)  # the probe's graph, torch's form
    >>> divide_rms_norms(graph, fuses=True), sorted(node.op_type for node in graph)
    (1, ['Add', 'Div', 'Mul', 'Pow', 'ReduceMean', 'Sqrt'])
"""

from __future__ import annotations

import functools

import numpy as np
from onnxscript import ir

from fxforge.exporters.onnx_engine import NOT_HERE, PatternRule, apply_to_graph, pattern_pass
from fxforge.exporters.onnx_ir import (
    constant,
    constant_value,
    float_value,
    is_onnx_op,
    onnxruntime_optimized,
    producer,
    reduce_axes,
)

RMS_NORM = "RMS norm x * Reciprocal(Sqrt(.)) -> x / Sqrt(.) (ORT fuses it into SimplifiedLayerNormalization)"


NOT_FUSED = "the installed ONNX Runtime does not fuse x / Sqrt(.) into SimplifiedLayerNormalization"


class DividedRmsNorm(PatternRule):
    """The module's rule as an onnxscript rule: ``Mul(x, Reciprocal(s))`` (either operand order) of the main
    graph where ``s`` is ``Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps))`` and the result is scaled by a 1-D
    weight becomes ``Div(x, s)``; refused everywhere when ``fuses`` is False (default: probe the installed
    ONNX Runtime once, at the first norm found, :func:`onnxruntime_fuses_rms_norm`).

    Example:
        >>> DividedRmsNorm(fuses=True).what == RMS_NORM
        True
    """

    what = RMS_NORM
    commute = True

    def __init__(self, fuses: bool | None = None) -> None:
        super().__init__()
        self.fuses = fuses

    def pattern(self, op, x, s):
        return op.Mul(x, op.Reciprocal(s))

    def refusal(self, context, x, s):
        found = _rms_norm(context.root) if context.graph_or_function is context.model.graph else None
        if found is None or found[0] is not x:
            return NOT_HERE
        if self.fuses is None:
            self.fuses = onnxruntime_fuses_rms_norm()
        return None if self.fuses else NOT_FUSED

    def rewrite(self, op, x, s):
        return op.Div(x, s)


rms_norm = pattern_pass(DividedRmsNorm)


def divide_rms_norms(graph: ir.Graph, *, fuses: bool | None = None) -> int:
    """:class:`DividedRmsNorm` applied to ``graph`` outside an export; returns how many norms were rewritten
    (``fuses`` as the rule takes it; False changes nothing).

    Example:
        >>> divide_rms_norms(ir.Graph([], [], nodes=[]), fuses=True)
        0
    """
    run = pattern_pass(functools.partial(DividedRmsNorm, fuses=fuses))
    return sum(apply_to_graph(run, graph, "rms_norm").counts().values())


def _rms_norm(mul: ir.Node) -> tuple[ir.Value, ir.Node] | None:
    """For a ``Mul`` of the rule: its x and the ``Reciprocal`` it multiplies by."""
    if not is_onnx_op(mul, "Mul") or len(mul.inputs) != 2 or mul.outputs[0].is_graph_output():
        return None
    for index in (0, 1):
        reciprocal = producer(mul.inputs[index], "Reciprocal")
        x = mul.inputs[1 - index]
        if reciprocal is None or x is None or x.dtype != ir.DataType.FLOAT or not _read_once(reciprocal):
            continue
        sqrt = producer(reciprocal.inputs[0], "Sqrt")
        add = producer(sqrt.inputs[0], "Add") if sqrt is not None and _read_once(sqrt) else None
        if add is None or not _read_once(add):
            continue
        means = [producer(v, "ReduceMean") for v in add.inputs]
        eps = [constant(v) for v in add.inputs]
        k = 0 if means[0] is not None and eps[1] is not None else 1 if means[1] is not None and eps[0] is not None \
            else None
        if k is None or eps[1 - k].size != 1 or not _last_axis_mean(means[k]):
            continue
        power = producer(means[k].inputs[0], "Pow")
        exponent = constant(power.inputs[1]) if power is not None and _read_once(power) else None
        if exponent is None or exponent.size != 1 or float(exponent.reshape(-1)[0]) != 2.0 or power.inputs[0] is not x:
            continue
        if _scaled_by_weight(mul.outputs[0]):
            return x, reciprocal
    return None


def _read_once(node: ir.Node) -> bool:
    return len(node.outputs) == 1 and len(node.outputs[0].uses()) == 1 and not node.outputs[0].is_graph_output()


def _last_axis_mean(mean: ir.Node) -> bool:
    """``ReduceMean`` over the last axis alone, keeping it, on a read-once output."""
    if not _read_once(mean) or mean.attributes.get_int("keepdims", 1) != 1:
        return False
    x = mean.inputs[0]
    axes = reduce_axes(mean)
    rank = None if x is None or x.shape is None else len(x.shape)
    return axes is not None and axes.size == 1 and rank is not None and int(axes.reshape(-1)[0]) in (-1, rank - 1)


def _scaled_by_weight(value: ir.Value) -> bool:
    """Whether ``value``'s one reader is a ``Mul`` by a 1-D tensor (the norm's weight, which ORT's fusion
    takes as the scale)."""
    uses = value.uses()
    if len(uses) != 1:
        return False
    reader = uses[0][0]
    if not is_onnx_op(reader, "Mul") or len(reader.inputs) != 2:
        return False
    other = reader.inputs[1] if reader.inputs[0] is value else reader.inputs[0]
    shape = None if other is None else other.shape if other.shape is not None else getattr(
        other.const_value, "shape", None)
    return shape is not None and len(shape) == 1


@functools.cache
def onnxruntime_fuses_rms_norm() -> bool:
    """Whether the installed ONNX Runtime's CPU provider fuses this module's form of an RMS norm into
    ``SimplifiedLayerNormalization``: probed once per process on a one-norm model.

    Example:
        >>> onnxruntime_fuses_rms_norm()  # ONNX Runtime 1.31
        True
    """
    try:
        return _fused(divided=True)
    except Exception:  # noqa: BLE001 - an ONNX Runtime that cannot run the probe keeps torch's form
        return False


def _norm_graph(hidden: int, divided: bool = False) -> ir.Graph:
    """``weight * (x * Reciprocal(Sqrt(mean(x**2, -1) + eps)))`` on x [1, 4, hidden] (``divided``: the
    rule's ``Div`` form)."""
    rows, full = [1, 4, 1], [1, 4, hidden]
    x = float_value("x", full)
    two, axes = constant_value("two", np.array(2.0, np.float32)), constant_value("axes", np.array([-1], np.int64))
    eps = constant_value("eps", np.array(1e-6, np.float32))
    weight = constant_value("weight", np.linspace(0.5, 1.5, hidden, dtype=np.float32))
    power = ir.Node("", "Pow", [x, two], outputs=[float_value("squares", full)])
    mean = ir.Node("", "ReduceMean", [power.outputs[0], axes], outputs=[float_value("mean", rows)])
    add = ir.Node("", "Add", [mean.outputs[0], eps], outputs=[float_value("shifted", rows)])
    sqrt = ir.Node("", "Sqrt", add.outputs, outputs=[float_value("root", rows)])
    if divided:
        middle = [ir.Node("", "Div", [x, sqrt.outputs[0]], outputs=[float_value("normed", full)])]
    else:
        reciprocal = ir.Node("", "Reciprocal", sqrt.outputs, outputs=[float_value("inverse", rows)])
        middle = [reciprocal, ir.Node("", "Mul", [x, reciprocal.outputs[0]], outputs=[float_value("normed", full)])]
    scale = ir.Node("", "Mul", [weight, middle[-1].outputs[0]], outputs=[float_value("y", full)])
    return ir.Graph([x], scale.outputs, nodes=[power, mean, add, sqrt, *middle, scale],
                    initializers=[two, axes, eps, weight], opset_imports={"": 20}, name="rms_norm")


def _fused(divided: bool) -> bool:
    """Optimize the probe's norm (``divided``: the rule's form, else torch's) in the installed ORT and look
    for ``SimplifiedLayerNormalization``."""
    model = ir.serde.serialize_model(ir.Model(_norm_graph(hidden=64, divided=divided), ir_version=10))
    optimized = onnxruntime_optimized(model.SerializeToString())
    return any(node.op_type == "SimplifiedLayerNormalization" for node in optimized.node)
