"""``rewrite()``: run passes in order, lint after each, verify each against the graph before it.

Example:
    >>> import torch, fxforge
    >>> cap = fxforge.capture(torch.nn.Sequential(torch.nn.Identity(), torch.nn.ReLU()), (torch.ones(2),))
    >>> rewrite(cap).report.counts
    {'cleanup': 1}
"""

from __future__ import annotations

from typing import Any

import torch

from fxforge.core.captured import Captured, LoweredRun
from fxforge.core.nodes import copy_graph_module, count_calls
from fxforge.core.plan import CallConditions
from fxforge.core.report import Report, RolledBack
from fxforge.core.shapes import annotate
from fxforge.core.source import first_line
from fxforge.core.verify import (
    Comparison,
    Float64Reference,
    check_same,
    isolated,
    random_like,
    with_special_values,
)
from fxforge.rewrites.passes import PassContext, Tuner
from fxforge.rewrites.registry import resolve

# Example inputs plus this many random inputs of the same shapes and dtypes.
RANDOM_CHECKS = 2


def verification_inputs(captured: Captured, count: int = RANDOM_CHECKS) -> list[tuple[tuple, dict]]:
    """The inputs each pass is checked on: the example inputs, then ``count`` random ones like them, the last
    with special values in its first batch element (:func:`~fxforge.core.verify.with_special_values`: a NaN,
    masks hiding every key).

    Example:
        >>> import fxforge
        >>> cap = fxforge.capture(torch.nn.ReLU(), (torch.ones(2, 3),))
        >>> inputs = verification_inputs(cap)
        >>> len(inputs), bool(inputs[-1][0][0][0, 0].isnan())
        (3, True)
    """
    inputs = [(captured.example_args, captured.example_kwargs)]
    for seed in range(1, count + 1):
        inputs.append(random_like((captured.example_args, captured.example_kwargs), seed=seed))
    if count:
        inputs[-1] = with_special_values(inputs[-1])
    return inputs


def _outputs(gm: torch.fx.GraphModule, inputs: list[tuple[tuple, dict]], modules: list,
             first_seed: int = 0) -> list[Any]:
    outputs = []
    for i, (args, kwargs) in enumerate(inputs, start=first_seed):
        with isolated(*modules, seed=i, inputs=(args, kwargs)), torch.no_grad():
            outputs.append(gm(*args, **kwargs))
    return outputs


def rewrite(captured: Captured, rewrites: Any = "default", verify: bool = True, *,
            tuner: Tuner | None = None, conditions: CallConditions | None = None) -> Captured:
    """Apply rewrites to a captured graph and return a new ``Captured`` with a report.

    Passes run in order. Each works on a copy of the graph (parameters shared, never modified) and the
    graph is linted after it. With ``verify=True`` the rewritten graph is compared with the captured one
    on the example inputs and on random inputs of the same shapes and dtypes (same RNG seed, buffers
    restored; a graph a pass already ran on those inputs, as autotune runs the graph it chose, is not run
    on them again: its outputs, handed on as a :class:`~fxforge.core.captured.LoweredRun`, are compared).
    When they agree, every pass is verified at once; when they do not (or the rewritten graph raises),
    the passes run again one at a time, each checked against the graph before it, and a pass that raises
    or changes results beyond tolerance is rolled back and reported with the error it caused. A difference
    beyond the float32 tolerance is judged against the captured graph run in float64 first: a rewrite no
    farther from that exact result than float32 rounding takes the reference itself (a model with fifty
    folded BatchNorms) is kept, with a note; a real error (0.1 %) is rolled back.

    This is the rewrite stage alone: :func:`fxforge.rewrite` calls it with fxforge's autotune as the tuner.

    Args:
        captured: from :func:`fxforge.capture`; left unchanged.
        rewrites: ``"default"``, a list of built-in names, or pass objects.
        verify: check the rewrites numerically (recommended; costs one run of the graph per input, more
            only when a pass has to be found and rolled back).
        tuner: measures what passes cannot prove (see :class:`~fxforge.rewrites.passes.PassContext`); None:
            fused ops keep their composite kernel, unmeasured.
        conditions: the calls the graph will serve (:class:`~fxforge.core.plan.CallConditions`): passes
            refuse what does not hold for them, and verification runs under their autocast.

    Example:
        >>> import fxforge
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout()).eval()
        >>> new = rewrite(fxforge.capture(model, (torch.ones(1, 2),)))
        >>> new.report.counts, len(new.graph_module.graph.nodes) < len(model and [0] * 4)
        ({'cleanup': 1}, True)
    """
    passes = resolve(rewrites)
    conditions = conditions or CallConditions()
    with conditions.autocast_context():
        return _rewrite(captured, passes, verify, tuner, conditions)


def _rewrite(captured: Captured, passes: list, verify: bool, tuner: Tuner | None,
             conditions: CallConditions) -> Captured:
    if not verify:
        report = captured.report.copy()
        current, run = _apply(passes, captured, report, check=None, tuner=tuner, conditions=conditions)
        return _finish(captured, current, report, run)
    inputs = verification_inputs(captured)
    modules = [captured.module, captured.graph_module]
    plain, special = inputs[:-1], inputs[-1]  # the last has special values (NaN, masks hiding every key)
    if captured.example_outputs is not None:  # capture ran the model on the example inputs already
        reference = [captured.example_outputs, *_outputs(captured.graph_module, plain[1:], modules, first_seed=1)]
    else:
        reference = _outputs(captured.graph_module, plain, modules)
    try:
        reference += _outputs(captured.graph_module, [special], modules, first_seed=len(plain))
    except Exception:  # noqa: BLE001 - a model that refuses NaN (an assert) is checked without special values
        inputs = plain
    report = captured.report.copy()
    exact = Float64Reference(captured.graph_module, inputs)  # run only when a difference must be judged
    current, run = _apply(passes, captured, report, check=None, check_inputs=inputs, tuner=tuner,
                          conditions=conditions)
    if report.matches:
        try:
            result = check_same(captured.graph_module, current, inputs, [captured.module, current],
                                reference_outputs=reference, candidate_outputs=_ran(run, current, inputs),
                                exact=exact)
        except Exception:  # noqa: BLE001 - found and reported below, pass by pass
            result = None
        if result is not None and result.ok:
            applied = ", ".join(dict.fromkeys(m.rule for m in report.matches))
            report.verified.append(_verified(f"{applied}: verified together, ", result))
        else:
            report = captured.report.copy()
            current, run = _apply(passes, captured, report, check=(inputs, reference, exact), check_inputs=inputs,
                                  tuner=tuner, conditions=conditions)
    return _finish(captured, current, report, run)


def _ran(run: LoweredRun | None, graph_module: torch.fx.GraphModule, inputs: list) -> dict[int, Any]:
    """The outputs a tuner recorded for ``graph_module`` on ``inputs`` (empty if it computes another function)."""
    return run.outputs_for(graph_module, inputs) if run is not None else {}


def _verified(head: str, result: Comparison) -> str:
    """The report's line for a verified rewrite: ``head``, its error, and the note of a difference judged
    rounding."""
    return f"{head}max abs error {result.max_abs_err:.3g}" + (f" ({result.note})" if result.note else "")


def _finish(captured: Captured, current: torch.fx.GraphModule, report: Report, run: LoweredRun | None) -> Captured:
    report.nodes_after = count_calls(current.graph)
    run = run if run is not None and run.lowers(current) else None
    return captured.replace(graph_module=current, report=report, lowered_run=run, before=captured.before or captured)


def _apply(passes: list, captured: Captured, report: Report, check: tuple[list, list, Any] | None,
           check_inputs: list | None = None, tuner: Tuner | None = None,
           conditions: CallConditions | None = None) -> tuple[torch.fx.GraphModule, LoweredRun | None]:
    """Run ``passes`` from the captured graph, recording into ``report``; with ``check=(inputs,
    reference outputs, the float64 reference)`` verify each pass (its graph against the captured one's outputs, so errors
    cannot drift from pass to pass) and roll back those that differ. ``check_inputs`` (the verification
    inputs) and ``tuner`` go to the passes' context. Returns the graph and the latest lowered run a pass
    handed on (it may no longer match the graph)."""
    current, run = captured.graph_module, None
    reference = check[1] if check else None
    for rewrite_pass in passes:
        ctx = PassContext(rewrite_pass.name, training=captured.training, method=captured.method,
                          example_args=captured.example_args, example_kwargs=captured.example_kwargs,
                          check_inputs=check_inputs, tuner=tuner, conditions=conditions or CallConditions())
        candidate = copy_graph_module(current)
        try:
            rewrite_pass.apply(candidate, ctx)
            candidate.graph.lint()
            if ctx.matches:  # a pass that matched nothing leaves its copy unused: no code to generate
                candidate.recompile()
                # Passes that keep shape metadata up to date only need the nodes that lack it filled.
                force = not getattr(rewrite_pass, "keeps_meta", False)
                annotate(candidate, captured.example_args, captured.example_kwargs, force=force)
        except Exception as error:  # noqa: BLE001 - a broken pass is rolled back, never fatal
            report.rolled_back.append(RolledBack(rewrite_pass.name, len(ctx.matches), f"raised {first_line(error)}"))
            continue
        report.near_misses.extend(ctx.near_misses)
        report.tuning.extend(ctx.tuning)
        if not ctx.matches:
            continue
        if check is not None:
            inputs = check[0]
            modules = [captured.module, candidate]
            try:
                result = check_same(current, candidate, inputs, modules, reference_outputs=reference,
                                    candidate_outputs=_ran(ctx.lowered_run, candidate, inputs), exact=check[2])
            except Exception as error:  # noqa: BLE001 - a rewritten graph that cannot run is rolled back
                report.rolled_back.append(RolledBack(rewrite_pass.name, len(ctx.matches),
                                                     f"the rewritten graph raised {first_line(error)}"))
                continue
            if not result.ok:
                report.rolled_back.append(RolledBack(rewrite_pass.name, len(ctx.matches), result.reason))
                continue
            report.verified.append(_verified(f"{rewrite_pass.name}: ", result))
        report.matches.extend(ctx.matches)
        current, run = candidate, ctx.lowered_run or run
    return current, run
