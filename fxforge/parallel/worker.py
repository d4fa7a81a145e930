"""One stage of a local pipeline run (:func:`fxforge.parallel.launch.run_pipeline` starts one per rank).

::

    python -m fxforge.parallel.worker PAYLOAD RANK WORLD OUT_DIR [SETUP_MODULE:FUNCTION]

with ``MASTER_ADDR``/``MASTER_PORT`` set. It joins the process group, builds its stage with
``torch.distributed.pipelining`` at the partition's split spec, runs the schedule for the payload's steps
(each followed by the optimizer's step on the stage's parameters, when the payload has an optimizer) and
writes ``OUT_DIR/rank{RANK}.pt``: the first step's gradients by parameter name, the last stage's outputs,
each step's wall time, the last step's sends (:func:`fxforge.parallel.stage_sends.counted_sends`) and the
bytes one more, untimed step held at its peak; or, when it fails, ``OUT_DIR/rank{RANK}.error``: the exception
and its cause, on one line.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from fxforge.parallel.engine import build_pipe
from fxforge.parallel.processes import worker_main
from fxforge.parallel.stage_sends import counted_sends


def schedule_class(name: str) -> Any:
    """The ``torch.distributed.pipelining`` schedule a partition names.

    Example:
        >>> schedule_class("1F1B").__name__
        'Schedule1F1B'
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[name]


def schedule_step(schedule: Any, rank: int, world: int, args: tuple, kwargs: dict, target: torch.Tensor) -> Any:
    """One step of ``schedule`` as stage ``rank`` of ``world`` takes it: the first stage the batch, the last
    the loss's target, one stage alone both, the others neither (they receive what they compute on).

    Example (in each rank of an initialised process group, or alone under a fake one)::

        out = schedule_step(schedule, rank, world, (ids,), {}, torch.zeros(len(ids)))
    """
    if rank == 0 and world == 1:
        return schedule.step(*args, target=target, **kwargs)
    if rank == 0:
        return schedule.step(*args, **kwargs)
    if rank == world - 1:
        return schedule.step(target=target)
    return schedule.step()


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def run_rank(payload: dict[str, Any], rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Build this rank's stage and run the payload's steps on it (the process group is initialised)."""
    torch.set_num_threads(payload["threads"])
    from torch.distributed.pipelining import SplitPoint

    spec = {name: SplitPoint.BEGINNING for name in payload["split_points"]}
    pipe = build_pipe(payload["model"], payload["microbatch"], spec, payload["stages"])
    stage = pipe.build_stage(rank, device, None)
    schedule = schedule_class(payload["schedule"])(stage, payload["microbatches"], loss_fn=payload["loss_fn"])
    args = tuple(_to(a, device) for a in payload["args"])
    kwargs = {k: _to(v, device) for k, v in payload["kwargs"].items()}
    batch = next(t.shape[0] for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0)
    target = torch.zeros(batch, device=device)
    factory = payload.get("optimizer")
    optimizer = factory(list(stage.submod.parameters())) if factory is not None else None
    sends = counted_sends(stage, rank)

    def step() -> Any:
        out = schedule_step(schedule, rank, world, args, kwargs, target)
        if optimizer is not None:
            optimizer.step()
        return out

    grads, output, seconds, last_sends = None, None, [], []
    for _ in range(payload["steps"]):
        sends.clear()
        stage.submod.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        out = step()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
        last_sends = list(sends)
        if grads is None:
            grads = {name: (p.grad.detach().cpu().clone() if p.grad is not None else None)
                     for name, p in stage.submod.named_parameters()}
            output = torch.utils._pytree.tree_map(
                lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, out)
    return {"grads": grads, "output": output if rank == world - 1 else None, "seconds": seconds,
            "sends": last_sends, "memory": measured_step(stage, optimizer, step, device, barrier=dist.barrier)}


def measured_step(stage: Any, optimizer: Any, step: Any, device: torch.device, barrier: Any = None) -> int:
    """One more step of a pipeline stage, untimed, under :class:`~fxforge.training.measure.PhaseMeter`: its peak
    above the start plus what the stage keeps between steps (its weights, buffers and optimizer state), in
    bytes. ``barrier`` (``dist.barrier`` in a real run) is called before and after, so the ranks start together.

    Example (the run's worker, and the planner on each stage built under a fake process group)::

        peak_bytes = measured_step(stage, optimizer, lambda: schedule.step(x), torch.device("cpu"))
    """
    from fxforge.parallel.mesh_worker import local_bytes
    from fxforge.training.measure import PhaseMeter

    stage.submod.zero_grad(set_to_none=True)
    kept = sum(local_bytes(stage.submod, optimizer).values())
    if barrier is not None:
        barrier()
    with PhaseMeter(device) as meter:
        step()
        meter.end("step")
    if barrier is not None:
        barrier()
    return kept + meter.phases()["step"].peak_bytes


def main(argv: list[str]) -> int:
    return worker_main(argv, run_rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
