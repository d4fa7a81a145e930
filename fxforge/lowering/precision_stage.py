"""The precision stage of a plan: a rewritten graph's matrix products and convolutions in bfloat16, float16 or
int8 where the outputs keep the tolerance and the graph runs faster, else float32 with the reason.

Between the rewrites and lowering, for calls that record no gradients: the layers are chosen on calibration
calls (the example inputs and two random draws of their statistics, :func:`~fxforge.core.verify.random_like`)
by :func:`~fxforge.lowering.precision_choice.choose_layers`; the reduced graph (a new GraphModule sharing the
model's tensors, the reduced weights folded from them) is then timed against the float32 one on the example
inputs, both lowered, and kept only where it is faster. The report gets one line per layer (its precision, its
agreement reduced alone where measured, the reason where it stays in float32) and a note with the outputs'
agreement and both timings.

Int8 (:mod:`fxforge.lowering.int8`): linear layers quantize their inputs per token at call time; convolutions
quantize theirs with the range observed on the calibration calls, and the agreement is measured on one call
more that the observers did not see. On a GPU only the linear layers run in int8 (cuBLAS's int8 product
through ``torch._int_mm``): no int8 convolution kernel is at hand there. ``"auto"`` builds each precision the inputs' device has fast kernels for
(bf16 and int8 on CPU, bf16 and fp16 on CUDA) and races them against float32 in one timing: the fastest that
keeps the tolerance and beats float32 is kept.

Example:
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).eval()
    >>> new = fxforge.rewrite(fxforge.capture(model, (torch.randn(32, 64),)), [])
    >>> reduced = with_precision(new, "bf16", None)
    >>> reduced.report.notes[-1].startswith("precision bf16: ")
    True
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxforge.core.accuracy import Tolerance
from fxforge.core.captured import Captured
from fxforge.core.report import Tuning
from fxforge.core.source import node_source
from fxforge.core.verify import random_like
from fxforge.lowering.int8 import Int8Reduction, int8_layers
from fxforge.lowering.int8_ranges import observe_inputs
from fxforge.lowering.int8_speed import layer_speeds
from fxforge.lowering.lower import lower
from fxforge.lowering.precision_choice import FloatReduction, choose_layers
from fxforge.lowering.timing import DECISIVE, time_interleaved

PRECISIONS = {"float32": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
              "float16": torch.float16, "int8": "int8", "auto": "auto"}
CALIBRATION_DRAWS = 2  # random calls besides the example
TIMING_BUDGET_S = 1.0


def precision_dtype(precision: str) -> torch.dtype | str | None:
    """What ``precision`` names: a reduced floating-point dtype, ``"int8"``, ``"auto"`` (the fastest of those that
    keep the tolerance), or None (float32, nothing reduced).

    Raises:
        ValueError: a name fxforge does not reduce to.

    Example:
        >>> precision_dtype("bf16"), precision_dtype("int8"), precision_dtype("float32")
        (torch.bfloat16, 'int8', None)
        >>> precision_dtype("int4")
        Traceback (most recent call last):
        ...
        ValueError: precision='int4': expected one of float32, bf16, bfloat16, fp16, float16, int8, auto
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def _positional(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> tuple | None:
    """The example call as positional arguments of the graph (None: it takes keyword-only ones)."""
    if not kwargs:
        return tuple(args)
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return None if bound.kwargs else tuple(bound.args)  # (a ``**kwargs`` left empty is not an argument)


# Why a graph that takes keyword-only inputs keeps float32.
KEYWORD_ONLY = "the graph takes keyword-only inputs, which the calibration calls do not vary yet"


def calibration_calls(rewritten: Captured) -> list[tuple] | None:
    """The calls a precision is chosen on: the example as positional arguments of the graph, then
    ``CALIBRATION_DRAWS`` random draws of its statistics (:func:`~fxforge.core.verify.random_like`); None where
    the graph takes keyword-only inputs.

    Example:
        >>> len(calibration_calls(fxforge.capture(torch.nn.ReLU(), (torch.ones(2),))))
        3
    """
    example = _positional(rewritten.graph_module, rewritten.example_args, rewritten.example_kwargs)
    if example is None:
        return None
    return [example] + [random_like(example, seed) for seed in range(1, CALIBRATION_DRAWS + 1)]


def _raced(precision: str, example: tuple) -> list[str]:
    """The precisions ``precision`` tries: itself, or for ``"auto"`` those with fast kernels on the inputs' device
    (bf16 and int8 on CPU; bf16 and fp16 on CUDA)."""
    if precision != "auto":
        return [precision]
    return ["bf16", "fp16"] if "cuda" in _devices(example) else ["bf16", "int8"]


def _devices(example: tuple) -> set[str]:
    return {t.device.type for t in pytree.tree_leaves(example) if isinstance(t, torch.Tensor)}


def _candidate(gm: torch.fx.GraphModule, precision: str, calls: list, tolerance: Tolerance, report: Any
               ) -> tuple[torch.fx.GraphModule | None, str]:
    """The graph with its layers in ``precision`` where they keep ``tolerance`` on ``calls`` (None: no layer
    does), and the one-line summary of the choice; each layer's line goes to ``report``."""
    kind = precision_dtype(precision)
    if kind == "int8":
        # Static convolution inputs: observed on the calibration calls; the agreement is measured on those and one
        # call more that the observers did not see.
        names = [n.name for n in int8_layers(gm)]
        ranges = observe_inputs(gm, calls, names)
        offered = Int8Reduction(ranges, convolutions=_devices(calls[0]) <= {"cpu"})
        speeds = layer_speeds(gm, calls[0], [n.name for n in offered.layers(gm)], ranges)
        reduction = Int8Reduction(ranges, offered.convolutions, speeds)
        calls = calls + [random_like(calls[0], CALIBRATION_DRAWS + 1)]
    else:
        reduction, speeds = FloatReduction(kind), {}
    choice = choose_layers(gm, calls, reduction, tolerance)
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, speed in speeds.items():
        if not speed.faster:
            source = node_source(nodes[name])
            where = f" ({source})" if source else ""
            report.tuning.append(Tuning("precision", f"{name}{where}", "float32", kind="speed",
                                        note=f"kept in float32: not faster in {precision} at its size "
                                             f"({speed.describe()})"))
    for layer in choice.layers:
        report.tuning.append(layer.tuning(speeds[layer.name].describe() if layer.name in speeds else ""))
    if not choice.reduced:
        if speeds and not any(speed.faster for speed in speeds.values()):
            return None, f"no layer is faster in {precision} at its size"
        return None, choice.refusal or ""
    reduced = reduction.apply(gm, set(choice.reduced))  # (a new GraphModule, the model's tensors shared)
    summary = (f"{len(choice.reduced)} of {len(choice.layers)} layers in {precision}; outputs against float32 on "
               f"{len(calls)} calls: {choice.agreement.describe()} (tolerance: {tolerance.describe()})")
    return reduced, summary


def with_precision(rewritten: Captured, precision: str, tolerance: Any) -> Captured:
    """``rewritten`` with its layers in ``precision`` where they keep ``tolerance`` (see :class:`Tolerance`) and
    the graph runs faster (``"auto"``: the fastest of the precisions raced); otherwise ``rewritten`` itself, the
    reason in its report's notes."""
    if precision_dtype(precision) is None:
        return rewritten
    tolerance = Tolerance.of(tolerance)
    gm, report = rewritten.graph_module, rewritten.report
    calls = calibration_calls(rewritten)
    if calls is None:
        report.notes.append(f"precision {precision}: float32 kept: {KEYWORD_ONLY}")
        return rewritten
    candidates, summaries = {}, {}
    for name in _raced(precision, calls[0]):
        reduced, summaries[name] = _candidate(gm, name, calls, tolerance, report)
        if reduced is None:
            report.notes.append(f"precision {name}: float32 kept: {summaries[name]}")
        else:
            candidates[name] = reduced
    if not candidates:
        return rewritten
    runs = {"float32": lower(gm), **{name: lower(reduced) for name, reduced in candidates.items()}}
    with torch.no_grad():
        timings = time_interleaved({name: (lambda run=run: run(*calls[0])) for name, run in runs.items()},
                                   TIMING_BUDGET_S, decisive=DECISIVE)
    best = min(candidates, key=timings.__getitem__)
    faster = timings[best] < timings["float32"] * (1 - DECISIVE)
    report.tuning.append(Tuning("precision", "graph", best if faster else "float32", timings,
                                "" if faster else "not faster than float32 on the example inputs"))
    for name in candidates:
        against = f"{timings[name]:.3g} ms against float32's {timings['float32']:.3g} ms"
        if name == best and faster:
            report.notes.append(f"precision {name}: {summaries[name]}; {against}")
        elif timings[name] < timings["float32"] * (1 - DECISIVE):
            report.notes.append(f"precision {name}: not kept: slower than {best} ({against}) with {summaries[name]}")
        else:
            report.notes.append(f"precision {name}: float32 kept: not faster ({against}) with {summaries[name]}")
    if not faster:
        return rewritten
    return dataclasses.replace(rewritten, graph_module=candidates[best], lowered_run=None)
