"""Running a parallel plan for real and checking it: :func:`run` starts one local process per device
(gloo on CPU; NCCL with one GPU per rank where there are enough), runs forward + backward + the
optimizer's step (:mod:`fxforge.parallel.mesh_worker`), and sets the outputs and every parameter's
gradient of the first step against the model run in this one process on the whole batch; it measures the
steady step's time, per-device memory and every collective, next to what the plan predicted.

A plan with pipeline stages runs through :func:`fxforge.parallel.launch.run_pipeline` instead.

The batch is split over the data-parallel ranks (``dp x fsdp``) in equal parts, and their gradients are
averaged, so the loss must be a mean over the batch's rows (the default,
:func:`~fxforge.parallel.launch.square_mean_loss`, is).

Example (slow: starts processes)::

    plan = fxforge.parallelize(model, (ids,), devices=2, mesh={"tp": 2})
    result = fxforge.parallel.run(plan, (ids,), steps=3)
    result.max_error, result.grad_error, result.step_s, result.comm_bytes
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
from typing import Any

import torch

from fxforge.capture.model import normalize_inputs
from fxforge.core.memory import tensor_leaves
from fxforge.parallel.collectives import Collective, comparable, total_bytes
from fxforge.parallel.processes import run_workers

RTOL, ATOL = 1e-4, 1e-5
"""How close outputs and gradients must be to the single process's (sums in another order; float64 runs
land near 1e-15)."""
WARMUP_STEPS = 2
"""Steps before the measured ones: the optimizer creates its state in the first, DDP rebuilds its buckets
in the second."""


@dataclasses.dataclass(frozen=True)
class MeshRun:
    """What a run of a plan did, against the model in one process and the plan's predictions.

    Attributes:
        strategy: the mesh that ran; ``backend``: gloo or nccl.
        max_error: the largest absolute difference of an output from the single process's.
        grad_error: the largest absolute difference of a parameter's full gradient from the single process's.
        step_s: the median wall time of a measured step (the slowest rank's, between barriers).
        comm_bytes: bytes of every collective one rank took part in during a steady step (the full tensors':
            :class:`~fxforge.parallel.collectives.Collective`); for a pipeline, every stage's sends.
        collectives: rank 0's collectives of the steady step (a pipeline: every stage's sends).
        memory_per_device: the largest measured peak of a rank's steady step, in bytes (its share of the
            weights, buffers and optimizer state included); for a pipeline, of a stage's step.
        predicted_step_s, predicted_comm_bytes, predicted_memory: the plan's figures (None when not given).
        collectives_match: the counted collectives equal the predicted ones, record by record.
        ok: outputs and gradients within ``rtol=1e-4, atol=1e-5`` of the single process's.
    """

    strategy: dict[str, int]
    backend: str
    max_error: float
    grad_error: float
    step_s: float
    comm_bytes: int | None
    collectives: list[Collective]
    memory_per_device: int | None
    predicted_step_s: float | None = None
    predicted_comm_bytes: int | None = None
    predicted_memory: int | None = None
    collectives_match: bool | None = None
    step_seconds: tuple[float, ...] = ()
    ok: bool = False

    def __str__(self) -> str:
        from fxforge.parallel.strategy import name

        def vs(measured: float | None, predicted: float | None, unit: str, scale: float) -> str:
            text = "not measured" if measured is None else f"{measured * scale:.1f} {unit}"
            return text if predicted is None else f"{text} (predicted {predicted * scale:.1f})"

        return (f"{name(self.strategy)} on {self.backend}: outputs max error {self.max_error:.2e}, gradients "
                f"{self.grad_error:.2e}; step {vs(self.step_s, self.predicted_step_s, 'ms', 1e3)}, memory "
                f"{vs(self.memory_per_device, self.predicted_memory, 'MiB', 2**-20)} per device, collectives "
                f"{vs(self.comm_bytes, self.predicted_comm_bytes, 'KiB', 2**-10)}")


def reference(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Any
              ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None]]:
    """The single-process step a run must equal: outputs and each parameter's gradient, by name."""
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    loss_fn(out, None).backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
             for n, p in model.named_parameters(remove_duplicate=False)}
    return [t.detach() for t in tensor_leaves(out)], grads


def _max_difference(expected: list[torch.Tensor | None], got: list[torch.Tensor | None]) -> tuple[float, bool]:
    """The largest absolute difference, and whether every pair is close (:data:`RTOL`, :data:`ATOL`)."""
    error, close = 0.0, True
    if len(expected) != len(got):
        return float("inf"), False
    for e, g in zip(expected, got):
        if e is None or g is None:
            if (e is None) != (g is None) and float((e if e is not None else g).abs().max()) > 0:
                return float("inf"), False
            continue
        if e.shape != g.shape:
            return float("inf"), False
        if e.numel():
            e, g = e.detach().cpu(), g.detach().cpu()
            diff = (e.double() - g.double()).abs()
            error = max(error, float(diff.nan_to_num(nan=float("inf")).max()))
            close &= bool(torch.allclose(e, g, rtol=RTOL, atol=ATOL, equal_nan=True))
    return error, close


def run(plan: Any, example_inputs: Any, steps: int = 1, *, threads: int | None = None, timeout: float = 600.0,
        backend: str | None = None, dtype: torch.dtype | None = None, worker_setup: Any = None) -> MeshRun:
    """Run ``plan`` on local processes and check it against the model in this one process.

    Args:
        plan: a :class:`~fxforge.parallel.plan.ParallelPlan` (its model is sent pickled: its class must be
            importable; keep dropout off for an exact check).
        example_inputs: the whole batch (split over the data-parallel ranks).
        steps: measured steps, after :data:`WARMUP_STEPS`; the gradients are checked on the first step.
        threads: torch threads per process (default: this machine's cores shared among the ranks).
        backend: ``"gloo"`` or ``"nccl"`` (default nccl when there is a GPU per rank).
        dtype: run the model and the floating-point inputs in this dtype (copies); ``torch.float64``
            makes the check exact up to the order of sums.
        worker_setup: a module-level function each worker calls before it loads the model.

    Raises:
        RuntimeError: a rank failed (its own error is given) or the run did not finish in time.
    """
    from fxforge.parallel.launch import cast_floating, square_mean_loss
    from fxforge.parallel.strategy import devices_of, full

    strategy = full(plan.strategy)
    if strategy["pp"] > 1:
        return _pipeline(plan, example_inputs, steps, threads=threads, timeout=timeout, backend=backend,
                         dtype=dtype, worker_setup=worker_setup)
    world = devices_of(strategy)
    use_cuda = backend == "nccl" or (backend is None and torch.cuda.device_count() >= world)
    backend = backend or ("nccl" if use_cuda else "gloo")
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    loss_fn = plan.loss or square_mean_loss
    args, kwargs = cast_floating(normalize_inputs(example_inputs), dtype)
    model = copy.deepcopy(plan.model)
    if dtype is not None:
        model = model.to(dtype)
    payload = {"model": model, "strategy": strategy, "tp_plan": plan.tp, "args": args, "kwargs": kwargs,
               "loss_fn": loss_fn, "optimizer": plan.optimizer_factory, "steps": max(1, steps),
               "warmup": WARMUP_STEPS, "threads": threads, "backend": backend, "cuda": use_cuda}
    results = run_workers("fxforge.parallel.mesh_worker", payload, world, threads=threads, timeout=timeout,
                          worker_setup=worker_setup, what="rank")
    expected_out, expected_grads = reference(copy.deepcopy(model), args, kwargs, loss_fn)
    # Each data-parallel replica computed its rows; tensor-parallel ranks of one replica hold the same.
    firsts = {r["index"]: r for r in results}
    parts = [tensor_leaves(firsts[i]["output"]) for i in sorted(firsts)]
    got_out = [torch.cat(p) if p[0].dim() else p[0] for p in zip(*parts)]
    names = list(expected_grads)
    grads = results[0]["grads"]
    measured = [r["seconds"][WARMUP_STEPS:] for r in results]
    per_step = tuple(max(s[i] for s in measured) for i in range(len(measured[0])))
    predicted = getattr(plan, "chosen", None)
    predicted_collectives = getattr(plan, "collectives", None)
    counted = results[0]["collectives"]
    peak = max(max(r["memory"].values(), default=0) + sum(r["persistent"].values()) for r in results)
    out_error, out_close = _max_difference(expected_out, got_out)
    grad_error, grad_close = _max_difference([expected_grads[n] for n in names], [grads.get(n) for n in names])
    return MeshRun(
        strategy, backend, out_error, grad_error, statistics.median(per_step), total_bytes(counted), counted, peak,
        predicted_step_s=getattr(predicted, "step_s", None),
        predicted_comm_bytes=total_bytes(predicted_collectives) if predicted_collectives is not None else None,
        predicted_memory=getattr(predicted, "memory_per_device", None),
        collectives_match=(comparable(counted) == comparable(predicted_collectives)
                           if predicted_collectives is not None else None),
        step_seconds=per_step, ok=out_close and grad_close)


def _pipeline(plan: Any, example_inputs: Any, steps: int, **options: Any) -> MeshRun:
    """A pipeline plan, run by :func:`~fxforge.parallel.launch.run_pipeline` on its partition."""
    from fxforge.parallel.launch import run_pipeline
    from fxforge.parallel.strategy import full

    part = plan.chosen.partition
    if part is None:
        raise ValueError("this pipeline plan has no partition to run (plan it with fxforge.parallelize)")
    if plan.loss is not None:
        options["loss_fn"] = plan.loss
    options.setdefault("optimizer", plan.optimizer_factory)
    done = run_pipeline(part, example_inputs, steps=steps + 1, **options)
    steady = done.step_seconds[1:] or done.step_seconds
    sends = list(done.sends)
    return MeshRun(full(plan.strategy), done.backend, done.output_error, done.gradient_error,
                   statistics.median(steady), total_bytes(sends), sends, max(done.memory_per_stage),
                   predicted_step_s=plan.chosen.step_s, predicted_comm_bytes=plan.chosen.comm_bytes,
                   predicted_memory=plan.chosen.memory_per_device,
                   collectives_match=comparable(sends) == comparable(plan.chosen.collectives),
                   step_seconds=tuple(steady), ok=done.ok)
