"""``conv_activation``: a convolution or linear layer and the activation after it become one fused op.

The rules, top to bottom (``conv`` is every call form of a 1d/2d/3d convolution, ``act`` every form of
relu, relu6/hardtanh, leaky_relu, gelu, silu, sigmoid, tanh and hardswish; see
:mod:`fxforge.rewrites.pattern`):

- relu(conv(x) + other)   -> fxforge::conv_pointwise(x, ..., other, "relu")     (residual blocks)
- act(conv(x))            -> fxforge::conv_pointwise(x, ..., None, act)
- conv(x) + other         -> fxforge::conv_pointwise(x, ..., other, "none")
- act(linear(x))          -> fxforge::linear_pointwise(x, ..., act)
- linear(x)               -> fxforge::linear_pointwise(x, ..., "none")         (no activation after it)

The last rule fuses nothing: it lets autotune choose the kernel of a plain linear layer too. On some CPUs
oneDNN's inner product runs a float32 linear layer much faster than torch's BLAS (on an AMD EPYC, MKL's
sgemm reaches about 225 GFLOP/s where oneDNN reaches 360-520), and where it does not, the composite kernel
is the plain ``F.linear`` again.

Before them, an activation written out as its formula becomes the op (:data:`WRITTEN_OUT`: GELU's tanh
approximation as transformers' ``gelu_new`` writes it, eight elementwise passes, becomes
``F.gelu(approximate="tanh")``, one), so that it runs as one vectorised kernel and fuses after a linear
layer like the op itself. It stays when autotune undoes the fusions (it is not a fused op).

It runs after ``conv_bn_fold``, so conv+BN+activation chains end as one op. Each rule refuses, with
the reason, in training mode (the fused ops are for inference; training keeps eager's ops), when an
activation's parameter is computed at run time, and when the added tensor's shape or dtype differs from
the convolution's output (no broadcasting). After fusing, the pass asks its context's tuner
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
import math
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

F = nn.functional
CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
conv_pointwise = torch.ops.fxforge.conv_pointwise.default
linear_pointwise = torch.ops.fxforge.linear_pointwise.default


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
    result = match.anchor.meta.get("val")
    tensors = [match.tensor(k) for k in ("x", "w", "other") if k in match.bindings]
    if not isinstance(result, torch.Tensor) or any(t is None for t in tensors):
        return Refusal("no shape metadata for the matched values")
    if not all(t.is_floating_point() for t in tensors) or len({t.dtype for t in tensors}) > 1:
        return Refusal("the inputs are not floating point tensors of one dtype")
    other = match.tensor("other") if "other" in match.bindings else None
    if other is not None and (other.shape != result.shape or other.dtype != result.dtype):
        return Refusal(f"the added tensor has shape {tuple(other.shape)}, the convolution's output "
                       f"{tuple(result.shape)}")
    return None


def conv_rule(dims: int, activation: Activation, residual: bool) -> Rule:
    """The rule fusing a ``dims``-d convolution, an optional residual add, and ``activation``.

    Example:
        >>> conv_rule(2, RELU, residual=True).name
        'relu(conv2d + other)'
    """
    conv = CONVS[dims]

    def fused(x, w, b, stride, padding, dilation, groups, other, p, q):
        name, scalars = activation.fused(p, q)
        return conv_pointwise(x, w, b, list(stride), list(padding), list(dilation), groups, other, name, scalars,
                              "composite")

    if residual:
        def pattern(x, w, b, stride, padding, dilation, groups, other, p, q):
            return activation.pattern(conv(x, w, b, stride, padding, dilation, groups) + other, p, q)

        def replacement(x, w, b, stride, padding, dilation, groups, other, p=None, q=None):
            return fused(x, w, b, stride, padding, dilation, groups, other, p, q)
    else:
        def pattern(x, w, b, stride, padding, dilation, groups, p, q):
            return activation.pattern(conv(x, w, b, stride, padding, dilation, groups), p, q)

        def replacement(x, w, b, stride, padding, dilation, groups, p=None, q=None):
            return fused(x, w, b, stride, padding, dilation, groups, None, p, q)

    inner = f"conv{dims}d + other" if residual else f"conv{dims}d"
    name = inner if activation is NO_ACTIVATION else f"{activation.name}({inner})"
    return Rule(name, pattern, replacement, check=refuse_unfusable,
                description=f"{name} -> fxforge::conv_pointwise")


def linear_rule(activation: Activation) -> Rule:
    """The rule fusing a linear layer and ``activation``.

    Example:
        >>> linear_rule(RELU).name, linear_rule(NO_ACTIVATION).name
        ('relu(linear)', 'linear')
    """
    def pattern(x, w, b, p, q):
        return activation.pattern(F.linear(x, w, b), p, q)

    def replacement(x, w, b, p=None, q=None):
        name, scalars = activation.fused(p, q)
        return linear_pointwise(x, w, b, name, scalars, "composite")

    name = "linear" if activation is NO_ACTIVATION else f"{activation.name}(linear)"
    return Rule(name, pattern, replacement, check=refuse_unfusable, description=f"{name} -> fxforge::linear_pointwise")


def gelu_tanh_written_out(y):
    """GELU's tanh approximation as transformers writes it (``NewGELUActivation``: GPT-2, GPT-Neo, CodeGen,
    T5 v1.1 ``gelu_new``): eight elementwise passes where ``F.gelu(approximate="tanh")`` makes one."""
    return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))


def refuse_non_float(match: Match) -> Refusal | None:
    """Refuse an activation written out on values that are not floating point (or have no metadata)."""
    value = match.tensor("y")
    if value is None or not value.is_floating_point():
        return Refusal("the activation's input is not a floating point tensor with shape metadata")
    return None


# Activations written out as their formula become the op first (one vectorised kernel; then the fusion
# rules below see it after a linear layer).
WRITTEN_OUT: list[Rule] = [
    Rule("gelu(approximate='tanh') written out", gelu_tanh_written_out, lambda y: F.gelu(y, approximate="tanh"),
         check=refuse_non_float, description="0.5*y*(1+tanh(sqrt(2/pi)*(y+0.044715*y^3))) -> gelu(y, approximate='tanh')"),
]

DIMS = (2, 1, 3)
FUSIONS: list[Rule] = [
    *(conv_rule(d, RELU, residual=True) for d in DIMS),
    *(conv_rule(d, a, residual=False) for d in DIMS for a in ACTIVATIONS),
    *(conv_rule(d, NO_ACTIVATION, residual=True) for d in DIMS),
    *(linear_rule(a) for a in ACTIVATIONS),
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
