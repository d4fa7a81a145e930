"""Running a :class:`~fxforge.parallel.partition.Partition` for real: one local process per stage, on
``torch.distributed`` (gloo on CPU, NCCL on GPUs) and ``torch.distributed.pipelining``'s schedules, then
checking its outputs and gradients against the model run in one process.

The model, the batch and the split travel to the workers in one ``torch.save`` file (the model pickled:
its class must be importable, which the workers ensure by sharing this process's ``sys.path``); each
worker builds its stage with :meth:`Partition.build_stage`'s route (``pipeline()`` at the split spec),
runs the schedule for a number of steps, and writes back its parameters' gradients (and, on the last
stage, the outputs). The reference runs the same microbatches one after another in this process, each
loss divided by their count, as the schedules scale the gradients.

Example (slow: starts processes)::

    part = fxforge.partition(model.eval(), (x,), stages=2, microbatches=4)
    run = run_pipeline(part, (x,))
    run.ok, run.output_error, run.gradient_error
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import statistics
import time
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxforge.capture.model import normalize_inputs
from fxforge.core.memory import tensor_leaves
from fxforge.parallel.partition import Partition
from fxforge.parallel.processes import run_workers
from fxforge.parallel.restructure import pipeline_ready
from fxforge.parallel.units import microbatches_of

RTOL, ATOL = 1e-4, 1e-5
"""How close the pipeline's outputs and gradients must be to the single process's (float32 sums in
another order: microbatches' gradients are accumulated per stage)."""


def square_mean_loss(output: Any, target: Any = None) -> torch.Tensor:
    """The loss the check runs when none is given: the mean square of every floating-point output
    (``target`` is ignored).

    Example:
        >>> square_mean_loss((torch.ones(2), torch.full((3,), 2.0))).item()
        5.0
    """
    leaves = [t for t in tensor_leaves(output) if t.is_floating_point()]
    return sum(t.float().square().mean() for t in leaves)


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    """What a local pipeline run did, against the single-process model.

    Attributes:
        stages, microbatches, schedule, backend: what ran.
        output_error: the largest absolute difference of the last stage's outputs from the model's.
        gradient_error: the largest absolute difference of a parameter's gradient (summed over the stages
            holding a copy of it) from the model's.
        outputs_match, gradients_match: within ``rtol=1e-4, atol=1e-5``.
        step_seconds: per step, the slowest rank's wall time (the first step included: it warms up).
        reference_seconds: per step, the single process's time for the same microbatches.
        sends: every stage's sends of the last step, one record per microbatch and direction
            (:func:`fxforge.parallel.stage_sends.counted_sends`).
        memory_per_stage: per stage, the bytes one more step held at its peak (its weights, buffers and
            optimizer state included), measured by the CPU allocator's records or CUDA's statistics.
    """

    stages: int
    microbatches: int
    schedule: str
    backend: str
    output_error: float
    gradient_error: float
    outputs_match: bool
    gradients_match: bool
    step_seconds: tuple[float, ...]
    reference_seconds: tuple[float, ...]
    sends: tuple[Any, ...] = ()
    memory_per_stage: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.outputs_match and self.gradients_match

    def __str__(self) -> str:
        steady = self.step_seconds[1:] or self.step_seconds
        ref = self.reference_seconds[1:] or self.reference_seconds
        verdict = "match" if self.ok else "DIFFER"
        return (f"{self.stages} processes ({self.backend}, {self.schedule}, {self.microbatches} microbatches): "
                f"outputs and gradients {verdict} the single process (max abs error {self.output_error:.2e} "
                f"outputs, {self.gradient_error:.2e} gradients); step {statistics.median(steady) * 1e3:.1f} ms "
                f"vs {statistics.median(ref) * 1e3:.1f} ms in one process")


def reference_step(model: torch.nn.Module, args: tuple, kwargs: dict, microbatches: int, loss_fn: Any
                   ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None], float]:
    """The single-process step the pipeline must equal: the microbatches in turn, each loss / count.

    Returns the outputs' tensors (concatenated over the microbatches), each parameter's gradient by
    name, and the seconds it took.
    """
    model.zero_grad(set_to_none=True)
    outputs = []
    start = time.perf_counter()
    for mb_args, mb_kwargs in microbatches_of(args, kwargs, microbatches):
        leaves = tensor_leaves(model(*mb_args, **mb_kwargs))
        # The last stage hands the loss the model's output tensors: one, or a tuple of them.
        (loss_fn(leaves[0] if len(leaves) == 1 else tuple(leaves), None) / microbatches).backward()
        outputs.append([t.detach() for t in leaves])
    seconds = time.perf_counter() - start
    joined = [torch.cat(parts) if parts[0].dim() else torch.stack(parts) for parts in zip(*outputs)]
    grads = {name: (p.grad.detach().clone() if p.grad is not None else None)
             for name, p in model.named_parameters(remove_duplicate=False)}
    return joined, grads, seconds


def run_pipeline(part: Partition, example_inputs: Any, *, schedule: str | None = None, loss_fn: Any = None,
                 steps: int = 1, backend: str | None = None, threads: int | None = None,
                 timeout: float = 600.0, worker_setup: Any = None, dtype: torch.dtype | None = None,
                 optimizer: Any = None) -> PipelineRun:
    """Run ``part`` in ``part.stages`` local processes and check it against the model in this one.

    Args:
        part: the partition (its model is pickled to the workers; keep dropout off for an exact check).
        example_inputs: the whole batch.
        schedule: ``"1F1B"`` or ``"GPipe"`` (default: the partition's).
        loss_fn: ``(output, target) -> loss`` on each microbatch's outputs: the model's output tensor (or a
            tuple of its output tensors), and ``target`` None; default :func:`square_mean_loss`. It must be
            importable by name (a module-level function): the workers receive it pickled.
        steps: steps to run and time (gradients are checked on the first).
        backend: ``"gloo"`` (default on CPU) or ``"nccl"`` (default when CUDA has a GPU per stage).
        threads: torch threads per process (default: this machine's cores shared among the stages).
        timeout: seconds to wait for the workers.
        dtype: run the check with the model and the floating-point inputs in this dtype (copies):
            ``torch.float64`` tells a pipeline error from float32 rounding that ill-conditioned layers
            amplify (batch norm in train mode over a few samples per microbatch).
        worker_setup: a module-level function each worker calls before it unpickles the model (what this
            process did before building it, e.g. registering ops a model's library needs at import).
        optimizer: an optimizer class or a picklable factory ``params -> Optimizer``: each stage steps it on
            its own parameters after the schedule, inside the timed step (None: forward and backward only).
            Gradients are checked on the first step, before its update.

    Raises:
        RuntimeError: a worker failed (its last error line is given) or did not finish in time.
    """
    schedule = schedule or part.schedule
    loss_fn = loss_fn or square_mean_loss
    use_cuda = backend == "nccl" or (backend is None and torch.cuda.device_count() >= part.stages)
    backend = backend or ("nccl" if use_cuda else "gloo")
    threads = threads or max(1, (os.cpu_count() or 1) // part.stages)
    args, kwargs = normalize_inputs(example_inputs)
    model, microbatch = part.model, part.units.microbatch
    if dtype is not None:  # the model and the floating-point inputs in ``dtype``, on copies
        model = copy.deepcopy(model).to(dtype)
        args, kwargs, microbatch = cast_floating((args, kwargs, microbatch), dtype)
    reference_model = copy.deepcopy(model)
    # The stages are built from the model as the engine runs it (a root sharing the model's parameters
    # where submodules were replaced); each parameter's gradient is checked under the model's own name.
    staged = pipeline_ready(model, part.column_blocks)
    aliases: dict[int, tuple[str, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), (name, []))
    for name, p in staged.named_parameters(remove_duplicate=False):
        aliases[id(p)][1].append(name)
    try:
        pickle.dumps(loss_fn)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise ValueError(f"loss_fn cannot be sent to the workers ({error}): give a module-level function") from None
    payload = {"model": staged, "microbatch": microbatch, "split_points": part.split_points,
               "stages": part.stages, "microbatches": part.microbatches, "schedule": schedule,
               "args": args, "kwargs": kwargs, "loss_fn": loss_fn, "steps": steps, "threads": threads,
               "backend": backend, "cuda": use_cuda, "optimizer": optimizer}
    results = run_workers("fxforge.parallel.worker", payload, part.stages, threads=threads, timeout=timeout,
                          worker_setup=worker_setup, what="pipeline stage")
    return _compare(part, reference_model, list(aliases.values()), args, kwargs, loss_fn, results, schedule,
                    backend, steps)


def cast_floating(value: Any, dtype: torch.dtype | None) -> Any:
    """``value`` with every floating-point tensor in it cast to ``dtype`` (None: as it is).

    Example:
        >>> cast_floating((torch.ones(1), torch.ones(1, dtype=torch.long)), torch.float64)[0].dtype
        torch.float64
    """
    if dtype is None:
        return value
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                           value)


def _compare(part: Partition, model: torch.nn.Module, aliases: list[tuple[str, list[str]]], args: tuple,
             kwargs: dict, loss_fn: Any, results: list[dict[str, Any]], schedule: str, backend: str,
             steps: int) -> PipelineRun:
    reference_seconds = []
    outputs, grads = None, None
    for _ in range(steps):
        out, g, seconds = reference_step(model, args, kwargs, part.microbatches, loss_fn)
        outputs, grads = (outputs, grads) if outputs is not None else (out, g)
        reference_seconds.append(seconds)
    got_outputs = [t for t in pytree.tree_leaves(results[-1]["output"]) if isinstance(t, torch.Tensor)]
    output_error, outputs_match = _difference(outputs, got_outputs)
    # A parameter several stages hold (tied embeddings, a layer's column blocks) gets a gradient on each,
    # under any of its names: they add up.
    summed: dict[str, torch.Tensor] = {}
    for result in results:
        for name, grad in result["grads"].items():
            if grad is not None:
                summed[name] = summed[name] + grad if name in summed else grad
    expected, got = [], []
    for reference_name, names in aliases:
        parts = [summed[n] for n in names if n in summed]
        expected.append(grads[reference_name])
        got.append(sum(parts) if parts else None)
    gradient_error, gradients_match = 0.0, True
    for ref, mine in zip(expected, got):
        if ref is None or mine is None:
            if (ref is None) != (mine is None) and (ref if ref is not None else mine).abs().max() > 0:
                gradients_match = False
                gradient_error = float("inf")
            continue
        error, close = _difference([ref], [mine])
        gradient_error = max(gradient_error, error)
        gradients_match &= close
    step_seconds = tuple(max(r["seconds"][i] for r in results) for i in range(steps))
    sends = tuple(c for result in results for c in result["sends"])
    return PipelineRun(part.stages, part.microbatches, schedule, backend, output_error, gradient_error,
                       outputs_match, gradients_match, step_seconds, tuple(reference_seconds), sends,
                       tuple(result["memory"] for result in results))


def _difference(expected: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, bool]:
    if len(expected) != len(got) or any(e.shape != g.shape for e, g in zip(expected, got)):
        return float("inf"), False
    error, close = 0.0, True
    for e, g in zip(expected, got):
        e, g = e.detach().float().cpu(), g.detach().float().cpu()
        if e.numel():  # NaN where both are NaN is close, but its error reads inf, not 0 (max ignores NaN)
            error = max(error, float((e - g).abs().nan_to_num(nan=float("inf")).max()))
        close &= bool(torch.allclose(e, g, rtol=RTOL, atol=ATOL, equal_nan=True))
    return error, close
