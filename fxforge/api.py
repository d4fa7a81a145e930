"""The public entry point that wraps a model: ``optimize`` (function and decorator), a thin door to the targets.

Example:
    >>> opt = fxforge.optimize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.ones(2, 4),))
    >>> opt(torch.ones(2, 4)).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import functools
from typing import Any

from fxforge.rewrites.registry import resolve
from fxforge.targets import lookup


def optimize(model: Any = None, example_inputs: Any = None, *, target: str = "native", rewrites: Any = "default",
             verify: bool = True, method: str = "auto", dynamic: bool | None = None, memory_budget: Any = None,
             objective: str = "latency", **target_options: Any) -> Any:
    """Capture, rewrite and run a model through fxforge.

    Three forms:

    - ``fxforge.optimize(model, example_inputs)`` returns an :class:`OptimizedModule` (an ``nn.Module``
      sharing the model's parameters); with example inputs it captures now, otherwise on the first call.
    - ``@fxforge.optimize`` on an ``nn.Module`` class: instances capture themselves on their first call.
    - ``@fxforge.optimize(target=..., rewrites=...)``: the same, with options.

    With ``target="inductor"`` the module is as with ``"native"`` (same guards, plan cache and live weights),
    but each plan's rewritten graph is compiled by ``torch.compile`` (checked against it on the example
    inputs; conv+activation fusion left to Inductor; see :mod:`fxforge.lowering.inductor`).

    With ``target="auto"`` every target (``targets=``, by default all three) is built, checked against eager
    on fresh inputs and timed against the others on the example inputs, and the fastest is returned, its
    ``report.race`` listing every contender's latency, prepare time and error, and why it won (see
    :mod:`fxforge.targets.auto`). ``budget_s`` (default 300) bounds the search: a build that would
    not fit in what is left (Inductor's compile, estimated from the graph's size) is skipped with that
    reason. The choice is remembered on disk per model structure, input signature, machine and library
    versions, so the next optimize of the same model builds only the winner (``FXFORGE_TARGET_CACHE=0``
    races every time). It needs example inputs and a model instance.

    With ``target="onnxruntime"`` the model is exported with :func:`fxforge.export_onnx` (for the example
    inputs or the first call's) and runs in an ONNX Runtime session: an
    :class:`~fxforge.exporters.ort_module.OnnxRuntimeModule` (CUDA provider when torch sees a GPU, CPU
    otherwise; outputs in the model's own structure; inputs the file does not take raise
    :class:`~fxforge.exporters.ort_module.InputShapeError`). ``dynamic`` decides how it meets other sizes:
    True exports once with the batch and sequence dims dynamic (``export_onnx(..., dynamic=True)``), and
    that one session serves every batch size and length; None (the default) exports the example's shapes,
    then, on the first call that differs from them only in sizes, exports once more with the dims that
    changed (and the batch and sequence dims) dynamic and serves every later size with that session; False
    exports once, static. ``dynamic_batch`` / ``dynamic_shapes`` choose the dims themselves (one export).
    The module's ``exports`` counts the exports made. Decorated classes run eagerly in training mode and
    export on their first call in eval mode.

    With ``memory_budget`` (a model in training mode, and example inputs) the result is a
    :class:`~fxforge.training.module.CheckpointedModule`: the training step recomputes in the backward what
    its ``plan`` chose so that the simulated peak fits the budget with the least recompute time. ``"60%"`` is
    60 % of the unconstrained activation peak; bytes (an int, or ``"2GiB"``) cap the whole step's peak,
    weights, gradients and optimizer state included (``optimizer=``, default ``torch.optim.AdamW``, says
    what the optimizer keeps; ``loss=``, the caller's loss over the outputs, lets the plan count what that
    loss allocates). On CPU each plan is checked on one measured step (``check=False`` skips it) and made again
    with the excess kept back where that step held more than the budget. Outputs, gradients and batch-norm
    statistics are eager's; in eval mode or without grad the model runs eagerly. ``target="inductor"``
    compiles the plan's forward and backward graphs with Inductor (fused kernels, the plan's saved values;
    outputs and gradients eager's to float rounding).

    With ``objective="throughput"`` (``target="native"`` or ``"onnxruntime"``, a model instance and example inputs:
    one request)
    the result serves a stream of independent requests: streams (worker threads) x intra-op threads per stream
    x batch size are chosen by measurement (a few seconds on a small model; ``throughput_budget_s=`` seconds of
    timing, default 3), batching only where the example proves the model batch-separable;
    ``opt.map(requests)`` returns each request's outputs, and ``opt(x)`` is safe from many threads at once.
    ``opt.report.throughput`` lists every configuration tried (samples/s, p50/p90/p99 latency, utilization;
    ``.frame()``), the choice marked (:mod:`fxforge.runtime.throughput`, ``docs/throughput.md``). The default,
    ``"latency"``, is one call at a time with every core.

    Args:
        model: an ``nn.Module`` instance or class (or None for the decorator-with-options form).
        example_inputs: a tuple of inputs, one tensor, or a dict of keyword inputs.
        target: ``"native"`` (run the rewritten graph with PyTorch), ``"inductor"`` (compile it with
            ``torch.compile``), ``"onnxruntime"``, or ``"auto"`` (the fastest of them, measured).
        rewrites: ``"default"``, a list of built-in names, or pass objects.
        verify: check every rewrite numerically and roll back one that changes results.
        method: capture method, ``"auto"``, ``"fx"`` or ``"export"``.
        objective: ``"latency"`` (one call at a time) or ``"throughput"`` (many independent requests; see above).
        dynamic: how plans meet other sizes (``"native"``/``"inductor"``; ``"onnxruntime"``: see above). None:
            the first plan is for the example's sizes, and the dims a later call changes become dynamic in
            one new plan (as ``torch.compile``), except that a model taking token inputs (integer or bool
            tensors of rank >= 2: ids, masks) has its batch and sequence dims dynamic from the first plan,
            every request having its own length. True: every dim dynamic from the first plan. False: one
            plan per input signature. A dynamic batch dim includes a batch of one where the model allows.
        target_options: for ``"native"``: ``tuning`` (a :class:`~fxforge.lowering.autotune.TuningPolicy`:
            choices autotune must not measure), ``dynamic_shapes``, ``max_plans``; for ``"inductor"`` the
            last two. For ``"onnxruntime"``: ``dynamic_batch``,
            ``dynamic_shapes``, ``opset``, ``attention``, ``external_data`` (see :func:`fxforge.export_onnx`),
            ``path`` (keep the ONNX file there), ``providers``, ``session_options``,
            ``intra_op_num_threads`` (the session's). For ``"auto"``: ``targets`` (a list of the three),
            ``budget_s`` (seconds, None for no limit), ``max_plans``.

    Each target is one module of :mod:`fxforge.targets` (``fxforge.targets.TARGETS`` lists them, with what
    each serves: ``TARGETS[name].contract``); this function checks the options once and hands the model to
    the target.

    Raises:
        ValueError: an unknown target, rewrite name or objective, or ``objective="throughput"`` with what it does
            not serve (checked before anything runs).
        TypeError: an option the target does not take.

    Example:
        >>> @fxforge.optimize
        ... class Net(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x.relu()
        >>> Net()(-torch.ones(1)).tolist()
        [0.0]
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()).eval()
        >>> ort_net = fxforge.optimize(model, (torch.ones(2, 3),), target="onnxruntime", dynamic_batch=True)
        >>> ort_net(-torch.ones(4, 3)).shape, ort_net.providers[-1]
        (torch.Size([4, 3]), 'CPUExecutionProvider')
    """
    chosen = lookup(target)
    _check_objective(objective, target, model, example_inputs, memory_budget)
    if objective == "throughput":
        target_options["objective"] = objective
    if memory_budget is not None:
        return chosen.checkpointed(model, example_inputs, memory_budget, **target_options)
    options = chosen.check({"rewrites": rewrites, "verify": verify, "method": method, "dynamic": dynamic,
                            **target_options})
    resolve(rewrites)  # fail early on an unknown rewrite name
    if model is None:
        return functools.partial(optimize, example_inputs=example_inputs, target=target, **options)
    return chosen.build(model, example_inputs, options)


# The targets objective="throughput" serves: their calls run on the stream's intra-op threads (torch's, or an ONNX
# Runtime session of that many); Inductor's kernels fix their OpenMP thread count when they compile.
THROUGHPUT_TARGETS = ("native", "onnxruntime")


def _check_objective(objective: str, target: str, model: Any, example_inputs: Any, memory_budget: Any) -> None:
    """``objective`` is one optimize serves with the other arguments given (raises ValueError naming the one
    that is not).

    Example:
        >>> _check_objective("throughput", "inductor", torch.nn.ReLU(), torch.ones(1), None)
        Traceback (most recent call last):
        ...
        ValueError: objective='throughput' runs with target='native' or 'onnxruntime', not target='inductor'
    """
    if objective not in ("latency", "throughput"):
        raise ValueError(f"objective must be 'latency' or 'throughput', got {objective!r}")
    if objective == "latency":
        return
    if target not in THROUGHPUT_TARGETS:
        raise ValueError(f"objective='throughput' runs with target='native' or 'onnxruntime', not target={target!r}")
    if memory_budget is not None:
        raise ValueError("objective='throughput' serves inference requests; memory_budget plans a training step: "
                         "give one or the other")
    if model is None or isinstance(model, type):
        raise ValueError("objective='throughput' needs a model instance, not a class or the decorator form: it "
                         "measures the model on its example inputs")
    if example_inputs is None:
        raise ValueError("objective='throughput' needs example_inputs (one request): it measures on them")
    import torch
    from torch.utils._pytree import tree_flatten

    tensors = [*tree_flatten(example_inputs)[0], *getattr(model, "parameters", list)()]
    device = next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "cpu"), None)
    if device is not None:
        raise ValueError(f"objective='throughput' chooses CPU streams x threads; the model or example_inputs are on "
                         f"{device.type}: use objective='latency' there")


def parallelize(model: Any, example_inputs: Any, devices: int = 4, memory_per_device: Any = None, loss: Any = None,
                optimizer: Any = "adamw", mesh: dict[str, int] | None = None, **options: Any) -> Any:
    """Plan data, fully sharded, tensor and pipeline parallelism for training ``model`` on ``devices``.

    Returns a :class:`~fxforge.parallel.plan.ParallelPlan`: ``.strategy`` (``{"dp", "fsdp", "tp", "pp"}``),
    ``.tp_plan`` (module -> ``"colwise" | "rowwise" | "sequence" | "vocab" | "replicate"``), ``.candidates``
    (every mesh with its predicted step time, memory per device and collective bytes; those that do not fit
    refused with the figure) and ``.why``. ``fxforge.parallel.run(plan, inputs)`` runs it on local processes
    and checks it against the model in one. See :func:`fxforge.parallel.planner.parallelize` for the options.

    Example (slow: measures the link once, then cached)::

        plan = fxforge.parallelize(model, (ids,), devices=2, memory_per_device="4GiB")
        print(plan)
        result = fxforge.parallel.run(plan, (ids,), steps=3)
    """
    from fxforge.parallel.planner import parallelize as plan

    return plan(model, example_inputs, devices, memory_per_device, loss, optimizer, mesh, **options)
