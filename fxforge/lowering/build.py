"""Building a plan: capture -> rewrite -> lower, for one input signature (what the native and inductor
targets run).

- :func:`rewrite`: the rewrite stage with fxforge's autotune as its tuner (``fxforge.rewrite``);
- :class:`Lowering`: how a target turns a rewritten graph into a plan (the native target's kernels chosen by
  autotune, or Inductor's compile) and which rewrites it leaves to its own compiler;
- :func:`build_plan` / :func:`plan_builder`: a :class:`~fxforge.core.plan.Plan` for a call, which
  :class:`~fxforge.runtime.native.OptimizedModule` asks for per input signature.

Example:
    >>> import torch
    >>> plan = build_plan(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval(), (torch.ones(2, 4),), {})
    >>> plan.captured.method, plan.executable(torch.ones(2, 4)).shape
    ('fx', torch.Size([2, 4]))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxforge.capture import capture
from fxforge.capture.dynamic import capture_dynamic, capture_with_dims
from fxforge.core.captured import Captured
from fxforge.core.gc_pause import no_collection
from fxforge.core.plan import CallConditions, Plan
from fxforge.core.symbolic import ShapeGuard
from fxforge.lowering.autotune import MEASURE_ALL, TuningPolicy, autotune
from fxforge.lowering.lower import make_plan, plain_plan
from fxforge.lowering.precision_stage import precision_dtype, with_precision
from fxforge.rewrites import pipeline
from fxforge.rewrites.registry import resolve


def rewrite(captured: Captured, rewrites: Any = "default", verify: bool = True, *,
            tuning: TuningPolicy | None = MEASURE_ALL, conditions: CallConditions | None = None) -> Captured:
    """Apply rewrites to a captured graph and return a new ``Captured`` with a report.

    The rewrite stage (:func:`fxforge.rewrites.pipeline.rewrite`: passes in order, each verified, rolled
    back if it changes results) with fxforge's autotune measuring what passes cannot prove (which fused
    kernel and layout, and whether a fusion pays at all).

    Args:
        captured: from :func:`fxforge.capture`; left unchanged.
        rewrites: ``"default"``, a list of built-in names, or pass objects.
        verify: check the rewrites numerically.
        tuning: autotune's :class:`~fxforge.lowering.autotune.TuningPolicy` (choices it must not measure);
            None: nothing is timed and fused ops keep their composite kernel (what an export wants).
        conditions: the calls the graph will serve (:class:`~fxforge.core.plan.CallConditions`; default:
            calls that record no gradients, outside autocast).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout()).eval()
        >>> rewrite(capture(model, (torch.ones(1, 2),))).report.counts
        {'cleanup': 1}
    """
    tuner = functools.partial(autotune, policy=tuning) if tuning is not None else None
    return pipeline.rewrite(captured, rewrites, verify, tuner=tuner, conditions=conditions)


@dataclasses.dataclass(frozen=True)
class Lowering:
    """How a target turns a rewritten graph into a plan.

    Attributes:
        lower: ``(rewritten, dynamic) -> Plan`` for calls that record no gradients.
        tuned: whether autotune times PyTorch's kernels for the rewrites (False: the rewrites are kept
            unmeasured, the compiler choosing its own kernels).
        left_out: rewrites the target's compiler does better itself (left out of its plans).
        reduced: ``(rewritten, dynamic, precision, tolerance) -> Plan`` for a target whose compiler reduces the
            precision itself (Inductor's int8); None: the precision stage reduces the rewritten graph
            (:func:`~fxforge.lowering.precision_stage.with_precision`) and ``lower`` lowers it.

    Example:
        >>> NATIVE.tuned, NATIVE.left_out, NATIVE.reduced
        (True, (), None)
    """

    lower: Callable[[Captured, bool], Plan]
    tuned: bool = True
    left_out: tuple[str, ...] = ()
    reduced: Callable[[Captured, bool, str, Any], Plan] | None = None


def _native_lower(captured: Captured, dynamic: bool) -> Plan:
    return make_plan(captured)


# The native target's lowering: fused ops as direct calls of the kernels autotune chose.
NATIVE = Lowering(_native_lower)


def build_plan(module: nn.Module, args: tuple, kwargs: dict, conditions: CallConditions | None = None,
               dynamic: Any = None, *, rewrites: Any = "default", verify: bool = True, method: str = "auto",
               tuning: TuningPolicy = MEASURE_ALL, lowering: Lowering = NATIVE, precision: str = "float32",
               tolerance: Any = None) -> Plan:
    """Capture ``module`` for these inputs, rewrite it for calls made under ``conditions`` (autotune choosing
    kernels and layout), lower it with ``lowering``.

    A plan for calls that record gradients, or run under autocast, keeps eager's ops where gradients or
    autocast need them (no folded parameters, no fused kernels) and runs its rewritten graph as it is. Other
    plans run their matrix products and convolutions in ``precision`` (``"bf16"``, ``"fp16"``) where the outputs
    keep ``tolerance`` and the graph measures faster (:mod:`fxforge.lowering.precision_stage`). Plans
    are built outside inference mode, so that what they compute once (folded and prepacked weights) is an
    ordinary tensor whatever mode the first call was made in.

    ``dynamic`` makes the plan serve many sizes: a set of input dims ``(leaf, dim)`` of the flattened
    ``(args, kwargs)`` (captured by :func:`~fxforge.capture.dynamic.capture_with_dims`), or a
    ``dynamic_shapes`` spec in torch.export's format. The graph then has symbolic sizes; the plan's
    ``shapes`` (a :class:`~fxforge.core.symbolic.ShapeGuard`) says which calls it serves, including the size
    relations rewrites assumed (listed in the report's notes). ``"fx"``: a plan for these inputs captured by
    torch.fx's symbolic trace (which records sizes as the ops that read them), whatever ``method`` says: what
    an optimized module tries at new sizes (after a check against eager) where torch.export specialises a dim.

    Raises:
        CaptureError: the module could not be captured (with those dims dynamic).

    Example:
        >>> plan = build_plan(torch.nn.ReLU(), (torch.ones(2),), {})
        >>> plan.report.method
        'fx'
    """
    conditions = conditions or CallConditions()
    with torch.inference_mode(False), no_collection():
        if dynamic is None or dynamic == "fx":
            how = "fx" if dynamic == "fx" else method
            captured, guard = capture(module, args, how, example_kwargs=kwargs, check=verify), None
        else:
            if isinstance(dynamic, (set, frozenset)):
                captured = capture_with_dims(module, args, kwargs, dynamic)
            else:
                captured = capture_dynamic(module, args, kwargs, dynamic)
            guard = ShapeGuard.of(captured.graph_module, captured.graph_module.meta.get("fxforge_ranges"))
        eager_ops = conditions.gradients or bool(conditions.autocast)  # no fused ops: nothing to time or lower
        if eager_ops:
            rewritten = rewrite(captured, rewrites, verify=verify, tuning=None, conditions=conditions)
            plan = plain_plan(rewritten)
        else:
            kept = [p for p in resolve(rewrites) if p.name not in lowering.left_out] if lowering.left_out else rewrites
            rewritten = rewrite(captured, kept, verify=verify, tuning=tuning if lowering.tuned else None,
                                conditions=conditions)
            symbolic = dynamic is not None and dynamic != "fx"
            if lowering.reduced is not None and precision_dtype(precision) is not None:
                plan = lowering.reduced(rewritten, symbolic, precision, tolerance)
            else:
                plan = lowering.lower(with_precision(rewritten, precision, tolerance), symbolic)
    if guard is not None and guard.symbols:
        plan.shapes = guard
        assumed = guard.take_assumptions()
        plan.report.notes.append(f"dynamic sizes: {guard.describe()}" + (
            f"; rewrites assumed {', '.join(assumed)} (checked per input signature)" if assumed else ""))
    return plan


def plan_builder(module: nn.Module, **options: Any) -> Callable[..., Plan]:
    """``(args, kwargs, conditions, dynamic=None) -> Plan`` for ``module``: what an optimized module calls
    for a call it has no plan for.

    Args:
        module: the model.
        options: ``rewrites``, ``verify``, ``method``, ``tuning``, ``lowering``, ``precision``, ``tolerance``
            (see :func:`build_plan`).

    Example:
        >>> build = plan_builder(torch.nn.ReLU(), rewrites=[])
        >>> build((torch.ones(1),), {}, CallConditions()).report.counts
        {}
    """
    return functools.partial(_build, module, options)


def _build(module: nn.Module, options: dict, args: tuple, kwargs: dict, conditions: CallConditions,
           dynamic: Any = None) -> Plan:
    return build_plan(module, args, kwargs, conditions, dynamic, **options)
