"""Rank 0's training step as the mesh builds it, timed in this process under a fake process group.

A rank does more than its share of the one-process step: DDP copies every gradient into its buckets and back
and divides them; tensor parallelism adds DTensor's dispatch on every sharded operator; FSDP2 copies into and
out of each all-gather and reduce-scatter buffer, runs hooks around every block, and steps the optimizer over
DTensor shards. None of that is in the one-process step divided by the ranks, and on small models it is a
large part of the step (on the 4-layer models of ``benchmarks/parallel_plans.py`` at 2 ranks: DDP 10-15 %
more forward + backward on ViT, FSDP2 a quarter more on BERT). So each mesh is built on a copy of the model
exactly as :func:`fxforge.parallel.mesh_worker.parallelized` builds it for the run (DDP with a blocking
all-reduce hook, as the fake backend needs), over PyTorch's fake process group (collectives that move
nothing), and rank 0's step is timed on its slice of the batch. The collectives themselves are priced on the
link (:mod:`fxforge.core.links`).

The fake all-gathers leave their buffers as they were allocated, so the gathered parameters hold whatever
bytes were there; denormal floats among them would slow the arithmetic, so they are flushed while timing.

Example::

    >>> import torch
    >>> from fxforge.parallel.launch import square_mean_loss
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    >>> steps = built_steps(net, [{"pp": 1, "dp": 1, "fsdp": 2, "tp": 1}], {}, (torch.randn(4, 8),), {},
    ...                     square_mean_loss, torch.optim.AdamW, threads=1)
    >>> forward_backward, optimizer = steps["fsdp2"]
    >>> forward_backward > 0 and optimizer > 0
    True
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from fxforge.parallel.strategy import devices_of, full
from fxforge.parallel.strategy import name as mesh_name


def built(mesh: dict[str, int]) -> bool:
    """Whether a mesh's rank is timed as built: every mesh over more than one device but pipelines (timed by
    their stages).

    >>> built({"pp": 1, "dp": 2, "fsdp": 1, "tp": 1}), built({"pp": 2, "dp": 1, "fsdp": 1, "tp": 1})
    (True, False)
    """
    mesh = full(mesh)
    return mesh["pp"] == 1 and devices_of(mesh) > 1


@contextlib.contextmanager
def fake_group(world: int, rank: int = 0) -> Iterator[None]:
    """The default process group, for the block's duration: the fake backend at ``world`` ranks, as ``rank``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def flushed_denormals() -> Iterator[None]:
    """Denormal floats flushed to zero for the block (torch's default, off, restored after)."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def built_rank(model: torch.nn.Module, mesh: dict[str, int], tp_plan: Any) -> Iterator[torch.nn.Module]:
    """Rank 0 of ``mesh``, for the block's duration: a copy of ``model`` parallelized as
    :func:`fxforge.parallel.mesh_worker.parallelized` does for the run (DDP with a blocking all-reduce hook, as
    the fake backend needs), under a fake process group, denormals flushed."""
    from fxforge.parallel.mesh_worker import build_mesh, parallelized

    mesh = full(mesh)
    with fake_group(devices_of(mesh)), flushed_denormals():
        local, _ = parallelized(copy.deepcopy(model), mesh, tp_plan, build_mesh(mesh, "cpu"), blocking_ddp=True)
        yield local


def built_steps(model: torch.nn.Module, meshes: list[dict[str, int]], tp_plans: dict[int, Any], args: tuple,
                kwargs: dict, loss_fn: Any, optimizer_factory: Any, *, threads: int,
                timer: Any = None) -> dict[str, tuple[float, float]]:
    """Median seconds of rank 0's forward + backward and optimizer step for each mesh that :func:`built`,
    keyed by the mesh's name; ``args``/``kwargs`` are the whole batch, and each rank steps its replicas' slice.

    The model is copied for each mesh, never changed. Needs no process group to be initialised here.
    ``timer`` times a step (default :func:`fxforge.parallel.step_costs.time_step`).
    """
    from fxforge.parallel.mesh_worker import data_slice
    from fxforge.parallel.step_costs import time_step

    timer = timer or time_step
    times: dict[str, tuple[float, float]] = {}
    for mesh in (full(m) for m in meshes if built(m)):
        rank_args, rank_kwargs = data_slice((args, kwargs), 0, mesh["dp"] * mesh["fsdp"])
        with built_rank(model, mesh, tp_plans.get(mesh["tp"])) as local:
            times[mesh_name(mesh)] = timer(local, rank_args, rank_kwargs, loss_fn, optimizer_factory,
                                           threads=threads)
    return times


@dataclasses.dataclass(frozen=True)
class StageStep:
    """One pipeline stage's step as built: median seconds of its part of the schedule (``forward_backward``) and
    of its optimizer step, and the bytes it held at its peak (weights, buffers and optimizer state kept between
    steps, plus the step's peak above its start: what the run's worker measures).

    >>> StageStep(0.2, 0.01, 3 << 20).peak_bytes
    3145728
    """

    forward_backward: float
    optimizer: float
    peak_bytes: int


def stage_steps(part: Any, args: tuple, kwargs: dict, loss_fn: Any, optimizer_factory: Any, *,
                threads: int) -> list[StageStep] | str:
    """Each pipeline stage's step as :mod:`fxforge.parallel.worker` builds it, in this process under a fake
    process group as that stage's rank: timed over the whole batch (every microbatch's forward and backward,
    the loss on the last stage, the engine's own work between them; sends and receives move nothing), its
    optimizer step timed, and one more step's peak measured as the run's worker measures it
    (:func:`fxforge.parallel.worker.measured_step`). Or the reason it cannot be run so: a later stage that
    receives integers would index with whatever its receive buffer held.

    What a stage holds is the engine's business as much as the graph's: the receive buffers of every
    microbatch, the outputs it keeps until their gradients come back, the loss's values on the last stage.
    The partition's per-stage activation model prices the graph's part (on the 4-layer models of
    ``benchmarks/parallel_plans.py``: 3-17 % off the run), so the stage is measured as built.

    Example (slow: builds the stages)::

        steps = stage_steps(fxforge.partition(model, batch, 2), (x,), {}, square_mean_loss, torch.optim.AdamW,
                            threads=1)
        steps[0].forward_backward, steps[0].peak_bytes
    """
    import statistics
    import time

    from fxforge.parallel.engine import build_pipe
    from fxforge.parallel.restructure import pipeline_ready
    from fxforge.parallel.worker import measured_step, schedule_class, schedule_step

    # A copy: the stages share their parameters with the model they are built from, and their optimizers step
    # on whatever gradients the fake receives produced.
    staged = pipeline_ready(copy.deepcopy(part.model), part.column_blocks)
    pipe = build_pipe(staged, part.units.microbatch, part.split_spec, part.stages)
    for index in range(1, part.stages):
        for node in pipe.get_stage_module(index).graph.find_nodes(op="placeholder"):
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.dtype == torch.bool):
                return (f"stage {index} receives {node.name} ({value.dtype}): not timed without the stage before it")
    rows = next(t.shape[0] for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    target = torch.zeros(rows)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    steps = []
    try:
        for rank in range(part.stages):
            with fake_group(part.stages, rank), flushed_denormals():
                stage = pipe.build_stage(rank, torch.device("cpu"), None)
                schedule = schedule_class(part.schedule)(stage, part.microbatches, loss_fn=loss_fn)
                optimizer = optimizer_factory(list(stage.submod.parameters())) if optimizer_factory else None
                runs = []
                for _ in range(4):
                    stage.submod.zero_grad(set_to_none=True)
                    start = time.perf_counter()
                    schedule_step(schedule, rank, part.stages, args, kwargs, target)
                    middle = time.perf_counter()
                    if optimizer is not None:
                        optimizer.step()
                    runs.append((middle - start, time.perf_counter() - middle))

                def step(schedule=schedule, rank=rank, optimizer=optimizer) -> None:
                    schedule_step(schedule, rank, part.stages, args, kwargs, target)
                    if optimizer is not None:
                        optimizer.step()

                peak = measured_step(stage, optimizer, step, torch.device("cpu"))
                steady = runs[1:]
                steps.append(StageStep(statistics.median(r[0] for r in steady),
                                       statistics.median(r[1] for r in steady), peak))
    finally:
        torch.set_num_threads(previous)
    return steps


def built_peaks(model: torch.nn.Module, mesh: dict[str, int], tp_plan: Any, args: tuple, kwargs: dict,
                loss_fn: Any, optimizer_factory: Any = None) -> dict[str, int]:
    """Rank 0's forward, backward and (with ``optimizer_factory``) optimizer-step peaks above the start of a
    step (the CPU allocator's records, as the run measures them: :class:`fxforge.training.measure.PhaseMeter`),
    with the mesh built on a copy of the model under the fake process group, on its replicas' slice of
    ``args``/``kwargs`` (the whole batch). A warm-up step first: lazy buffers, DTensor's caches, the
    optimizer's state (kept between steps, so not in the peaks, as in the run).

    What a tensor-parallel rank saves for backward is DTensor's business: the inputs of column-split layers
    whole, the outputs of row-split ones after their all-reduce, and what each redistribution keeps; on T5 at
    2 ranks the rank's forward peak is 84 % of one process's where the split values make up 71 % of the saved
    bytes. The optimizer's step over DTensor shards keeps temporaries of its own too: on a small float64 BERT
    at 2 ranks (hidden 64) its peak was 1,445 KiB above the step's start against 1,126 for the backward, which
    the one-process optimizer model put lower. Measured here, it is what the run will hold.

    Example::

        peaks = built_peaks(model, {"tp": 2}, plan.tp, (ids,), {}, square_mean_loss, torch.optim.AdamW)
        peaks["forward"], peaks["backward"], peaks["optimizer"]
    """
    from fxforge.parallel.mesh_worker import data_slice
    from fxforge.training.measure import PhaseMeter

    mesh = full(mesh)
    rank_args, rank_kwargs = data_slice((args, kwargs), 0, mesh["dp"] * mesh["fsdp"])
    with built_rank(model, mesh, tp_plan) as local:
        optimizer = optimizer_factory(list(local.parameters())) if optimizer_factory is not None else None
        loss_fn(local(*rank_args, **rank_kwargs), None).backward()
        if optimizer is not None:
            optimizer.step()
        for p in local.parameters():
            p.grad = None
        with PhaseMeter(torch.device("cpu")) as meter:
            loss = loss_fn(local(*rank_args, **rank_kwargs), None)
            meter.end("forward")
            loss.backward()
            meter.end("backward")
            if optimizer is not None:
                optimizer.step()
                meter.end("optimizer")
        return {phase: figures.peak_bytes for phase, figures in meter.phases().items()}
