"""``conv_activation``: a convolution or linear layer, a tensor added after it and the activation after that
become one fused op.

The rules, top to bottom (``conv`` is every call form of a 1d/2d/3d convolution, ``conv_t`` of a transposed
one, ``act`` every form of relu, relu6/hardtanh, leaky_relu, gelu, silu, sigmoid, tanh, hardswish and
hardsigmoid, ``±`` an add or a subtraction; see :mod:`fxforge.rewrites.pattern`):

- act(conv(x) ± other)    -> fxforge::conv_pointwise(x, ..., other, "add"/"sub", act)   (residual blocks)
- act(conv(x))            -> fxforge::conv_pointwise(x, ..., None, "add", act)
- conv(x) ± other         -> fxforge::conv_pointwise(x, ..., other, "add"/"sub", "none")
- act(conv_t(x))          -> fxforge::conv_transpose_pointwise(x, ..., act)
- act(linear(x) ± other)  -> fxforge::linear_pointwise(x, ..., other, "add"/"sub", act)
- act(linear(x))          -> fxforge::linear_pointwise(x, ..., None, "add", act)
- linear(x) ± other       -> fxforge::linear_pointwise(x, ..., other, "add"/"sub", "none")
- linear(x)               -> fxforge::linear_pointwise(x, ..., "none")         (no activation after it)

``other`` is a tensor of the layer's output shape or one that broadcasts onto it (a ``[1, C, 1, 1]`` gate);
a number, or a constant per-channel tensor, is folded into the weights instead (``binary_fold``).
The last rule fuses nothing: it lets autotune choose the kernel of a plain linear layer too. On some CPUs
oneDNN's inner product runs a float32 linear layer much faster than torch's BLAS (on an AMD EPYC, MKL's
sgemm reaches about 225 GFLOP/s where oneDNN reaches 360-520), and where it does not, the composite kernel
is the plain ``F.linear`` again.

Before them, an op written out as its formula becomes the op (:data:`~fxforge.rewrites.written_out.WRITTEN_OUT`:
GELU's tanh approximation, leaky ReLU as ``where``, a linear layer as ``addmm``), so that it fuses like the op.

It runs after ``conv_bn_fold``, so conv+BN+activation chains end as one op. Each rule refuses, with
the reason, in training mode (the fused ops are for inference; training keeps eager's ops), when an
activation's parameter is computed at run time, when the added tensor's dtype differs from the layer's output
or broadcasting it would change that output, and when the added tensor is the layer's own output (``y + y``:
the fused op would compute the layer twice). After fusing, the pass asks its context's tuner
(:func:`fxforge.lowering.autotune.autotune` when called through :func:`fxforge.rewrite`), which times the
kernels of each fused op on the real shapes, picks the memory layout, and keeps the fusion only if the
whole graph got faster; the report lists its choices and timings. Without a tuner (an ONNX export:
ONNX Runtime picks its own kernels) the fused ops keep their composite kernel, unmeasured.

Example:
    >>> from torch import nn
    >>> from fxforge.lowering.autotune import TuningPolicy
    >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    >>> cap = fxforge.capture(model, (torch.randn(1, 3, 8, 8),))
    >>> new = fxforge.rewrite(cap, ["conv_bn_fold", "conv_activation"],
    ...                       tuning=TuningPolicy(keep="fused"))  # a model this small may measure no faster
    >>> new.report.counts
    {'conv_bn_fold': 1, 'conv_activation': 1}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from fxforge.core.nodes import copy_graph_module
from fxforge.core.plan import CallConditions
from fxforge.rewrites import fused_ops  # noqa: F401 - registers torch.ops.fxforge.*
from fxforge.rewrites.passes import Pass, PassContext, Refusal
from fxforge.rewrites.pattern import Match, Rule, apply_rules
from fxforge.rewrites.written_out import WRITTEN_OUT

F = nn.functional
CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_TRANSPOSES = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
conv_pointwise = torch.ops.fxforge.conv_pointwise.default
linear_pointwise = torch.ops.fxforge.linear_pointwise.default
conv_transpose_pointwise = torch.ops.fxforge.conv_transpose_pointwise.default


@dataclasses.dataclass(frozen=True)
class Activation:
    """One activation the fused ops take.

    Attributes:
        name: how rules and the report name it.
        pattern: ``(y, p, q) -> torch calls``; ``p``/``q`` stand for the activation's parameters.
        fused: ``(p, q) -> (activation, scalars)`` for the fused op (see :mod:`fxforge.rewrites.fused_ops`).

    Example:
        >>> HARDTANH.fused(0.0, 6.0)
        ('hardtanh', [0.0, 6.0])
    """

    name: str
    pattern: Callable
    fused: Callable[[Any, Any], tuple[str, list[float]]]


RELU = Activation("relu", lambda y, p, q: torch.relu(y), lambda p, q: ("relu", []))
HARDTANH = Activation("hardtanh", lambda y, p, q: F.hardtanh(y, p, q), lambda p, q: ("hardtanh", [float(p), float(q)]))
ACTIVATIONS: list[Activation] = [
    RELU,
    HARDTANH,  # nn.ReLU6 and F.relu6 are hardtanh(0, 6)
    Activation("leaky_relu", lambda y, p, q: F.leaky_relu(y, p), lambda p, q: ("leaky_relu", [float(p)])),
    Activation("gelu", lambda y, p, q: F.gelu(y, approximate=p),
               lambda p, q: ("gelu" if p == "none" else "gelu_tanh", [])),
    Activation("silu", lambda y, p, q: F.silu(y), lambda p, q: ("silu", [])),
    Activation("sigmoid", lambda y, p, q: torch.sigmoid(y), lambda p, q: ("sigmoid", [])),
    Activation("tanh", lambda y, p, q: torch.tanh(y), lambda p, q: ("tanh", [])),
    Activation("hardswish", lambda y, p, q: F.hardswish(y), lambda p, q: ("hardswish", [])),
    Activation("hardsigmoid", lambda y, p, q: F.hardsigmoid(y), lambda p, q: ("hardsigmoid", [])),
]
NO_ACTIVATION = Activation("none", lambda y, p, q: y, lambda p, q: ("none", []))


def refuse_unfusable(match: Match) -> Refusal | None:
    """Why the matched ops cannot become one fused op, or None.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); _ = g.output(x)
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), g)
        >>> str(refuse_unfusable(Match(gm, {"x": x, "p": x}, [x])))
        'the activation parameter p is computed at run time'
    """
    for name in ("p", "q"):
        if isinstance(match.bindings.get(name), Node):
            return Refusal(f"the activation parameter {name} is computed at run time")
    if match.bindings.get("p") not in (None, "none", "tanh") and isinstance(match.bindings.get("p"), str):
        return Refusal(f"gelu approximation {match['p']!r} is not one the fused op has")
    padding = match.bindings.get("padding")
    if isinstance(padding, str):
        return Refusal(f"padding={padding!r} that is not a fixed number of elements")
    if "other" in match.bindings and not isinstance(match["other"], Node):
        return Refusal(f"the {_operand(match)} value is a number, not a tensor (binary_fold folds numbers into the "
                       "bias where it runs)")
    if "other" in match.bindings and match["other"] in match.nodes:
        return Refusal(f"the {_operand(match)} tensor is the layer's own output: fusing would compute the layer twice")
    result = match.anchor.meta.get("val")
    tensors = [match.tensor(k) for k in ("x", "w", "other") if k in match.bindings]
    if not isinstance(result, torch.Tensor) or any(t is None for t in tensors):
        missing = [k for k in ("x", "w", "other") if k in match.bindings and match.tensor(k) is None]
        return Refusal(f"no shape metadata for {', '.join(missing) or 'the result'} (a value the capture did not "
                       "annotate)")
    if not all(t.is_floating_point() for t in tensors) or len({t.dtype for t in tensors}) > 1:
        return Refusal("the inputs are not floating point tensors of one dtype")
    other = match.tensor("other") if "other" in match.bindings else None
    if other is not None:
        layer = _layer_output(match)
        shape = tuple(layer.shape) if layer is not None else tuple(result.shape)
        if other.dim() > len(shape) or not _broadcasts_onto(tuple(other.shape), shape):
            return Refusal(f"the {_operand(match)} tensor has shape {tuple(other.shape)}, which does not broadcast "
                           f"onto the layer's output {shape} without changing it")
    return None


def _operand(match: Match) -> str:
    """``added`` or ``subtracted``: what the match does with its ``other`` tensor."""
    return "subtracted" if any(op.name == "sub" for op in match.ops.values()) else "added"


def _layer_output(match: Match) -> torch.Tensor | None:
    """The (fake) output of the matched convolution or linear layer, before the add and the activation."""
    layer = next((op.node for op in match.ops.values() if str(op.name).startswith(("conv", "linear"))), None)
    value = layer.meta.get("val") if layer is not None else None
    return value if isinstance(value, torch.Tensor) else None


def _broadcasts_onto(shape: tuple, target: tuple) -> bool:
    """Whether a tensor of ``shape`` broadcasts onto ``target`` leaving it as it is (sizes compared as given)."""
    offset = len(target) - len(shape)
    return all(size == 1 or size == target[offset + i] for i, size in enumerate(shape))


BINARY_PATTERNS = {None: lambda y, other: y, "add": lambda y, other: y + other, "sub": lambda y, other: y - other}


def _rule_name(inner: str, binary: str | None, activation: Activation) -> str:
    inner = {None: inner, "add": f"{inner} + other", "sub": f"{inner} - other"}[binary]
    return inner if activation is NO_ACTIVATION else f"{activation.name}({inner})"


def conv_rule(dims: int, activation: Activation, binary: str | None) -> Rule:
    """The rule fusing a ``dims``-d convolution, an optional tensor added or subtracted after it (``binary``:
    ``"add"``, ``"sub"`` or None) and ``activation``.

    Example:
        >>> conv_rule(2, RELU, "add").name, conv_rule(3, NO_ACTIVATION, "sub").name
        ('relu(conv2d + other)', 'conv3d - other')
    """
    conv, combine = CONVS[dims], BINARY_PATTERNS[binary]

    def fused(x, w, b, stride, padding, dilation, groups, other, p, q):
        name, scalars = activation.fused(p, q)
        return conv_pointwise(x, w, b, list(stride), list(padding), list(dilation), groups, other, binary or "add",
                              name, scalars, "composite")

    if binary is not None:
        def pattern(x, w, b, stride, padding, dilation, groups, other, p, q):
            return activation.pattern(combine(conv(x, w, b, stride, padding, dilation, groups), other), p, q)

        def replacement(x, w, b, stride, padding, dilation, groups, other, p=None, q=None):
            return fused(x, w, b, stride, padding, dilation, groups, other, p, q)
    else:
        def pattern(x, w, b, stride, padding, dilation, groups, p, q):
            return activation.pattern(conv(x, w, b, stride, padding, dilation, groups), p, q)

        def replacement(x, w, b, stride, padding, dilation, groups, p=None, q=None):
            return fused(x, w, b, stride, padding, dilation, groups, None, p, q)

    name = _rule_name(f"conv{dims}d", binary, activation)
    return Rule(name, pattern, replacement, check=refuse_unfusable,
                description=f"{name} -> fxforge::conv_pointwise")


def conv_transpose_rule(dims: int, activation: Activation) -> Rule:
    """The rule fusing a ``dims``-d transposed convolution and ``activation``.

    Example:
        >>> conv_transpose_rule(2, RELU).name
        'relu(conv_transpose2d)'
    """
    conv = CONV_TRANSPOSES[dims]

    def pattern(x, w, b, stride, padding, output_padding, groups, dilation, p, q):
        return activation.pattern(conv(x, w, b, stride, padding, output_padding, groups, dilation), p, q)

    def replacement(x, w, b, stride, padding, output_padding, groups, dilation, p=None, q=None):
        name, scalars = activation.fused(p, q)
        return conv_transpose_pointwise(x, w, b, list(stride), list(padding), list(output_padding), groups,
                                        list(dilation), name, scalars, "composite")

    name = f"{activation.name}(conv_transpose{dims}d)"
    return Rule(name, pattern, replacement, check=refuse_unfusable,
                description=f"{name} -> fxforge::conv_transpose_pointwise")


def linear_rule(activation: Activation, binary: str | None = None) -> Rule:
    """The rule fusing a linear layer, an optional tensor added or subtracted after it, and ``activation``.

    Example:
        >>> linear_rule(RELU).name, linear_rule(NO_ACTIVATION).name, linear_rule(RELU, "add").name
        ('relu(linear)', 'linear', 'relu(linear + other)')
    """
    combine = BINARY_PATTERNS[binary]
    if binary is not None:
        def pattern(x, w, b, other, p, q):
            return activation.pattern(combine(F.linear(x, w, b), other), p, q)

        def replacement(x, w, b, other, p=None, q=None):
            name, scalars = activation.fused(p, q)
            return linear_pointwise(x, w, b, other, binary, name, scalars, "composite")
    else:
        def pattern(x, w, b, p, q):
            return activation.pattern(F.linear(x, w, b), p, q)

        def replacement(x, w, b, p=None, q=None):
            name, scalars = activation.fused(p, q)
            return linear_pointwise(x, w, b, None, "add", name, scalars, "composite")

    name = _rule_name("linear", binary, activation)
    return Rule(name, pattern, replacement, check=refuse_unfusable, description=f"{name} -> fxforge::linear_pointwise")


DIMS = (2, 1, 3)
BINARY = ("add", "sub")
# Longest first: an activation after an added tensor, the activation alone, the added tensor alone.
FUSIONS: list[Rule] = [
    *(conv_rule(d, a, b) for d in DIMS for a in ACTIVATIONS for b in BINARY),
    *(conv_rule(d, a, None) for d in DIMS for a in ACTIVATIONS),
    *(conv_rule(d, NO_ACTIVATION, b) for d in DIMS for b in BINARY),
    *(conv_transpose_rule(d, a) for d in DIMS for a in ACTIVATIONS),
    *(linear_rule(a, b) for a in ACTIVATIONS for b in BINARY),
    *(linear_rule(a) for a in ACTIVATIONS),
    *(linear_rule(NO_ACTIVATION, b) for b in BINARY),
]
# A linear layer alone is not a fusion but a kernel choice: a refused one is no near miss in the report, and
# without a tuner (an ONNX export: ONNX Runtime picks its own kernels) it is not applied.
PLAIN_LINEAR = linear_rule(NO_ACTIVATION)
RULES: list[Rule] = [*FUSIONS, PLAIN_LINEAR]


def _not_for(ctx: PassContext) -> Refusal | None:
    """Why the fused ops do not serve the calls this graph is for, or None."""
    if ctx.training:
        return Refusal("fused ops are for inference; in training mode eager's ops are kept")
    if ctx.conditions.gradients:
        return Refusal(f"fused ops have no gradients (eager's ops keep them, double backward included): "
                       f"{CallConditions.FOR_GRADIENTS}")
    if ctx.conditions.autocast:
        return Refusal("under autocast eager's ops are kept: autocast chooses each op's precision, and has no "
                       "rule for fxforge's fused ops")
    return None


def fuse_and_tune(graph_module: torch.fx.GraphModule, ctx: PassContext) -> None:
    """The ``conv_activation`` pass: apply :data:`RULES`, then let the context's tuner keep what is faster."""
    refusal = _not_for(ctx)
    if refusal is not None:
        for node in graph_module.graph.nodes:
            if any(next(rule.pattern_graph.matches(node, graph_module), None) for rule in FUSIONS):
                ctx.refused(node, refusal)
        return
    apply_rules(graph_module, ctx, WRITTEN_OUT)
    recognized = list(ctx.matches)
    before = copy_graph_module(graph_module)
    apply_rules(graph_module, ctx, RULES if ctx.tuner is not None else FUSIONS)
    if len(ctx.matches) == len(recognized) or ctx.tuner is None:
        return
    tuned = ctx.tuner(graph_module, before, ctx)
    if not tuned.fused:  # the graph is back to ``before``: the written-out activations stay recognised
        ctx.matches[:] = recognized
    ctx.lowered_run = tuned.lowered_run


CONV_ACTIVATION = Pass("conv_activation", fuse_and_tune,
                       "conv (+ residual add) + activation and linear + activation -> one fused op, and a plain "
                       "linear layer -> the same op (its kernel chosen by timing), kept where autotune measured it "
                       "faster", keeps_meta=True)
