"""Int8 plans for the ``inductor`` target: fxforge's calibrated quantize/dequantize pairs around the layers that
keep the tolerance, compiled by Inductor with freezing, whose quantization passes turn each pair and its layer
into one oneDNN int8 kernel (``onednn.qlinear_pointwise``, ``onednn.qconv_pointwise``) with the activation after
it and the next layer's quantization fused.

This is what PT2E quantization with ``X86InductorQuantizer`` hands Inductor, built from fxforge's own observers
and checked as every reduced-precision plan is:

- **the graph** (:func:`qdq_copy`): each chosen linear layer or 2d convolution reads its input through
  ``quantized_decomposed.quantize_per_tensor`` / ``dequantize_per_tensor`` (uint8, the range observed on the
  calibration calls: static) and its weight through ``dequantize_per_channel`` of the int8 weight (symmetric, per
  output channel, folded from the live float weight);
- **the layers** (:class:`QdqReduction`): chosen by sensitivity on that graph run eagerly (the decomposed ops
  compute what the fused kernels compute, up to their rounding), as for the native target's int8
  (:func:`~fxforge.lowering.precision_choice.choose_layers`), keeping a margin of the tolerance, the agreement
  measured on one call more that the observers did not see;
- **the plan** (:func:`inductor_int8_plan`): the int8 graph compiled with ``freezing`` (the weights become
  constants of the compiled code, which is what lets Inductor prepack them), checked against float32 within
  the tolerance on every calibration call (chosen again with a smaller margin and compiled again where it
  breaks it), and timed against the float32 compiled graph: kept only where faster, else the float32 plan
  with the reason.

What freezing changes for the user: a changed weight (or BatchNorm statistic) is quantized and compiled again
on the next call (seconds), not read live (:class:`FrozenInt8`). A call whose inputs hold NaN or an infinity
runs the float32 compiled graph (int8 has no such values; eager's answer has them). Where the compiled graph
writes into its inputs (Inductor adds a residual in place), every call hands it copies. As with PT2E, an
activation beyond its calibrated range is clamped to it: the tolerance was measured on inputs of the example's
statistics, and the report says so.

Example:
    >>> _ = torch.manual_seed(0)
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU()).eval())
    >>> x = torch.randn(4, 16)
    >>> qdq = qdq_copy(gm, {"_0"}, {"_0": (-3.0, 3.0)})
    >>> sorted({str(n.target) for n in qdq.graph.nodes if "quantize" in str(n.target)})
    ['quantized_decomposed.dequantize_per_channel.default', 'quantized_decomposed.dequantize_per_tensor.default', 'quantized_decomposed.quantize_per_tensor.default']
    >>> bool((qdq(x) - gm(x)).abs().max() < 0.05 * gm(x).abs().max())
    True
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.ao.quantization.fx._decomposed  # registers the quantized_decomposed ops
import torch.utils._pytree as pytree
from torch._inductor import config as inductor_config
from torch.fx import Node

from fxforge.core.accuracy import Tolerance, agreement
from fxforge.core.captured import Captured
from fxforge.core.derived import Derived, DerivedValues
from fxforge.core.nodes import copy_graph_module
from fxforge.core.plan import Plan
from fxforge.core.report import Tuning
from fxforge.core.source import first_line
from fxforge.core.verify import isolated, random_like
from fxforge.lowering.inductor import compiled_with_flat_outputs
from fxforge.lowering.int8 import _CONVS, _LINEARS, _is_conv, _parts, int8_layers
from fxforge.lowering.int8_ops import QMAX, input_qparams, weight_int8, weight_scale
from fxforge.lowering.int8_ops import _finite as finite
from fxforge.lowering.int8_ranges import observe_inputs
from fxforge.lowering.precision import _module_call_as_function
from fxforge.lowering.precision_choice import choose_layers
from fxforge.lowering.precision_stage import CALIBRATION_DRAWS, KEYWORD_ONLY, _devices, calibration_calls
from fxforge.lowering.timing import DECISIVE, time_interleaved
from fxforge.rewrites.folding import attribute_tensor, fold_constants

_QD = torch.ops.quantized_decomposed
TIMING_BUDGET_S = 1.0
OBSERVED_VALUES = 1 << 16  # values of each input the ranges are observed on, at least (see observed_calls)
OBSERVED_CALLS = 32
# The layers are chosen to keep this share of the tolerance's distance from float32 (relative error, and one less
# the cosine), then, where the compiled graph breaks the tolerance all the same, the second.
MARGINS = (0.8, 0.4)


def qdq_layers(gm: torch.fx.GraphModule) -> list[Node]:
    """The layers of ``gm`` Inductor's int8 passes take: plain linear layers and 2d convolutions (modules or
    functional calls) with a float32 weight of the model, in graph order.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Conv1d(1, 1, 1)))
        >>> [n.name for n in qdq_layers(gm)]
        ['_0']
    """
    return [n for n in int8_layers(gm) if n.op == "call_module" or n.target in _LINEARS + _CONVS]


def _zero_points(gm: torch.fx.GraphModule, name: str, channels: int) -> str:
    """A buffer of ``channels`` zero points (int64 zeros: the weights are symmetric) registered on ``gm``."""
    attribute = f"_fxforge_qdq_zero_{name}"
    gm.register_buffer(attribute, torch.zeros(channels, dtype=torch.int64), persistent=False)
    return attribute


def qdq_copy(gm: torch.fx.GraphModule, names: set[str], ranges: dict[str, tuple[float, float]], *,
             residuals: bool = True) -> torch.fx.GraphModule:
    """A new GraphModule of ``gm``'s graph (sharing the model's tensors) where each named layer with an observed
    input range in ``ranges`` reads its input quantized to uint8 in that range and its weight quantized to int8
    per output channel (see the module docstring); the int8 weights and scales are folded from the live weights.
    ``residuals``: every other reader of a quantized input (a residual connection) reads the dequantized value
    too (:func:`_quantized_value`); else only the layers do.
    """
    copy = copy_graph_module(gm)
    kept = {n for n in qdq_layers(copy) if n.name not in names or n.name not in ranges}  # (float32 layers)
    shared: dict[Node, Node] = {}  # a quantized input -> its dequantized value, which every reader but these takes
    for node in [n for n in copy.graph.nodes if n.name in names and n.name in ranges]:
        name = node.name
        if node.op == "call_module":
            node = _module_call_as_function(copy, node)
        parts = _parts(node, copy)
        graph = copy.graph
        channels = int(attribute_tensor(copy, parts.weight.target).shape[0])
        if parts.input not in shared:
            conv = node.target in _CONVS
            readers = kept if residuals and conv else {u for u in parts.input.users if u.name not in names}
            shared[parts.input] = _quantized_value(copy, parts.input, input_qparams(*ranges[name]), readers)
        with graph.inserting_before(node):
            quantized = graph.call_function(weight_int8, (parts.weight,))
            scales = graph.call_function(weight_scale, (parts.weight,))
            zeros = graph.get_attr(_zero_points(copy, name, channels))
            weight = graph.call_function(_QD.dequantize_per_channel.default,
                                         (quantized, scales, zeros, 0, -QMAX - 1, QMAX, torch.int8))
        node.args = (shared[parts.input], weight, *node.args[2:])
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("input", "weight")}
        fold_constants(copy, [quantized, scales])  # (the int8 weight and scales follow the live weight)
    copy.graph.eliminate_dead_code()
    copy.graph.lint()
    copy.recompile()
    return copy


def _quantized_value(gm: torch.fx.GraphModule, value: Node, qparams: tuple[float, int], kept: set[Node]) -> Node:
    """``value`` quantized to uint8 with ``qparams`` and dequantized, read in its place by every reader but the
    graph's output and the readers ``kept`` (layers left in float32): a residual connection then adds the value
    the next layer reads, as PT2E's quantizer makes it, which lets Inductor fuse the addition into the int8
    kernel before it (a ResNet block at batch 8: 15.7 ms without, 11.1 ms with)."""
    graph = gm.graph
    if value.op == "placeholder":  # (after every input: a folded constant's get_attr may come before one)
        where = graph.inserting_after(list(graph.find_nodes(op="placeholder"))[-1])
    else:
        where = graph.inserting_after(value)
    scale, zero = qparams
    with where:
        quantized = graph.call_function(_QD.quantize_per_tensor.default, (value, scale, zero, 0, 255, torch.uint8))
    with graph.inserting_after(quantized):
        dequantized = graph.call_function(_QD.dequantize_per_tensor.default,
                                          (quantized, scale, zero, 0, 255, torch.uint8))
    value.replace_all_uses_with(dequantized, delete_user_cb=lambda user: user is not quantized
                                and user.op != "output" and user not in kept)
    return dequantized


class QdqReduction:
    """The trials of :func:`~fxforge.lowering.precision_choice.choose_layers` for Inductor's int8: each runs
    :func:`qdq_copy` of the graph eagerly, the layers' inputs in the ``ranges`` observed on calibration calls.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8)))
        >>> reduction = QdqReduction({"_0": (-1.0, 1.0)})
        >>> reduction.kind, [n.name for n in reduction.layers(gm)]
        ('int8', ['_0'])
    """

    kind = "int8"

    def __init__(self, ranges: dict[str, tuple[float, float]], residuals: bool = True):
        self.ranges, self.residuals = ranges, residuals

    def layers(self, gm: torch.fx.GraphModule) -> list[Node]:
        """The layers Inductor's int8 can run that met an input on the calibration calls."""
        return [n for n in qdq_layers(gm) if n.name in self.ranges]

    def apply(self, gm: torch.fx.GraphModule, names: set[str]) -> torch.fx.GraphModule:
        """:func:`qdq_copy` of ``gm`` with the named layers in int8."""
        return qdq_copy(gm, names, self.ranges, residuals=self.residuals)

    def run(self, gm: torch.fx.GraphModule, inputs: Sequence[tuple], names: set[str]) -> list:
        """``gm``'s outputs on ``inputs`` with the named layers in int8."""
        quantized = self.apply(gm, names)
        with torch.no_grad():
            return [quantized(*args) for args in inputs]


def _finite(args: tuple, kwargs: dict) -> bool:
    # (int8_ops' one-pass check on each floating-point input: a sum that overflows reads as not finite, and that
    # call runs in float32)
    return all(finite(t) for t in pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _ordinary(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if tensor.is_inference() else tensor


def _copy_floating(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if tensor.is_floating_point() else tensor


def _freeze(gm: torch.fx.GraphModule, dynamic: bool) -> Any:
    """``torch.compile`` of a fresh copy of ``gm`` with freezing (a new code object: TorchDynamo's cache of an
    earlier compile, whose constants are the old weights, is not reused)."""
    return compiled_with_flat_outputs(copy_graph_module(gm), dynamic=dynamic, options={"freezing": True})


class FrozenInt8:
    """A plan's executable: the int8 graph compiled with freezing, the float32 compiled graph for calls with NaN
    or an infinity in their inputs. Calls run without recording gradients (the plan serves only such calls;
    freezing applies only to them).

    :meth:`build` observes the named layers' input ranges on the calibration ``calls`` (the first is the one it
    compiles for; the plan's are :func:`observed_calls`), makes the int8 graph (:func:`qdq_copy`) and compiles it;
    :meth:`refreezing` is the plan's derived value that builds it all again when a tensor the graph reads changed
    (new weights: new int8 weights, new activation ranges).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8)))
        >>> frozen = FrozenInt8(gm, ["_0"], [(torch.randn(2, 8),)], gm, dynamic=False)
        >>> frozen(torch.full((2, 8), float("nan"))).isnan().all().item()
        True
    """

    def __init__(self, gm: torch.fx.GraphModule, names: Sequence[str], calls: Sequence[tuple], float32: Any, *,
                 dynamic: bool, residuals: bool = True):
        self.gm, self.names, self.calls, self.float32, self.dynamic = gm, list(names), list(calls), float32, dynamic
        self.residuals = residuals
        self.qdq: torch.fx.GraphModule | None = None
        self.compiled: Any = None
        self.compiles = 0
        self.copies_inputs = False

    def build(self, ranges: dict[str, tuple[float, float]] | None = None) -> None:
        """Observe (unless given the ``ranges`` observed on ``calls`` already), quantize and compile (for the first
        calibration call, under ``no_grad``), now rather than on a user's call."""
        example = self.calls[0]
        if ranges is None:
            with isolated(self.gm, inputs=(example, {})):
                ranges = observe_inputs(self.gm, self.calls, self.names)
        self.qdq = qdq_copy(self.gm, set(self.names), ranges, residuals=self.residuals)
        self.compiled = _freeze(self.qdq, self.dynamic)
        self.compiles += 1
        # TorchDynamo reads Inductor's ``freezing`` when it traces (to make the weights static inputs), not from
        # the compile's options: it is set while these compiles run. (``isolated`` holds the lock every fxforge
        # compile and call through TorchDynamo takes, so no other compile sees it.)
        with isolated(self.qdq, inputs=(example, {})), inductor_config.patch(freezing=True), torch.no_grad(), \
                warnings.catch_warnings():
            # (Inductor's int8 lowering copies a tensor with torch.tensor(...), which warns; not the user's doing)
            warnings.filterwarnings("ignore", "To copy construct from a tensor", UserWarning)
            given = pytree.tree_map_only(torch.Tensor, torch.clone, example)
            self.compiled(*given)
        # Inductor's int8 kernels add a residual in place (oneDNN's ``sum`` post-op writes into the tensor added),
        # and where that tensor is an input of the graph, they change the caller's tensor (torch 2.13: int8
        # ``x + linear(gelu(linear(x)))`` wrote its result into ``x``; a clone in the graph is removed as a no-op).
        # Where the compiled graph changed its inputs, every call gets copies of them.
        self.copies_inputs = not all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(given),
                                                                         pytree.tree_leaves(example))
                                     if isinstance(a, torch.Tensor))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            self.build()
        if not _finite(args, kwargs):
            return self.float32(*args, **kwargs)
        if self.copies_inputs:
            args, kwargs = pytree.tree_map_only(torch.Tensor, _copy_floating, (args, kwargs))
        if torch.is_inference_mode_enabled():
            # One compile serves every call: TorchDynamo would compile again (tens of seconds with freezing,
            # which Inductor's cache skips) for calls in inference mode and again for inference tensors; such
            # inputs are copied into ordinary tensors instead, and the call runs outside inference mode.
            with torch.inference_mode(False):
                args, kwargs = pytree.tree_map_only(torch.Tensor, _ordinary, (args, kwargs))
                with torch.no_grad():
                    return self.compiled(*args, **kwargs)
        with torch.no_grad():
            return self.compiled(*args, **kwargs)

    def refreezing(self) -> Derived:
        """The derived value that builds the int8 graph again (:meth:`build`) when a parameter or buffer of the
        float32 graph, or a tensor one of its folded values is computed from, changed."""
        folds = self.gm.meta.get("fxforge_folds", {})
        sources = {id(t): t for t in [*self.gm.parameters(), *self.gm.buffers(),
                                      *(t for recipe in folds.values() for t in recipe.sources)]}

        def build_again() -> torch.Tensor:
            self.build()
            return torch.empty(0)

        return Derived(torch.empty(0), tuple(sources.values()), build_again, replace=lambda value: None)


def observed_calls(calls: list[tuple]) -> list[tuple]:
    """The calls the ranges are observed on: ``calls``, and for small inputs more random draws of the example's
    statistics, until each input has given about OBSERVED_VALUES values (at most OBSERVED_CALLS calls). A range is
    clamped beyond (static quantization): observed on three calls of a 2x1x4x4 image, it is the largest of 96
    values, which a fresh image passes often; the relative error on it was 0.33.

    Example:
        >>> len(observed_calls([(torch.randn(2, 4),)] * 3)), len(observed_calls([(torch.randn(64, 1024),)] * 3))
        (32, 3)
    """
    sizes = [t.numel() for t in pytree.tree_leaves(calls[0]) if isinstance(t, torch.Tensor)]
    wanted = min(OBSERVED_CALLS, -(-OBSERVED_VALUES // max(min(sizes, default=1), 1)))
    extra = range(len(calls), wanted)
    return list(calls) + [random_like(calls[0], 100 + seed) for seed in extra]


def _choice(gm: torch.fx.GraphModule, calls: list[tuple], ranges: dict[str, tuple[float, float]],
            tolerance: Tolerance, margin: float, residuals: bool) -> Any:
    """The layers that keep ``margin`` of ``tolerance`` on ``calls`` (run eagerly, :class:`QdqReduction`)."""
    strict = dataclasses.replace(tolerance, relative_error=tolerance.relative_error * margin,
                                 cosine=1 - (1 - tolerance.cosine) * margin)
    with isolated(gm, inputs=(calls[0], {})):
        return choose_layers(gm, calls, QdqReduction(ranges, residuals=residuals), strict)


def inductor_int8_plan(captured: Captured, float32_plan: Plan, tolerance: Any, *, dynamic: bool = False) -> Plan:
    """The int8 plan of a rewritten graph for the inductor target (see the module docstring), or
    ``float32_plan`` (Inductor's compile of the float32 graph, built by the caller) where no layer keeps
    ``tolerance``, the compiled int8 graph breaks it, or it is not faster; the report says which, and each
    layer's precision."""
    tolerance = Tolerance.of(tolerance)
    gm, report = captured.graph_module, captured.report
    calls = calibration_calls(captured)
    if calls is None:
        report.notes.append(f"precision int8: float32 kept: {KEYWORD_ONLY}")
        return float32_plan
    if not _devices(calls[0]) <= {"cpu"}:
        report.notes.append("precision int8: float32 kept: Inductor's int8 kernels are oneDNN's, for the CPU (on a "
                            "GPU, target='native' runs linear layers in int8)")
        return float32_plan
    if not _finite(calls[0], {}):
        report.notes.append("precision int8: float32 kept: the example inputs hold NaN or an infinity, so no range "
                            "can be calibrated on them")
        return float32_plan
    start = time.perf_counter()
    observing = observed_calls(calls)
    with isolated(gm, inputs=(calls[0], {})):
        ranges = observe_inputs(gm, observing, [n.name for n in qdq_layers(gm)])
        held_out = calls + [random_like(calls[0], CALIBRATION_DRAWS + 1)]
        with torch.no_grad():
            reference = [gm(*args) for args in held_out]
    convolutions = any(_is_conv(gm, n) for n in qdq_layers(gm) if n.name in ranges)
    # The layers are chosen on the graph run eagerly, keeping a share of the tolerance (MARGINS) for the compiled
    # kernels, which round a little differently (their requantized outputs drift from the decomposed ops' through
    # a deep network: ResNet-50's cosine 0.99936 eagerly, 0.99894 compiled). Convolutions' residual connections
    # are quantized too (faster) unless that keeps fewer layers. Where the compiled graph still breaks the
    # tolerance: compiled again without them, then with the smaller margin.
    attempts = [(convolutions, MARGINS[0])] + ([(False, MARGINS[0])] if convolutions else []) + [(False, MARGINS[1])]
    frozen, refusal, chosen, tried = None, None, None, set()
    for attempt, (residuals, margin) in enumerate(attempts):
        if (residuals, margin) in tried:
            continue
        choice = _choice(gm, held_out, ranges, tolerance, margin, residuals)
        if attempt == 0 and residuals and len(choice.reduced) < len(choice.layers):
            alone = _choice(gm, held_out, ranges, tolerance, margin, False)
            if len(alone.reduced) > len(choice.reduced):
                choice, residuals = alone, False
        tried.add((residuals, margin))
        if chosen is None:
            chosen = choice
        if not choice.reduced:
            break
        try:
            frozen = FrozenInt8(gm, choice.reduced, observing, float32_plan.executable, dynamic=dynamic,
                                residuals=residuals)
            frozen.build(ranges)
            with isolated(gm, inputs=(calls[0], {})), torch.no_grad():
                found = agreement(reference, [frozen(*args) for args in held_out], tolerance.metric)
        except Exception as error:  # noqa: BLE001 - a compile failure refuses the int8 plan with its reason
            report.notes.append(f"precision int8: float32 kept: Inductor could not compile the int8 graph "
                                f"({type(error).__name__}: {first_line(error)})")
            return float32_plan
        chosen, refusal = choice, tolerance.refusal(found)
        how = ("the convolutions' residual connections read them quantized too" if residuals else
               "only the layers read them quantized")
        summary = (f"{len(choice.reduced)} of {len(choice.layers)} layers in int8 (static: inputs in the ranges "
                   f"calibrated on {len(observing)} calls, clamped beyond them; {how}; chosen keeping "
                   f"{margin:.0%} of the tolerance); the compiled graph against float32 on {len(held_out)} calls: "
                   f"{found.describe()} (tolerance: {tolerance.describe()})")
        if refusal is None:
            break
        if attempt + 1 < len(attempts):
            report.notes.append(f"precision int8: compiled again: {summary} breaks it: {refusal}")
    report.tuning.extend(layer.tuning() for layer in chosen.layers)
    if not chosen.reduced:
        report.notes.append(f"precision int8: float32 kept: {chosen.refusal}")
        return float32_plan
    if refusal is not None:
        report.notes.append(f"precision int8: float32 kept: the compiled int8 graph breaks the tolerance: {refusal}; "
                            f"{summary}")
        return float32_plan
    with torch.no_grad():
        timings = time_interleaved({"float32": lambda: float32_plan.executable(*calls[0]),
                                    "int8": lambda: frozen(*calls[0])}, TIMING_BUDGET_S, decisive=DECISIVE)
    faster = timings["int8"] < timings["float32"] * (1 - DECISIVE)
    report.tuning.append(Tuning("precision", "graph", "int8" if faster else "float32", timings,
                                "" if faster else "not faster than float32 on the example inputs"))
    against = f"{timings['int8']:.3g} ms against float32's {timings['float32']:.3g} ms"
    if not faster:
        report.notes.append(f"precision int8: float32 kept: not faster ({against}) with {summary}")
        return float32_plan
    copies = ("; its inputs are copied on each call (Inductor's int8 kernel adds a residual into the tensor it is "
              "given, which was an input)" if frozen.copies_inputs else "")
    report.notes.append(f"precision int8: {summary}; {against}; compiled by Inductor with freezing in "
                        f"{time.perf_counter() - start:.1f} s: a changed weight is quantized and compiled again on "
                        f"the next call{copies}")
    derived = DerivedValues([*float32_plan.derived.items, frozen.refreezing()])
    return Plan(captured, frozen, derived)
