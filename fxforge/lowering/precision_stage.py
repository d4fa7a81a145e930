"""The precision stage of a plan: a rewritten graph's matrix products and convolutions in bfloat16 or float16
where the outputs keep the tolerance and the graph runs faster, else float32 with the reason.

Between the rewrites and lowering, for calls that record no gradients: the layers are chosen on calibration
calls (the example inputs and two random draws of their statistics, :func:`~fxforge.core.verify.random_like`)
by :func:`~fxforge.lowering.precision_choice.choose_layers`; the reduced graph (a new GraphModule sharing the
model's tensors, the reduced weights folded from them) is then timed against the float32 one on the example
inputs, both lowered, and kept only where it is faster. The report gets one line per layer (its precision, its
agreement reduced alone where measured, the reason where it stays in float32) and a note with the outputs'
agreement and both timings.

Example:
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).eval()
    >>> new = fxforge.rewrite(fxforge.capture(model, (torch.randn(32, 64),)), [])
    >>> reduced = with_precision(new, "bf16", None)
    >>> reduced.report.notes[-1].startswith("precision bf16: ")
    True
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

import torch

from fxforge.core.accuracy import Tolerance
from fxforge.core.captured import Captured
from fxforge.core.report import Tuning
from fxforge.core.verify import random_like
from fxforge.lowering.lower import lower
from fxforge.lowering.precision import reduce_layers
from fxforge.lowering.precision_choice import choose_layers
from fxforge.lowering.timing import DECISIVE, time_interleaved

PRECISIONS = {"float32": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
              "float16": torch.float16}
CALIBRATION_DRAWS = 2  # random calls besides the example
TIMING_BUDGET_S = 1.0


def precision_dtype(precision: str) -> torch.dtype | None:
    """The dtype ``precision`` names (None: float32, nothing reduced).

    Raises:
        ValueError: a name fxforge does not reduce to.

    Example:
        >>> precision_dtype("bf16"), precision_dtype("float32")
        (torch.bfloat16, None)
        >>> precision_dtype("int4")
        Traceback (most recent call last):
        ...
        ValueError: precision='int4': expected one of float32, bf16, bfloat16, fp16, float16
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def _positional(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> tuple:
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def with_precision(rewritten: Captured, precision: str, tolerance: Any) -> Captured:
    """``rewritten`` with its layers in ``precision`` where they keep ``tolerance`` (see :class:`Tolerance`) and
    the graph runs faster; otherwise ``rewritten`` itself, the reason in its report's notes."""
    dtype = precision_dtype(precision)
    if dtype is None:
        return rewritten
    tolerance = Tolerance.of(tolerance)
    gm, report = rewritten.graph_module, rewritten.report
    example = _positional(gm, rewritten.example_args, rewritten.example_kwargs)
    calls = [example] + [random_like(example, seed) for seed in range(1, CALIBRATION_DRAWS + 1)]
    choice = choose_layers(gm, calls, dtype, tolerance)
    for layer in choice.layers:
        where = f" ({layer.source})" if layer.source else ""
        measured = f"reduced alone: {layer.alone.describe()}" if layer.alone is not None else ""
        note = "; ".join(x for x in (layer.reason, measured) if x)
        report.tuning.append(Tuning("precision", f"{layer.name}{where}", layer.dtype, note=note, kind="accuracy"))
    if not choice.reduced:
        report.notes.append(f"precision {precision}: float32 kept: {choice.refusal}")
        return rewritten
    reduced = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # (the model's tensors, shared)
    reduced.meta.update(gm.meta)
    reduced.meta["fxforge_folds"] = dict(gm.meta.get("fxforge_folds", {}))
    chosen = set(choice.reduced)
    reduce_layers(reduced, [n for n in reduced.graph.nodes if n.name in chosen], dtype)
    runs = {"float32": lower(gm), precision: lower(reduced)}
    with torch.no_grad():
        timings = time_interleaved({name: (lambda run=run: run(*example)) for name, run in runs.items()},
                                   TIMING_BUDGET_S, decisive=DECISIVE)
    summary = (f"{len(choice.reduced)} of {len(choice.layers)} layers in {precision}; outputs against float32 on "
               f"{len(calls)} calls: {choice.agreement.describe()} (tolerance: relative error "
               f"{tolerance.relative_error:.3g}, cosine {tolerance.cosine}, top-1 {tolerance.top1:.0%})")
    faster = timings[precision] < timings["float32"] * (1 - DECISIVE)
    report.tuning.append(Tuning("precision", "graph", precision if faster else "float32", timings,
                                "" if faster else "not faster than float32 on the example inputs"))
    if not faster:
        report.notes.append(f"precision {precision}: float32 kept: not faster ({timings[precision]:.3g} ms against "
                            f"float32's {timings['float32']:.3g} ms) with {summary}")
        return rewritten
    report.notes.append(f"precision {precision}: {summary}; {timings[precision]:.3g} ms against float32's "
                        f"{timings['float32']:.3g} ms")
    return dataclasses.replace(rewritten, graph_module=reduced, lowered_run=None)
